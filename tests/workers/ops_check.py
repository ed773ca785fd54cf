"""Every public op of gradsync checked against an independent numpy reference.

Run as ``mpiexec -n N python tests/workers/ops_check.py [SECTION ...]`` (tests/test_ops.py does, for
N = 1, 2, 4). Without arguments every section but ``check_torch`` runs, on numpy arrays alone, and the
job then checks that nothing imported torch; ``check_torch`` (torch tensors) runs when named.

Each rank builds the inputs of *every* rank, from a numpy RNG seeded by (rank, case), so it can work
out what each collective must return with numpy alone. The reference is written from the documented
rules, not from gradsync's own code:

* floating sums, averages and products of float16/bfloat16/float32 are computed in float32
  (float64 in float64) and rounded once to the tensor's dtype; prescale multiplies each input
  before the reduction, postscale the result after it; Average is the sum divided by the size;
* integer Average is the floor of the exact mean; integer Sum/Product never overflow here (the
  inputs are chosen for that), so the reference needs no wrap-around;
* bool Sum/Max are logical or, Min/Product logical and; bool Average is a TypeError.

The inputs are chosen so that every result is exact: floats are multiples of 2**-10 of magnitude
at most 4 (products use a few small dyadic values), so float32 sums are exact in any order and the
comparison can be exact too. Only the "random floats" case uses unquantised values and a tolerance.

Prints ``ops_check rank R: N cases passed`` at the end. On any failure it prints the traceback and
aborts the whole job (MPI Abort), so no rank is left waiting for a collective that never comes.
"""

from __future__ import annotations

import sys
import time
import traceback
import zlib
from functools import partial

import ml_dtypes
import numpy as np
from mpi4py import MPI

import gradsync as gs
from gradsync import Average, CollectiveError, Max, Min, Product, Sum

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {
    "float16": np.dtype(np.float16), "bfloat16": BF16, "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64), "uint8": np.dtype(np.uint8), "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16), "int32": np.dtype(np.int32), "int64": np.dtype(np.int64),
    "bool": np.dtype(np.bool_),
}
FLOATS = ("float16", "bfloat16", "float32", "float64")
INTS = ("uint8", "int8", "int16", "int32", "int64")
OPS = (Average, Sum, Min, Max, Product)

RANK = 0
SIZE = 1
PASSED = 0


# ---- inputs and the numpy reference --------------------------------------------------------------

def name_of(dtype: np.dtype) -> str:
    dtype = np.dtype(dtype)
    return "bfloat16" if dtype == BF16 else dtype.name


def rng_for(case: str, rank: int) -> np.random.Generator:
    return np.random.default_rng([rank, zlib.crc32(case.encode())])


def make(case: str, rank: int, dtype: str, shape: tuple[int, ...], op=Sum) -> np.ndarray:
    """Rank ``rank``'s input for ``case``: deterministic, and chosen so the reference is exact."""
    rng = rng_for(case, rank)
    dt = DTYPES[dtype]
    if dtype == "bool":
        # Mostly False for the "or" ops and mostly True for the "and" ops, so both outcomes occur.
        return np.asarray(rng.random(shape) < (0.3 if op in (Sum, Max) else 0.7))
    if dtype in FLOATS:
        if op == Product:
            values = rng.choice([-2.0, -1.5, -1.0, -0.5, 0.5, 1.0, 1.5, 2.0], size=shape)
        else:
            values = np.round(rng.uniform(-4, 4, size=shape) * 1024) / 1024
        return np.asarray(values).astype(dt)
    info = np.iinfo(dt)
    if op == Product:
        lo, hi = (0, 3) if info.min == 0 else (-3, 3)
    elif op == Sum or (op == Average and dtype == "int64"):
        lo, hi = info.min // 4, info.max // 4  # the sum of up to 4 ranks fits the dtype
    else:  # Min, Max, and Average of the narrow ints, which must not overflow (int64 accumulator)
        lo, hi = info.min, info.max
    return np.asarray(rng.integers(lo, hi, size=shape, dtype=dt, endpoint=True))


def all_inputs(case: str, dtype: str, shape, op=Sum) -> list[np.ndarray]:
    """Every rank's input; ``shape`` is every rank's shape, or a list of one shape per rank."""
    shapes = shape if isinstance(shape, list) else [shape] * SIZE
    return [make(case, r, dtype, shapes[r], op) for r in range(SIZE)]


