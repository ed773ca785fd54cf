"""The GPU data path without a GPU: the coordinator's device routing, events, fusion, the MPI
staging backend and the error paths, on the fake device runtime of tests/fakegpu.py.

Multi-rank checks run in MPI jobs (tests/workers/device_check.py); the single-process tests here
replace the backend by a recording fake of the NCCL backend (world of one rank) to check what only
NCCL does: the host never blocks, a cycle's allreduces form one group, and an asynchronous NCCL
error stops gradsync instead of hanging it.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import fakegpu
import gradsync
from gradsync import CollectiveError, ReduceOp
from gradsync.arrays.device import resolve_gpu_operations
from gradsync.backends.nccl import traits as nccl_traits
from gradsync.config import Config
from mpi_launch import run_mpi


@pytest.mark.mpi
def test_device_path_through_mpi_staging_on_two_ranks():
    result = run_mpi("device_check.py", 2, env={"GRADSYNC_GPU_OPERATIONS": "MPI"}, timeout=180)
    for rank in range(2):
        assert f"device_check rank {rank}: 9 checks passed" in result.stdout, result.stdout


@pytest.mark.mpi
def test_ranks_with_different_gpu_backends_fail_alike():
    result = run_mpi("device_mismatch.py", 2, timeout=120)
    for rank in range(2):
        assert f"device_mismatch rank {rank}: 1 checks passed" in result.stdout, result.stdout


# ---------------------------------------------------------------------------------------------------
# Settings and dtype rules


def test_gpu_operations_setting():
    assert Config.resolve(environ={}).gpu_operations == ""
    assert Config.resolve({"gpu_operations": "nccl"}, environ={}).gpu_operations == "nccl"
    assert Config.resolve(environ={"GRADSYNC_GPU_OPERATIONS": "MPI"}).gpu_operations == "MPI"
    with pytest.raises(ValueError, match="GRADSYNC_GPU_OPERATIONS='gloo' must be NCCL or MPI"):
        Config.resolve(environ={"GRADSYNC_GPU_OPERATIONS": "gloo"})
    assert resolve_gpu_operations("", nccl_loads=True) == "nccl"
    assert resolve_gpu_operations("", nccl_loads=False) == "mpi"
    assert resolve_gpu_operations(" MPI ", nccl_loads=True) == "mpi"
    assert resolve_gpu_operations("NCCL", nccl_loads=False) == "nccl"


@pytest.mark.parametrize("dtype, average, expected", [
    ("float16", True, "float16"), ("bfloat16", True, "bfloat16"),   # native on NCCL
    ("float32", False, "float32"), ("bool", False, "uint8"),
    ("int32", True, "int64"), ("int8", False, "int8"),              # floor of the exact mean
    ("int16", False, "int32"), ("int16", True, "int64"),            # NCCL has no int16
])
def test_nccl_fusion_buffer_dtypes(dtype, average, expected):
    from gradsync.arrays import dtypes

    native = nccl_traits((2, 20, 0)).native
    assert dtypes.accumulator(dtype, average, native) == dtypes.NUMPY_DTYPES[expected]


@pytest.mark.torch
def test_a_tensor_on_an_unsupported_device_is_refused_naming_it():
    torch = pytest.importorskip("torch")
    gradsync.init()
    try:
        with pytest.raises(TypeError, match=r"rank 0: allreduce of tensor 'm': the tensor is on meta; "
                                            "gradsync moves host \\(CPU\\) memory, torch CUDA tensors"):
            gradsync.allreduce(torch.empty(3, device="meta"), name="m")
    finally:
        gradsync.shutdown()


# ---------------------------------------------------------------------------------------------------
# A world of one rank with a fake NCCL backend


class FakeNccl:
    """Records what the executor asks of NCCL; a world of one, so allreduce leaves data as it is.
    Its work runs on the stream given, like NCCL's kernels."""

    name = "fake NCCL"
    traits = nccl_traits((2, 20, 0))  # ncclAvg for floating dtypes
    closed = None

    def __init__(self) -> None:
        self.groups: list[list[tuple]] = []
        self.gate = threading.Event()  # cleared: allreduce holds the coordinator until it is set
        self.gate.set()
        self.entered = threading.Event()
        self.error: str | None = None
        self.closes: list[bool] = []  # the abort flag of each close()

    def allreduce(self, runtime, device, stream, buffers):
        assert runtime.current_stream(device) is stream, "NCCL work must go on the comm stream"
        self.entered.set()
        assert self.gate.wait(10)
        self.groups.append([(b.shape, dtype, op, logical) for b, dtype, op, logical in buffers])

    def broadcast(self, runtime, device, stream, buffer, dtype, root):
        pass

    def allgather(self, runtime, device, stream, send, recv, dtype, counts):
        stream.enqueue("allgather", lambda: np.copyto(recv.data, send.data))

    def async_error(self):
        return self.error

    def close(self, abort=False):
        self.closes.append(abort)


