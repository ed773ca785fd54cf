"""grouped_allreduce, reducescatter, grouped_reducescatter and alltoall against numpy references.

Run as ``mpiexec -n N python tests/workers/collectives_check.py [SECTION ...]``
(tests/test_collectives.py does, for N = 1, 2, 4).

Inputs and references come from ops_check.py (every rank builds every rank's input from a seeded
RNG; references follow the documented dtype rules, and inputs are chosen so results are exact):

* grouped allreduce: each member equals the allreduce reference of that member;
* reducescatter: rank r's output is rows ``sum(counts[:r])`` .. ``sum(counts[:r+1])`` of the
  allreduce reference, where ``counts[r] = N // size + (r < N % size)``;
* alltoall: rank r's output is every source rank's block of rows for r, concatenated in source
  rank order, and the received splits are those blocks' lengths.

Prints ``collectives_check rank R: N cases passed``; on a failure it aborts the job.
"""

from __future__ import annotations

import time

import numpy as np
import ops_check as oc
from mpi4py import MPI
from ops_check import (
    DTYPES,
    FLOATS,
    OPS,
    all_inputs,
    expect,
    expect_equal,
    raises,
    run_main,
    to_numpy,
    to_torch,
)

import gradsync as gs
from gradsync import Average, CollectiveError, Max, Min, Product, Sum, dtypes
from gradsync.coordinator import Entry
from gradsync.handles import Handle
from gradsync.protocol import Kind, Request

RANK = SIZE = 0


