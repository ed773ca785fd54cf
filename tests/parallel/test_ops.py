"""allreduce, broadcast, allgather, the object collectives and barrier on numpy arrays, against
the numpy references of tests/parallel/reference.py (every rank builds every rank's input).

The last test checks that nothing in the job imported torch: these ops need numpy alone. Their
torch-tensor counterparts are in test_ops_torch.py. The allreduce tests run again without fusion
and with a 4 KiB fusion threshold, every test without the response cache and with a cache of 3
entries (evictions while requests wait on their bits), the tests with a joined rank at 3
ranks without the cache, and the allreduce tests through shared memory in chunks of 4 KiB: see
``VARIANTS``.
"""

from __future__ import annotations

import sys
import time
from functools import partial

import numpy as np
import pytest
from mpi4py import MPI
from reference import (
    DTYPES,
    FLOATS,
    INTS,
    UNSIGNED,
    WORLD_SIZE,
    all_inputs,
    assert_array,
    assert_fragments,
    assert_no_framework_was_imported,
    assert_rejected_before_sending,
    beside_a_joined_rank,
    dtype_op_params,
    make,
    pair_params,
    reference_allreduce,
    rng_for,
)

import gradsync as gs
from gradsync import Average, CollectiveError, Max, Min, Product, Sum

# Literals (tests/test_parallel.py reads them without importing this file). Every test whose
# execution depends on fusion has "allreduce" in its name.
VARIANTS = {
    "no-fusion": {"env": {"GRADSYNC_FUSION_THRESHOLD": "0"}, "k": "allreduce"},
    "4k-fusion": {"env": {"GRADSYNC_FUSION_THRESHOLD": "4096"}, "k": "allreduce"},
    "no-cache": {"env": {"GRADSYNC_CACHE_CAPACITY": "0"}},
    "tiny-cache": {"env": {"GRADSYNC_CACHE_CAPACITY": "3"}},
    "joined-no-cache": {"env": {"GRADSYNC_CACHE_CAPACITY": "0"}, "ranks": (3,), "k": "join"},
    # Every allreduce through shared memory, in chunks of one page (gradsync/backends/shared.py).
    "shared-memory": {"env": {"GRADSYNC_SHARED_MEMORY_THRESHOLD": "0", "GRADSYNC_SHARED_MEMORY_BYTES": "4096"},
                      "ranks": (2, 3), "k": "allreduce"},
}

ROOTS = [pytest.param(r, id=f"root{r}") for r in range(WORLD_SIZE)]


# ---- allreduce -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("dtype", "op"), dtype_op_params())
def test_allreduce_returns_the_reduction_of_every_ranks_tensor(case, rank, dtype, op):
    inputs = all_inputs(case, dtype, (3, 5), op)
    assert_array(gs.allreduce(inputs[rank], name=case, op=op), reference_allreduce(inputs, op))


@pytest.mark.parametrize(("dtype", "op"), dtype_op_params())
def test_allreduce_leaves_its_input_alone(case, rank, dtype, op):
    inputs = all_inputs(case, dtype, (3, 5), op)
    mine = inputs[rank].copy()
    gs.allreduce(mine, name=case, op=op)
    assert_array(mine, inputs[rank])


@pytest.mark.parametrize(("dtype", "op"), dtype_op_params())
def test_allreduce_in_place_writes_the_result_into_its_argument_and_returns_it(case, rank, dtype, op):
    inputs = all_inputs(case, dtype, (3, 5), op)
    tensor = inputs[rank].copy()
    assert gs.allreduce_(tensor, name=case, op=op) is tensor
    assert_array(tensor, reference_allreduce(inputs, op))


@pytest.mark.parametrize(("dtype", "op"), dtype_op_params())
def test_allreduce_async_handles_give_the_result_out_of_place_and_in_place(case, rank, dtype, op):
    inputs = all_inputs(case, dtype, (3, 5), op)
    out_of_place, in_place = inputs[rank].copy(), inputs[rank].copy()
    h1 = gs.allreduce_async(out_of_place, name=case + ".async", op=op)
    h2 = gs.allreduce_async_(in_place, name=case + ".async_", op=op)
    got1, got2 = gs.synchronize(h1), gs.synchronize(h2)
    want = reference_allreduce(inputs, op)
    assert_array(got1, want)
    assert got2 is in_place
    assert_array(in_place, want)
    assert_array(out_of_place, inputs[rank])
    assert gs.poll(h1) and gs.poll(h2), "poll is True once synchronized"


@pytest.mark.parametrize("submit", [gs.allreduce, gs.allreduce_async_], ids=["allreduce", "allreduce_async_"])
def test_allreduce_average_of_bool_is_a_type_error_naming_the_tensor_and_the_rank(case, rank, submit):
    assert_rejected_before_sending(TypeError, lambda: submit(np.ones((3, 5), bool), name=case, op=Average),
                                   case, "Average", "bool", repr(case), f"rank {rank}")


