"""DistributedOptimizer's contract on GPU tensors (run by tests/test_gpu.py).

1. Clipping right after ``backward()`` (no synchronize()) equals single-process training on the
   GPU: the end-of-backward wait made the current stream wait for the allreduces.
2. ``broadcast_optimizer_state`` of CUDA state: what the root pickles holds host tensors only, and
   every rank ends with the root's state on its own parameters' GPU.

Run as ``mpiexec -n N python tests/workers/gpu_contract.py`` (N ranks may share one GPU with
GRADSYNC_GPU_OPERATIONS=MPI). Prints ``gpu_contract rank R: ok`` at the end.
"""

from __future__ import annotations

import copy
import sys

import torch
from mpi4py import MPI

import gradsync
from gradsync.torch.functions import _on_host

STEPS, BATCH = 4, 8


def fail(message: str) -> None:
    print(f"gpu_contract rank {gradsync.rank()}: {message}", flush=True)
    MPI.COMM_WORLD.Abort(1)
    sys.exit(1)


def tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors(item)


def clipping_after_backward(device: torch.device) -> None:
    rank, size = gradsync.rank(), gradsync.size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(device)
    alone = copy.deepcopy(model)
    opt = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                        named_parameters=model.named_parameters())
    alone_opt = torch.optim.SGD(alone.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x = torch.randn(BATCH * size, 16, generator=data).to(device)
        y = torch.randint(0, 4, (BATCH * size,), generator=data).to(device)
        shard = slice(rank * BATCH, (rank + 1) * BATCH)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[shard]), y[shard]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        alone_opt.zero_grad()
        torch.nn.functional.cross_entropy(alone(x), y).backward()
        torch.nn.utils.clip_grad_norm_(alone.parameters(), 0.05)
        alone_opt.step()
        worst = max((p - q).abs().max().item() for p, q in zip(model.parameters(), alone.parameters()))
        if worst > 1e-5:
            fail(f"step {step}: clipped training differs from one process by {worst}")


def broadcast_of_cuda_state(device: torch.device) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3).to(device)
    adam = torch.optim.Adam(model.parameters(), lr=0.01 * (gradsync.rank() + 1))
    if gradsync.rank() == 0:  # only the root has state (on its GPU)
        model(torch.ones(2, 8, device=device)).sum().backward()
        adam.step()
        sent = [t for t in tensors(_on_host(adam.state_dict())) if t.device.type != "cpu"]
        if sent:
            fail(f"the root would pickle {len(sent)} tensor(s) outside host memory")
    gradsync.broadcast_optimizer_state(adam, root_rank=0)
    state = adam.state[model.weight]
    if state["exp_avg"].device != model.weight.device:
        fail(f"exp_avg loaded onto {state['exp_avg'].device}, the parameter is on {model.weight.device}")
    gathered = gradsync.allgather(state["exp_avg"].reshape(1, -1).cpu(), name="gpu_contract.exp_avg")
    if not all(torch.equal(gathered[0], row) for row in gathered):
        fail("the ranks hold different Adam moments after broadcast_optimizer_state")


def main() -> None:
    gradsync.init()
    device = torch.device("cuda", gradsync.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    clipping_after_backward(device)
    broadcast_of_cuda_state(device)
    print(f"gpu_contract rank {gradsync.rank()}: ok", flush=True)
    gradsync.shutdown()


if __name__ == "__main__":
    main()