def rows_of(rows: int, rank: int) -> slice:
    """The rows reducescatter gives ``rank``: the first rows % SIZE ranks get one more."""
    counts = [rows // SIZE + (r < rows % SIZE) for r in range(SIZE)]
    start = sum(counts[:rank])
    return slice(start, start + counts[rank])


def alltoall_splits(case: str, rank: int, trailing: tuple[int, ...]) -> list[int]:
    """Rank ``rank``'s uneven splits for ``case``: 0 to 3 rows per destination, zeros included."""
    rng = oc.rng_for(case + ".splits", rank)
    return rng.integers(0, 4, size=SIZE).tolist()


def reference_alltoall(inputs: list[np.ndarray], splits: list[list[int]]) -> tuple[np.ndarray, list]:
    """What rank RANK receives: from each source, its block of rows for RANK, in source order."""
    blocks = []
    for source, rows in zip(inputs, splits):
        start = sum(rows[:RANK])
        blocks.append(source[start:start + rows[RANK]])
    return np.concatenate(blocks), [rows[RANK] for rows in splits]


def valid(dtype: str, op) -> bool:
    return not (dtype == "bool" and op == Average)


# ---- grouped allreduce ---------------------------------------------------------------------------

GROUP_SHAPES = [(3, 5), (0,), (2, 1, 4), ()]


def check_grouped_allreduce_every_dtype_and_op() -> None:
    """The four forms, every (dtype, op); members of several shapes, a zero-size one, a scalar."""
    for dtype in DTYPES:
        for op in OPS:
            case = f"grouped.{dtype}.{op.name}"
            inputs = [all_inputs(f"{case}.{i}", dtype, shape, op)
                      for i, shape in enumerate(GROUP_SHAPES)]
            mine = [member[RANK] for member in inputs]
            if not valid(dtype, op):
                with raises(TypeError, "Average", "bool", repr(case), "member 0", f"rank {RANK}"):
                    gs.grouped_allreduce(mine, name=case, op=op)
                continue
            wants = [oc.reference_allreduce(member, op) for member in inputs]
            before = [m.copy() for m in mine]
            for i, (got, want) in enumerate(zip(gs.grouped_allreduce(mine, name=case, op=op), wants)):
                expect_equal(got, want, f"{case}: grouped_allreduce member {i}")
            for m, b in zip(mine, before):
                expect_equal(m, b, f"{case}: grouped_allreduce left its inputs alone")

            handle = gs.grouped_allreduce_async(mine, name=case + ".async", op=op)
            for got, want in zip(gs.synchronize(handle), wants):
                expect_equal(got, want, f"{case}: grouped_allreduce_async")
            expect(gs.poll(handle), f"{case}: poll is True once synchronized")

            inplace = [m.copy() for m in mine]
            got = gs.grouped_allreduce_(inplace, name=case + "_", op=op)
            expect(all(g is m for g, m in zip(got, inplace)), f"{case}: returns its arguments")
            for m, want in zip(inplace, wants):
                expect_equal(m, want, f"{case}: grouped_allreduce_")

            inplace = [m.copy() for m in mine]
            gs.synchronize(gs.grouped_allreduce_async_(inplace, name=case + "_async_", op=op))
            for m, want in zip(inplace, wants):
                expect_equal(m, want, f"{case}: grouped_allreduce_async_")


def check_grouped_scale_factors_and_non_contiguous() -> None:
    for dtype in FLOATS:
        case = f"grouped.scale.{dtype}"
        inputs = [all_inputs(f"{case}.{i}", dtype, (4, 6)) for i in range(3)]
        wants = [oc.reference_allreduce(m, Average, 0.5, 4.0) for m in inputs]
        bases = [m[RANK].copy() for m in inputs]
        views = [b.T for b in bases]  # transposed: non-contiguous members, reduced in place
        gs.grouped_allreduce_(views, name=case, prescale_factor=0.5, postscale_factor=4.0)
        for i, (b, want) in enumerate(zip(bases, wants)):
            expect_equal(b, want, f"{case}: member {i} (transposed, in place, scaled)")


# ---- reducescatter -------------------------------------------------------------------------------

def reducescatter_shapes() -> list[tuple[int, ...]]:
    """Uneven (2*SIZE+1 rows), fewer rows than ranks, no rows, exactly divisible, 1-d."""
    return [(2 * SIZE + 1, 3), (max(SIZE - 1, 1), 2, 2), (0, 4), (3 * SIZE, 1), (SIZE + 2,)]


def check_reducescatter_every_dtype_and_op() -> None:
    for dtype in DTYPES:
        for op in OPS:
            for k, shape in enumerate(reducescatter_shapes()):
                case = f"rs.{dtype}.{op.name}.{k}"
                inputs = all_inputs(case, dtype, shape, op)
                if not valid(dtype, op):
                    with raises(TypeError, "Average", "bool", repr(case), f"rank {RANK}"):
                        gs.reducescatter(inputs[RANK], name=case, op=op)
                    continue
                want = oc.reference_allreduce(inputs, op)[rows_of(shape[0], RANK)]
                before = inputs[RANK].copy()
                expect_equal(gs.reducescatter(inputs[RANK], name=case, op=op), want, case)
                expect_equal(inputs[RANK], before, f"{case}: input left alone")
                handle = gs.reducescatter_async(inputs[RANK], name=case + ".async", op=op)
                expect_equal(gs.synchronize(handle), want, f"{case}: reducescatter_async")


def check_reducescatter_scale_factors_and_strides() -> None:
    for dtype in FLOATS:
        case = f"rs.scale.{dtype}"
        shape = (5, 2 * SIZE + 1)
        inputs = all_inputs(case, dtype, shape)
        transposed = [x.T for x in inputs]  # non-contiguous input, scattered along its dim 0
        want = oc.reference_allreduce(transposed, Average, 0.25, 2.0)[rows_of(shape[1], RANK)]
        got = gs.reducescatter(transposed[RANK], name=case, prescale_factor=0.25,
                               postscale_factor=2.0)
        expect_equal(got, want, f"{case}: transposed input, scale factors")


def check_grouped_reducescatter() -> None:
    for dtype in DTYPES:
        for op in OPS:
            case = f"grs.{dtype}.{op.name}"
            shapes = reducescatter_shapes()
            inputs = [all_inputs(f"{case}.{i}", dtype, s, op) for i, s in enumerate(shapes)]
            mine = [member[RANK] for member in inputs]
            if not valid(dtype, op):
                with raises(TypeError, "Average", "bool", repr(case), f"rank {RANK}"):
                    gs.grouped_reducescatter(mine, name=case, op=op)
                continue
            wants = [oc.reference_allreduce(m, op)[rows_of(s[0], RANK)] for m, s in zip(inputs, shapes)]
            for i, (got, want) in enumerate(zip(gs.grouped_reducescatter(mine, name=case, op=op),
                                                wants)):
                expect_equal(got, want, f"{case}: member {i}")
            handle = gs.grouped_reducescatter_async(mine, name=case + ".async", op=op)
            for got, want in zip(gs.synchronize(handle), wants):
                expect_equal(got, want, f"{case}: grouped_reducescatter_async")


# ---- alltoall ------------------------------------------------------------------------------------

def check_alltoall_every_dtype() -> None:
    """Uneven splits (zeros included, different on every rank), even default splits, no rows."""
    for dtype in DTYPES:
        case = f"a2a.{dtype}"
        trailing = (2, 3)
        splits = [alltoall_splits(case, r, trailing) for r in range(SIZE)]
        inputs = all_inputs(case, dtype, [(sum(s),) + trailing for s in splits])
        want, want_splits = reference_alltoall(inputs, splits)
        before = inputs[RANK].copy()
        got, received = gs.alltoall(inputs[RANK], splits=splits[RANK], name=case)
        expect_equal(got, want, f"{case}: uneven splits")
        expect_equal(received, np.array(want_splits, np.int64), f"{case}: received splits")
        expect_equal(inputs[RANK], before, f"{case}: input left alone")

        handle = gs.alltoall_async(inputs[RANK], np.array(splits[RANK]), name=case + ".async")
        got, received = gs.synchronize(handle)
        expect_equal(got, want, f"{case}: alltoall_async with splits as an array")

        even = all_inputs(case + ".even", dtype, (2 * SIZE, 3))
        want, want_splits = reference_alltoall(even, [[2] * SIZE] * SIZE)
        got, received = gs.alltoall(even[RANK], name=case + ".even")
        expect_equal(got, want, f"{case}: default (even) splits")
        expect_equal(received, np.full(SIZE, 2, np.int64), f"{case}: default received splits")

        empty = np.zeros((0, 3), DTYPES[dtype])
        got, received = gs.alltoall(empty, splits=[0] * SIZE, name=case + ".empty")
        expect_equal(got, empty, f"{case}: nothing sent, nothing received")
        expect_equal(received, np.zeros(SIZE, np.int64), f"{case}: all splits 0")


def check_alltoall_non_contiguous_and_repeated() -> None:
    """A transposed input; the same name again with other splits (alltoall is never cached)."""
    for round_ in range(3):
        case = f"a2a.again.{round_}"
        splits = [alltoall_splits(case, r, (4,)) for r in range(SIZE)]
        inputs = all_inputs(case, "float32", [(4, sum(s)) for s in splits])
        transposed = [x.T for x in inputs]
        want, _ = reference_alltoall(transposed, splits)
        got, _ = gs.alltoall(transposed[RANK], splits[RANK], name="a2a.again")
        expect_equal(got, want, f"{case}: transposed input, name reused with new splits")


# ---- torch ---------------------------------------------------------------------------------------

def check_torch() -> None:
    """Every supported dtype as torch tensors: outputs are torch tensors of the input's dtype."""
    import torch

    assert set(DTYPES) == set(dtypes.SUPPORTED), "a supported dtype would go untested"
    for dtype in dtypes.SUPPORTED:
        for op in (Sum, Average, Min, Max, Product):
            if not valid(dtype, op):
                continue
            case = f"torch.grouped.{dtype}.{op.name}"
            inputs = [all_inputs(f"{case}.{i}", dtype, s, op) for i, s in enumerate(GROUP_SHAPES)]
            wants = [oc.reference_allreduce(m, op) for m in inputs]
            tensors = [to_torch(m[RANK]) for m in inputs]
            for i, (got, want) in enumerate(zip(gs.grouped_allreduce(tensors, name=case, op=op),
                                                wants)):
                expect_equal(to_numpy(got, dtype, case), want, f"{case}: member {i}")
            got = gs.grouped_allreduce_(tensors, name=case + "_", op=op)
            expect(all(g is t for g, t in zip(got, tensors)), f"{case}: in place returns its inputs")
            for t, want in zip(tensors, wants):
                expect_equal(to_numpy(t, dtype, case), want, f"{case}: grouped_allreduce_")

            case = f"torch.rs.{dtype}.{op.name}"
            shape = (2 * SIZE + 1, 3)
            inputs = all_inputs(case, dtype, shape, op)
            want = oc.reference_allreduce(inputs, op)[rows_of(shape[0], RANK)]
            got = gs.reducescatter(to_torch(inputs[RANK]), name=case, op=op)
            expect_equal(to_numpy(got, dtype, case), want, case)
            got = gs.grouped_reducescatter([to_torch(inputs[RANK])], name=case + ".g", op=op)
            expect_equal(to_numpy(got[0], dtype, case), want, f"{case}: grouped")

        case = f"torch.a2a.{dtype}"
        splits = [alltoall_splits(case, r, (2,)) for r in range(SIZE)]
        inputs = all_inputs(case, dtype, [(sum(s), 2) for s in splits])
        want, want_splits = reference_alltoall(inputs, splits)
        got, received = gs.alltoall(to_torch(inputs[RANK]), torch.tensor(splits[RANK]), name=case)
        expect_equal(to_numpy(got, dtype, case), want, case)
        expect(isinstance(received, torch.Tensor) and received.tolist() == want_splits,
               f"{case}: received splits as a torch tensor: {received!r}")


# ---- errors --------------------------------------------------------------------------------------

def check_errors_before_anything_is_sent() -> None:
    """Bad arguments raise on the calling rank, name the collective, the rank and the value, and
    queue nothing: every name (and the unnamed counters) is free again afterwards."""
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    where = f"rank {RANK}"
    with raises(ValueError, "empty", "'g.empty'", where):
        gs.grouped_allreduce([], name="g.empty")
    with raises(ValueError, "empty"):
        gs.grouped_reducescatter_async((), name="g.empty")
    with raises(TypeError, "list or tuple", "ndarray", "'g.notlist'", where):
        gs.grouped_allreduce(x, name="g.notlist")
    with raises(TypeError, "same dtype", "member 0: float32", "member 1: float64", where):
        gs.grouped_allreduce([x, x.astype(np.float64)], name="g.mixed")
    with raises(TypeError, "member 1", "not supported", where):
        gs.grouped_allreduce_async_([x, x.astype(np.complex64)], name="g.complex")
    with raises(TypeError, "member 0", "prescale_factor", where):
        gs.grouped_reducescatter([x.astype(np.int32)] * 2, name="g.int.scale", prescale_factor=2.0)
    readonly = x.copy()
    readonly.flags.writeable = False
    with raises(ValueError, "read-only", "member 1", where):
        gs.grouped_allreduce_([x.copy(), readonly], name="g.readonly")
    with raises(ValueError, "op=9", where):
        gs.grouped_allreduce([x], name="g.op", op=9)
    for submit in (gs.reducescatter, gs.reducescatter_async, gs.alltoall, gs.alltoall_async):
        with raises(ValueError, "0-d", "'zero.d'", where):
            submit(np.ones((), np.float32), name="zero.d")
    with raises(ValueError, "0-d", "member 0"):
        gs.grouped_reducescatter([np.ones(())], name="zero.d")

    rows = SIZE + 1
    y = np.zeros((rows, 2), np.float32)
    fine = [1] * SIZE
    fine[0] += 1
    bad_splits = [
        (ValueError, [1] * (SIZE + 1), f"{SIZE + 1} entries", f"{SIZE} ranks"),
        (ValueError, [rows + 1] + [-1] + [0] * (SIZE - 2) if SIZE > 1 else [-1], "negative"),
        (ValueError, [0] * SIZE, "sum to 0", f"dimension 0 of the tensor is {rows}"),
        (TypeError, [1.5] * SIZE, "ints"),
        (TypeError, "ab", "ints"),
    ]
    for error, splits, *fragments in bad_splits:
        with raises(error, "'bad.splits'", where, *fragments):
            gs.alltoall(y, splits, name="bad.splits")
    if SIZE > 1:
        with raises(ValueError, "not divisible", f"({rows})", f"({SIZE})", "splits=", where):
            gs.alltoall(y, name="bad.splits")
    got, received = gs.alltoall(y, fine, name="bad.splits")
    expect(received.tolist() == [fine[0]] * SIZE if RANK == 0 else received.tolist() == [1] * SIZE,
           "the name of a rejected alltoall is free")

    # Unnamed ops rejected above did not advance the unnamed counters.
    group = gs.grouped_allreduce_async([x, x], op=Sum)
    expect(group.name == "grouped_allreduce.noname.0", f"first unnamed group: {group.name}")
    for got in gs.synchronize(group):
        expect_equal(got, x * SIZE, "first unnamed group")
    for name in ("g.empty", "g.notlist", "g.mixed", "g.complex", "g.int.scale", "g.readonly", "g.op"):
        for got in gs.grouped_allreduce([x], name=name, op=Sum):
            expect_equal(got, x * SIZE, f"the group name {name!r} is free")


def check_mismatches() -> None:
    """Ranks disagreeing on one member fail the whole group on every rank; alltoall and
    reducescatter name each rank's value; the job and the names stay usable."""
    if SIZE == 1:
        return
    x = np.ones((2, 3), np.float32)
    shape = gs.grouped_allreduce_async([x, np.zeros((RANK + 1, 2), np.float32), x], name="mm.g")
    count = gs.grouped_allreduce_async([x] * (2 + RANK % 2), name="mm.count")
    rs = gs.reducescatter_async(np.zeros((RANK + 2, 2)), name="mm.rs")
    a2a = gs.alltoall_async(np.zeros((SIZE, RANK + 1)), name="mm.a2a")
    for handle, fragments in [
        (shape, ["grouped allreduce 'mm.g' fails as a whole", "'mm.g.1'", "disagree on shape",
                 *[f"rank {r}: {(r + 1, 2)}" for r in range(SIZE)]]),
        (count, ["grouped allreduce 'mm.count' fails as a whole", "group size",
                 *[f"rank {r}: {2 + r % 2}" for r in range(SIZE)]]),
        (rs, ["reducescatter 'mm.rs'", "disagree on shape", *[f"rank {r}: {(r + 2, 2)}" for r in range(SIZE)]]),
        (a2a, ["alltoall 'mm.a2a'", "all but the first dimension",
               *[f"rank {r}: {(SIZE, r + 1)}" for r in range(SIZE)]]),
    ]:
        with raises(CollectiveError, f"rank {RANK}", *fragments):
            gs.synchronize(handle)
        if isinstance(handle, gs.GroupHandle):
            for member in handle.handles:  # every member failed, none completed
                with raises(CollectiveError, "fails as a whole"):
                    member.wait()
    for name in ("mm.g", "mm.count"):
        for got in gs.grouped_allreduce([x, x], name=name, op=Sum):
            expect_equal(got, x * SIZE, f"after the {name} mismatch the group name is usable")
    expect_equal(gs.reducescatter(x, name="mm.rs", op=Sum), (x * SIZE)[rows_of(2, RANK)],
                 "after the reducescatter mismatch the name is usable")


# ---- all or nothing ------------------------------------------------------------------------------

def group_entries(group: str, tensors: list[np.ndarray]) -> list[Entry]:
    """The entries grouped_allreduce_ would queue, built by hand so they can be submitted apart."""
    return [Entry(Request(f"{group}.{i}", Kind.ALLREDUCE, RANK, "float32", t.shape, Sum,
                          group=group, group_size=len(tensors)), Handle(f"{group}.{i}"), t, t, t)
            for i, t in enumerate(tensors)]


def check_group_waits_for_its_last_member() -> None:
    """The last rank submits a group's last member late: until then no member completes on any
    rank, though every other member is ready everywhere. Twice: negotiated in full, then (same
    names) through the response cache. Each member is large, so each alone would exceed a small
    fusion threshold: a group is one response whatever the threshold."""
    coordinator = gs.runtime.get().coordinator
    executed: list[tuple[str, ...]] = []
    execute = coordinator._execute

    def recording(responses, replied_ns):  # one response, or a batch of device allreduces
        executed.extend(response.names for response in responses)
        execute(responses, replied_ns)

    coordinator._execute = recording
    late = SIZE - 1
    try:
        for round_ in range(2):
            tensors = [np.full(300_000, RANK + i, np.float32) for i in range(3)]  # 1.2 MB each
            entries = group_entries("late", tensors)
            submitted = entries if RANK != late else entries[:-1]
            handles = [coordinator.submit(e) for e in submitted]
            MPI.COMM_WORLD.Barrier()  # every rank has submitted what it will before the wait
            time.sleep(0.5)  # time for the coordinator to run anything it (wrongly) could
            expect(not any(h.done() for h in handles),
                   f"round {round_}: no member ran before the last one was submitted")
            MPI.COMM_WORLD.Barrier()
            if RANK == late:
                handles.append(coordinator.submit(entries[-1]))
            for i, handle in enumerate(handles):
                want = np.full(300_000, sum(range(SIZE)) + SIZE * i, np.float32)
                expect_equal(handle.wait(), want, f"round {round_}: member {i} after the last came")
            expect(("late.0", "late.1", "late.2") in [tuple(sorted(n)) for n in executed],
                   f"round {round_}: the group ran as one response: {executed}")
            executed.clear()
    finally:
        del coordinator._execute


def check_with_a_joined_rank() -> None:
    """The last rank joins; the others run every new op twice (in full, then cached): a joined
    rank contributes the op's identity to reductions and sends no alltoall rows."""
    if SIZE == 1:
        return
    others = list(range(SIZE - 1))
    if RANK == SIZE - 1:
        expect(gs.join() in others, "join returns one of the others: they joined after this rank")
        return
    for round_ in range(2):
        case = "joined"
        for op in (Sum, Max, Min, Product):
            inputs = [all_inputs(f"{case}.{i}.{op.name}", "int32", (2 * SIZE + 1, 2), op)
                      for i in range(2)]
            mine = [m[RANK].copy() for m in inputs]
            want = [oc.reference_allreduce([m[r] for r in others], op) for m in inputs]
            for got, w in zip(gs.grouped_allreduce(mine, name=f"{case}.g.{op.name}", op=op), want):
                expect_equal(got, w, f"{case}: grouped allreduce {op.name}, round {round_}")
            got = gs.reducescatter(mine[0], name=f"{case}.rs.{op.name}", op=op)
            expect_equal(got, want[0][rows_of(2 * SIZE + 1, RANK)], f"{case}: reducescatter {op.name}")
        splits = [alltoall_splits(f"{case}.{round_}", r, (2,)) for r in range(SIZE)]
        a2a_inputs = all_inputs(f"{case}.a2a.{round_}", "float64", [(sum(s), 2) for s in splits])
        splits[SIZE - 1] = [0] * SIZE  # the joined rank sends nothing
        want, want_splits = reference_alltoall(a2a_inputs, splits)
        got, received = gs.alltoall(a2a_inputs[RANK], splits[RANK], name=f"{case}.a2a")
        expect_equal(got, want, f"{case}: alltoall with a joined rank")
        expect(received.tolist() == want_splits, f"{case}: received {received}")
    expect(gs.join() in others, "join returns one of the ranks that joined after the last rank")


SECTIONS = [
    check_grouped_allreduce_every_dtype_and_op,
    check_grouped_scale_factors_and_non_contiguous,
    check_reducescatter_every_dtype_and_op,
    check_reducescatter_scale_factors_and_strides,
    check_grouped_reducescatter,
    check_alltoall_every_dtype,
    check_alltoall_non_contiguous_and_repeated,
    check_torch,
    check_errors_before_anything_is_sent,
    check_mismatches,
    check_group_waits_for_its_last_member,
    check_with_a_joined_rank,
]


def learn_rank(rank: int, size: int) -> None:
    global RANK, SIZE
    RANK, SIZE = rank, size


if __name__ == "__main__":
    run_main(SECTIONS, "collectives_check", learn_rank, {check_torch})