def test_unnamed_allreduces_are_matched_by_the_order_of_the_calls(case, rank):
    inputs = all_inputs(case, "float32", (4,))
    blocking = [gs.allreduce(inputs[rank], op=Sum) for _ in range(3)]
    handles = [gs.allreduce_async(inputs[rank], op=Sum) for _ in range(3)]
    for got in blocking + [gs.synchronize(h) for h in handles]:
        assert_array(got, reference_allreduce(inputs, Sum))


_RANDOM_TOLERANCE = {"float16": (2.0 ** -10, 1e-6), "bfloat16": (2.0 ** -7, 1e-6),
                     "float32": (1e-6, 1e-6), "float64": (1e-13, 1e-12)}


@pytest.mark.parametrize(("dtype", "op"), dtype_op_params(FLOATS, (Sum, Average)))
def test_allreduce_of_random_floats_is_the_float64_sum_within_rounding(case, rank, size, dtype, op):
    """Unquantised floats: float32/64 close to the float64 sum; 16-bit within one unit of the
    float32 sum rounded once (MPI may add in any order, so float32 may differ in its last bit)."""
    inputs = [rng_for(case, r).standard_normal((7, 9)).astype(DTYPES[dtype]) for r in range(size)]
    exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)
    want = (exact * (1.0 if op == Sum else 1.0 / size)).astype(DTYPES[dtype])
    rtol, atol = _RANDOM_TOLERANCE[dtype]
    assert_array(gs.allreduce(inputs[rank], name=case, op=op), want, rtol=rtol, atol=atol)


# ---- scale factors -------------------------------------------------------------------------------

_FACTORS = [pytest.param(pre, post, id=f"pre{pre}-post{post}")
            for pre, post in ((3.0, 1.0), (1.0, 3.0), (0.5, 0.25), (3.0, 0.75))]


@pytest.mark.parametrize(("prescale", "postscale"), _FACTORS)
@pytest.mark.parametrize(("dtype", "op"), dtype_op_params(FLOATS, (Sum, Average, Max, Product)))
def test_allreduce_scales_each_input_before_and_the_result_after_the_reduction(
        case, rank, dtype, op, prescale, postscale):
    """In the reduction's precision; submitted together out of place, in place and on a strided
    view in place, so that they are fused."""
    inputs = all_inputs(case, dtype, (2, 3), op)
    kw = {"op": op, "prescale_factor": prescale, "postscale_factor": postscale}
    inplace = inputs[rank].copy()
    strided = np.repeat(inputs[rank], 2, axis=1)[:, ::2]
    handles = [gs.allreduce_async(inputs[rank], name=case, **kw),
               gs.allreduce_async_(inplace, name=case + "_", **kw),
               gs.allreduce_async_(strided, name=case + ".strided", **kw)]
    results = [gs.synchronize(h) for h in handles]
    want = reference_allreduce(inputs, op, prescale, postscale)
    for got in results:
        assert_array(got, want)
    assert results[1] is inplace and results[2] is strided


@pytest.mark.parametrize("dtype", FLOATS)
def test_blocking_allreduce_applies_the_postscale(case, rank, dtype):
    inputs = all_inputs(case, dtype, (4,))
    got = gs.allreduce(inputs[rank], name=case, op=Sum, postscale_factor=0.5)
    assert_array(got, reference_allreduce(inputs, Sum, 1.0, 0.5))


@pytest.mark.parametrize(("submit", "factor"), [
    pytest.param(gs.allreduce, {"prescale_factor": 2.0}, id="allreduce-prescale"),
    pytest.param(gs.allreduce_, {"postscale_factor": 0.5}, id="allreduce_-postscale")])
@pytest.mark.parametrize("dtype", INTS + ("bool",))
def test_allreduce_scale_factors_on_integers_and_bool_are_a_type_error(case, rank, dtype, submit, factor):
    x = make(case, rank, dtype, (3,))
    assert_rejected_before_sending(TypeError, lambda: submit(x, name=case, op=Sum, **factor), case,
                                   "floating-point", repr(case), f"rank {rank}", dtype)


@pytest.mark.parametrize("dtype", INTS + ("bool",))
def test_allreduce_scale_factors_of_exactly_one_are_accepted_on_any_dtype(case, rank, dtype):
    inputs = all_inputs(case, dtype, (3,))
    got = gs.allreduce(inputs[rank], name=case, op=Sum, prescale_factor=1.0, postscale_factor=1)
    assert_array(got, reference_allreduce(inputs, Sum))


# ---- the wider unsigned integers (every op on them: the tests over DTYPES above) -----------------