def reference_allreduce(inputs: list[np.ndarray], op, prescale=1.0, postscale=1.0) -> np.ndarray:
    dtype = inputs[0].dtype
    n = len(inputs)
    if dtype == np.bool_:
        stacked = np.stack(inputs)
        result = stacked.any(axis=0) if op in (Sum, Max) else stacked.all(axis=0)
        return np.asarray(result, dtype=dtype)
    if name_of(dtype) in FLOATS:
        wide = np.float64 if dtype == np.float64 else np.float32
        stacked = np.stack([x.astype(wide) * wide(prescale) for x in inputs])
        if op in (Sum, Average):
            result = stacked.sum(axis=0)
        else:
            result = {Min: stacked.min, Max: stacked.max, Product: stacked.prod}[op](axis=0)
        if op == Average:
            result = result / wide(n)
        result = np.asarray(result * wide(postscale), dtype=wide)
        return result.astype(dtype)  # the one rounding to float16/bfloat16
    assert prescale == postscale == 1.0
    stacked = np.stack([x.astype(np.int64) for x in inputs])
    if op == Sum:
        result = stacked.sum(axis=0)
    elif op == Average:
        result = np.floor_divide(stacked.sum(axis=0), n)  # floor of the exact mean
    else:
        result = {Min: stacked.min, Max: stacked.max, Product: stacked.prod}[op](axis=0)
    result = np.asarray(result)
    info = np.iinfo(dtype)
    assert result.size == 0 or (info.min <= result.min() and result.max() <= info.max), \
        "test bug: the reference overflows"
    return result.astype(dtype)


# ---- assertions ----------------------------------------------------------------------------------

def passed() -> None:
    global PASSED
    PASSED += 1


def expect(condition: bool, what: str) -> None:
    assert condition, f"rank {RANK}: {what}"
    passed()


def expect_equal(got, want: np.ndarray, what: str, rtol: float = 0.0, atol: float = 0.0) -> None:
    """``got`` is a numpy array of ``want``'s dtype and shape, equal (or within the tolerance)."""
    assert isinstance(got, np.ndarray), f"rank {RANK}: {what}: got a {type(got)}, not an ndarray"
    assert got.dtype == want.dtype, f"rank {RANK}: {what}: dtype {got.dtype}, want {want.dtype}"
    assert got.shape == want.shape, f"rank {RANK}: {what}: shape {got.shape}, want {want.shape}"
    if name_of(want.dtype) in FLOATS:
        got, want = got.astype(np.float64), want.astype(np.float64)
    if rtol or atol:
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"rank {RANK}: {what}")
    else:
        np.testing.assert_array_equal(got, want, err_msg=f"rank {RANK}: {what}")
    passed()


class raises:
    """``with raises(Error, *fragments):`` the body raises Error whose message has every fragment.

    The exception is kept as ``.value``; any other exception propagates.
    """

    def __init__(self, error: type[BaseException], *fragments: str) -> None:
        self.error, self.fragments = error, fragments
        self.value: BaseException | None = None

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb) -> bool:
        assert kind is not None, f"rank {RANK}: expected {self.error.__name__} {self.fragments}"
        if not issubclass(kind, self.error):
            return False
        for fragment in self.fragments:
            assert fragment in str(value), f"rank {RANK}: {fragment!r} not in {str(value)!r}"
        self.value = value
        passed()
        return True


# ---- allreduce -----------------------------------------------------------------------------------

def check_allreduce_every_dtype_and_op() -> None:
    """The four forms of allreduce, for every (dtype, op), out of place and in place."""
    for dtype in DTYPES:
        for op in OPS:
            case = f"allreduce.{dtype}.{op.name}"
            inputs = all_inputs(case, dtype, (3, 5), op)
            mine = inputs[RANK]
            if dtype == "bool" and op == Average:
                with raises(TypeError, "Average", "bool", repr(case), f"rank {RANK}"):
                    gs.allreduce(mine, name=case, op=op)
                with raises(TypeError, "Average", "bool"):
                    gs.allreduce_async_(mine, name=case, op=op)
                continue
            want = reference_allreduce(inputs, op)
            before = mine.copy()

            expect_equal(gs.allreduce(mine, name=case, op=op), want, f"{case}: allreduce")
            expect_equal(mine, before, f"{case}: allreduce left its input alone")

            inplace = mine.copy()
            expect(gs.allreduce_(inplace, name=case + "_", op=op) is inplace,
                   f"{case}: allreduce_ returns its argument")
            expect_equal(inplace, want, f"{case}: allreduce_")

            out_of_place, in_place = mine.copy(), mine.copy()
            h1 = gs.allreduce_async(out_of_place, name=case + ".async", op=op)
            h2 = gs.allreduce_async_(in_place, name=case + ".async_", op=op)
            expect_equal(gs.synchronize(h1), want, f"{case}: allreduce_async")
            expect(gs.synchronize(h2) is in_place, f"{case}: allreduce_async_ returns its argument")
            expect_equal(in_place, want, f"{case}: allreduce_async_")
            expect_equal(out_of_place, before, f"{case}: allreduce_async left its input alone")
            expect(gs.poll(h1) and gs.poll(h2), f"{case}: poll is True once synchronized")


def check_unnamed_ops_match_by_order() -> None:
    inputs = all_inputs("unnamed", "float32", (4,))
    want = reference_allreduce(inputs, Sum)
    for _ in range(3):
        expect_equal(gs.allreduce(inputs[RANK], op=Sum), want, "unnamed allreduce")
    handles = [gs.allreduce_async(inputs[RANK], op=Sum) for _ in range(3)]
    for handle in handles:
        expect_equal(gs.synchronize(handle), want, "unnamed allreduce_async")


