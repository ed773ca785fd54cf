"""The Average divisor beside a joined rank is the core's, for dense, sparse and integer tensors alike.

At 3 ranks, rank 2 calls join() at once while ranks 0 and 1 average a dense gradient, a sparse one
(an allgather of indices and values, which gradsync.torch finishes itself) and an integer tensor
(Horovod's integer scaling, also finished in gradsync.torch). Each must be divided by the same
number: the world size (3), or with ``GRADSYNC_JOIN_DIVISOR=contributors`` (the variant) the
ranks that had not joined (2). The reference is numpy: the sum of ranks 0 and 1's inputs over
that divisor, computed here from the seeded inputs of both.
"""

import os

import numpy as np
import pytest

import gradsync

torch = pytest.importorskip("torch")
import gradsync.torch as hvd  # noqa: E402 - after the importorskip

pytestmark = pytest.mark.torch

RANKS = (3,)
VARIANTS = {"contributors": {"env": {"GRADSYNC_JOIN_DIVISOR": "contributors"}, "ranks": (3,)}}

JOINED = 2  # the rank that joins at once
ROWS, WIDTH = 6, 4


def divisor() -> int:
    """What an Average divides by while rank 2 has joined, by the job's setting."""
    return 2 if os.environ.get("GRADSYNC_JOIN_DIVISOR") == "contributors" else 3


def dense_input(r: int) -> np.ndarray:
    return np.random.default_rng(10 + r).standard_normal((ROWS, WIDTH))


def sparse_rows(r: int) -> list[int]:
    return [r, r + 3, 5]  # rank 0 and 1 overlap on row 5


def sparse_input(r: int) -> np.ndarray:
    """Rank r's sparse gradient, dense: its rows of ones times (r + 1)."""
    dense = np.zeros((ROWS, WIDTH))
    for row in sparse_rows(r):
        dense[row] += r + 1.0
    return dense


def test_dense_sparse_and_integer_averages_divide_alike(rank):
    if rank == JOINED:
        gradsync.join()
        return
    dense = torch.from_numpy(dense_input(rank))
    indices = torch.tensor([sparse_rows(rank)])
    values = torch.full((3, WIDTH), rank + 1.0, dtype=torch.float64)
    sparse = torch.sparse_coo_tensor(indices, values, (ROWS, WIDTH), check_invariants=True)
    integer = torch.full((5,), 7 * (rank + 1), dtype=torch.int32)  # 7 and 14: sum 21
    dense_handle = hvd.allreduce_async(dense, name="jd.dense", op=hvd.Average)
    sparse_wait = hvd.sparse_allreduce_async(sparse, "jd.sparse", hvd.Average)
    integer_handle = hvd.allreduce_async(integer, name="jd.int", op=hvd.Average)
    got_dense = hvd.synchronize(dense_handle).numpy()
    got_sparse = sparse_wait().to_dense().numpy()
    got_integer = hvd.synchronize(integer_handle).numpy()
    gradsync.join()
    d = divisor()
    np.testing.assert_allclose(got_dense, (dense_input(0) + dense_input(1)) / d, rtol=1e-12)
    np.testing.assert_allclose(got_sparse, (sparse_input(0) + sparse_input(1)) / d, rtol=1e-12)
    np.testing.assert_array_equal(got_integer, np.full(5, int(21 / d), np.int32))  # 7 or 10


def test_the_optimizer_divides_sparse_and_dense_gradients_alike(rank):
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(ROWS, WIDTH, sparse=True)
    linear = torch.nn.Linear(WIDTH, 1, bias=False)
    with torch.no_grad():
        linear.weight.fill_(1.0)
    params = list(embedding.named_parameters(prefix="jd.emb")) + list(
        linear.named_parameters(prefix="jd.lin"))
    opt = gradsync.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=1.0), params)
    if rank == JOINED:
        gradsync.join()
        return
    rows = torch.tensor(sparse_rows(rank))
    out = linear(embedding(rows))  # d(sum)/d(embedding row) = linear's weight = ones
    (out.sum() * (rank + 1)).backward()
    opt.synchronize()
    got_sparse = embedding.weight.grad.to_dense().numpy()
    got_dense = linear.weight.grad.numpy()
    with opt.skip_synchronize():
        opt.step()
    gradsync.join()
    d = divisor()
    np.testing.assert_allclose(got_sparse, (sparse_input(0) + sparse_input(1)) / d, rtol=1e-6)
    # linear's gradient: (rank + 1) times the sum of the rank's embedding rows
    torch.manual_seed(0)
    before = torch.nn.Embedding(ROWS, WIDTH, sparse=True).weight.detach().numpy()
    want = sum((r + 1) * before[sparse_rows(r)].sum(axis=0) for r in (0, 1)) / d
    np.testing.assert_allclose(got_dense, want[None, :], rtol=1e-5)
