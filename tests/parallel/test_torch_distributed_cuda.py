"""The torch.distributed backend "gradsync" on CUDA tensors (every test skips without a GPU).

The same calls as tests/parallel/test_torch_distributed.py, on tensors of each rank's GPU
(``cuda:<local rank modulo the GPUs present>``), against numpy references built on every rank,
and torch's DDP and FSDP2 on the GPU against one process on the whole batch (float64). One GPU per
rank runs through NCCL; ranks sharing a GPU need ``GRADSYNC_GPU_OPERATIONS=MPI`` (the staging path):

    mpiexec -n 1 python -m pytest tests/parallel/test_torch_distributed_cuda.py
    GRADSYNC_GPU_OPERATIONS=MPI mpiexec -n 2 python -m pytest tests/parallel/test_torch_distributed_cuda.py

scripts/gpu_check.sh runs both.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from reference import WORLD_SIZE

pytestmark = [pytest.mark.torch, pytest.mark.gpu]
torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
RANKS = (1, 2)

import gradsync.torch  # noqa: E402,F401 - registers the backend

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
SHARED = WORLD_SIZE > GPUS and os.environ.get("GRADSYNC_GPU_OPERATIONS", "").lower() != "mpi"
if not GPUS:
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if SHARED:
    pytest.skip(f"{WORLD_SIZE} ranks on {GPUS} GPU(s): NCCL needs one GPU per rank; set "
                "GRADSYNC_GPU_OPERATIONS=MPI", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def process_group():
    dist.init_process_group(backend="gradsync", init_method="gradsync://")
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture
def device():
    index = gradsync.local_rank() % GPUS
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def inputs(size: int, shape=(3, 4), dtype=torch.float64) -> list[torch.Tensor]:
    """Every rank's input (host memory): rank r holds r + 1 + its index."""
    return [(torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape) + r + 1).to(dtype)
            for r in range(size)]


@pytest.mark.parametrize(("op", "fold"), [("SUM", sum), ("AVG", lambda xs: sum(xs) / len(xs)),
                                          ("MAX", lambda xs: torch.stack(xs).amax(0)),
                                          ("MIN", lambda xs: torch.stack(xs).amin(0)),
                                          ("PRODUCT", lambda xs: torch.stack(xs).prod(0))])
def test_all_reduce_of_a_cuda_tensor_in_place(rank, size, device, op, fold):
    tensor = inputs(size)[rank].to(device)
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op))
    assert tensor.is_cuda
    torch.testing.assert_close(tensor.cpu(), fold(inputs(size)), rtol=1e-12, atol=0)


def test_all_reduce_bitwise_and_of_cuda_integers(rank, size, device):
    values = [torch.tensor([0b1111, 0b1010, 7], dtype=torch.int64) - r for r in range(size)]
    tensor = values[rank].to(device)
    dist.all_reduce(tensor, op=dist.ReduceOp.BAND)
    want = values[0]
    for value in values[1:]:
        want = want & value
    assert torch.equal(tensor.cpu(), want)


def test_async_all_reduce_work_and_future_of_a_cuda_tensor(rank, size, device):
    tensor = inputs(size, dtype=torch.float32)[rank].to(device)
    work = dist.all_reduce(tensor, async_op=True)
    future = work.get_future()
    work.wait()
    want = sum(inputs(size, dtype=torch.float32))
    torch.testing.assert_close(future.wait()[0].cpu(), want)
    torch.testing.assert_close(tensor.cpu(), want)


@pytest.mark.parametrize("root", range(WORLD_SIZE))
def test_broadcast_of_a_cuda_tensor(rank, size, device, root):
    tensor = inputs(size)[rank].to(device)
    dist.broadcast(tensor, src=root)
    assert torch.equal(tensor.cpu(), inputs(size)[root])