def check_random_floats() -> None:
    """Unquantised floats: float32/64 close to the float64 sum; 16-bit within one unit of the
    float32 sum rounded once (MPI may add in any order, so float32 may differ in its last bit)."""
    rtol = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 1e-6, "float64": 1e-13}
    atol = {"float16": 1e-6, "bfloat16": 1e-6, "float32": 1e-6, "float64": 1e-12}
    for dtype in FLOATS:
        case = f"random.{dtype}"
        inputs = [rng_for(case, r).standard_normal((7, 9)).astype(DTYPES[dtype])
                  for r in range(SIZE)]
        exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)
        for op, scale in ((Sum, 1.0), (Average, 1.0 / SIZE)):
            want = (exact * scale).astype(DTYPES[dtype])
            got = gs.allreduce(inputs[RANK], name=f"{case}.{op.name}", op=op)
            expect_equal(got, want, f"{case}: {op.name}", rtol=rtol[dtype], atol=atol[dtype])


def check_scale_factors() -> None:
    """prescale multiplies each input before the reduction (in the reduction's precision), postscale
    the result after it; both on every floating dtype, any op; TypeError on other dtypes."""
    factors = ((3.0, 1.0), (1.0, 3.0), (0.5, 0.25), (3.0, 0.75))
    for dtype in FLOATS:
        checks = []
        for op in (Sum, Average, Max, Product):
            for pre, post in factors:
                case = f"scaled.{dtype}.{op.name}.{pre}.{post}"
                inputs = all_inputs(case, dtype, (2, 3), op)
                want = reference_allreduce(inputs, op, pre, post)
                kw = {"op": op, "prescale_factor": pre, "postscale_factor": post}
                inplace = inputs[RANK].copy()
                strided_base = np.repeat(inputs[RANK], 2, axis=1)
                strided = strided_base[:, ::2]
                checks += [
                    (gs.allreduce_async(inputs[RANK], name=case, **kw), want, case),
                    (gs.allreduce_async_(inplace, name=case + "_", **kw), want, case + " in place"),
                    (gs.allreduce_async_(strided, name=case + ".strided", **kw), want,
                     case + " strided in place"),
                ]
                expect(np.array_equal(strided.astype(np.float64), inputs[RANK].astype(np.float64)),
                       "test setup: strided view")
        for handle, want, what in checks:
            expect_equal(gs.synchronize(handle), want, what)
        expect_equal(gs.allreduce(make("scaled.blocking", RANK, dtype, (4,)), name=f"sb.{dtype}",
                                  op=Sum, postscale_factor=0.5),
                     reference_allreduce(all_inputs("scaled.blocking", dtype, (4,)), Sum, 1.0, 0.5),
                     f"{dtype}: blocking allreduce with postscale")
    for dtype in INTS + ("bool",):
        x = make("scaled.int", RANK, dtype, (3,))
        with raises(TypeError, "floating-point", "'bad.pre'", f"rank {RANK}", dtype):
            gs.allreduce(x, name="bad.pre", op=Sum, prescale_factor=2.0)
        with raises(TypeError, "floating-point", "'bad.post'"):
            gs.allreduce_(x, name="bad.post", op=Sum, postscale_factor=0.5)
        # Factors of exactly 1.0 are the defaults and fine on any dtype.
        want = reference_allreduce(all_inputs("scaled.int", dtype, (3,)), Sum)
        expect_equal(gs.allreduce(x, name=f"unit.{dtype}", op=Sum, prescale_factor=1.0,
                                  postscale_factor=1), want, f"{dtype}: unit factors")


def check_zero_size_and_scalars() -> None:
    for dtype, op in (("float32", Sum), ("bfloat16", Average), ("int32", Average), ("bool", Max),
                      ("float64", Product), ("uint8", Min)):
        for shape in ((0,), (2, 0, 3)):
            case = f"empty.{dtype}.{op.name}.{shape}"
            x = np.empty(shape, DTYPES[dtype])
            want = np.empty(shape, DTYPES[dtype])
            expect_equal(gs.allreduce(x, name=case, op=op), want, case)
            expect(gs.allreduce_(x, name=case + "_", op=op) is x, f"{case}: allreduce_")
            expect_equal(gs.synchronize(gs.broadcast_async(x, SIZE - 1, name=case + ".bc")), want,
                         f"{case}: broadcast")
        # A zero-size tensor submitted together with non-empty ones (so fused with them).
        case = f"empty.fused.{dtype}"
        inputs = all_inputs(case, dtype, (5,), op)
        handles = [gs.allreduce_async(inputs[RANK], name=case + ".a", op=op),
                   gs.allreduce_async(np.empty(0, DTYPES[dtype]), name=case + ".empty", op=op),
                   gs.allreduce_async(inputs[RANK][::-1], name=case + ".b", op=op)]
        want = reference_allreduce(inputs, op)
        expect_equal(gs.synchronize(handles[0]), want, f"{case}: before the empty one")
        expect_equal(gs.synchronize(handles[1]), np.empty(0, DTYPES[dtype]),
                     f"{case}: the empty one")
        expect_equal(gs.synchronize(handles[2]), want[::-1].copy(), f"{case}: after the empty one")

    for dtype in DTYPES:
        for op in (Sum, Average, Max):
            if dtype == "bool" and op == Average:
                continue
            case = f"scalar.{dtype}.{op.name}"
            inputs = all_inputs(case, dtype, (), op)
            want = reference_allreduce(inputs, op)
            expect_equal(gs.allreduce(inputs[RANK], name=case, op=op), want, case)
            inplace = inputs[RANK].copy()
            gs.allreduce_(inplace, name=case + "_", op=op)
            expect_equal(inplace, want, f"{case}: in place")
        case = f"scalar.{dtype}.broadcast"
        inputs = all_inputs(case, dtype, ())
        expect_equal(gs.broadcast(inputs[RANK], 0, name=case), inputs[0], case)