@pytest.mark.parametrize("dtype", UNSIGNED)
def test_unsigned_integers_are_moved_bit_for_bit_up_to_their_largest_value(case, rank, size, dtype):
    top = np.iinfo(dtype).max
    mine = np.array([top - rank, rank, top], dtype)
    assert_array(gs.broadcast(mine, size - 1, name=case + ".broadcast"),
                 np.array([top - size + 1, size - 1, top], dtype))
    assert_array(gs.allgather(mine[None], name=case + ".allgather"),
                 np.array([[top - r, r, top] for r in range(size)], dtype))
    assert_array(gs.allreduce(mine, name=case + ".max", op=Max), np.array([top, size - 1, top], dtype))


# ---- zero-size and 0-d tensors -------------------------------------------------------------------

_EMPTY_CASES = pair_params([("float32", Sum), ("bfloat16", Average), ("int32", Average),
                            ("bool", Max), ("float64", Product), ("uint8", Min)])
_EMPTY_SHAPES = [pytest.param((0,), id="0"), pytest.param((2, 0, 3), id="2x0x3")]


@pytest.mark.parametrize("shape", _EMPTY_SHAPES)
@pytest.mark.parametrize(("dtype", "op"), _EMPTY_CASES)
def test_allreduce_of_a_zero_size_tensor_is_an_empty_tensor(case, dtype, op, shape):
    x = np.empty(shape, DTYPES[dtype])
    assert_array(gs.allreduce(x, name=case, op=op), np.empty(shape, DTYPES[dtype]))
    assert gs.allreduce_(x, name=case + "_", op=op) is x


@pytest.mark.parametrize("shape", _EMPTY_SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "bool", "float64", "uint8"])
def test_broadcast_of_a_zero_size_tensor_is_an_empty_tensor(case, size, dtype, shape):
    x = np.empty(shape, DTYPES[dtype])
    got = gs.synchronize(gs.broadcast_async(x, size - 1, name=case))
    assert_array(got, np.empty(shape, DTYPES[dtype]))


@pytest.mark.parametrize(("dtype", "op"), _EMPTY_CASES)
def test_allreduce_of_a_zero_size_tensor_submitted_among_others(case, rank, dtype, op):
    """Submitted together with non-empty ones, so fused with them."""
    inputs = all_inputs(case, dtype, (5,), op)
    handles = [gs.allreduce_async(inputs[rank], name=case + ".a", op=op),
               gs.allreduce_async(np.empty(0, DTYPES[dtype]), name=case + ".empty", op=op),
               gs.allreduce_async(inputs[rank][::-1], name=case + ".b", op=op)]
    before, empty, after = (gs.synchronize(h) for h in handles)
    want = reference_allreduce(inputs, op)
    assert_array(before, want)
    assert_array(empty, np.empty(0, DTYPES[dtype]))
    assert_array(after, want[::-1].copy())


@pytest.mark.parametrize(("dtype", "op"), dtype_op_params(ops=(Sum, Average, Max)))
def test_allreduce_of_a_0d_array_is_a_0d_array(case, rank, dtype, op):
    inputs = all_inputs(case, dtype, (), op)
    assert_array(gs.allreduce(inputs[rank], name=case, op=op), reference_allreduce(inputs, op))


@pytest.mark.parametrize(("dtype", "op"), dtype_op_params(ops=(Sum, Average, Max)))
def test_allreduce_in_place_of_a_0d_array(case, rank, dtype, op):
    inputs = all_inputs(case, dtype, (), op)
    inplace = inputs[rank].copy()
    gs.allreduce_(inplace, name=case, op=op)
    assert_array(inplace, reference_allreduce(inputs, op))


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_of_a_0d_array_is_the_roots_value(case, rank, dtype):
    inputs = all_inputs(case, dtype, ())
    assert_array(gs.broadcast(inputs[rank], 0, name=case), inputs[0])


# ---- non-contiguous views ------------------------------------------------------------------------

_VIEWS = {
    "transposed": lambda a: a.T,
    "strided": lambda a: a[::2, 1::3],
    "reversed": lambda a: a[:, ::-1],
    "slice": lambda a: a[1:5, 2:7],
    "column": lambda a: a[:, 3],
}
_VIEW_CASES = [pytest.param(d, op, label, id=f"{d}-{op.name}-{label}")
               for d, op in (("float32", Sum), ("float64", Average), ("bfloat16", Sum),
                             ("float16", Average), ("int16", Average), ("int32", Max),
                             ("uint8", Min), ("int64", Product), ("bool", Sum))
               for label in _VIEWS]


@pytest.mark.parametrize(("dtype", "op", "view"), _VIEW_CASES)
def test_allreduce_of_a_non_contiguous_view_gives_a_new_array(case, rank, dtype, op, view):
    view = _VIEWS[view]
    bases = all_inputs(case, dtype, (6, 8), op)
    got = gs.allreduce(view(bases[rank]), name=case, op=op)
    assert_array(got, reference_allreduce([view(b) for b in bases], op))


