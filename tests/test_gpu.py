"""The GPU data path on a real GPU (pytest marker ``gpu``; every test skips without CUDA).

In-process tests run a world of one rank through NCCL (the default when it loads). The MPI jobs
train with DistributedOptimizer on the GPU: one rank through NCCL, and two ranks sharing one GPU
through the MPI staging path; both must equal single-process training on the GPU.
scripts/gpu_check.sh runs these and the GPU benchmarks in one go.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import gradsync
from gradsync import Average, Max, Min, Sum
from mpi_launch import run_mpi

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                "float64": torch.float64, "uint8": torch.uint8, "int8": torch.int8,
                "int16": torch.int16, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool}


@pytest.fixture
def world_of_one(monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    gradsync.init(fusion_threshold=4096)
    try:
        yield
    finally:
        gradsync.shutdown()


def test_allreduce_of_many_tensors_through_fusion_every_dtype(world_of_one):
    """Many small tensors of every dtype fuse into few buffers; with one rank Sum/Min/Max return
    the input and Average with factors returns input * prescale * postscale."""
    cases = []
    for i, (name, dtype) in enumerate(TORCH_DTYPES.items()):
        for op in ((Sum, Max) if name == "bool" else (Average, Sum, Min, Max)):
            for j in range(5):
                data = torch.arange(3 + j, dtype=torch.float64).remainder(2 if name == "bool" else 7)
                tensor = data.to(dtype).cuda()
                factors = {"prescale_factor": 0.5, "postscale_factor": 4.0} if (
                    op == Average and name in ("float16", "bfloat16", "float32", "float64")) else {}
                handle = gradsync.allreduce_async(tensor, name=f"{name}.{op.name}.{j}", op=op, **factors)
                cases.append((handle, data.to(dtype), 2.0 if factors else 1.0))
    for handle, expected, scale in cases:
        result = gradsync.synchronize(handle)
        assert result.is_cuda and result.dtype == expected.dtype
        want = (expected.double() * scale).to(expected.dtype)
        assert torch.equal(result.cpu(), want), (handle.name, result.cpu(), want)
    assert gradsync.process.runtime.get().coordinator.device.backend.name == "NCCL"


def test_synchronize_does_not_block_the_host(world_of_one):
    tensor = torch.ones(1 << 20, device="cuda")
    gradsync.allreduce_(tensor, name="warm", op=Sum)  # creates the communicator
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time on the compute stream before the gradient
    tensor.fill_(3.0)
    started = time.perf_counter()
    gradsync.synchronize(gradsync.allreduce_async_(tensor, name="late", op=Sum))
    host_s = time.perf_counter() - started
    assert host_s < 0.5, f"synchronize() took {host_s:.2f} s: it waited for the GPU"
    assert torch.equal(tensor, torch.full_like(tensor, 3.0))  # .cpu() waits; the stream saw the result


def test_broadcast_and_allgather_of_cuda_tensors(world_of_one):
    base = torch.arange(24, dtype=torch.float32, device="cuda").reshape(4, 6)
    strided = base[:, ::2]
    out = gradsync.broadcast(strided, root_rank=0, name="bcast")
    assert torch.equal(out, strided)
    gathered = gradsync.allgather(base.to(torch.int16), name="gather")
    assert torch.equal(gathered, base.to(torch.int16))


def test_cupy_arrays(world_of_one):
    cupy = pytest.importorskip("cupy")
    array = cupy.arange(10, dtype=cupy.float32)
    result = gradsync.allreduce(array, name="cupy", op=Average, postscale_factor=3.0)
    assert isinstance(result, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(result), np.arange(10) * 3.0)


@pytest.mark.mpi
def test_training_through_nccl_equals_single_process_training():
    result = run_mpi("gpu_train.py", 1, env={"NCCL_SOCKET_IFNAME": "lo"}, timeout=180)
    assert "gpu_train rank 0: 5 steps equal (NCCL, 1 ranks)" in result.stdout, result.stdout


@pytest.mark.mpi
def test_two_ranks_on_one_gpu_through_mpi_staging_equal_single_process_training():
    result = run_mpi("gpu_train.py", 2, env={"GRADSYNC_GPU_OPERATIONS": "MPI"}, timeout=180)
    for rank in range(2):
        assert f"gpu_train rank {rank}: 5 steps equal (MPI" in result.stdout, result.stdout


@pytest.mark.mpi
@pytest.mark.parametrize(("ranks", "env"), [(1, {"NCCL_SOCKET_IFNAME": "lo"}),
                                            (2, {"GRADSYNC_GPU_OPERATIONS": "MPI"})],
                         ids=["nccl-1", "mpi-staging-2"])
def test_clipping_after_backward_and_broadcast_of_cuda_optimizer_state(ranks, env):
    """Clipping right after backward() equals single-process GPU training; the root's CUDA
    optimizer state travels as host tensors and lands on each rank's own GPU."""
    result = run_mpi("gpu_contract.py", ranks, env=env, timeout=180)
    for rank in range(ranks):
        assert f"gpu_contract rank {rank}: ok" in result.stdout, result.stdout