@pytest.fixture
def fake_nccl():
    gradsync.init(fusion_threshold=64)
    fake = FakeNccl()
    gradsync.process.runtime.get().coordinator.device.backend = fake
    try:
        yield fake
    finally:
        gradsync.shutdown()


def test_the_host_does_not_wait_for_device_work(fake_nccl):
    """The producer finishes 0.5 s late: synchronize() returns at once (enqueued, the caller's
    stream made to wait), and reading the tensor then sees the result."""
    tensor = fakegpu.array(np.zeros(4, np.float32))
    fakegpu.later(tensor, np.arange(4, dtype=np.float32), delay=0.5)
    started = time.perf_counter()
    out = gradsync.synchronize(gradsync.allreduce_async(tensor, name="async", op=gradsync.Average,
                                                        postscale_factor=2.0))
    assert time.perf_counter() - started < 0.4, "synchronize() blocked the host on device work"
    np.testing.assert_array_equal(fakegpu.read(out), np.arange(4) * 2.0)
    ops = fakegpu.DEVICE.default_stream(0).ops
    assert "wait" in ops, "the caller's stream was not made to wait on the done event"


def test_fused_responses_of_one_cycle_go_in_one_group(fake_nccl):
    """Four 8-element float32 tensors with a 64-byte threshold: two fused responses; with every
    request ready in one cycle they are reduced in a single group, and integer Average is the
    floor of the mean applied after NCCL's sum."""
    tensors = [fakegpu.array(np.full(8, i, np.float32)) for i in range(4)]
    ints = fakegpu.array(np.array([7, -7, 3], np.int32))
    fake_nccl.gate.clear()  # the coordinator stops in the first allreduce, the others queue up
    first = gradsync.allreduce_async_(fakegpu.array(np.ones(2, np.float32)), name="first")
    assert fake_nccl.entered.wait(10)
    handles = [gradsync.allreduce_async_(t, name=f"g{i}") for i, t in enumerate(tensors)]
    handles.append(gradsync.allreduce_async_(ints, name="ints"))
    fake_nccl.gate.set()
    for handle in [first] + handles:
        gradsync.synchronize(handle)
    assert len(fake_nccl.groups) == 2, fake_nccl.groups
    shapes = sorted(shape for shape, *_ in fake_nccl.groups[1])
    assert shapes == [(3,), (16,), (16,)], fake_nccl.groups
    for i, tensor in enumerate(tensors):
        np.testing.assert_array_equal(fakegpu.read(tensor), np.full(8, i))
    np.testing.assert_array_equal(fakegpu.read(ints), [7, -7, 3])  # a world of one: the mean is itself


@pytest.mark.parametrize("error, raised", [
    ("internal error - please report this issue to the NCCL developers (ncclResult_t 3)",
     CollectiveError),
    ("remote process exited or there was a network error (ncclResult_t 6)", gradsync.RankFailureError),
])
def test_an_async_nccl_error_stops_gradsync_with_the_error(fake_nccl, error, raised):
    """A peer that NCCL lost is a rank failure (RankFailureError); any other error a CollectiveError."""
    from gradsync.backends.nccl import NcclBackend

    fake_nccl.peer_failed = NcclBackend.peer_failed
    tensor = fakegpu.array(np.ones(3, np.float32))
    fakegpu.later(tensor, np.ones(3, np.float32), delay=5.0)  # device work that never finishes in time
    gradsync.synchronize(gradsync.allreduce_async_(tensor, name="stuck"))
    fake_nccl.error = error
    deadline = time.monotonic() + 10
    coordinator = gradsync.process.runtime.get().coordinator
    while coordinator.queue.closed_error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(raised, match=f"GPU collectives failed: {error.split(' ')[0]}"):
        gradsync.allreduce_async_(fakegpu.array(np.ones(3, np.float32)), name="after")
    assert fake_nccl.closes and fake_nccl.closes[0] is True, "the communicators were not aborted"


def test_allgather_and_broadcast_through_the_nccl_path(fake_nccl):
    rows = np.arange(6, dtype=np.float64).reshape(3, 2)
    gathered = gradsync.allgather(fakegpu.FakeArray(rows[:, :]), name="gather")
    np.testing.assert_array_equal(fakegpu.read(gathered), rows)
    data = fakegpu.FakeArray(np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2])  # not contiguous
    gradsync.broadcast_(data, root_rank=0, name="bcast")
    np.testing.assert_array_equal(fakegpu.read(data), np.arange(12).reshape(3, 4)[:, ::2])