@pytest.mark.parametrize(("dtype", "op", "view"), _VIEW_CASES)
def test_allreduce_in_place_of_a_non_contiguous_view_writes_through_to_the_base_array(
        case, rank, dtype, op, view):
    """The view's elements of the base get the result; the base's other elements are untouched."""
    view = _VIEWS[view]
    bases = all_inputs(case, dtype, (6, 8), op)
    base = bases[rank].copy()
    target = view(base)
    assert not target.flags.c_contiguous, "test setup"
    assert gs.allreduce_(target, name=case, op=op) is target
    want_base = bases[rank].copy()
    view(want_base)[...] = reference_allreduce([view(b) for b in bases], op)
    assert_array(base, want_base)


# ---- tensors over the fusion threshold -----------------------------------------------------------

_LARGE = 600_000  # 2.4 MB of float32: over the default 1 MiB fusion threshold
_LARGE_CASES = pair_params([("float32", Sum), ("float16", Average), ("int8", Average), ("bool", Min)])


@pytest.mark.parametrize(("dtype", "op"), _LARGE_CASES)
def test_allreduce_of_a_tensor_over_the_fusion_threshold(case, rank, dtype, op):
    inputs = all_inputs(case, dtype, (_LARGE,), op)
    assert_array(gs.allreduce(inputs[rank], name=case, op=op), reference_allreduce(inputs, op))


@pytest.mark.parametrize(("dtype", "op"), _LARGE_CASES)
def test_allreduce_in_place_of_a_tensor_over_the_fusion_threshold(case, rank, dtype, op):
    inputs = all_inputs(case, dtype, (_LARGE,), op)
    inplace = inputs[rank].copy()
    gs.allreduce_(inplace, name=case, op=op)
    assert_array(inplace, reference_allreduce(inputs, op))


def test_allreduce_in_place_of_a_large_strided_view(case, rank):
    bases = all_inputs(case, "float32", (1000, 1200))
    base = bases[rank].copy()
    gs.allreduce_(base[:, ::2], name=case, op=Sum)
    want_base = bases[rank].copy()
    want_base[:, ::2] = reference_allreduce([b[:, ::2] for b in bases], Sum)
    assert_array(base, want_base)


def test_allreduce_of_a_large_tensor_submitted_among_small_ones(case, rank):
    big = all_inputs(case + ".big", "float32", (_LARGE,))
    small = [all_inputs(f"{case}.{i}", "float32", (10,)) for i in range(20)]
    handles = [gs.allreduce_async(s[rank], name=f"{case}.{i}", op=Sum) for i, s in enumerate(small[:10])]
    handles.append(gs.allreduce_async(big[rank], name=case + ".big", op=Sum))
    handles += [gs.allreduce_async(s[rank], name=f"{case}.{i + 10}", op=Sum)
                for i, s in enumerate(small[10:])]
    results = [gs.synchronize(h) for h in handles]
    wants = [reference_allreduce(s, Sum) for s in small[:10]] + [reference_allreduce(big, Sum)]
    wants += [reference_allreduce(s, Sum) for s in small[10:]]
    for got, want in zip(results, wants, strict=True):
        assert_array(got, want)


def test_allreduce_of_hundreds_of_small_tensors_submitted_together(case, rank):
    """Mixed dtypes, ops and shapes (so fused, over more than one fusion buffer), half of them in
    place, then synchronized."""
    rng = np.random.default_rng(1234)  # the same plan on every rank
    checks = []
    for i in range(400):
        dtype = ("float32", "float16", "bfloat16", "int32", "uint8", "bool", "float64")[i % 7]
        op = (Sum, Average, Max)[i % 3]
        if dtype == "bool" and op == Average:
            op = Min
        shape = [(), (0,), (int(rng.integers(1, 9)),), (3, int(rng.integers(1, 5)))][i % 4]
        if i % 50 == 0:
            shape = (700,)  # 400 x ~2.8 kB: more than one 1 MiB buffer
        name, in_place = f"{case}.{i}", i % 2 == 0
        inputs = all_inputs(name, dtype, shape, op)
        x = inputs[rank].copy()
        submit = gs.allreduce_async_ if in_place else gs.allreduce_async
        checks.append((submit(x, name=name, op=op), x, in_place, reference_allreduce(inputs, op)))
    results = [gs.synchronize(handle) for handle, *_ in checks]
    for got, (_, x, in_place, want) in zip(results, checks):
        assert got is x or not in_place, "in place returns its argument"
        assert_array(got, want)


