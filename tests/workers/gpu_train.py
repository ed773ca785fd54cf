"""DistributedOptimizer on GPU tensors equals single-process training on the GPU.

Run as ``mpiexec -n N python tests/workers/gpu_train.py`` (N ranks may share one GPU with
GRADSYNC_GPU_OPERATIONS=MPI; NCCL needs one GPU per rank). Each rank trains on its shard of every
batch; each rank also trains the same model alone on the whole batches and checks that its
parameters match that reference after each step. Prints ``gpu_train rank R: STEPS steps equal``.
"""

from __future__ import annotations

import sys

import torch
from mpi4py import MPI

import gradsync

STEPS, BATCH = 5, 8


def model_and_data():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    batches = [(torch.randn(BATCH * gradsync.size(), 16), torch.randint(0, 4, (BATCH * gradsync.size(),)))
               for _ in range(STEPS)]
    return model, batches


def main() -> None:
    gradsync.init()
    rank, size = gradsync.rank(), gradsync.size()
    device = torch.device("cuda", gradsync.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    model, batches = model_and_data()
    reference = [p.detach().clone() for p in model.parameters()]
    model = model.to(device)
    optimizer = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                              named_parameters=model.named_parameters())
    gradsync.broadcast_parameters(model.state_dict(), root_rank=0)
    alone = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(device)
    with torch.no_grad():
        for p, r in zip(alone.parameters(), reference):
            p.copy_(r)
    alone_opt = torch.optim.SGD(alone.parameters(), lr=0.1, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    for step, (x, y) in enumerate(batches):
        x, y = x.to(device), y.to(device)
        shard = slice(rank * BATCH, (rank + 1) * BATCH)
        optimizer.zero_grad()
        loss_fn(model(x[shard]), y[shard]).backward()
        optimizer.step()
        alone_opt.zero_grad()
        loss_fn(alone(x), y).backward()
        alone_opt.step()
        for (name, p), q in zip(model.named_parameters(), alone.parameters()):
            if not torch.allclose(p, q, rtol=1e-4, atol=1e-5):
                print(f"rank {rank}: step {step}: {name} differs by {(p - q).abs().max().item()}", flush=True)
                MPI.COMM_WORLD.Abort(1)
                sys.exit(1)
    backend = gradsync.process.runtime.get().coordinator.device.backend
    print(f"gpu_train rank {rank}: {STEPS} steps equal ({backend.name}, {size} ranks)", flush=True)
    gradsync.shutdown()


if __name__ == "__main__":
    main()