def test_watchdog_thread_ends_at_shutdown(fake_nccl):
    gradsync.allreduce_(fakegpu.array(np.ones(2)), name="w")
    gradsync.shutdown()
    assert not [t for t in threading.enumerate() if t.name == "gradsync-device-watchdog"]
    assert fake_nccl.closes == [False], "the communicators were not destroyed at shutdown"


def test_the_device_watchdog_binds_the_gpu_before_it_queries_events(fake_nccl):
    """On CUDA a thread that queries an event without a current device gets a context on GPU 0
    (about 0.5 GiB on every rank of an 8-GPU node)."""
    fakegpu.DEVICE.unbound_queries = 0
    tensor = fakegpu.array(np.ones(3, np.float32), device=1)
    fakegpu.later(tensor, np.ones(3, np.float32), delay=0.2)  # the watchdog polls meanwhile
    out = gradsync.allreduce(tensor, name="on1")
    fakegpu.read(out)
    time.sleep(0.1)
    assert fakegpu.DEVICE.unbound_queries == 0


def test_allgather_results_are_allocated_on_the_callers_stream(fake_nccl):
    """With a caching allocator a result allocated on the coordinator's default stream could be
    reused while the caller's stream still reads it."""
    side = fakegpu.DEVICE.new_stream(0)
    with fakegpu.DEVICE.on_stream(side, 0):
        gathered = gradsync.allgather(fakegpu.array(np.arange(4.0).reshape(2, 2)), name="side")
        np.testing.assert_array_equal(fakegpu.read(gathered), np.arange(4.0).reshape(2, 2))
    assert gathered.stream is side


def test_a_second_process_set_on_the_same_gpu_is_refused_with_nccl():
    gradsync.init(gpu_operations="nccl")
    try:
        fake = FakeNccl()
        gradsync.process.runtime.get().coordinator.device.backend = fake
        gradsync.allreduce(fakegpu.array(np.ones(2, np.float32)), name="global")
        pairs = gradsync.add_process_set([0])
        with pytest.raises(ValueError, match=r"process set 0 already runs NCCL collectives on cuda:0"):
            gradsync.allreduce_async(fakegpu.array(np.ones(2, np.float32)), name="set", process_set=pairs)
    finally:
        gradsync.shutdown()


def test_a_pinned_buffer_grows_only_after_the_stream_is_done_with_the_old_one():
    from gradsync.backends.staging import StagingBackend

    class OneRankMpi:
        comm = OneRank()

        def allgather(self, send, recv, counts):
            recv[:send.size] = send

    device = fakegpu.DEVICE
    stream = device.new_stream(0)
    staging = StagingBackend(OneRankMpi())
    pinned, idle_when_grown = device.pinned, []

    def watched_pinned(dtype, count):
        idle_when_grown.append(stream.idle())
        return pinned(dtype, count)

    device.pinned = watched_pinned
    try:
        with device.on_stream(stream, 0):
            for count in (2, 8):  # the second grows both buffers
                send, recv = fakegpu.array(np.ones(count)), fakegpu.array(np.zeros(count))
                staging.allgather(device, 0, stream, send, recv, np.dtype(np.float64), [count])
                stream.enqueue("slow", lambda: time.sleep(0.3))  # the copy back is still running
    finally:
        del device.pinned
    assert idle_when_grown[2:] == [True, True], idle_when_grown


# ---------------------------------------------------------------------------------------------------
# The torch device runtime's copy primitives, on CPU tensors (the same code runs on CUDA tensors)


@pytest.mark.parametrize("dtype, buffer_dtype, prescale, scale, floor_divisor", [
    ("float16", "float32", 0.5, 4.0, 1), ("bfloat16", "bfloat16", 1.0, 0.25, 1),
    ("float32", "float32", 1.0, 1.0, 1), ("int32", "int64", 1.0, 1.0, 2), ("int8", "int64", 1.0, 1.0, 3),
    ("bool", "uint8", 1.0, 1.0, 1), ("int16", "int32", 1.0, 1.0, 1),
])
@pytest.mark.torch
def test_torch_copies_match_the_host_copies(dtype, buffer_dtype, prescale, scale, floor_divisor):
    """Pack (copy with the prescale into a wider buffer) and unpack (floor-divide, copy with the
    scale into a strided tensor) through torch's primitives give numpy's results bit for bit."""
    torch = pytest.importorskip("torch")
    from gradsync.arrays import dtypes
    from gradsync.executors.memory import HOST
    from gradsync.torch.array import TORCH
    from gradsync.torch.device import DEVICE, torch_dtype

    np_dtype, np_buffer = dtypes.NUMPY_DTYPES[dtype], dtypes.NUMPY_DTYPES[buffer_dtype]
    values = (np.arange(-6, 6) % 2 if dtype == "bool" else np.arange(-6, 6)).astype(np_dtype).reshape(3, 4)
    source = torch.from_numpy(values.view(np.int16)).view(torch.bfloat16) if dtype == "bfloat16" \
        else torch.from_numpy(values.copy())
    source = source[:, ::2]  # not contiguous
    host_source = values[:, ::2]
    buffer = torch.empty(6, dtype=torch_dtype(np_buffer))
    host_buffer = np.empty(6, np_buffer)
    DEVICE.copy(source, buffer, prescale)
    HOST.copy(host_source, host_buffer, prescale)
    np.testing.assert_array_equal(TORCH.host_view(buffer), host_buffer)
    out = torch.empty((3, 2), dtype=source.dtype)
    host_out = np.empty((3, 2), np_dtype)
    if floor_divisor != 1:
        DEVICE.floor_divide(buffer, floor_divisor)
        HOST.floor_divide(host_buffer, floor_divisor)
    DEVICE.copy(buffer, out, scale)
    HOST.copy(host_buffer, host_out, scale)
    np.testing.assert_array_equal(TORCH.host_view(out), host_out)


