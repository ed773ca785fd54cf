"""The Average divisor beside a joined rank is the core's, for dense, sparse and integer tensors alike.

The last rank calls join() at once while the others average a dense gradient, a sparse one (an
allgather of indices and values, which gradsync.torch finishes itself) and an integer tensor
(Horovod's integer scaling, also finished in gradsync.torch). Each must be divided by the same
number: the world size, or with ``GRADSYNC_JOIN_DIVISOR=contributors`` (the variant) the ranks
that had not joined. Run at 3 ranks (2 contributors: the two settings differ, and two sparse
gradients overlap), correct at any size from 2. The reference is numpy: the sum of the
contributors' inputs over that divisor, computed here from every rank's seeded input.
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

ROWS, WIDTH = 6, 4


@pytest.fixture
def joined(size):
    """The rank that joins at once (the last one); the others contribute."""
    if size == 1:
        pytest.skip("needs a rank that joins and one that does not")
    return size - 1


def divisor(size: int) -> int:
    """What an Average divides by while the last rank has joined, by the job's setting."""
    return size - 1 if os.environ.get("GRADSYNC_JOIN_DIVISOR") == "contributors" else size


def dense_input(r: int) -> np.ndarray:
    return np.random.default_rng(10 + r).standard_normal((ROWS, WIDTH))


def sparse_rows(r: int) -> list[int]:
    return [r % ROWS, (r + 3) % ROWS, 5]  # the ranks overlap on row 5


def sparse_input(r: int) -> np.ndarray:
    """Rank r's sparse gradient, dense: its rows of ones times (r + 1)."""
    dense = np.zeros((ROWS, WIDTH))
    for row in sparse_rows(r):
        dense[row] += r + 1.0
    return dense


def test_dense_sparse_and_integer_averages_divide_alike(rank, size, joined):
    if rank == joined:
        gradsync.join()
        return
    dense = torch.from_numpy(dense_input(rank))
    indices = torch.tensor([sparse_rows(rank)])
    values = torch.full((3, WIDTH), rank + 1.0, dtype=torch.float64)
    sparse = torch.sparse_coo_tensor(indices, values, (ROWS, WIDTH), check_invariants=True)
    integer = torch.full((5,), 7 * (rank + 1), dtype=torch.int32)
    dense_handle = hvd.allreduce_async(dense, name="jd.dense", op=hvd.Average)
    sparse_wait = hvd.sparse_allreduce_async(sparse, "jd.sparse", hvd.Average)
    integer_handle = hvd.allreduce_async(integer, name="jd.int", op=hvd.Average)
    got_dense = hvd.synchronize(dense_handle).numpy()
    got_sparse = sparse_wait().to_dense().numpy()
    got_integer = hvd.synchronize(integer_handle).numpy()
    gradsync.join()
    d, contributors = divisor(size), range(joined)
    np.testing.assert_allclose(got_dense, sum(map(dense_input, contributors)) / d, rtol=1e-12)
    np.testing.assert_allclose(got_sparse, sum(map(sparse_input, contributors)) / d, rtol=1e-12)
    total = sum(7 * (r + 1) for r in contributors)  # truncated toward zero, as Horovod's
    np.testing.assert_array_equal(got_integer, np.full(5, int(total / d), np.int32))


def test_the_optimizer_divides_sparse_and_dense_gradients_alike(rank, size, joined):
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(ROWS, WIDTH, sparse=True)
    linear = torch.nn.Linear(WIDTH, 1, bias=False)
    with torch.no_grad():
        linear.weight.fill_(1.0)
    params = list(embedding.named_parameters(prefix="jd.emb")) + list(
        linear.named_parameters(prefix="jd.lin"))
    opt = gradsync.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=1.0), params)
    if rank == joined:
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
    d, contributors = divisor(size), range(joined)
    np.testing.assert_allclose(got_sparse, sum(map(sparse_input, contributors)) / d, rtol=1e-6)
    # linear's gradient: (rank + 1) times the sum of the rank's embedding rows
    torch.manual_seed(0)
    before = torch.nn.Embedding(ROWS, WIDTH, sparse=True).weight.detach().numpy()
    want = sum((r + 1) * before[sparse_rows(r)].sum(axis=0) for r in contributors) / d
    np.testing.assert_allclose(got_dense, want[None, :], rtol=1e-5)