def check_non_contiguous() -> None:
    """Transposed, strided and reversed views: out of place they give a new array; in place the
    result is written through to the base array, and the base's other elements are untouched."""
    views = {
        "transposed": lambda a: a.T,
        "strided": lambda a: a[::2, 1::3],
        "reversed": lambda a: a[:, ::-1],
        "slice": lambda a: a[1:5, 2:7],
        "column": lambda a: a[:, 3],
    }
    for dtype, op in (("float32", Sum), ("float64", Average), ("bfloat16", Sum),
                      ("float16", Average), ("int16", Average), ("int32", Max), ("uint8", Min),
                      ("int64", Product), ("bool", Sum)):
        for label, view in views.items():
            case = f"strided.{dtype}.{op.name}.{label}"
            bases = all_inputs(case, dtype, (6, 8), op)
            want = reference_allreduce([view(b) for b in bases], op)
            expect_equal(gs.allreduce(view(bases[RANK]), name=case, op=op), want, case)

            base = bases[RANK].copy()
            target = view(base)
            expect(not target.flags.c_contiguous, f"{case}: test setup")
            expect(gs.allreduce_(target, name=case + "_", op=op) is target, f"{case}: allreduce_")
            want_base = bases[RANK].copy()
            view(want_base)[...] = want
            expect_equal(base, want_base, f"{case}: in place writes through to the base array")


def check_large_tensors() -> None:
    """Tensors over the 1 MiB fusion threshold, contiguous or strided, alone or among small ones."""
    n = 600_000  # 2.4 MB of float32
    for dtype, op in (("float32", Sum), ("float16", Average), ("int8", Average), ("bool", Min)):
        case = f"large.{dtype}.{op.name}"
        inputs = all_inputs(case, dtype, (n,), op)
        want = reference_allreduce(inputs, op)
        expect_equal(gs.allreduce(inputs[RANK], name=case, op=op), want, case)
        inplace = inputs[RANK].copy()
        gs.allreduce_(inplace, name=case + "_", op=op)
        expect_equal(inplace, want, f"{case}: in place")

    case = "large.strided"
    bases = all_inputs(case, "float32", (1000, 1200))
    base = bases[RANK].copy()
    gs.allreduce_(base[:, ::2], name=case, op=Sum)
    want_base = bases[RANK].copy()
    want_base[:, ::2] = reference_allreduce([b[:, ::2] for b in bases], Sum)
    expect_equal(base, want_base, f"{case}: in place on a strided 600k-element view")

    case = "large.among.small"
    big = all_inputs(case + ".big", "float32", (n,))
    small = [all_inputs(f"{case}.{i}", "float32", (10,)) for i in range(20)]
    handles = [gs.allreduce_async(s[RANK], name=f"{case}.{i}", op=Sum)
               for i, s in enumerate(small[:10])]
    handles.append(gs.allreduce_async(big[RANK], name=case + ".big", op=Sum))
    handles += [gs.allreduce_async(s[RANK], name=f"{case}.{i + 10}", op=Sum)
                for i, s in enumerate(small[10:])]
    wants = [reference_allreduce(s, Sum) for s in small[:10]] + [reference_allreduce(big, Sum)]
    wants += [reference_allreduce(s, Sum) for s in small[10:]]
    for handle, want in zip(handles, wants, strict=True):
        expect_equal(gs.synchronize(handle), want, f"{case}: {handle.name}")


def check_many_small_tensors_fused() -> None:
    """Hundreds of small tensors of mixed dtypes, ops and shapes submitted together (so they are
    fused, over more than one fusion buffer), half of them in place, then synchronized."""
    rng = np.random.default_rng(1234)  # the same plan on every rank
    plan = []
    for i in range(400):
        dtype = ("float32", "float16", "bfloat16", "int32", "uint8", "bool", "float64")[i % 7]
        op = (Sum, Average, Max)[i % 3]
        if dtype == "bool" and op == Average:
            op = Min
        shape = [(), (0,), (int(rng.integers(1, 9)),), (3, int(rng.integers(1, 5)))][i % 4]
        if i % 50 == 0:
            shape = (700,)  # 400 x ~2.8 kB: more than one 1 MiB buffer
        plan.append((f"small.{i}", dtype, op, shape, i % 2 == 0))
    checks = []
    for name, dtype, op, shape, in_place in plan:
        inputs = all_inputs(name, dtype, shape, op)
        x = inputs[RANK].copy()
        submit = gs.allreduce_async_ if in_place else gs.allreduce_async
        checks.append((submit(x, name=name, op=op), x, in_place, reference_allreduce(inputs, op)))
    for handle, x, in_place, want in checks:
        result = gs.synchronize(handle)
        if in_place:
            expect(result is x, f"{handle.name}: in place returns its argument")
        expect_equal(result, want, handle.name)


