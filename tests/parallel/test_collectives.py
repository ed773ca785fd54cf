"""grouped_allreduce, reducescatter, grouped_reducescatter and alltoall on numpy arrays, against the
numpy references of tests/parallel/reference.py (every rank builds every rank's input):

* a grouped allreduce gives each member that member's allreduce;
* reducescatter gives rank r its block of rows of the allreduce (the first ``N % size`` ranks
  one row more);
* alltoall gives rank r every source rank's block of rows for r, in source rank order, and the
  number of rows from each.

The group tests, the mismatches and the joined rank run again without the response cache, with a
cache of 3 entries (groups larger than the cache keep being evicted) and with fusion threshold 0
(a group is still one response): see ``VARIANTS``. The last test checks that nothing imported
torch; test_collectives_torch.py runs these ops on torch tensors.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI
from reference import (
    DTYPES,
    FLOATS,
    WORLD_SIZE,
    all_inputs,
    alltoall_splits,
    assert_array,
    assert_fragments,
    assert_no_framework_was_imported,
    assert_rejected_before_sending,
    beside_a_joined_rank,
    dtype_op_params,
    raises,
    reference_allreduce,
    reference_alltoall,
    rows_of,
)

import gradsync as gs
from gradsync import Average, CollectiveError, Max, Min, Product, Sum

# Literals (tests/test_parallel.py reads them without importing this file): the group tests, the
# disagreements and the joined rank.
VARIANTS = {
    "no-cache": {"env": {"GRADSYNC_CACHE_CAPACITY": "0"}, "k": "group or disagree or joined"},
    "tiny-cache": {"env": {"GRADSYNC_CACHE_CAPACITY": "3"}, "k": "group or disagree or joined"},
    "no-fusion": {"env": {"GRADSYNC_FUSION_THRESHOLD": "0"}, "k": "group or disagree or joined"},
}

# ---- grouped allreduce ---------------------------------------------------------------------------

_GROUP_SHAPES = [(3, 5), (0,), (2, 1, 4), ()]  # several shapes, a zero-size member, a scalar


def _group_inputs(case: str, dtype: str, op) -> list[list[np.ndarray]]:
    """Member i's input on every rank."""
    return [all_inputs(f"{case}.{i}", dtype, shape, op) for i, shape in enumerate(_GROUP_SHAPES)]


def _assert_members(got: list, wants: list[np.ndarray]) -> None:
    assert len(got) == len(wants)
    for member, want in zip(got, wants):
        assert_array(member, want)


@pytest.mark.parametrize(("dtype", "op"), dtype_op_params())
def test_grouped_allreduce_gives_each_member_its_allreduce(case, rank, dtype, op):
    inputs = _group_inputs(case, dtype, op)
    got = gs.grouped_allreduce([m[rank] for m in inputs], name=case, op=op)
    _assert_members(got, [reference_allreduce(m, op) for m in inputs])


@pytest.mark.parametrize(("dtype", "op"), dtype_op_params())
def test_grouped_allreduce_leaves_its_inputs_alone(case, rank, dtype, op):
    inputs = _group_inputs(case, dtype, op)
    mine = [m[rank].copy() for m in inputs]
    gs.grouped_allreduce(mine, name=case, op=op)
    _assert_members(mine, [m[rank] for m in inputs])


@pytest.mark.parametrize(("dtype", "op"), dtype_op_params())
def test_grouped_allreduce_async_handle_gives_every_members_allreduce(case, rank, dtype, op):
    inputs = _group_inputs(case, dtype, op)
    handle = gs.grouped_allreduce_async([m[rank] for m in inputs], name=case, op=op)
    _assert_members(gs.synchronize(handle), [reference_allreduce(m, op) for m in inputs])
    assert gs.poll(handle), "poll is True once synchronized"


@pytest.mark.parametrize(("dtype", "op"), dtype_op_params())
def test_grouped_allreduce_in_place_writes_each_result_into_its_member(case, rank, dtype, op):
    inputs = _group_inputs(case, dtype, op)
    inplace = [m[rank].copy() for m in inputs]
    got = gs.grouped_allreduce_(inplace, name=case, op=op)
    assert all(g is m for g, m in zip(got, inplace)), "returns its arguments"
    _assert_members(inplace, [reference_allreduce(m, op) for m in inputs])


