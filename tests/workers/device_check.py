"""The coordinator's device path on a fake GPU (tests/fakegpu.py), against numpy references.

Run as ``mpiexec -n N python tests/workers/device_check.py`` with GRADSYNC_GPU_OPERATIONS=MPI (the
staging path; tests/test_device.py does, for N = 2). Each rank derives every rank's inputs from
(rank, case), so it computes the expected results with numpy alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for fakegpu

from harness import run_checks  # noqa: E402

import fakegpu  # noqa: E402
import gradsync as gs  # noqa: E402
from gradsync import Average, CollectiveError, Max, Min, Sum  # noqa: E402

gs.init()
RANK, SIZE = gs.rank(), gs.size()


def inputs(case: int, shape, dtype, rank: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * case + rank)
    if np.dtype(dtype) == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    return rng.integers(-8, 9, shape).astype(dtype)


def everyone(case, shape, dtype):
    return [inputs(case, shape, dtype, r) for r in range(SIZE)]


def check_allreduce_many_tensors_through_fusion_every_dtype_and_op():
    cases = []
    for i, dtype in enumerate(("float16", "float32", "float64", "int8", "int32", "int64", "uint8",
                               "int16", "bool")):
        dtype_ops = (Sum, Max) if dtype == "bool" else (Average, Sum, Min, Max)
        if dtype == "uint8":
            dtype_ops = (Sum, Max)  # negative inputs would wrap
        for j, op in enumerate(dtype_ops):
            case = 10 * i + j
            shape = (3, 5) if j % 2 else (7,)
            data = everyone(case, shape, dtype if dtype != "uint8" else "int8")
            data = [d.astype(dtype) for d in data]
            tensor = fakegpu.array(data[RANK])
            handle = gs.allreduce_async_(tensor, name=f"many.{dtype}.{op.name}", op=op)
            cases.append((tensor, handle, data, op, dtype))
    for tensor, handle, data, op, dtype in cases:
        gs.synchronize(handle)
        stacked = np.stack([d.astype(np.float64) for d in data])
        expected = {Sum: stacked.sum(0), Max: stacked.max(0), Min: stacked.min(0)}.get(op)
        if op == Average:
            expected = (np.floor(stacked.sum(0) / SIZE) if np.dtype(dtype).kind in "iu"
                        else stacked.sum(0) / SIZE)
        if dtype == "bool":
            expected = stacked.max(0) > 0
        np.testing.assert_array_equal(fakegpu.read(tensor), expected.astype(dtype),
                                      err_msg=f"{dtype} {op.name}")


def check_pack_waits_for_the_producer_stream():
    """The producer's kernel writes the gradient 0.3 s after submission: a coordinator that did not
    wait on the submission's event would reduce the old values."""
    tensor = fakegpu.array(np.zeros(6, np.float32))
    fakegpu.later(tensor, np.full(6, RANK + 1, np.float32), delay=0.3)
    gs.synchronize(gs.allreduce_async_(tensor, name="producer", op=Sum))
    np.testing.assert_array_equal(fakegpu.read(tensor), np.full(6, SIZE * (SIZE + 1) / 2))


def check_out_of_place_prescale_postscale_and_non_contiguous():
    base = everyone(50, (4, 6), "float32")
    source = fakegpu.FakeArray(base[RANK][:, ::2])  # non-contiguous
    result = gs.allreduce(source, name="scaled", op=Average, prescale_factor=0.5, postscale_factor=4.0)
    assert isinstance(result, fakegpu.FakeArray) and result.shape == (4, 3)
    expected = sum(b[:, ::2] * 0.5 for b in base) / SIZE * 4.0
    np.testing.assert_allclose(fakegpu.read(result), expected, rtol=1e-6)
    np.testing.assert_array_equal(source.data, base[RANK][:, ::2])  # input untouched


def check_broadcast_and_allgather_of_device_tensors():
    data = everyone(60, (5,), "int64")
    tensor = fakegpu.array(data[RANK])
    gs.broadcast_(tensor, root_rank=SIZE - 1, name="bcast")
    np.testing.assert_array_equal(fakegpu.read(tensor), data[SIZE - 1])
    rows = [inputs(61, (r + 1, 3), "float32", r) for r in range(SIZE)]
    gathered = gs.allgather(fakegpu.array(rows[RANK]), name="gather")
    np.testing.assert_array_equal(fakegpu.read(gathered), np.concatenate(rows))


def check_host_and_device_tensors_are_never_fused_together():
    host = np.full(4, float(RANK), np.float32)
    device = fakegpu.array(np.full(4, float(RANK), np.float32))
    handles = [gs.allreduce_async_(host, name="mixed.host", op=Sum),
               gs.allreduce_async_(device, name="mixed.device", op=Sum)]
    for handle in handles:
        gs.synchronize(handle)
    total = sum(range(SIZE))
    np.testing.assert_array_equal(host, np.full(4, total))
    np.testing.assert_array_equal(fakegpu.read(device), np.full(4, total))


def check_ranks_disagreeing_on_the_device_get_an_error_listing_each_rank():
    tensor = np.zeros(3, np.float32) if RANK == 0 else fakegpu.array(np.zeros(3, np.float32))
    try:
        gs.allreduce(tensor, name="where")
    except CollectiveError as exc:
        message = str(exc)
    else:
        raise AssertionError("no error for a cpu/cuda mismatch")
    listed = ", ".join(f"rank {r}: {'cpu' if r == 0 else 'cuda'!r}" for r in range(SIZE))
    assert f"ranks disagree on device: {listed}" in message, message


def check_a_second_gpu_on_one_rank_is_refused_before_queueing():
    gs.allreduce(fakegpu.array(np.zeros(2)), name="first.gpu")  # this rank's GPU is cuda:0 now
    try:
        gs.allreduce_async_(fakegpu.array(np.zeros(2), device=1), name="other.gpu")
    except ValueError as exc:
        assert f"rank {RANK}" in str(exc) and "'other.gpu'" in str(exc), exc
        assert "one GPU per rank" in str(exc) and "cuda:1" in str(exc), exc
    else:
        raise AssertionError("a tensor on a second GPU was accepted")


def check_the_communication_stream_keeps_the_tensors_alive():
    device = fakegpu.DEVICE
    before = len(device.kept)
    tensor = fakegpu.array(np.ones(3, np.float32))
    gs.allreduce_(tensor, name="kept", op=Sum)
    streams = {stream for _, stream in device.kept[before:]}
    assert id(tensor) in {i for i, _ in device.kept[before:]}
    assert streams and all(s in device.streams for s in streams), "keep_alive on a non-comm stream"


def check_every_rank_used_the_staging_backend():
    backend = gs.process.runtime.get().coordinator.device.backend
    assert backend is not None and backend.name.startswith("MPI"), backend


if __name__ == "__main__":
    count = run_checks(globals())
    print(f"device_check rank {RANK}: {count} checks passed", flush=True)