def check_submission_order_differs_between_ranks() -> None:
    """The same collectives submitted in different orders on different ranks (rank 0 in order,
    odd ranks reversed, other ranks shuffled), some ranks pausing between submissions, and
    synchronized in yet another order: negotiation orders them, and every result is right."""
    jobs = []  # (name, submit, expected result, in-place target or None)
    for i in range(30):
        dtype = ("float32", "int64", "bfloat16", "bool", "int8", "float16")[i % 6]
        op = (Sum, Max, Average, Min, Product)[i % 5]
        if dtype == "bool" and op == Average:
            op = Sum
        name = f"order.allreduce.{i}"
        inputs = all_inputs(name, dtype, (i % 4 + 1, 3), op)
        x = inputs[RANK].copy()
        in_place = i % 3 == 0
        submit = partial(gs.allreduce_async_ if in_place else gs.allreduce_async, x, name, op=op)
        jobs.append((name, submit, reference_allreduce(inputs, op), x if in_place else None))
    for i in range(12):
        name, root = f"order.broadcast.{i}", i % SIZE
        inputs = all_inputs(name, ("float64", "bfloat16", "int16", "bool")[i % 4], (5,))
        x = inputs[RANK].copy()
        in_place = i % 2 == 0
        submit = partial(gs.broadcast_async_ if in_place else gs.broadcast_async, x, root, name)
        jobs.append((name, submit, inputs[root], x if in_place else None))
    for i in range(12):
        name = f"order.allgather.{i}"
        inputs = all_inputs(name, ("int32", "float32", "uint8")[i % 3],
                            [(r % 3, 2) for r in range(SIZE)])
        jobs.append((name, partial(gs.allgather_async, inputs[RANK], name), np.concatenate(inputs),
                     None))
    big = all_inputs("order.big", "float32", (300_000,))
    jobs.append(("order.big", partial(gs.allreduce_async, big[RANK], "order.big", op=Sum),
                 reference_allreduce(big, Sum), None))

    order = list(range(len(jobs)))
    if RANK % 2 == 1:
        order.reverse()
    elif RANK > 0:
        np.random.default_rng(RANK).shuffle(order)
    handles = {}
    for k, index in enumerate(order):
        name, submit, _, _ = jobs[index]
        handles[name] = submit()
        if RANK == SIZE - 1 and k % 10 == 9:
            time.sleep(0.002)  # spread this rank's requests over several negotiation cycles
    wait_order = list(range(len(jobs)))
    np.random.default_rng(100 + RANK).shuffle(wait_order)
    for index in wait_order:
        name, _, want, target = jobs[index]
        result = gs.synchronize(handles[name])
        if target is not None:
            expect(result is target, f"{name}: in place returns its argument")
        expect_equal(result, want, f"{name} (submitted in rank {RANK}'s own order)")


# ---- broadcast, allgather, objects, barrier ------------------------------------------------------

def check_broadcast() -> None:
    for root in range(SIZE):
        for dtype in DTYPES:
            case = f"broadcast.{root}.{dtype}"
            inputs = all_inputs(case, dtype, (4, 3))
            want = inputs[root]
            mine = inputs[RANK].copy()
            expect_equal(gs.broadcast(mine, root, name=case), want, case)
            expect_equal(mine, inputs[RANK], f"{case}: broadcast left its input alone")
            target = inputs[RANK].copy()
            expect(gs.broadcast_(target, np.int64(root), name=case + "_") is target,
                   f"{case}: broadcast_ returns its argument")
            expect_equal(target, want, f"{case}: broadcast_")
            out_of_place, in_place = inputs[RANK].copy(), inputs[RANK].copy()
            h1 = gs.broadcast_async(out_of_place, root, name=case + ".async")
            h2 = gs.broadcast_async_(in_place, root, name=case + ".async_")
            expect_equal(gs.synchronize(h1), want, f"{case}: broadcast_async")
            expect(gs.synchronize(h2) is in_place, f"{case}: broadcast_async_ returns its argument")
            expect_equal(in_place, want, f"{case}: broadcast_async_")

        for dtype in ("float32", "bfloat16", "bool", "int8"):
            for label, view in (("transposed", lambda a: a.T), ("strided", lambda a: a[::2, 1::3]),
                                ("reversed", lambda a: a[::-1])):
                case = f"broadcast.{root}.{dtype}.{label}"
                bases = all_inputs(case, dtype, (6, 8))
                expect_equal(gs.broadcast(view(bases[RANK]), root, name=case), view(bases[root]),
                             f"{case}: from a non-contiguous source")
                base = bases[RANK].copy()
                gs.broadcast_(view(base), root, name=case + "_")
                want_base = bases[RANK].copy()
                view(want_base)[...] = view(bases[root])
                expect_equal(base, want_base, f"{case}: in place writes through to the base array")