def _ordered_jobs(case: str, rank: int, size: int) -> list[tuple]:
    """(name, submit, expected result, in-place target or None) of the ordering test."""
    jobs = []
    for i in range(30):
        dtype = ("float32", "int64", "bfloat16", "bool", "int8", "float16")[i % 6]
        op = (Sum, Max, Average, Min, Product)[i % 5]
        if dtype == "bool" and op == Average:
            op = Sum
        name = f"{case}.allreduce.{i}"
        inputs = all_inputs(name, dtype, (i % 4 + 1, 3), op)
        x = inputs[rank].copy()
        in_place = i % 3 == 0
        submit = partial(gs.allreduce_async_ if in_place else gs.allreduce_async, x, name, op=op)
        jobs.append((name, submit, reference_allreduce(inputs, op), x if in_place else None))
    for i in range(12):
        name, root = f"{case}.broadcast.{i}", i % size
        inputs = all_inputs(name, ("float64", "bfloat16", "int16", "bool")[i % 4], (5,))
        x = inputs[rank].copy()
        in_place = i % 2 == 0
        submit = partial(gs.broadcast_async_ if in_place else gs.broadcast_async, x, root, name)
        jobs.append((name, submit, inputs[root], x if in_place else None))
    for i in range(12):
        name = f"{case}.allgather.{i}"
        inputs = all_inputs(name, ("int32", "float32", "uint8")[i % 3], [(r % 3, 2) for r in range(size)])
        jobs.append((name, partial(gs.allgather_async, inputs[rank], name), np.concatenate(inputs), None))
    big = all_inputs(f"{case}.big", "float32", (300_000,))
    jobs.append((f"{case}.big", partial(gs.allreduce_async, big[rank], f"{case}.big", op=Sum),
                 reference_allreduce(big, Sum), None))
    return jobs


def test_allreduce_broadcast_and_allgather_submitted_in_a_different_order_on_every_rank(case, rank, size):
    """Rank 0 submits in order, odd ranks reversed, other ranks shuffled, the last rank pausing
    between submissions, and each synchronizes in yet another order: negotiation orders them, and
    every result is right."""
    jobs = _ordered_jobs(case, rank, size)
    order = list(range(len(jobs)))
    if rank % 2 == 1:
        order.reverse()
    elif rank > 0:
        np.random.default_rng(rank).shuffle(order)
    handles = {}
    for k, index in enumerate(order):
        name, submit, _, _ = jobs[index]
        handles[name] = submit()
        if rank == size - 1 and k % 10 == 9:
            time.sleep(0.002)  # spread this rank's requests over several negotiation cycles
    wait_order = list(range(len(jobs)))
    np.random.default_rng(100 + rank).shuffle(wait_order)
    results = {jobs[i][0]: gs.synchronize(handles[jobs[i][0]]) for i in wait_order}
    for name, _, want, target in jobs:
        assert target is None or results[name] is target, f"{name}: in place returns its argument"
        assert_array(results[name], want)


# ---- broadcast -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("root", ROOTS)
def test_broadcast_returns_the_roots_tensor_and_leaves_the_input_alone(case, rank, root, dtype):
    inputs = all_inputs(case, dtype, (4, 3))
    mine = inputs[rank].copy()
    assert_array(gs.broadcast(mine, root, name=case), inputs[root])
    assert_array(mine, inputs[rank])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("root", ROOTS)
def test_broadcast_in_place_writes_the_roots_tensor_into_its_argument(case, rank, root, dtype):
    """The root given as a numpy integer."""
    inputs = all_inputs(case, dtype, (4, 3))
    target = inputs[rank].copy()
    assert gs.broadcast_(target, np.int64(root), name=case) is target
    assert_array(target, inputs[root])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("root", ROOTS)
def test_broadcast_async_handles_give_the_roots_tensor_out_of_place_and_in_place(case, rank, root, dtype):
    inputs = all_inputs(case, dtype, (4, 3))
    out_of_place, in_place = inputs[rank].copy(), inputs[rank].copy()
    h1 = gs.broadcast_async(out_of_place, root, name=case + ".async")
    h2 = gs.broadcast_async_(in_place, root, name=case + ".async_")
    got1, got2 = gs.synchronize(h1), gs.synchronize(h2)
    assert_array(got1, inputs[root])
    assert got2 is in_place
    assert_array(in_place, inputs[root])


_BROADCAST_VIEWS = {"transposed": lambda a: a.T, "strided": lambda a: a[::2, 1::3],
                    "reversed": lambda a: a[::-1]}


