"""The execution plans on every rank: grouped allgather against numpy, and every collective with
MPI's count limit patched to a few elements, so that the chunked paths of the host backend run
without moving gigabytes (the real >2**31-element case is scripts/large_count_check.py)."""

import numpy as np
import pytest

import gradsync


@pytest.fixture
def tiny_mpi_counts():
    """Every MPI call of the host backend moves at most 7 elements (bytes for the byte-based calls)."""
    backend = gradsync.process.runtime.get().coordinator.host.backend
    backend.max_count = 7
    yield
    del backend.max_count  # back to the class's 2**31 - 1


def rows(rank: int, n: int, width: int = 3, dtype=np.float64) -> np.ndarray:
    """Rank ``rank``'s ``n`` rows: distinct values that name the rank and the row."""
    return (100 * rank + np.arange(n * width)).reshape(n, width).astype(dtype)


def test_grouped_allgather_gathers_each_member_like_allgather():
    rank, size = gradsync.rank(), gradsync.size()
    first = rows(rank, rank + 1)  # first dimensions differ by rank
    second = rows(rank, 2, width=1)[:, 0]
    out = gradsync.grouped_allgather([first, second], name="gag")
    np.testing.assert_array_equal(out[0], np.concatenate([rows(r, r + 1) for r in range(size)]))
    np.testing.assert_array_equal(out[1], np.concatenate([rows(r, 2, width=1)[:, 0] for r in range(size)]))


def test_grouped_allgather_of_a_strided_member_and_an_empty_one():
    rank, size = gradsync.rank(), gradsync.size()
    strided = rows(rank, 4, width=4)[::2, ::2]
    empty = np.zeros((0, 5))
    out = gradsync.synchronize(gradsync.grouped_allgather_async([strided, empty], name="gag2"))
    np.testing.assert_array_equal(out[0], np.concatenate([rows(r, 4, width=4)[::2, ::2] for r in range(size)]))
    assert out[1].shape == (0, 5) and out[1].dtype == np.float64


def test_a_grouped_allgather_whose_ranks_disagree_fails_whole_on_every_rank():
    if gradsync.size() == 1:
        pytest.skip("needs two ranks to disagree")
    width = 2 + (gradsync.rank() % 2)  # trailing dimension differs
    with pytest.raises(gradsync.CollectiveError, match="grouped allgather 'gbad' fails as a whole"):
        gradsync.grouped_allgather([np.zeros((1, width)), np.zeros(3)], name="gbad")


def test_chunked_allreduce_equals_numpy(tiny_mpi_counts):
    size = gradsync.size()
    x = np.arange(50, dtype=np.float64) + gradsync.rank()
    got = gradsync.allreduce(x, name="big.sum", op=gradsync.Sum)
    np.testing.assert_array_equal(got, sum(np.arange(50.0) + r for r in range(size)))


def test_chunked_broadcast_equals_the_root(tiny_mpi_counts):
    x = np.full(33, gradsync.rank(), np.int16)
    np.testing.assert_array_equal(gradsync.broadcast(x, root_rank=0, name="big.bcast"), np.zeros(33))


def test_chunked_allgather_equals_numpy(tiny_mpi_counts):
    rank, size = gradsync.rank(), gradsync.size()
    got = gradsync.allgather(rows(rank, rank + 2), name="big.gather")
    np.testing.assert_array_equal(got, np.concatenate([rows(r, r + 2) for r in range(size)]))


def test_chunked_alltoall_equals_numpy(tiny_mpi_counts):
    rank, size = gradsync.rank(), gradsync.size()
    splits = [r + 1 for r in range(size)]  # rank r gets r + 1 rows from everyone
    out, received = gradsync.alltoall(rows(rank, sum(splits)), splits=splits, name="big.a2a")
    starts = np.cumsum([0] + splits)
    expected = np.concatenate([rows(r, sum(splits))[starts[rank]:starts[rank + 1]] for r in range(size)])
    np.testing.assert_array_equal(out, expected)
    assert received.tolist() == [rank + 1] * size


def test_chunked_reducescatter_equals_numpy(tiny_mpi_counts):
    rank, size = gradsync.rank(), gradsync.size()
    x = rows(rank, 2 * size + 1)
    total = sum(rows(r, 2 * size + 1) for r in range(size))
    counts = [len(part) for part in np.array_split(np.arange(2 * size + 1), size)]
    start = sum(counts[:rank])
    got = gradsync.reducescatter(x, name="big.rs", op=gradsync.Sum)
    np.testing.assert_array_equal(got, total[start:start + counts[rank]])