def check_allgather() -> None:
    """First dimensions differ between ranks, including 0 rows on some rank or on all of them."""
    rows = {
        "r%3": lambda r: r % 3,  # rank 0 sends no rows
        "last-empty": lambda r: 0 if r == SIZE - 1 else 2,
        "r+1": lambda r: r + 1,
        "all-empty": lambda r: 0,
    }
    for dtype in DTYPES:
        for label, first in rows.items():
            for trailing in ((), (2, 3)):
                case = f"allgather.{dtype}.{label}.{trailing}"
                inputs = all_inputs(case, dtype, [(first(r),) + trailing for r in range(SIZE)])
                want = np.concatenate(inputs, axis=0)
                expect_equal(gs.allgather(inputs[RANK], name=case), want, case)
                if trailing:
                    handle = gs.allgather_async(inputs[RANK], name=case + ".async")
                    expect_equal(gs.synchronize(handle), want, f"{case}: allgather_async")
        case = f"allgather.{dtype}.transposed"
        inputs = all_inputs(case, dtype, [(3, r + 1) for r in range(SIZE)])
        expect_equal(gs.allgather(inputs[RANK].T, name=case), np.concatenate([x.T for x in inputs]),
                     f"{case}: non-contiguous input")
    with raises(ValueError, "0-d", "'scalar.gather'", f"rank {RANK}"):
        gs.allgather(np.array(1.0), name="scalar.gather")


def check_objects() -> None:
    for root in range(SIZE):
        def obj(r):
            return {"root": r, "list": [1, 2.5, ("x", None, b"\x00\xff")], "set": {r, "s"},
                    "nested": {"deep": [[r] * r, {"k": (r, -r)}]}, "text": "é" * (r + 1)}
        got = gs.broadcast_object(obj(RANK) if RANK == root else "ignored", root_rank=root)
        expect(got == obj(root), f"broadcast_object from {root}: {got!r}")
    big = {"blob": "x" * 1_500_000, "rank0": True}
    expect(gs.broadcast_object(big if RANK == 0 else None, name="big.object") == big,
           "broadcast_object of a 1.5 MB object")

    def mine(r):
        return {"rank": r, "items": list(range(r)), "nested": {"s": "x" * r, "t": (r, [r] * r)},
                "none": None if r % 2 else [None]}
    gathered = gs.allgather_object(mine(RANK))
    expect(gathered == [mine(r) for r in range(SIZE)], f"allgather_object: {gathered!r}")
    expect(gs.allgather_object(None, name="nones") == [None] * SIZE, "allgather_object of None")


def check_barrier() -> None:
    gs.barrier()
    gs.barrier(name="named.barrier")
    if RANK == 0:
        time.sleep(0.2)
    entered = time.time()
    gs.barrier()
    left = time.time()
    last_entry = max(gs.allgather_object(entered, name="barrier.times"))
    expect(left >= last_entry,
           f"barrier returned at {left}, before the last rank entered it at {last_entry}")


# ---- torch tensors -------------------------------------------------------------------------------

def to_torch(a: np.ndarray):
    """A torch tensor holding a copy of ``a`` (bfloat16 through int16)."""
    import torch

    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def to_numpy(t, dtype: str, what: str) -> np.ndarray:
    """``t`` as numpy, after checking that it is a torch tensor of ``dtype`` (a gradsync name)."""
    import torch

    expect(isinstance(t, torch.Tensor), f"{what}: returns a torch.Tensor, not {type(t)}")
    expect(t.dtype == getattr(torch, dtype), f"{what}: dtype {t.dtype}")
    t = t.contiguous()
    return t.view(torch.int16).numpy().view(BF16) if t.dtype == torch.bfloat16 else t.numpy()


