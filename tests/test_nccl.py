"""The NCCL binding (gradsync.backends.nccl_api): loading, version, unique ids, errors, dtype/op mapping.

Everything but the tests marked ``gpu`` runs without a GPU: NCCL loads, reports its version and makes
unique ids on any machine; ncclCommInitRank then fails at once with "unhandled cuda error". Tests that
must not see this process's cached library run in a subprocess (with a timeout, so a hang fails).
The ``gpu`` tests move data through a world of one rank on the first CUDA device.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import gradsync
from gradsync.backends import nccl_api as nccl
from gradsync.engine.protocol import ReduceOp
from gradsync.errors import GradsyncError, NcclError, NcclUnavailableError
from gradsync.process.libraries import loaded_library

ROOT = Path(__file__).resolve().parent.parent
#: A recent NCCL for the mapping tests, and one from before ncclAvg / bfloat16 (2.10).
NEW, OLD = (2, 32, 3), (2, 9, 9)

requires_nccl = pytest.mark.skipif(not nccl.nccl_built(), reason="no NCCL library (pip install gradsync[nccl-cu12])")


def _wheel_installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="module", autouse=True)
def loopback_bootstrap():
    """NCCL's bootstrap listener (ncclGetUniqueId) on the loopback interface, before any NCCL call here."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NCCL_SOCKET_IFNAME", "lo")
        yield


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (own NCCL cache), with ``env`` added; fail after 60 s."""
    environ = {k: v for k, v in os.environ.items() if k != nccl.ENV_LIBRARY}
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), environ.get("PYTHONPATH")]))
    environ.update(NCCL_SOCKET_IFNAME="lo", PYTHONPATH=path, **env)  # this checkout's gradsync
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environ, capture_output=True,
                          text=True, timeout=60)


def last_json(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------
# Loading and version


@requires_nccl
@pytest.mark.skipif(not _wheel_installed("nvidia-nccl-cu12"), reason="nvidia-nccl-cu12 is not installed")
def test_library_loads_from_the_cu12_wheel():
    result = run_python("""
        import json
        from gradsync.backends import nccl_api as nccl
        lib = nccl.load_library()
        print(json.dumps({"source": lib.source, "path": lib.path, "same": nccl.load_library() is lib}))
    """)
    info = last_json(result)
    assert info["source"] == "nvidia-nccl-cu12 wheel"
    assert info["path"].endswith("nvidia/nccl/lib/libnccl.so.2") and Path(info["path"]).is_file()
    assert info["same"], "load_library() must cache the library"


@requires_nccl
def test_version_is_a_3_tuple_and_matches_the_shipped_header():
    v = nccl.version()
    assert isinstance(v, tuple) and len(v) == 3 and all(isinstance(x, int) for x in v)
    assert v >= (2, 0, 0)
    header = Path(nccl.load_library().path).parent.parent / "include" / "nccl.h"
    if header.is_file():
        text = header.read_text()
        expected = tuple(int(re.search(rf"#define NCCL_{part} (\d+)", text).group(1))
                         for part in ("MAJOR", "MINOR", "PATCH"))
        assert v == expected


@pytest.mark.parametrize("code, expected", [
    (23203, (2, 32, 3)),   # the 2.9+ encoding: major*10000 + minor*100 + patch
    (21003, (2, 10, 3)),
    (20900, (2, 9, 0)),
    (2804, (2, 8, 4)),     # before 2.9: major*1000 + minor*100 + patch
    (2708, (2, 7, 8)),
    (30001, (3, 0, 1)),
])
def test_decode_version(code, expected):
    assert nccl.decode_version(code) == expected


def test_nccl_built_and_nccl_version_agree():
    built, version = gradsync.nccl_built(), gradsync.nccl_version()
    assert isinstance(built, bool)
    assert built == (version is not None)
    if built:
        assert version == nccl.version()
    assert "nccl_built" in gradsync.__all__ and "nccl_version" in gradsync.__all__
    assert gradsync.nccl_built.__doc__ and gradsync.nccl_version.__doc__


@requires_nccl
def test_unique_ids_are_128_bytes_and_differ():
    first, second = nccl.unique_id(), nccl.unique_id()
    assert isinstance(first, bytes) and len(first) == 128 and len(second) == 128
    assert first != second


# ---------------------------------------------------------------------------------------------------
# Where the library is looked for, and what a failure says


def test_missing_GRADSYNC_NCCL_LIBRARY_is_an_error_naming_the_path(tmp_path):
    missing = tmp_path / "nowhere" / "libnccl.so.2"
    result = run_python("""
        import json, gradsync
        from gradsync.backends import nccl_api as nccl
        try:
            nccl.load_library()
        except nccl.NcclUnavailableError as exc:
            error = {"type": type(exc).__name__, "import_error": isinstance(exc, ImportError),
                     "message": str(exc)}
        print(json.dumps({"error": error, "built": gradsync.nccl_built(),
                          "version": gradsync.nccl_version()}))
    """, GRADSYNC_NCCL_LIBRARY=str(missing))
    info = last_json(result)
    assert info["error"]["type"] == "NcclUnavailableError" and info["error"]["import_error"]
    message = info["error"]["message"]
    assert f"GRADSYNC_NCCL_LIBRARY={missing}: no such file" in message
    # An explicit path is never silently replaced by another NCCL.
    assert "no other place was searched because GRADSYNC_NCCL_LIBRARY is set" in message
    assert info["built"] is False and info["version"] is None


def test_without_cffi_nccl_is_reported_unavailable():
    result = run_python("""
        import json, sys
        sys.modules["cffi"] = None   # import cffi now raises ImportError
        import gradsync
        from gradsync.backends import nccl_api as nccl
        try:
            nccl.load_library()
        except nccl.NcclUnavailableError as exc:
            message = str(exc)
        print(json.dumps([gradsync.nccl_built(), gradsync.nccl_version(), message]))
    """)
    built, version, message = last_json(result)
    assert (built, version) == (False, None)
    assert "the NCCL binding needs cffi" in message


def test_GRADSYNC_NCCL_LIBRARY_that_is_not_a_library(tmp_path):
    import _cffi_backend

    text_file = tmp_path / "libnccl.so.2"
    text_file.write_text("not a shared object\n")
    for path, reason in ((text_file, "cannot load library"),
                         (Path(_cffi_backend.__file__), "loads but is not NCCL")):
        result = run_python("""
            import json
            from gradsync.backends import nccl_api as nccl
            try:
                print(json.dumps(f"loaded {nccl.load_library()}"))
            except nccl.NcclUnavailableError as exc:
                print(json.dumps(str(exc)))
        """, GRADSYNC_NCCL_LIBRARY=str(path))
        message = last_json(result)
        assert f"GRADSYNC_NCCL_LIBRARY={path}" in message and reason in message, message


@requires_nccl
def test_GRADSYNC_NCCL_LIBRARY_may_name_the_library_or_its_directory():
    path = Path(nccl.load_library().path)
    for value in (str(path), str(path.parent)):
        result = run_python("""
            import json
            from gradsync.backends import nccl_api as nccl
            lib = nccl.load_library()
            print(json.dumps({"source": lib.source, "path": lib.path, "version": lib.version}))
        """, GRADSYNC_NCCL_LIBRARY=value)
        info = last_json(result)
        assert info["source"] == f"GRADSYNC_NCCL_LIBRARY={value}"
        assert Path(info["path"]).resolve() == path.resolve()
        assert tuple(info["version"]) == nccl.version()


def test_a_failed_search_lists_every_place_and_why():
    with pytest.raises(NcclUnavailableError) as caught:
        nccl._search("", ("gradsync-test-no-nccl-cu12", "gradsync-test-no-nccl-cu13"),
                     ("gradsync_test_no_nccl", "libgradsync_test_no_nccl.so.2"))
    message = str(caught.value)
    assert isinstance(caught.value, ImportError)
    assert "GRADSYNC_NCCL_LIBRARY: not set" in message
    assert "gradsync-test-no-nccl-cu12 wheel: not installed" in message
    assert "gradsync-test-no-nccl-cu13 wheel: not installed" in message
    assert "system: ctypes.util.find_library('gradsync_test_no_nccl') found nothing" in message
    assert "system (libgradsync_test_no_nccl.so.2): cannot load library" in message
    assert "pip install gradsync[nccl-cu12]" in message


def test_the_search_order_is_env_loaded_cu12_cu13_system():
    assert nccl.WHEELS == ("nvidia-nccl-cu12", "nvidia-nccl-cu13")
    message = ""
    try:
        nccl._search("", ("gradsync-test-a", "gradsync-test-b"), ("gradsync_test_c", "libgradsync_test_c.so"),
                     loaded="/gradsync-test-loaded/libnccl.so.2")
    except NcclUnavailableError as exc:
        message = str(exc)
    places = ["GRADSYNC_NCCL_LIBRARY", f"{nccl.LOADED_SOURCE}: ", "gradsync-test-a", "gradsync-test-b", "gradsync_test_c"]
    positions = [message.index(p) for p in places]
    assert positions == sorted(positions), message


@requires_nccl
def test_an_nccl_already_loaded_in_the_process_is_taken_and_logged():
    # torch's CUDA builds load their NCCL at import; loading another file beside it would put two
    # NCCLs in one process. Here ctypes stands in for torch.
    path = nccl.load_library().path
    result = run_python(f"""
        import ctypes, json, logging
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        logging.getLogger("gradsync").setLevel(logging.INFO)
        ctypes.CDLL({path!r})
        from gradsync.backends import nccl_api as nccl
        lib = nccl.load_library()
        print(json.dumps({{"source": lib.source, "path": lib.path}}))
    """)
    info = last_json(result)
    assert info["source"] == nccl.LOADED_SOURCE, info
    assert Path(info["path"]).resolve() == Path(path).resolve()
    assert f"gradsync: NCCL {'.'.join(map(str, nccl.version()))} from {info['path']} " \
           f"({nccl.LOADED_SOURCE})" in result.stderr, result.stderr


def test_a_loaded_file_is_found_by_its_mapped_path(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 2 /torch/site-packages/nvidia/nccl/lib/libnccl.so.2\n")
    assert loaded_library(nccl.LOADED_PATTERN, str(maps)) == \
        "/torch/site-packages/nvidia/nccl/lib/libnccl.so.2"
    maps.write_text("7f00-7f01 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/libnccl.so.2.21.5\n"
                    "7f00-7f01 r-xp 0 08:01 2 /usr/lib/libnccl-net.so\n")
    assert loaded_library(nccl.LOADED_PATTERN, str(maps)) == "/usr/lib/x86_64-linux-gnu/libnccl.so.2.21.5"


def test_the_binding_imports_no_framework():
    result = run_python("""
        import json, sys
        import gradsync
        from gradsync.backends import nccl_api as nccl
        gradsync.nccl_built()
        print(json.dumps(sorted(m for m in ("torch", "cupy", "jax", "tensorflow") if m in sys.modules)))
    """)
    assert last_json(result) == []


def test_the_packaged_declarations_are_native_nccl_api_h():
    native = ROOT / "native" / "nccl_api.h"
    if not native.is_file():
        pytest.skip("not a source checkout")
    packaged = Path(nccl.__file__).with_name("nccl_api.h")
    assert packaged.read_text() == native.read_text(), "src/gradsync/nccl_api.h must link to native/nccl_api.h"


@requires_nccl
def test_enum_values_match_the_shipped_nccl_h():
    header = Path(nccl.load_library().path).parent.parent / "include" / "nccl.h"
    if not header.is_file():
        pytest.skip(f"{header} is not there")
    text = header.read_text()
    checked = 0
    for enum in ("ncclResult_t", "ncclRedOp_t", "ncclDataType_t"):
        body = re.search(r"typedef enum \{([^}]*)\}\s*" + enum + ";", text).group(1)
        for name, value in re.findall(r"(\w+)\s*=\s*(\d+)\b", body):
            if name.startswith("ncclNum"):  # a count of the members, not one: grows with versions
                continue
            assert nccl._const(name) == int(value), f"{enum}.{name}"
            checked += 1
    assert checked >= 30


# ---------------------------------------------------------------------------------------------------
# Errors


@requires_nccl
def test_check_raises_NcclError_with_NCCL_error_string():
    assert nccl.check(0, "ncclAllReduce") is None
    library = nccl.load_library()
    expected = library.ffi.string(library.lib.ncclGetErrorString(4)).decode()
    with pytest.raises(NcclError) as caught:
        nccl.check(4, "ncclAllReduce")
    error = caught.value
    assert isinstance(error, GradsyncError)
    assert error.result == 4 and error.call == "ncclAllReduce"
    assert str(error).startswith("ncclAllReduce failed: ") and expected in str(error)
    with pytest.raises(NcclError) as caught:
        nccl.check(1, "ncclCommInitRank(nranks=2, rank=1)")
    assert caught.value.call == "ncclCommInitRank"
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.result, copy.call) == (str(error), 4, "ncclAllReduce")


@requires_nccl
def test_comm_init_rank_without_a_gpu_raises_NcclError():
    result = run_python("""
        import json
        from gradsync.backends import nccl_api as nccl
        lib = nccl.load_library()
        try:
            comm = nccl.Communicator.init_rank(1, nccl.unique_id(), 0)
        except nccl.NcclError as exc:
            print(json.dumps({"message": str(exc), "result": exc.result, "call": exc.call,
                              "expected": lib.ffi.string(lib.lib.ncclGetErrorString(exc.result)).decode()}))
        else:
            comm.destroy()
            print(json.dumps({"message": "a GPU is present"}))
    """)
    info = last_json(result)
    if info["message"] == "a GPU is present":
        pytest.skip("a CUDA GPU is present: ncclCommInitRank succeeds")
    assert info["call"] == "ncclCommInitRank" and info["result"] == 1
    assert info["message"].startswith("ncclCommInitRank(nranks=1, rank=0) failed: ")
    assert info["expected"] in info["message"] and "unhandled cuda error" in info["message"]


def test_init_rank_checks_its_arguments_before_calling_nccl():
    with pytest.raises(ValueError, match="128 bytes, got 5"):
        nccl.Communicator.init_rank(1, b"short", 0)
    with pytest.raises(ValueError, match=r"rank 2 is outside \[0, 2\)"):
        nccl.Communicator.init_rank(2, bytes(128), 2)


@requires_nccl
def test_a_destroyed_communicator_refuses_calls():
    comm = nccl.Communicator(None, nccl.load_library())
    comm.destroy()
    comm.abort()
    for call in (lambda: comm.size, lambda: comm.async_error(),
                 lambda: comm.allreduce(0, 0, 1, "float32", ReduceOp.Sum, 0),
                 lambda: comm.send(0, 1, "float32", 0, 0)):
        with pytest.raises(NcclError, match="already destroyed or aborted"):
            call()


@requires_nccl
def test_group_is_balanced_when_its_body_raises():
    with nccl.group():
        pass
    with pytest.raises(ValueError, match="inside"):
        with nccl.group():
            raise ValueError("inside")
    with nccl.group():   # a group left open would make this ncclGroupEnd close the outer one
        pass


# ---------------------------------------------------------------------------------------------------
# dtype and op mapping (values of nccl.h)


@pytest.mark.parametrize("dtype, expected", [
    ("int8", 0), ("uint8", 1), ("int32", 2), ("int64", 4),
    ("float16", 6), ("float32", 7), ("float64", 8), ("bfloat16", 9),
    ("bool", 1),  # as uint8
])
def test_dtype_mapping(dtype, expected):
    assert nccl.nccl_dtype(dtype, NEW) == expected


def test_dtypes_nccl_lacks_are_rejected_clearly():
    with pytest.raises(TypeError, match="NCCL has no 16-bit integer type.*int32"):
        nccl.nccl_dtype("int16", NEW)
    with pytest.raises(TypeError, match="does not support dtype 'complex64'"):
        nccl.nccl_dtype("complex64", NEW)
    with pytest.raises(TypeError, match=r"bfloat16 needs NCCL >= 2.10; this NCCL is 2.9.9"):
        nccl.nccl_dtype("bfloat16", OLD)
    assert nccl.nccl_dtype("float16", OLD) == 6


SUM, PROD, MAX, MIN, AVG = 0, 1, 2, 3, 4


@pytest.mark.parametrize("op, dtype, version, expected", [
    (ReduceOp.Sum, "float32", NEW, SUM),
    (ReduceOp.Product, "float32", NEW, PROD),
    (ReduceOp.Max, "int64", NEW, MAX),
    (ReduceOp.Min, "float16", NEW, MIN),
    (ReduceOp.Average, "float32", NEW, AVG),
    (ReduceOp.Average, "bfloat16", NEW, AVG),
    (ReduceOp.Sum, "bool", NEW, MAX),          # logical or
    (ReduceOp.Max, "bool", NEW, MAX),
    (ReduceOp.Min, "bool", NEW, MIN),          # logical and
    (ReduceOp.Product, "bool", NEW, MIN),
    (int(ReduceOp.Sum), "int8", NEW, SUM),     # a plain int is accepted as a ReduceOp
])
def test_op_mapping(op, dtype, version, expected):
    assert nccl.nccl_op(op, dtype, version) == expected


@pytest.mark.parametrize("dtype, version, averages", [
    ("float32", NEW, True), ("float16", NEW, True), ("float32", OLD, False),  # ncclAvg from 2.10
    ("int32", NEW, False),  # ncclAvg would truncate in int32; gradsync takes the floor of the mean
])
def test_which_averages_nccl_computes_itself(dtype, version, averages):
    assert nccl.averages(dtype, version) is averages


def test_op_mapping_rejections():
    with pytest.raises(TypeError, match="Average is not defined for bool"):
        nccl.nccl_op(ReduceOp.Average, "bool", NEW)
    with pytest.raises(TypeError, match="16-bit integer"):
        nccl.nccl_op(ReduceOp.Sum, "int16", NEW)
    with pytest.raises(TypeError, match="has no average for int32: reduce with Sum and divide"):
        nccl.nccl_op(ReduceOp.Average, "int32", NEW)
    with pytest.raises(TypeError, match="has no average for float32"):
        nccl.nccl_op(ReduceOp.Average, "float32", OLD)


# ---------------------------------------------------------------------------------------------------
# On a GPU: a world of one rank


class _Device:
    """Device arrays through torch, or else cupy: upload, pointer, stream, download."""

    def __init__(self):
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None:
            self.torch = torch
            if not torch.cuda.is_available():
                pytest.skip("needs a CUDA GPU")
            return
        self.torch = None
        try:
            import cupy
            available = cupy.cuda.is_available()
        except Exception:
            available = False
        if not available:
            pytest.skip("needs a CUDA GPU")
        self.cupy = cupy

    def upload(self, array: np.ndarray):
        if self.torch is not None:
            return self.torch.from_numpy(array).cuda()
        return self.cupy.asarray(array)

    def pointer(self, array) -> int:
        return array.data_ptr() if self.torch is not None else array.data.ptr

    def stream(self) -> int:
        if self.torch is not None:
            return self.torch.cuda.current_stream().cuda_stream
        return self.cupy.cuda.get_current_stream().ptr

    def download(self, array) -> np.ndarray:
        if self.torch is not None:
            self.torch.cuda.synchronize()
            return array.cpu().numpy()
        self.cupy.cuda.Device().synchronize()
        return self.cupy.asnumpy(array)


@pytest.fixture
def gpu_comm():
    device = _Device()
    if not nccl.nccl_built():
        pytest.skip("no NCCL library")
    with nccl.Communicator.init_rank(1, nccl.unique_id(), 0) as comm:
        yield device, comm


@pytest.mark.gpu
def test_gpu_communicator_properties(gpu_comm):
    _, comm = gpu_comm
    assert (comm.size, comm.rank, comm.device) == (1, 0, 0)
    assert comm.async_error() is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, op", [("float32", ReduceOp.Sum), ("float32", ReduceOp.Average),
                                       ("int32", ReduceOp.Sum), ("float16", ReduceOp.Max),
                                       ("bool", ReduceOp.Sum)])
def test_gpu_allreduce_world_of_one(gpu_comm, dtype, op):
    device, comm = gpu_comm
    data = (np.arange(10) % 2).astype(dtype) if dtype == "bool" else np.arange(10).astype(dtype)
    send, recv = device.upload(data), device.upload(np.zeros_like(data))
    comm.allreduce(device.pointer(send), device.pointer(recv), data.size, dtype, op, device.stream())
    np.testing.assert_array_equal(device.download(recv), data)


@pytest.mark.gpu
def test_gpu_broadcast_allgather_reducescatter_sendrecv(gpu_comm):
    device, comm = gpu_comm
    data = np.arange(8, dtype=np.float32)
    send, stream = device.upload(data), device.stream()
    for run in (
        lambda out: comm.broadcast(device.pointer(send), device.pointer(out), 8, "float32", 0, stream),
        lambda out: comm.allgather(device.pointer(send), device.pointer(out), 8, "float32", stream),
        lambda out: comm.reducescatter(device.pointer(send), device.pointer(out), 8, "float32",
                                       ReduceOp.Sum, stream),
    ):
        out = device.upload(np.zeros(8, np.float32))
        run(out)
        np.testing.assert_array_equal(device.download(out), data)
    out = device.upload(np.zeros(8, np.float32))
    with nccl.group():
        comm.send(device.pointer(send), 8, "float32", 0, stream)
        comm.recv(device.pointer(out), 8, "float32", 0, stream)
    np.testing.assert_array_equal(device.download(out), data)