@pytest.mark.parametrize(("dtype", "op"), dtype_op_params())
def test_grouped_allreduce_async_in_place_writes_each_result_into_its_member(case, rank, dtype, op):
    inputs = _group_inputs(case, dtype, op)
    inplace = [m[rank].copy() for m in inputs]
    gs.synchronize(gs.grouped_allreduce_async_(inplace, name=case, op=op))
    _assert_members(inplace, [reference_allreduce(m, op) for m in inputs])


def test_grouped_allreduce_average_of_bool_is_a_type_error_naming_the_member(case, rank):
    mine = [m[rank] for m in _group_inputs(case, "bool", Average)]
    with raises(TypeError, "Average", "bool", repr(case), "member 0", f"rank {rank}"):
        gs.grouped_allreduce(mine, name=case, op=Average)


@pytest.mark.parametrize("dtype", FLOATS)
def test_grouped_allreduce_in_place_of_transposed_members_with_scale_factors(case, rank, dtype):
    inputs = [all_inputs(f"{case}.{i}", dtype, (4, 6)) for i in range(3)]
    bases = [m[rank].copy() for m in inputs]
    gs.grouped_allreduce_([b.T for b in bases], name=case, prescale_factor=0.5, postscale_factor=4.0)
    _assert_members(bases, [reference_allreduce(m, Average, 0.5, 4.0) for m in inputs])


# ---- reducescatter -------------------------------------------------------------------------------

_RS_SHAPES = {  # rows depend on the world size
    "uneven": (2 * WORLD_SIZE + 1, 3), "fewer-rows-than-ranks": (max(WORLD_SIZE - 1, 1), 2, 2),
    "no-rows": (0, 4), "divisible": (3 * WORLD_SIZE, 1), "1d": (WORLD_SIZE + 2,),
}


@pytest.mark.parametrize("shape", _RS_SHAPES)
@pytest.mark.parametrize(("dtype", "op"), dtype_op_params())
def test_reducescatter_gives_each_rank_its_rows_of_the_reduction(case, rank, size, dtype, op, shape):
    shape = _RS_SHAPES[shape]
    inputs = all_inputs(case, dtype, shape, op)
    got = gs.reducescatter(inputs[rank], name=case, op=op)
    assert_array(got, reference_allreduce(inputs, op)[rows_of(shape[0], rank, size)])


@pytest.mark.parametrize("shape", _RS_SHAPES)
@pytest.mark.parametrize(("dtype", "op"), dtype_op_params())
def test_reducescatter_leaves_its_input_alone(case, rank, dtype, op, shape):
    inputs = all_inputs(case, dtype, _RS_SHAPES[shape], op)
    mine = inputs[rank].copy()
    gs.reducescatter(mine, name=case, op=op)
    assert_array(mine, inputs[rank])


@pytest.mark.parametrize("shape", _RS_SHAPES)
@pytest.mark.parametrize(("dtype", "op"), dtype_op_params())
def test_reducescatter_async_handle_gives_this_ranks_rows(case, rank, size, dtype, op, shape):
    shape = _RS_SHAPES[shape]
    inputs = all_inputs(case, dtype, shape, op)
    got = gs.synchronize(gs.reducescatter_async(inputs[rank], name=case, op=op))
    assert_array(got, reference_allreduce(inputs, op)[rows_of(shape[0], rank, size)])


@pytest.mark.parametrize("shape", _RS_SHAPES)
def test_reducescatter_average_of_bool_is_a_type_error(case, rank, shape):
    inputs = all_inputs(case, "bool", _RS_SHAPES[shape], Average)
    with raises(TypeError, "Average", "bool", repr(case), f"rank {rank}"):
        gs.reducescatter(inputs[rank], name=case, op=Average)