def check_torch() -> None:
    import torch

    for dtype in ("float32", "bfloat16", "int64", "bool"):
        for op in (Sum, Average, Min, Max):
            if dtype == "bool" and op == Average:
                continue
            case = f"torch.allreduce.{dtype}.{op.name}"
            inputs = all_inputs(case, dtype, (4, 6), op)
            want = reference_allreduce(inputs, op)
            expect_equal(to_numpy(gs.allreduce(to_torch(inputs[RANK]), name=case, op=op), dtype,
                                  case), want, case)
            tensor = to_torch(inputs[RANK])
            expect(gs.allreduce_(tensor, name=case + "_", op=op) is tensor,
                   f"{case}: allreduce_ returns its argument")
            expect_equal(to_numpy(tensor, dtype, case), want, f"{case}: allreduce_")
            base = to_torch(inputs[RANK])
            gs.allreduce_(base.t(), name=case + ".t", op=op)
            expect_equal(to_numpy(base, dtype, case), want,
                         f"{case}: allreduce_ of a transposed view")

        for root in range(SIZE):
            case = f"torch.broadcast.{dtype}.{root}"
            inputs = all_inputs(case, dtype, (3, 5))
            tensor = to_torch(inputs[RANK])
            expect(gs.broadcast_(tensor, root, name=case) is tensor,
                   f"{case}: broadcast_ returns its argument")
            expect_equal(to_numpy(tensor, dtype, case), inputs[root], case)
            base = to_torch(inputs[RANK])
            gs.broadcast_(base[:, ::2], root, name=case + ".strided")
            want_base = inputs[RANK].copy()
            want_base[:, ::2] = inputs[root][:, ::2]
            expect_equal(to_numpy(base, dtype, case), want_base, f"{case}: strided broadcast_")

        case = f"torch.allgather.{dtype}"
        inputs = all_inputs(case, dtype, [(r % 3, 2) for r in range(SIZE)])
        got = gs.allgather(to_torch(inputs[RANK]), name=case)
        expect_equal(to_numpy(got, dtype, case), np.concatenate(inputs), case)

    with raises(TypeError, "complex64", "'torch.complex'", f"rank {RANK}"):
        gs.allreduce(torch.zeros(3, dtype=torch.complex64), name="torch.complex")


# ---- errors --------------------------------------------------------------------------------------

def check_errors_before_anything_is_sent() -> None:
    """Argument errors are raised on the calling rank before the request is queued, so the name is
    free again at once (reusing it below would fail or hang otherwise)."""
    x = np.arange(6, dtype=np.float32)
    for bad_root in (SIZE, -1, 1.0, None):
        with raises(ValueError, f"rank {RANK}", "'bad.root'", f"root_rank={bad_root!r}"):
            gs.broadcast(x, bad_root, name="bad.root")
    with raises(ValueError, f"rank {RANK}", "'bad.root'"):
        gs.broadcast_async_(x, SIZE + 3, name="bad.root")
    with raises(ValueError, f"root_rank={SIZE}"):
        gs.broadcast_object("o", root_rank=SIZE)
    expect_equal(gs.broadcast(x + RANK, SIZE - 1, name="bad.root"), x + (SIZE - 1),
                 "the name of a rejected broadcast is free")

    submitters = (gs.allreduce, gs.allreduce_async_, partial(gs.broadcast, root_rank=0),
                  partial(gs.broadcast_async_, root_rank=0), gs.allgather, gs.allgather_async)
    for bad in (np.zeros(3, np.complex64), np.zeros(3, np.uint16), np.zeros(2, "U3")):
        for submit in submitters:
            with raises(TypeError, bad.dtype.name, "not supported", "'bad.dtype'", f"rank {RANK}"):
                submit(bad, name="bad.dtype")

    for bad in ([1.0, 2.0], 3.0, "text", None):
        for submit in submitters:
            with raises(TypeError, "'not.array'", type(bad).__name__, f"rank {RANK}"):
                submit(bad, name="not.array")

    with raises(TypeError, "Average", "bool", "'bool.avg'", f"rank {RANK}"):
        gs.allreduce(np.ones(4, bool), name="bool.avg")  # Average is the default op
    with raises(ValueError, "op=7", "'bad.op'", f"rank {RANK}"):
        gs.allreduce(x, name="bad.op", op=7)
    readonly = np.ones(3)
    readonly.flags.writeable = False
    with raises(ValueError, "read-only", f"rank {RANK}"):
        gs.allreduce_(readonly, name="readonly")
    with raises(ValueError, "read-only", f"rank {RANK}"):
        gs.broadcast_(readonly, 0, name="readonly")

    for name in ("bad.dtype", "not.array", "bool.avg", "bad.op", "readonly"):
        expect_equal(gs.allreduce(x, name=name, op=Sum), x * SIZE, f"the name {name!r} is free")


def check_name_reuse_while_in_flight() -> None:
    """A name is in flight from submission until its handle completes; reusing it is a ValueError.

    With several ranks, rank 0 submits first and the others only after it checked (so its
    collective cannot complete meanwhile). Alone, nothing waits for other ranks, so the check
    holds the GIL (a long switch interval) to keep the coordinator from running in between.
    """
    x = np.ones(3, np.float32)
    if SIZE > 1:
        if RANK == 0:
            handle = gs.allreduce_async(x, name="dup", op=Sum)
            expect(not gs.poll(handle), "poll is False while other ranks have not submitted")
            with raises(ValueError, "'dup'", "in flight", "rank 0"):
                gs.allreduce_async(x, name="dup")
            with raises(ValueError, "'dup'", "in flight"):
                gs.broadcast(x, 0, name="dup")
        MPI.COMM_WORLD.Barrier()
        if RANK != 0:
            handle = gs.allreduce_async(x, name="dup", op=Sum)
    else:
        interval = sys.getswitchinterval()
        sys.setswitchinterval(60.0)
        try:
            handle = gs.allreduce_async(x, name="dup", op=Sum)
            expect(not gs.poll(handle), "poll is False before the coordinator ran")
            with raises(ValueError, "'dup'", "in flight"):
                gs.allreduce_async(x, name="dup")
        finally:
            sys.setswitchinterval(interval)
    expect_equal(gs.synchronize(handle), x * SIZE, "the first 'dup' completes")
    expect(gs.poll(handle), "poll is True after synchronize")
    expect_equal(gs.allreduce(x, name="dup", op=Sum), x * SIZE, "the name is free once done")