# ---------------------------------------------------------------------------------------------------
# The NCCL backend's calls, with a recording communicator (ncclGroupStart/End run for real)


class RecordingComm:
    def __init__(self):
        self.calls = []

    def allreduce(self, send, recv, count, dtype, op, stream):
        self.calls.append(("allreduce", send, recv, count, dtype, ReduceOp(op), stream))
        return 1

    def broadcast(self, send, recv, count, dtype, root, stream):
        self.calls.append(("broadcast", send, recv, count, dtype, root, stream))

    def abort(self):
        self.calls.append(("abort",))

    def destroy(self):
        self.calls.append(("destroy",))


class OneRank:
    def Get_rank(self):
        return 1

    def Get_size(self):
        return 3


@pytest.mark.skipif(not gradsync.nccl_built(), reason="no NCCL library")
def test_nccl_backend_calls():
    from gradsync.backends.nccl import NcclBackend

    backend = NcclBackend(OneRank())
    comm = backend._comms[0] = RecordingComm()
    device = fakegpu.DEVICE
    stream = device.new_stream(0)
    floats = fakegpu.array(np.zeros(5, np.float32))
    flags = fakegpu.array(np.zeros(3, np.uint8))
    ints = fakegpu.array(np.zeros(4, np.int64))
    # What a plan sends: ncclAvg for floats; an integer Average as Sum (the plan floor-divides).
    backend.allreduce(device, 0, stream, [
        (floats, floats.dtype, ReduceOp.Average, False), (flags, flags.dtype, ReduceOp.Sum, True),
        (ints, ints.dtype, ReduceOp.Sum, False)])
    pointer = device.pointer
    assert comm.calls == [
        ("allreduce", pointer(floats), pointer(floats), 5, "float32", ReduceOp.Average, id(stream)),
        ("allreduce", pointer(flags), pointer(flags), 3, "bool", ReduceOp.Sum, id(stream)),
        ("allreduce", pointer(ints), pointer(ints), 4, "int64", ReduceOp.Sum, id(stream))]
    comm.calls.clear()
    send = fakegpu.array(np.zeros(2, np.float64))
    recv = fakegpu.array(np.zeros(9, np.float64))
    backend.allgather(device, 0, stream, send, recv, np.dtype(np.float64), [4, 2, 3])
    base = pointer(recv)
    assert comm.calls == [  # allgatherv: one broadcast per rank; this rank (1) sends its own buffer
        ("broadcast", base, base, 4, "int64", 0, id(stream)),
        ("broadcast", pointer(send), base + 4 * 8, 2, "int64", 1, id(stream)),
        ("broadcast", base + 6 * 8, base + 6 * 8, 3, "int64", 2, id(stream))]


@pytest.mark.skipif(not gradsync.nccl_built(), reason="no NCCL library")
def test_an_aborted_nccl_backend_refuses_work_and_never_makes_a_new_communicator():
    """After the watchdog's abort, a later device batch of the same cycle must not create a new
    communicator: its unique-id broadcast would wait for ranks that are not in it."""
    from gradsync.backends.nccl import NcclBackend
    from gradsync.errors import NcclError

    class CountingRank(OneRank):
        broadcasts = 0

        def bcast(self, value, root):
            CountingRank.broadcasts += 1
            return value

    backend = NcclBackend(CountingRank())
    backend._comms[0] = RecordingComm()
    backend.close(abort=True)
    device = fakegpu.DEVICE
    buffer = fakegpu.array(np.zeros(3, np.float32))
    with pytest.raises(NcclError, match="the NCCL communicators were aborted after an error"):
        backend.allreduce(device, 0, device.new_stream(0), [(buffer, buffer.dtype, ReduceOp.Sum, False)])
    assert CountingRank.broadcasts == 0