@pytest.mark.parametrize("dtype", FLOATS)
def test_reducescatter_of_a_transposed_input_with_scale_factors(case, rank, size, dtype):
    """Scattered along the view's dimension 0."""
    shape = (5, 2 * size + 1)
    transposed = [x.T for x in all_inputs(case, dtype, shape)]
    got = gs.reducescatter(transposed[rank], name=case, prescale_factor=0.25, postscale_factor=2.0)
    want = reference_allreduce(transposed, Average, 0.25, 2.0)[rows_of(shape[1], rank, size)]
    assert_array(got, want)


def _grouped_rs(case: str, dtype: str, op, rank: int, size: int) -> tuple[list, list]:
    """This rank's members (one per reducescatter shape), and what it must receive of each."""
    shapes = list(_RS_SHAPES.values())
    inputs = [all_inputs(f"{case}.{i}", dtype, s, op) for i, s in enumerate(shapes)]
    wants = [reference_allreduce(m, op)[rows_of(s[0], rank, size)] for m, s in zip(inputs, shapes)]
    return [m[rank] for m in inputs], wants


@pytest.mark.parametrize(("dtype", "op"), dtype_op_params())
def test_grouped_reducescatter_gives_each_member_its_reducescatter(case, rank, size, dtype, op):
    mine, wants = _grouped_rs(case, dtype, op, rank, size)
    _assert_members(gs.grouped_reducescatter(mine, name=case, op=op), wants)


@pytest.mark.parametrize(("dtype", "op"), dtype_op_params())
def test_grouped_reducescatter_async_handle_gives_every_members_rows(case, rank, size, dtype, op):
    mine, wants = _grouped_rs(case, dtype, op, rank, size)
    _assert_members(gs.synchronize(gs.grouped_reducescatter_async(mine, name=case, op=op)), wants)


def test_grouped_reducescatter_average_of_bool_is_a_type_error(case, rank, size):
    mine, _ = _grouped_rs(case, "bool", Sum, rank, size)
    with raises(TypeError, "Average", "bool", repr(case), f"rank {rank}"):
        gs.grouped_reducescatter(mine, name=case, op=Average)


# ---- alltoall ------------------------------------------------------------------------------------

def _uneven(case: str, dtype: str, size: int):
    """Every rank's splits (0 to 3 rows per destination, zeros included) and input."""
    splits = [alltoall_splits(case, r) for r in range(size)]
    return splits, all_inputs(case, dtype, [(sum(s), 2, 3) for s in splits])


