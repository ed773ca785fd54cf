"""Process sets on numpy arrays, against numpy references computed from the members' known inputs.

Two disjoint sets: ``evens`` (world ranks 0, 2, ...; registered through
``init(process_sets=...)``) and ``odds`` (1, 3, ...; registered with ``add_process_set``). At 2
ranks each set has one member, at 3 the sets differ in size, at 4 both have two. At 1 rank the
only set is the global one: the ops on it run, registration is not tested.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pytest
from mpi4py import MPI
from reference import assert_no_framework_was_imported

import gradsync
from gradsync.arrays import dtypes
from gradsync.engine.protocol import split_rows

RANKS = (1, 2, 3, 4)
# Each set's allreduce through its own shared memory, in chunks of one page (backends/shared.py).
VARIANTS = {
    "shared-memory": {"env": {"GRADSYNC_SHARED_MEMORY_THRESHOLD": "0", "GRADSYNC_SHARED_MEMORY_BYTES": "4096"},
                      "ranks": (3, 4), "k": "allreduce"},
}


@dataclass(frozen=True)
class Sets:
    evens: gradsync.ProcessSet
    odds: gradsync.ProcessSet | None  # None at one rank
    mine: gradsync.ProcessSet  # the one of the two this rank belongs to

    @property
    def other(self) -> gradsync.ProcessSet | None:
        return self.odds if self.mine is self.evens else self.evens


@pytest.fixture(scope="module")
def sets():
    """gradsync started again with ``evens`` registered by init(), and ``odds`` added; every set
    still registered is removed at the end."""
    size = MPI.COMM_WORLD.Get_size()
    gradsync.shutdown()
    if size > 1:
        evens = gradsync.ProcessSet(range(0, size, 2))
        gradsync.init(process_sets=[evens])
        odds = gradsync.add_process_set(range(1, size, 2))
    else:
        gradsync.init()
        evens, odds = gradsync.global_process_set, None
    rank = gradsync.rank()
    yield Sets(evens, odds, evens if rank % 2 == 0 else odds)
    gradsync.shutdown()  # forgets every set, whatever the tests removed or added
    gradsync.init()


def _needs_two_ranks(size: int) -> None:
    if size == 1:
        pytest.skip("at one rank the only set is the global one")


def data(world_rank: int, dtype: str) -> np.ndarray:
    """World rank ``world_rank``'s input: small values, exact in every dtype."""
    values = (np.arange(6).reshape(2, 3) + world_rank) % 3
    if dtype == "bool":
        values = values % 2
    return values.astype(dtypes.NUMPY_DTYPES[dtype])


def reference(members, dtype: str, op) -> np.ndarray:
    """The allreduce of ``data`` over the world ranks ``members``."""
    stacked = np.stack([data(r, dtype).astype(np.float64) for r in members])
    if op == gradsync.Sum:
        out = stacked.max(0) if dtype == "bool" else stacked.sum(0)
    elif op == gradsync.Max:
        out = stacked.max(0)
    else:  # Average: floor of the mean for integers
        out = stacked.sum(0) / len(members)
        if dtype in dtypes.INTEGER:
            out = np.floor(out)
    return out.astype(dtypes.NUMPY_DTYPES[dtype])


