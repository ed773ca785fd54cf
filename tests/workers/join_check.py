"""join() for uneven inputs: ranks with fewer batches join early and the others keep training.

Rank r has 2 + r batches. Every rank trains with DistributedOptimizer until it runs out and then
calls join(). The reference, computed by every rank alone with numpy/torch: at each step, the
average over the world size of the gradients of the ranks that still had a batch (joined ranks
count as zeros, as in Horovod and DDP), or over the contributors with GRADSYNC_JOIN_DIVISOR.
That half needs torch and runs with --torch; the other half (every op's stand-in contribution of a
joined rank) runs on numpy arrays alone.
"""

import os

import numpy as np
from harness import run_numpy_or_torch_checks, torch_requested

import gradsync

if torch_requested():
    import torch

    torch.set_num_threads(1)
gradsync.init()
rank, size = gradsync.rank(), gradsync.size()
by_contributors = os.environ.get("GRADSYNC_JOIN_DIVISOR") == "contributors"


def batches(r):
    g = torch.Generator().manual_seed(100 + r)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(2 + r)]


def torch_check_uneven_training_with_join():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    reference = torch.nn.Linear(3, 1)
    reference.load_state_dict(model.state_dict())
    opt = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        model.named_parameters())
    for x, y in batches(rank):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    last = gradsync.join()
    assert last == size - 1, last  # the rank with the most batches joins last

    every = [batches(r) for r in range(size)]
    for step in range(2 + size - 1):
        active = [r for r in range(size) if step < len(every[r])]
        grads = []
        for r in active:
            reference.zero_grad()
            torch.nn.functional.mse_loss(reference(every[r][step][0]), every[r][step][1]).backward()
            grads.append([p.grad.clone() for p in reference.parameters()])
        divisor = len(active) if by_contributors else size
        with torch.no_grad():
            for i, p in enumerate(reference.parameters()):
                p -= 0.1 * sum(g[i] for g in grads) / divisor
    if rank == size - 1:  # the last rank stepped through every batch: it must match exactly
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(p, q, atol=1e-6), (p, q)


def check_join_stand_ins_for_every_op():
    if rank == 0:
        return_value = gradsync.join()
    else:
        x = np.full(3, float(rank), np.float64)
        assert np.all(gradsync.allreduce(x, name="j.sum", op=gradsync.Sum) == sum(range(1, size)))
        assert np.all(gradsync.allreduce(x, name="j.min", op=gradsync.Min) == 1)
        assert np.all(gradsync.allreduce(x, name="j.max", op=gradsync.Max) == size - 1)
        assert np.all(gradsync.allreduce(x, name="j.prod", op=gradsync.Product) ==
                      np.prod(np.arange(1, size, dtype=float)))
        gathered = gradsync.allgather(np.full((1, 2), rank), name="j.gather")
        assert gathered.tolist() == [[r, r] for r in range(1, size)], gathered
        try:
            gradsync.broadcast(np.ones(2), root_rank=0, name="j.bcast")
        except gradsync.CollectiveError as exc:
            assert "root rank 0 has called join()" in str(exc), exc
        else:
            raise AssertionError("a broadcast from a joined rank succeeded")
        gradsync.barrier()
        return_value = gradsync.join()
    assert return_value != 0 or size == 1


run_numpy_or_torch_checks(globals())
print(f"join_check rank {rank}: passed", flush=True)