def test_all_gather_into_tensor_and_all_gather_of_cuda_tensors(rank, size, device):
    mine = inputs(size)[rank].to(device)
    into = torch.empty((size * 3, 4), dtype=torch.float64, device=device)
    listed = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather_into_tensor(into, mine)
    dist.all_gather(listed, mine)
    assert torch.equal(into.cpu(), torch.cat(inputs(size)))
    for got, want in zip(listed, inputs(size)):
        assert got.is_cuda and torch.equal(got.cpu(), want)


def test_reduce_scatter_tensor_of_cuda_tensors(rank, size, device):
    rows = [torch.arange(size * 2, dtype=torch.float64) * (r + 1) for r in range(size)]
    output = torch.empty(2, dtype=torch.float64, device=device)
    dist.reduce_scatter_tensor(output, rows[rank].to(device))
    assert output.is_cuda
    torch.testing.assert_close(output.cpu(), sum(rows)[2 * rank:2 * rank + 2], rtol=1e-12, atol=0)


def test_all_to_all_single_with_uneven_splits_of_cuda_tensors(rank, size, device):
    # rank r sends d + 1 rows to rank d; row values say (sender, receiver)
    sent = [torch.cat([torch.full((d + 1, 2), 10.0 * r + d) for d in range(size)]) for r in range(size)]
    output = torch.empty((size * (rank + 1), 2), device=device)
    dist.all_to_all_single(output, sent[rank].to(device), output_split_sizes=[rank + 1] * size,
                           input_split_sizes=[d + 1 for d in range(size)])
    want = torch.cat([torch.full((rank + 1, 2), 10.0 * r + rank) for r in range(size)])
    assert torch.equal(output.cpu(), want)


def test_send_and_recv_of_cuda_tensors_around_a_ring(rank, size, device):
    if size < 2:
        pytest.skip("needs two ranks")
    tensor = torch.full((5,), float(rank), device=device)
    received = torch.empty(5, device=device)
    right, left = (rank + 1) % size, (rank - 1) % size
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, right),
                                    dist.P2POp(dist.irecv, received, left)])
    for work in works:
        work.wait()
    assert torch.equal(received.cpu(), torch.full((5,), float(left)))


def test_object_collectives_and_barrier_beside_cuda_tensors(rank, size, device):
    objects = [None] * size
    dist.all_gather_object(objects, {"rank": rank})
    dist.barrier()
    assert objects == [{"rank": r} for r in range(size)]


def batch(r: int, step: int) -> tuple:
    g = torch.Generator().manual_seed(100 * step + r)
    return torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randn(6, 4, generator=g, dtype=torch.float64)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()


def trained_alone(size: int, steps: int, device) -> list[torch.Tensor]:
    alone = model().to(device)
    optimizer = torch.optim.SGD(alone.parameters(), lr=0.1)
    for step in range(steps):
        xs, ys = zip(*(batch(r, step) for r in range(size)))
        torch.nn.functional.mse_loss(alone(torch.cat(xs).to(device)), torch.cat(ys).to(device)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().cpu() for p in alone.parameters()]


def train_three_steps(module: torch.nn.Module, rank: int, device) -> None:
    """Three SGD steps of ``module`` (DDP or FSDP2) on this rank's batches."""
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for step in range(3):
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(module(x.to(device)), y.to(device)).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("options", [{}, {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.0005}],
                         ids=["default", "bucket-view"])
def test_ddp_on_cuda_trains_like_one_process_on_the_whole_batch(rank, size, device, options):
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model().to(device), device_ids=[device.index], **options)
    train_three_steps(ddp, rank, device)
    for got, want in zip(ddp.module.parameters(), trained_alone(size, 3, device)):
        torch.testing.assert_close(got.detach().cpu(), want, rtol=1e-12, atol=1e-12)


def test_fsdp2_on_cuda_trains_like_one_process_on_the_whole_batch(rank, size, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda", (size,))
    sharded = model().to(device)
    for layer in (sharded[0], sharded[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    train_three_steps(sharded, rank, device)
    for got, want in zip(sharded.parameters(), trained_alone(size, 3, device)):
        torch.testing.assert_close(got.full_tensor().detach().cpu(), want, rtol=1e-12, atol=1e-12)