def assert_equal(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and np.array_equal(got, want), (got, want)


# ---- registration --------------------------------------------------------------------------------

def test_sets_get_ids_in_registration_order_and_know_their_members(sets, rank, size):
    _needs_two_ranks(size)
    assert (sets.evens.process_set_id, sets.odds.process_set_id) == (1, 2)
    assert gradsync.global_process_set.process_set_id == 0
    assert gradsync.global_process_set.ranks == list(range(size))
    assert sets.evens.included() == (rank % 2 == 0) and sets.evens.size() == len(range(0, size, 2))
    assert sets.mine.included() and sets.mine.rank() == rank // 2
    assert sets.mine.size() == len(range(rank % 2, size, 2))


_BAD_SETS = {
    "same-ranks": (lambda s, size: gradsync.add_process_set(list(s.evens.ranks)), "already has the ranks"),
    "registered": (lambda s, size: gradsync.add_process_set(s.evens), "already registered"),
    "outside": (lambda s, size: gradsync.add_process_set([0, size]), "ranks [{size}]"),
    "empty": (lambda s, size: gradsync.ProcessSet([]), "at least one rank"),
    "repeated": (lambda s, size: gradsync.ProcessSet([1, 1]), "distinct"),
}


@pytest.mark.parametrize("bad", _BAD_SETS)
def test_a_set_that_cannot_be_registered_is_a_value_error(sets, size, bad):
    _needs_two_ranks(size)
    call, text = _BAD_SETS[bad]
    with pytest.raises(ValueError, match=text.format(size=size).replace("[", r"\[").replace("]", r"\]")):
        call(sets, size)


def test_an_op_on_an_unregistered_set_is_a_value_error(sets, size):
    _needs_two_ranks(size)
    with pytest.raises(ValueError, match="is not registered"):
        gradsync.allreduce(np.ones(2), name="x", process_set=gradsync.ProcessSet([0]))


_OUTSIDE = {
    "allreduce": lambda s: gradsync.allreduce(np.ones(2), name="outside", process_set=s),
    "barrier": lambda s: gradsync.barrier(process_set=s),
    "broadcast_object": lambda s: gradsync.broadcast_object(1, root_rank=0, process_set=s),
}


@pytest.mark.parametrize("op", _OUTSIDE)
def test_an_op_on_a_set_this_rank_is_not_in_is_a_value_error_naming_the_set(sets, rank, size, op):
    """The odd ranks try an op on ``evens``; the even ranks do nothing."""
    _needs_two_ranks(size)
    if rank % 2 == 0:
        return
    evens = sets.evens
    with pytest.raises(ValueError) as caught:
        _OUTSIDE[op](evens)
    assert f"rank {rank} is not a member of ProcessSet(id 1, ranks {evens.ranks})" in str(caught.value)


# ---- every op on a set ---------------------------------------------------------------------------

_OPS = [pytest.param(d, op, id=f"{d}-{op.name}") for d in dtypes.SUPPORTED
        for op in (gradsync.Sum, gradsync.Max, gradsync.Average) if not (d == "bool" and op == gradsync.Average)]


@pytest.mark.parametrize(("dtype", "op"), _OPS)
def test_allreduce_on_a_set_reduces_over_its_members(sets, case, rank, dtype, op):
    out = gradsync.allreduce(data(rank, dtype), name=case, op=op, process_set=sets.mine)
    assert_equal(out, reference(sets.mine.ranks, dtype, op))


@pytest.mark.parametrize("dtype", dtypes.SUPPORTED)
def test_grouped_allreduce_on_a_set_reduces_each_member_over_the_sets_ranks(sets, case, rank, dtype):
    group = gradsync.grouped_allreduce([data(rank, dtype), data(rank, dtype)[0]], op=gradsync.Sum,
                                       name=case, process_set=sets.mine)
    want = reference(sets.mine.ranks, dtype, gradsync.Sum)
    assert_equal(group[0], want)
    assert_equal(group[1], want[0])


def _my_rows(sets: Sets, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Six rows on every member (its data three times), and the rows of their sum this member
    gets: split among the set's members in world-rank order, as evenly as possible."""
    rows = split_rows(6, sets.mine.size())
    start = sum(rows[:sets.mine.rank()])
    full = np.concatenate([reference(sets.mine.ranks, dtype, gradsync.Sum)] * 3)
    return full[start:start + rows[sets.mine.rank()]], full


@pytest.mark.parametrize("dtype", dtypes.SUPPORTED)
def test_reducescatter_on_a_set_splits_the_rows_among_its_members(sets, case, rank, dtype):
    tall = np.concatenate([data(rank, dtype)] * 3)
    out = gradsync.reducescatter(tall, op=gradsync.Sum, name=case, process_set=sets.mine)
    assert_equal(out, _my_rows(sets, dtype)[0])


@pytest.mark.parametrize("dtype", dtypes.SUPPORTED)
def test_grouped_reducescatter_on_a_set_splits_each_members_rows(sets, case, rank, dtype):
    tall = np.concatenate([data(rank, dtype)] * 3)
    outs = gradsync.grouped_reducescatter([tall, tall[:1]], op=gradsync.Sum, name=case, process_set=sets.mine)
    assert_equal(outs[0], _my_rows(sets, dtype)[0])


def _as(values: np.ndarray, dtype: str) -> np.ndarray:
    return (values % 2).astype(bool) if dtype == "bool" else values.astype(dtypes.NUMPY_DTYPES[dtype])


@pytest.mark.parametrize("dtype", dtypes.SUPPORTED)
def test_alltoall_on_a_set_sends_one_block_to_each_member(sets, case, dtype):
    """Member i sends j + 1 rows of value 10 * i + j to member j."""
    me, members = sets.mine.rank(), sets.mine.size()
    send = _as(np.concatenate([np.full((j + 1, 2), 10 * me + j) for j in range(members)]), dtype)
    out, received = gradsync.alltoall(send, splits=[j + 1 for j in range(members)], name=case,
                                      process_set=sets.mine)
    assert list(received) == [me + 1] * members, received
    assert_equal(out, _as(np.concatenate([np.full((me + 1, 2), 10 * i + me) for i in range(members)]), dtype))


def test_broadcast_on_a_set_takes_the_root_as_a_world_rank(sets, case, rank):
    root = sets.mine.ranks[-1]
    out = gradsync.broadcast(np.full(3, float(rank)), root_rank=root, name=case, process_set=sets.mine)
    assert_equal(out, np.full(3, float(root)))


def test_broadcast_on_a_set_from_a_rank_outside_it_is_a_value_error(sets, size):
    _needs_two_ranks(size)
    with pytest.raises(ValueError, match=f"is not a member of process set {sets.mine.process_set_id}"):
        gradsync.broadcast(np.zeros(1), root_rank=sets.other.ranks[0], name="bad", process_set=sets.mine)


def test_broadcast_object_on_a_set_gives_the_roots_object(sets, rank):
    root = sets.mine.ranks[-1]
    assert gradsync.broadcast_object({"r": rank}, root_rank=root, process_set=sets.mine) == {"r": root}


def test_allgather_on_a_set_concatenates_in_world_rank_order(sets, case, rank):
    out = gradsync.allgather(np.full((rank + 1, 2), rank, np.int32), name=case, process_set=sets.mine)
    assert_equal(out, np.concatenate([np.full((r + 1, 2), r, np.int32) for r in sets.mine.ranks]))


def test_allgather_object_on_a_set_lists_the_members_objects(sets, rank):
    assert gradsync.allgather_object(rank, process_set=sets.mine) == sets.mine.ranks


def test_unnamed_ops_are_numbered_per_set(sets, rank, size):
    """The ranks of one set issue more unnamed ops on their set than the other's: the global
    set's numbering is unaffected."""
    for _ in range(1 + rank % 2):
        gradsync.allreduce(np.ones(1), process_set=sets.mine)
    out = gradsync.allreduce(np.ones(1), op=gradsync.Sum)  # global: the same number on every rank
    assert out[0] == size


def test_disjoint_sets_do_not_wait_for_each_other(sets, case, rank, size):
    """The odd ranks submit only after rank 0 tells them (over the user's own MPI traffic) that the
    even set finished: if a set waited for ranks outside it, this would deadlock."""
    _needs_two_ranks(size)
    world = MPI.COMM_WORLD
    if rank % 2 == 0:
        out = gradsync.allreduce(np.ones(4), name=case, op=gradsync.Sum, process_set=sets.evens)
        if rank == 0:
            for odd in sets.odds.ranks:
                world.send("evens done", dest=odd, tag=7)
        assert_equal(out, np.full(4, float(sets.evens.size())))
        return
    request = world.irecv(source=0, tag=7)
    deadline = time.monotonic() + 30
    done, message = request.test()
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
        done, message = request.test()
    assert message == "evens done", "the even set never finished on its own"
    out = gradsync.allreduce(np.ones(4), name=case, op=gradsync.Sum, process_set=sets.odds)
    assert_equal(out, np.full(4, float(sets.odds.size())))


def test_global_and_set_ops_interleave_in_any_order(sets, case, rank, size):
    order = [("set", sets.mine), ("global", gradsync.global_process_set)]
    handles = [gradsync.allreduce_async(np.full(2, 1.0), name=f"{case}.{label}", op=gradsync.Sum,
                                        process_set=process_set)
               for label, process_set in (order if rank % 2 else order[::-1])]
    sums = sorted(float(gradsync.synchronize(h)[0]) for h in handles)
    assert sums == sorted([float(sets.mine.size()), float(size)])


def test_a_disagreement_inside_a_set_names_world_ranks(sets, case):
    members = sets.mine
    if members.size() < 2:
        return  # a set of one rank cannot disagree with itself (not a skip: the other set runs it)
    shape = (2,) if members.rank() == 0 else (3,)
    with pytest.raises(gradsync.CollectiveError) as caught:
        gradsync.allreduce(np.ones(shape), name=case, process_set=members)
    after = gradsync.allreduce(np.ones(2), name=case, op=gradsync.Sum, process_set=members)
    listed = ", ".join(f"rank {r}: {(2,) if i == 0 else (3,)}" for i, r in enumerate(members.ranks))
    assert str(caught.value) == (f"gradsync: rank {gradsync.rank()}: allreduce {case!r}: ranks disagree "
                                 f"on shape: {listed} (in process set {members.process_set_id}, world "
                                 f"ranks {list(members.ranks)})")
    assert_equal(after, np.full(2, float(members.size())))


def test_join_in_a_set_returns_a_member(sets):
    assert gradsync.join(process_set=sets.mine) in sets.mine.ranks


def test_the_global_set_cannot_be_removed(sets):
    with pytest.raises(ValueError, match="cannot be removed"):
        gradsync.remove_process_set(gradsync.global_process_set)


def test_a_removed_set_refuses_ops_and_its_ranks_can_be_registered_again(sets, rank, size):
    """Last: it removes ``evens``, which the tests above use."""
    _needs_two_ranks(size)
    gradsync.remove_process_set(sets.evens)
    assert sets.evens.process_set_id is None
    if rank % 2 == 0:
        with pytest.raises(ValueError, match="is not registered"):
            gradsync.allreduce(np.ones(1), name="removed", process_set=sets.evens)
    again = gradsync.add_process_set(range(0, size, 2))
    assert again.process_set_id == 3, again
    if rank % 2 == 0:
        out = gradsync.allreduce(np.ones(1), op=gradsync.Sum, name="again", process_set=again)
        assert out[0] == again.size()


def test_no_test_of_this_file_imported_torch_or_jax(request):
    assert_no_framework_was_imported(request.session)
