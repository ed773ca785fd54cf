/* The subset of the NCCL C API that gradsync calls, as a cffi cdef (ABI mode: no compiler needed).
 *
 * This file is read by src/gradsync/backends/nccl_loader.py and given to cffi.FFI.cdef(); it is not a compilable
 * header (no #include, no preprocessor conditionals). src/gradsync/nccl_api.h is a symbolic link
 * to it, so that wheels and sdists ship it inside the package (pyproject.toml package-data).
 *
 * Declarations and enum values are copied from nccl.h of NCCL 2.32.3 (the nvidia-nccl-cu12 wheel,
 * nvidia/nccl/include/nccl.h; tests/test_nccl.py compares the values with the shipped header).
 * Existing names and values have not changed across NCCL 2.x releases (new names were appended,
 * which moves the ncclNum* counters); a version noted beside a name is the release that added it.
 * In ABI mode a symbol missing from an older library fails only when it is called.
 *
 * Device buffers and CUDA streams cross this boundary as plain integers (pointers) cast by the
 * caller; cudaStream_t is declared opaque here so that nothing needs cuda_runtime.h.
 */

/* ---- opaque handles ---- */
typedef struct ncclComm* ncclComm_t;
typedef void* cudaStream_t;

/* NCCL_UNIQUE_ID_BYTES = 128 */
typedef struct { char internal[128]; } ncclUniqueId;

/* ---- enums (numeric values as in nccl.h) ---- */
typedef enum { ncclSuccess                 =  0,
               ncclUnhandledCudaError      =  1,
               ncclSystemError             =  2,
               ncclInternalError           =  3,
               ncclInvalidArgument         =  4,
               ncclInvalidUsage            =  5,
               ncclRemoteError             =  6,
               ncclInProgress              =  7,   /* non-blocking communicators only */
               ncclTimeout                 =  8,
               ncclNumResults              =  9 } ncclResult_t;

/* nccl.h computes ncclMaxRedOp from sizeof(enum); it is 0x7fffffff with a 4-byte enum. */
typedef enum { ncclSum        = 0,
               ncclProd       = 1,
               ncclMax        = 2,
               ncclMin        = 3,
               ncclAvg        = 4,             /* 2.10 */
               ncclNumOps     = 5,
               ncclMaxRedOp   = 0x7fffffff } ncclRedOp_t;

typedef enum { ncclInt8       = 0, ncclChar       = 0,
               ncclUint8      = 1,
               ncclInt32      = 2, ncclInt        = 2,
               ncclUint32     = 3,
               ncclInt64      = 4,
               ncclUint64     = 5,
               ncclFloat16    = 6, ncclHalf       = 6,
               ncclFloat32    = 7, ncclFloat      = 7,
               ncclFloat64    = 8, ncclDouble     = 8,
               ncclBfloat16   = 9,                 /* 2.10 */
               ncclFloat8e4m3 = 10,
               ncclFloat8e5m2 = 11,
               ncclNumTypes   = 12 } ncclDataType_t;

/* ---- library and errors ---- */
ncclResult_t ncclGetVersion(int *version);
const char*  ncclGetErrorString(ncclResult_t result);
const char*  ncclGetLastError(ncclComm_t comm);          /* 2.13; comm may be NULL */

/* ---- communicators ---- */
ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId);
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError);   /* 2.4 */
ncclResult_t ncclCommCount(const ncclComm_t comm, int* count);
ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device);
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank);

/* ---- collectives (asynchronous with respect to the host, ordered on `stream`) ---- */
ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
    ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
    int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
    ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
    ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);

/* ---- point to point (2.7) ---- */
ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
    ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
    ncclComm_t comm, cudaStream_t stream);

/* ---- group calls ---- */
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);