def check_mismatches() -> None:
    """Ranks that disagree on a collective: synchronize raises CollectiveError on every rank,
    listing each rank's value; the job stays usable afterwards."""
    if SIZE == 1:
        return
    shape = gs.allreduce_async(np.zeros((RANK + 1, 2), np.float32), name="mm.shape")
    dtype = gs.allreduce_async(np.zeros(3, (np.float32, np.float64)[RANK % 2]), name="mm.dtype")
    op = gs.allreduce_async(np.zeros(3), name="mm.op", op=(Sum, Max)[RANK % 2])
    root = gs.broadcast_async(np.zeros(3), RANK, name="mm.root")
    rows = gs.allgather_async(np.zeros((2, RANK + 1)), name="mm.gather")
    cases = [
        (shape, "shape", [f"rank {r}: {(r + 1, 2)}" for r in range(SIZE)]),
        (dtype, "dtype", [f"rank {r}: '{('float32', 'float64')[r % 2]}'" for r in range(SIZE)]),
        (op, "op", [f"rank {r}: {('Sum', 'Max')[r % 2]}" for r in range(SIZE)]),
        (root, "root rank", [f"rank {r}: {r}" for r in range(SIZE)]),
        (rows, "shape", [f"rank {r}: {(2, r + 1)}" for r in range(SIZE)]),
    ]
    for handle, word, fragments in cases:
        with raises(CollectiveError, f"rank {RANK}", repr(handle.name), f"disagree on {word}",
                    *fragments) as caught:
            gs.synchronize(handle)
        expect(isinstance(caught.value, gs.GradsyncError), "CollectiveError is a GradsyncError")
    for handle, _, _ in cases:
        x = np.full(4, RANK, np.int32)
        expect_equal(gs.allreduce(x, name=handle.name, op=Sum),
                     np.full(4, sum(range(SIZE)), np.int32),
                     f"after the {handle.name} mismatch the job (and the name) are usable")


SECTIONS = [
    check_allreduce_every_dtype_and_op,
    check_unnamed_ops_match_by_order,
    check_random_floats,
    check_scale_factors,
    check_zero_size_and_scalars,
    check_non_contiguous,
    check_large_tensors,
    check_many_small_tensors_fused,
    check_submission_order_differs_between_ranks,
    check_broadcast,
    check_allgather,
    check_objects,
    check_barrier,
    check_torch,
    check_errors_before_anything_is_sent,
    check_name_reuse_while_in_flight,
    check_mismatches,
]


#: The sections that need torch: they run only when named, so that the default run needs numpy alone.
TORCH_SECTIONS = {check_torch}


def main(sections: list = SECTIONS, label: str = "ops_check", on_init=None,
         torch_sections: set = TORCH_SECTIONS) -> None:
    """Run ``sections`` (or those named on the command line; sections in ``torch_sections`` only
    when named) and print ``{label} rank R: N cases passed``; ``on_init(rank, size)`` lets another
    worker that shares these helpers learn both."""
    global RANK, SIZE
    gs.init()
    RANK, SIZE = gs.rank(), gs.size()
    if on_init is not None:
        on_init(RANK, SIZE)
    only = set(sys.argv[1:])  # optional: names of sections to run
    unknown = only - {section.__name__ for section in sections}
    assert not unknown, f"no such sections: {sorted(unknown)}"
    chosen = [s for s in sections if s.__name__ in only or (not only and s not in torch_sections)]
    for section in chosen:
        section()
    gs.barrier()
    torch_note = ""
    if not torch_sections & set(chosen):
        # Nor jax: the jax adapter, too, is imported only when a jax array is seen.
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "jax", "jaxlib"))
        expect(not loaded, f"every op ran on numpy arrays, yet a framework was imported: {loaded[:5]}")
        torch_note = "; torch not imported"
    # One write, so that mpiexec does not interleave it with another rank's line.
    sys.stdout.write(f"{label} rank {RANK}: {PASSED} cases passed{torch_note}\n")
    sys.stdout.flush()
    gs.shutdown()


def run_main(sections: list = SECTIONS, label: str = "ops_check", on_init=None,
             torch_sections: set = TORCH_SECTIONS) -> None:
    """:func:`main`, aborting the whole job on any failure so that no rank waits forever."""
    try:
        main(sections, label, on_init, torch_sections)
    except BaseException:  # noqa: BLE001 - whatever failed, the other ranks must not hang
        print(f"{label} rank {MPI.COMM_WORLD.Get_rank()} FAILED:\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(1)


if __name__ == "__main__":
    run_main()
