"""gradsync.torch.init with Horovod's arguments: a list of world ranks as ``comm``, numbered in the
list's order, and ``process_sets="dynamic"``. Run on N ranks with the list of every rank but the
last, reversed: ranks in the list print ``hvd rank R of M (world W)``, the last rank prints the
ValueError it got; then each checks an allreduce over the job it is in."""

import torch
from mpi4py import MPI

import gradsync.torch as hvd

world, everyone = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
ranks = list(range(everyone - 1))[::-1] if everyone > 1 else [0]
try:
    hvd.init(comm=ranks, process_sets="dynamic")
except ValueError as exc:
    print(f"world {world}: ValueError: {exc}", flush=True)
else:
    assert hvd.rank() == ranks.index(world) and hvd.size() == len(ranks)
    total = hvd.allreduce(torch.tensor([float(world)]), op=hvd.Sum).item()
    assert total == sum(ranks), total
    print(f"hvd rank {hvd.rank()} of {hvd.size()} (world {world})", flush=True)
    hvd.shutdown()