@pytest.mark.parametrize("dtype", DTYPES)
def test_alltoall_with_uneven_splits_gives_every_sources_rows_for_this_rank(case, rank, size, dtype):
    splits, inputs = _uneven(case, dtype, size)
    got, received = gs.alltoall(inputs[rank], splits=splits[rank], name=case)
    want, want_splits = reference_alltoall(inputs, splits, rank)
    assert_array(got, want)
    assert_array(received, np.array(want_splits, np.int64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_alltoall_leaves_its_input_alone(case, rank, size, dtype):
    splits, inputs = _uneven(case, dtype, size)
    mine = inputs[rank].copy()
    gs.alltoall(mine, splits=splits[rank], name=case)
    assert_array(mine, inputs[rank])


@pytest.mark.parametrize("dtype", DTYPES)
def test_alltoall_async_with_splits_as_an_array(case, rank, size, dtype):
    splits, inputs = _uneven(case, dtype, size)
    got, received = gs.synchronize(gs.alltoall_async(inputs[rank], np.array(splits[rank]), name=case))
    want, want_splits = reference_alltoall(inputs, splits, rank)
    assert_array(got, want)
    assert_array(received, np.array(want_splits, np.int64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_alltoall_without_splits_sends_every_rank_an_even_share(case, rank, size, dtype):
    inputs = all_inputs(case, dtype, (2 * size, 3))
    got, received = gs.alltoall(inputs[rank], name=case)
    assert_array(got, reference_alltoall(inputs, [[2] * size] * size, rank)[0])
    assert_array(received, np.full(size, 2, np.int64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_alltoall_of_no_rows_receives_no_rows(case, size, dtype):
    empty = np.zeros((0, 3), DTYPES[dtype])
    got, received = gs.alltoall(empty, splits=[0] * size, name=case)
    assert_array(got, empty)
    assert_array(received, np.zeros(size, np.int64))


def test_alltoall_of_a_transposed_input_reusing_its_name_with_new_splits(case, rank, size):
    """The same name three times with other splits (alltoall is never cached)."""
    results, wants = [], []
    for round_ in range(3):
        splits = [alltoall_splits(f"{case}.{round_}", r) for r in range(size)]
        transposed = [x.T for x in all_inputs(f"{case}.{round_}", "float32", [(4, sum(s)) for s in splits])]
        results.append(gs.alltoall(transposed[rank], splits[rank], name=case)[0])
        wants.append(reference_alltoall(transposed, splits, rank)[0])
    _assert_members(results, wants)


# ---- errors before anything is sent --------------------------------------------------------------
# Bad arguments raise on the calling rank, name the collective, the rank and the value, and queue
# nothing, so the name is free right after. Every rank makes the same mistake.

def _rejected(error, call, name: str, *fragments: str) -> None:
    """``call()`` raises ``error`` with every fragment; then a group of that name works."""
    assert_rejected_before_sending(error, call, name, *fragments, group=True)


_X = np.arange(6, dtype=np.float32).reshape(3, 2)


def test_an_empty_group_is_a_value_error(case, rank):
    _rejected(ValueError, lambda: gs.grouped_allreduce([], name=case), case, "empty", repr(case), f"rank {rank}")
    _rejected(ValueError, lambda: gs.grouped_reducescatter_async((), name=case), case, "empty")


def test_a_group_that_is_not_a_list_or_tuple_is_a_type_error(case, rank):
    _rejected(TypeError, lambda: gs.grouped_allreduce(_X, name=case), case,
              "list or tuple", "ndarray", repr(case), f"rank {rank}")


def test_a_group_of_mixed_dtypes_is_a_type_error_listing_each_members_dtype(case, rank):
    _rejected(TypeError, lambda: gs.grouped_allreduce([_X, _X.astype(np.float64)], name=case), case,
              "same dtype", "member 0: float32", "member 1: float64", f"rank {rank}")


def test_a_group_with_an_unsupported_member_is_a_type_error_naming_the_member(case, rank):
    _rejected(TypeError, lambda: gs.grouped_allreduce_async_([_X, _X.astype(np.complex64)], name=case),
              case, "member 1", "not supported", f"rank {rank}")


def test_a_grouped_reducescatter_of_integers_with_a_prescale_is_a_type_error(case, rank):
    _rejected(TypeError, lambda: gs.grouped_reducescatter([_X.astype(np.int32)] * 2, name=case,
                                                          prescale_factor=2.0),
              case, "member 0", "prescale_factor", f"rank {rank}")


def test_a_grouped_allreduce_in_place_with_a_read_only_member_is_a_value_error(case, rank):
    readonly = _X.copy()
    readonly.flags.writeable = False
    _rejected(ValueError, lambda: gs.grouped_allreduce_([_X.copy(), readonly], name=case), case,
              "read-only", "member 1", f"rank {rank}")


def test_a_grouped_allreduce_with_an_unknown_op_is_a_value_error(case, rank):
    _rejected(ValueError, lambda: gs.grouped_allreduce([_X], name=case, op=9), case, "op=9", f"rank {rank}")


@pytest.mark.parametrize("submit", [gs.reducescatter, gs.reducescatter_async, gs.alltoall, gs.alltoall_async],
                         ids=["reducescatter", "reducescatter_async", "alltoall", "alltoall_async"])
def test_reducescatter_and_alltoall_of_a_0d_array_are_a_value_error(case, rank, submit):
    _rejected(ValueError, lambda: submit(np.ones((), np.float32), name=case), case, "0-d", repr(case),
              f"rank {rank}")


def test_a_grouped_reducescatter_with_a_0d_member_is_a_value_error_naming_the_member(case, rank):
    _rejected(ValueError, lambda: gs.grouped_reducescatter([np.ones(())], name=case), case,
              "0-d", "member 0", f"rank {rank}")


def _bad_splits(size: int, rows: int) -> list:
    return [
        pytest.param(ValueError, [1] * (size + 1), (f"{size + 1} entries", f"{size} ranks"), id="too-many"),
        pytest.param(ValueError, [rows + 1] + [-1] + [0] * (size - 2) if size > 1 else [-1], ("negative",),
                     id="negative"),
        pytest.param(ValueError, [0] * size, ("sum to 0", f"dimension 0 of the tensor is {rows}"),
                     id="wrong-sum"),
        pytest.param(TypeError, [1.5] * size, ("ints",), id="floats"),
        pytest.param(TypeError, "ab", ("ints",), id="a-string"),
    ]


@pytest.mark.parametrize(("error", "splits", "fragments"), _bad_splits(WORLD_SIZE, WORLD_SIZE + 1))
def test_alltoall_with_bad_splits_fails_before_anything_is_sent(case, rank, size, error, splits, fragments):
    y = np.zeros((size + 1, 2), np.float32)
    with pytest.raises(error) as caught:
        gs.alltoall(y, splits, name=case)
    fine = [2] + [1] * (size - 1)
    _, received = gs.alltoall(y, fine, name=case)
    assert_fragments(caught.value, repr(case), f"rank {rank}", *fragments)
    assert received.tolist() == ([fine[0]] * size if rank == 0 else [1] * size), "the name is free"


def test_alltoall_without_splits_of_rows_not_divisible_by_the_size_is_a_value_error(case, rank, size):
    if size == 1:
        pytest.skip("every number of rows is divisible by 1")
    rows = size + 1
    y = np.zeros((rows, 2), np.float32)
    with pytest.raises(ValueError) as caught:
        gs.alltoall(y, name=case)
    gs.alltoall(y, [2] + [1] * (size - 1), name=case)  # the name is free
    assert_fragments(caught.value, "not divisible", f"({rows})", f"({size})", "splits=", repr(case),
                  f"rank {rank}")


def test_rejected_unnamed_groups_do_not_advance_the_unnamed_counter(size):
    """Unnamed groups are numbered in call order (``grouped_allreduce.noname.N``, the name the
    README documents); a rejected call takes no number, so the ranks' numbers stay aligned."""
    first = gs.grouped_allreduce_async([_X], op=Sum)
    gs.synchronize(first)
    with pytest.raises(ValueError):
        gs.grouped_allreduce([])
    with pytest.raises(TypeError):
        gs.grouped_allreduce([_X, _X.astype(np.float64)])
    group = gs.grouped_allreduce_async([_X, _X], op=Sum)
    got = gs.synchronize(group)
    number = int(first.name.rsplit(".", 1)[1])
    assert group.name == f"grouped_allreduce.noname.{number + 1}", (first.name, group.name)
    _assert_members(got, [_X * size, _X * size])


# ---- disagreements -------------------------------------------------------------------------------
# Ranks disagreeing on one member fail the whole group on every rank, with the exact message
# naming each rank's value; the job and the names stay usable.

def _needs_two_ranks(size: int) -> None:
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")


def _listed(value, size: int) -> str:
    return ", ".join(f"rank {r}: {value(r)!r}" for r in range(size))


def _fails_as_a_whole(handle) -> tuple[str, list[str]]:
    """The group's error, and each member's (every member must fail: none completed)."""
    with pytest.raises(CollectiveError) as caught:
        gs.synchronize(handle)
    members = []
    for member in handle.handles:
        with pytest.raises(CollectiveError) as failed:
            member.wait()
        members.append(str(failed.value))
    return str(caught.value), members


def test_a_group_whose_ranks_disagree_on_a_members_shape_fails_as_a_whole_on_every_rank(case, rank, size):
    _needs_two_ranks(size)
    x = np.ones((2, 3), np.float32)
    error, members = _fails_as_a_whole(gs.grouped_allreduce_async(
        [x, np.zeros((rank + 1, 2), np.float32), x], name=case))
    again = gs.grouped_allreduce([x, x], name=case, op=Sum)
    assert error == (f"gradsync: rank {rank}: grouped allreduce {case!r} fails as a whole: "
                     f"allreduce '{case}.1': ranks disagree on shape: {_listed(lambda r: (r + 1, 2), size)}")
    assert members == [error] * 3
    _assert_members(again, [x * size, x * size])


def test_a_group_whose_ranks_disagree_on_its_size_fails_as_a_whole_on_every_rank(case, rank, size):
    _needs_two_ranks(size)
    x = np.ones((2, 3), np.float32)
    error, members = _fails_as_a_whole(gs.grouped_allreduce_async([x] * (2 + rank % 2), name=case))
    again = gs.grouped_allreduce([x, x], name=case, op=Sum)
    assert error == (f"gradsync: rank {rank}: grouped allreduce {case!r} fails as a whole: "
                     f"allreduce '{case}.0': ranks disagree on group size: "
                     f"{_listed(lambda r: 2 + r % 2, size)}")
    assert members == [error] * (2 + rank % 2)
    _assert_members(again, [x * size, x * size])


def test_a_reducescatter_whose_ranks_disagree_on_the_shape_fails_on_every_rank(case, rank, size):
    _needs_two_ranks(size)
    with pytest.raises(CollectiveError) as caught:
        gs.synchronize(gs.reducescatter_async(np.zeros((rank + 2, 2)), name=case))
    x = np.ones((2, 3), np.float32)
    again = gs.reducescatter(x, name=case, op=Sum)
    assert str(caught.value) == (f"gradsync: rank {rank}: reducescatter {case!r}: ranks disagree on "
                                 f"shape: {_listed(lambda r: (r + 2, 2), size)}")
    assert_array(again, (x * size)[rows_of(2, rank, size)])


def test_an_alltoall_whose_ranks_disagree_on_the_trailing_shape_fails_on_every_rank(case, rank, size):
    _needs_two_ranks(size)
    with pytest.raises(CollectiveError) as caught:
        gs.synchronize(gs.alltoall_async(np.zeros((size, rank + 1)), name=case))
    again, _ = gs.alltoall(np.full((size, 2), rank), name=case)
    assert str(caught.value) == (f"gradsync: rank {rank}: alltoall {case!r}: ranks disagree on shape "
                                 f"(all but the first dimension must match): "
                                 f"{_listed(lambda r: (size, r + 1), size)}")
    assert_array(again, np.repeat(np.arange(size), 2).reshape(size, 2))


# ---- all or nothing ------------------------------------------------------------------------------

class _Recorder:
    """The names of every response the coordinator executes. Pins internals: it wraps the
    coordinator's response execution (``coordinator.execution.run``, every cycle's responses),
    and submits hand-built ``Entry`` objects (below), because the public API cannot submit part
    of a group."""

    def __init__(self) -> None:
        self.coordinator = gs.process.runtime.get().coordinator
        self.executed: list[tuple[str, ...]] = []
        self._run = self.coordinator.execution.run

    def __enter__(self):
        def recording(responses, replied_ns):
            self.executed.extend(response.names for response in responses)
            return self._run(responses, replied_ns)

        self.coordinator.execution.run = recording
        return self

    def __exit__(self, *exc) -> None:
        del self.coordinator.execution.run


def _group_entries(group: str, tensors: list[np.ndarray], rank: int) -> list:
    """The entries grouped_allreduce_ would queue, built by hand so they can be submitted apart."""
    from gradsync.engine.coordinator import Entry
    from gradsync.engine.protocol import Kind, Request
    from gradsync.handles import Handle

    return [Entry(Request(f"{group}.{i}", Kind.ALLREDUCE, rank, "float32", t.shape, Sum,
                          group=group, group_size=len(tensors)), Handle(f"{group}.{i}"), t, t, t)
            for i, t in enumerate(tensors)]


def test_no_member_of_a_group_runs_before_its_last_member_is_submitted(case, rank, size):
    """The last rank submits the group's last member late: until then no member completes on any
    rank, though every other member is ready everywhere. Twice: negotiated in full, then (same
    names) through the response cache. Each member is large, so each alone would exceed a small
    fusion threshold: a group is one response whatever the threshold."""
    late, seen = size - 1, []
    with _Recorder() as recorder:
        for _ in range(2):
            entries = _group_entries(case, [np.full(300_000, rank + i, np.float32) for i in range(3)], rank)
            handles = [recorder.coordinator.submit(e) for e in (entries if rank != late else entries[:-1])]
            MPI.COMM_WORLD.Barrier()  # every rank has submitted what it will before the wait
            time.sleep(0.5)  # time for the coordinator to run anything it (wrongly) could
            early = [h.done() for h in handles]
            MPI.COMM_WORLD.Barrier()
            if rank == late:
                handles.append(recorder.coordinator.submit(entries[-1]))
            results = [h.wait() for h in handles]
            seen.append((early, results, [tuple(sorted(n)) for n in recorder.executed]))
            recorder.executed.clear()
    names = tuple(f"{case}.{i}" for i in range(3))
    for early, results, executed in seen:
        assert not any(early), "no member ran before the last one was submitted"
        _assert_members(results, [np.full(300_000, sum(range(size)) + size * i, np.float32)
                                  for i in range(3)])
        assert names in executed, f"the group ran as one response: {executed}"


def _joined_contributions(case: str, op, others: list[int]):
    inputs = [all_inputs(f"{case}.{i}.{op.name}", "int32", (2 * WORLD_SIZE + 1, 2), op) for i in range(2)]
    return inputs, [reference_allreduce([m[r] for r in others], op) for m in inputs]


def _needs_a_rank_that_does_not_join(size: int) -> None:
    if size == 1:
        pytest.skip("needs a rank that joins and one that does not")


@pytest.mark.parametrize("op", [Sum, Max, Min, Product], ids=lambda op: op.name)
def test_a_joined_rank_contributes_the_identity_to_grouped_allreduce_and_reducescatter(case, rank, size, op):
    """The last rank joins; the others run each op twice (in full, then cached)."""
    _needs_a_rank_that_does_not_join(size)
    others = list(range(size - 1))
    inputs, wants = _joined_contributions(case, op, others)

    def twice():
        results = []
        for _ in range(2):
            results.append(gs.grouped_allreduce([m[rank].copy() for m in inputs], name=f"{case}.g", op=op))
            results.append([gs.reducescatter(inputs[0][rank].copy(), name=f"{case}.rs", op=op)])
        return results

    joined = beside_a_joined_rank(size - 1, twice)
    assert joined.last in others, "join returns one of the ranks that joined after the last"
    for i, got in enumerate(joined.result or []):
        _assert_members(got, wants if i % 2 == 0 else [wants[0][rows_of(2 * size + 1, rank, size)]])


def test_a_joined_rank_sends_no_alltoall_rows(case, rank, size):
    """The last rank joins; the others run the alltoall twice (it is never cached)."""
    _needs_a_rank_that_does_not_join(size)
    rounds = []
    for round_ in range(2):
        splits = [alltoall_splits(f"{case}.{round_}", r) for r in range(size)]
        inputs = all_inputs(f"{case}.{round_}", "float64", [(sum(s), 2) for s in splits])
        splits[size - 1] = [0] * size  # the joined rank sends nothing
        rounds.append((inputs, splits))
    joined = beside_a_joined_rank(size - 1, lambda: [gs.alltoall(inputs[rank], splits[rank], name=case)
                                                     for inputs, splits in rounds])
    assert joined.last in range(size - 1), "join returns one of the ranks that joined after the last"
    for (got, received), (inputs, splits) in zip(joined.result or [], rounds):
        want, want_splits = reference_alltoall(inputs, splits, rank)
        assert_array(got, want)
        assert received.tolist() == want_splits


def test_no_test_of_this_file_imported_torch_or_jax(request):
    assert_no_framework_was_imported(request.session)