@pytest.mark.parametrize("view", _BROADCAST_VIEWS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bool", "int8"])
@pytest.mark.parametrize("root", ROOTS)
def test_broadcast_from_a_non_contiguous_source(case, rank, root, dtype, view):
    view = _BROADCAST_VIEWS[view]
    bases = all_inputs(case, dtype, (6, 8))
    assert_array(gs.broadcast(view(bases[rank]), root, name=case), view(bases[root]))


@pytest.mark.parametrize("view", _BROADCAST_VIEWS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bool", "int8"])
@pytest.mark.parametrize("root", ROOTS)
def test_broadcast_in_place_of_a_non_contiguous_view_writes_through_to_the_base_array(
        case, rank, root, dtype, view):
    view = _BROADCAST_VIEWS[view]
    bases = all_inputs(case, dtype, (6, 8))
    base = bases[rank].copy()
    gs.broadcast_(view(base), root, name=case)
    want_base = bases[rank].copy()
    view(want_base)[...] = view(bases[root])
    assert_array(base, want_base)


# ---- allgather -----------------------------------------------------------------------------------

_ROWS = {
    "r%3": lambda r, size: r % 3,  # rank 0 sends no rows
    "last-empty": lambda r, size: 0 if r == size - 1 else 2,
    "r+1": lambda r, size: r + 1,
    "all-empty": lambda r, size: 0,
}


@pytest.mark.parametrize("trailing", [pytest.param((), id="1d"), pytest.param((2, 3), id="3d")])
@pytest.mark.parametrize("rows", _ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather_concatenates_every_ranks_rows_in_rank_order(case, rank, size, dtype, rows, trailing):
    """First dimensions differ between ranks, including 0 rows on some rank or on all of them."""
    inputs = all_inputs(case, dtype, [(_ROWS[rows](r, size),) + trailing for r in range(size)])
    assert_array(gs.allgather(inputs[rank], name=case), np.concatenate(inputs, axis=0))


@pytest.mark.parametrize("rows", _ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather_async_handle_gives_the_concatenation(case, rank, size, dtype, rows):
    inputs = all_inputs(case, dtype, [(_ROWS[rows](r, size), 2, 3) for r in range(size)])
    got = gs.synchronize(gs.allgather_async(inputs[rank], name=case))
    assert_array(got, np.concatenate(inputs, axis=0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather_of_a_non_contiguous_view(case, rank, size, dtype):
    inputs = all_inputs(case, dtype, [(3, r + 1) for r in range(size)])
    assert_array(gs.allgather(inputs[rank].T, name=case), np.concatenate([x.T for x in inputs]))


def test_allgather_of_a_0d_array_is_a_value_error(case, rank):
    with pytest.raises(ValueError) as caught:
        gs.allgather(np.array(1.0), name=case)
    for fragment in ("0-d", repr(case), f"rank {rank}"):
        assert fragment in str(caught.value)


# ---- objects, barrier ----------------------------------------------------------------------------

def _an_object(r: int) -> dict:
    return {"root": r, "list": [1, 2.5, ("x", None, b"\x00\xff")], "set": {r, "s"},
            "nested": {"deep": [[r] * r, {"k": (r, -r)}]}, "text": "é" * (r + 1)}


@pytest.mark.parametrize("root", ROOTS)
def test_broadcast_object_gives_every_rank_the_roots_object(rank, root):
    got = gs.broadcast_object(_an_object(rank) if rank == root else "ignored", root_rank=root)
    assert got == _an_object(root)


def test_broadcast_object_of_a_large_object(case, rank):
    big = {"blob": "x" * 1_500_000, "rank0": True}
    assert gs.broadcast_object(big if rank == 0 else None, name=case) == big


def _rank_object(r: int) -> dict:
    return {"rank": r, "items": list(range(r)), "nested": {"s": "x" * r, "t": (r, [r] * r)},
            "none": None if r % 2 else [None]}


def test_allgather_object_lists_every_ranks_object_in_rank_order(rank, size):
    assert gs.allgather_object(_rank_object(rank)) == [_rank_object(r) for r in range(size)]


def test_allgather_object_of_none(case, size):
    assert gs.allgather_object(None, name=case) == [None] * size


def test_barrier_unnamed_and_named(case, rank):
    # Each form returns None, and only once the last rank (rank 0, late) has entered it.
    for name in (None, case):
        if rank == 0:
            time.sleep(0.1)
        entered = time.time()
        assert gs.barrier(name=name) is None
        left = time.time()
        assert left >= max(gs.allgather_object(entered, name=f"{case}.{name}.times"))


def test_barrier_returns_only_after_the_last_rank_entered_it(case, rank):
    if rank == 0:
        time.sleep(0.2)
    entered = time.time()
    gs.barrier(name=case)
    left = time.time()
    last_entry = max(gs.allgather_object(entered, name=case + ".times"))
    assert left >= last_entry, f"barrier returned at {left}, before the last rank entered it at {last_entry}"


# ---- errors before anything is sent --------------------------------------------------------------
# Argument errors are raised on the calling rank, before the request is queued, so the name is
# free again at once: each test reuses it afterwards (that would fail or hang otherwise). Every
# rank makes the same mistake, so the ranks stay in step.

@pytest.mark.parametrize("bad_root", ["size", -1, 1.0, None], ids=["size", "-1", "1.0", "None"])
def test_broadcast_from_a_bad_root_is_a_value_error_before_anything_is_sent(case, rank, size, bad_root):
    bad_root = size if bad_root == "size" else bad_root
    x = np.arange(6, dtype=np.float32)
    assert_rejected_before_sending(ValueError, lambda: gs.broadcast(x, bad_root, name=case), case,
                                   f"rank {rank}", repr(case), f"root_rank={bad_root!r}")


def test_broadcast_async_in_place_from_a_bad_root_is_a_value_error_before_anything_is_sent(
        case, rank, size):
    x = np.arange(6, dtype=np.float32)
    assert_rejected_before_sending(ValueError, lambda: gs.broadcast_async_(x, size + 3, name=case),
                                   case, f"rank {rank}", repr(case))


def test_broadcast_object_from_a_bad_root_is_a_value_error(size):
    with pytest.raises(ValueError, match=f"root_rank={size}"):
        gs.broadcast_object("o", root_rank=size)


_SUBMITTERS = [pytest.param(s, id=i) for s, i in (
    (gs.allreduce, "allreduce"), (gs.allreduce_async_, "allreduce_async_"),
    (partial(gs.broadcast, root_rank=0), "broadcast"),
    (partial(gs.broadcast_async_, root_rank=0), "broadcast_async_"),
    (gs.allgather, "allgather"), (gs.allgather_async, "allgather_async"))]


@pytest.mark.parametrize("submit", _SUBMITTERS)
@pytest.mark.parametrize("dtype", ["complex64", "timedelta64[s]", "<U3"])
def test_an_unsupported_dtype_is_a_type_error_before_anything_is_sent(case, rank, submit, dtype):
    bad = np.zeros(3, dtype)
    assert_rejected_before_sending(TypeError, lambda: submit(bad, name=case), case,
                                   bad.dtype.name, "not supported", repr(case), f"rank {rank}")


@pytest.mark.parametrize("submit", _SUBMITTERS)
@pytest.mark.parametrize("bad", [[1.0, 2.0], 3.0, "text", None], ids=["list", "float", "str", "None"])
def test_something_that_is_not_an_array_is_a_type_error_before_anything_is_sent(case, rank, submit, bad):
    assert_rejected_before_sending(TypeError, lambda: submit(bad, name=case), case,
                                   repr(case), type(bad).__name__, f"rank {rank}")


def test_allreduce_of_bool_with_the_default_op_average_is_a_type_error(case, rank):
    assert_rejected_before_sending(TypeError, lambda: gs.allreduce(np.ones(4, bool), name=case), case,
                                   "Average", "bool", repr(case), f"rank {rank}")


def test_allreduce_with_an_unknown_op_is_a_value_error(case, rank):
    assert_rejected_before_sending(ValueError, lambda: gs.allreduce(np.ones(3), name=case, op=7), case,
                                   "op=7", repr(case), f"rank {rank}")


@pytest.mark.parametrize("submit", [gs.allreduce_, partial(gs.broadcast_, root_rank=0)],
                         ids=["allreduce_", "broadcast_"])
def test_an_in_place_op_on_a_read_only_array_is_a_value_error(case, rank, submit):
    readonly = np.ones(3)
    readonly.flags.writeable = False
    assert_rejected_before_sending(ValueError, lambda: submit(readonly, name=case), case,
                                   "read-only", f"rank {rank}")


def test_reusing_a_name_while_it_is_in_flight_is_a_value_error(case, rank, size):
    """A name is in flight from submission until its handle completes.

    With several ranks, rank 0 submits first and the others only after it checked (so its
    collective cannot complete meanwhile). Alone, nothing waits for other ranks, so the test
    holds the GIL (a long switch interval) to keep the coordinator from running in between.
    """
    x = np.ones(3, np.float32)
    if size > 1:
        try:
            if rank == 0:
                handle = gs.allreduce_async(x, name=case, op=Sum)
                assert not gs.poll(handle), "poll is False while other ranks have not submitted"
                with pytest.raises(ValueError, match="in flight") as again:
                    gs.allreduce_async(x, name=case)
                with pytest.raises(ValueError, match="in flight"):
                    gs.broadcast(x, 0, name=case)
                assert_fragments(again.value, repr(case), "rank 0")
        finally:
            MPI.COMM_WORLD.Barrier()  # whatever happened on rank 0: never leave the others here
        if rank != 0:
            handle = gs.allreduce_async(x, name=case, op=Sum)
    else:
        interval = sys.getswitchinterval()
        sys.setswitchinterval(60.0)
        try:
            handle = gs.allreduce_async(x, name=case, op=Sum)
            assert not gs.poll(handle), "poll is False before the coordinator ran"
            with pytest.raises(ValueError, match="in flight") as again:
                gs.allreduce_async(x, name=case)
            assert_fragments(again.value, repr(case))
        finally:
            sys.setswitchinterval(interval)
    assert_array(gs.synchronize(handle), x * size)
    assert gs.poll(handle), "poll is True after synchronize"
    assert_array(gs.allreduce(x, name=case, op=Sum), x * size)


# ---- mismatches ----------------------------------------------------------------------------------
# Ranks that disagree on a collective: synchronize raises CollectiveError on every rank, listing
# each rank's value; the job stays usable afterwards (and so does the name).

def _mismatch(what: str, name: str, rank: int):
    """Submit the mismatched collective ``what`` as ``name``; return its handle."""
    if what == "shape":
        return gs.allreduce_async(np.zeros((rank + 1, 2), np.float32), name=name)
    if what == "dtype":
        return gs.allreduce_async(np.zeros(3, (np.float32, np.float64)[rank % 2]), name=name)
    if what == "op":
        return gs.allreduce_async(np.zeros(3), name=name, op=(Sum, Max)[rank % 2])
    if what == "root rank":
        return gs.broadcast_async(np.zeros(3), rank, name=name)
    return gs.allgather_async(np.zeros((2, rank + 1)), name=name)


def _mismatch_message(what: str, name: str, rank: int, size: int) -> str:
    kind, word = {"allgather shape": ("allgather", "shape (all but the first dimension must match)"),
                  "root rank": ("broadcast", "root rank")}.get(what, ("allreduce", what))
    value = {"shape": lambda r: (r + 1, 2), "dtype": lambda r: ("float32", "float64")[r % 2],
             "op": lambda r: ("Sum", "Max")[r % 2], "root rank": lambda r: r,
             "allgather shape": lambda r: (2, r + 1)}[what]
    shown = (lambda v: v) if what == "op" else repr
    listed = ", ".join(f"rank {r}: {shown(value(r))}" for r in range(size))
    return f"gradsync: rank {rank}: {kind} {name!r}: ranks disagree on {word}: {listed}"


@pytest.mark.parametrize("what", ["shape", "dtype", "op", "root rank", "allgather shape"])
def test_ranks_that_disagree_get_a_collective_error_listing_every_ranks_value(case, rank, size, what):
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")
    handle = _mismatch(what, case, rank)
    with pytest.raises(CollectiveError) as caught:
        gs.synchronize(handle)
    after = gs.allreduce(np.full(4, rank, np.int32), name=case, op=Sum)
    assert str(caught.value) == _mismatch_message(what, case, rank, size)
    assert isinstance(caught.value, gs.GradsyncError)
    assert_array(after, np.full(4, sum(range(size)), np.int32)), "the job and the name are usable"


# ---- a joined rank -------------------------------------------------------------------------------
# Rank 0 joins at once; the others run the op, then join (reference.beside_a_joined_rank). A
# joined rank stands in for every op (the identity of the reduction, no allgather rows) until
# every rank has joined.

def _needs_a_rank_that_does_not_join(size: int) -> None:
    if size == 1:
        pytest.skip("needs a rank that joins and one that does not")


@pytest.mark.parametrize("op", [Sum, Min, Max, Product], ids=lambda op: op.name)
def test_allreduce_with_a_joined_rank_reduces_over_the_other_ranks(case, rank, size, op):
    _needs_a_rank_that_does_not_join(size)
    got = beside_a_joined_rank(0, lambda: gs.allreduce(np.full(3, float(rank)), name=case, op=op)).result
    if rank != 0:
        assert_array(got, reference_allreduce([np.full(3, float(r)) for r in range(1, size)], op))


def test_allgather_with_a_joined_rank_has_no_rows_from_it(case, rank, size):
    _needs_a_rank_that_does_not_join(size)
    got = beside_a_joined_rank(0, lambda: gs.allgather(np.full((1, 2), rank), name=case)).result
    if rank != 0:
        assert got.tolist() == [[r, r] for r in range(1, size)]


def test_a_broadcast_from_a_joined_root_is_a_collective_error_on_the_other_ranks(case, rank, size):
    _needs_a_rank_that_does_not_join(size)

    def broadcast():
        with pytest.raises(CollectiveError) as caught:
            gs.broadcast(np.ones(2), root_rank=0, name=case)
        return str(caught.value)

    message = beside_a_joined_rank(0, broadcast).result
    if rank != 0:
        assert message == (f"gradsync: rank {rank}: broadcast {case!r}: its root rank 0 has called join() "
                           "and cannot broadcast")


def test_a_barrier_with_a_joined_rank_waits_for_the_other_ranks_only(case, rank, size):
    _needs_a_rank_that_does_not_join(size)

    def barrier():  # the last rank enters late; every other rank but 0 must wait for it
        if rank == size - 1:
            time.sleep(0.2)
        entered = time.time()
        gs.barrier(name=case)
        return entered, time.time()

    joined = beside_a_joined_rank(0, barrier)
    times = gs.allgather_object(joined.result, name=case + ".times")
    assert times[0] is None  # rank 0 joined at once and never entered the barrier
    last_entry = max(entered for entered, _ in times[1:])
    assert all(left >= last_entry for _, left in times[1:]), times
    assert joined.last in range(1, size)  # a rank that left the barrier joined last


def test_join_returns_the_rank_that_joined_last(size):
    last = beside_a_joined_rank(0, lambda: None).last
    assert last != 0 or size == 1
    assert last in range(size)


def test_no_test_of_this_file_imported_torch_or_jax(request):
    assert_no_framework_was_imported(request.session)

