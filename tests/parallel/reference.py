"""Inputs that every rank can build for every rank, and the numpy references of the collectives.

Every rank builds the inputs of *every* rank from a numpy RNG seeded by (rank, case), so it can
work out what each collective must return with numpy alone. The references are written from the
documented rules (README, docs/architecture.md "Dtype rules"), not from gradsync's own code:

* floating sums, averages and products of float16/bfloat16/float32 are computed in float32
  (float64 in float64) and rounded once to the tensor's dtype; prescale multiplies each input
  before the reduction, postscale the result after it; Average is the sum times
  ``postscale / size`` (one factor, as gradsync folds it into the unpack);
* integer Average is the floor of the exact mean; integer Sum/Product never overflow here (the
  inputs are chosen for that), so the reference needs no wrap-around;
* bool Sum/Max are logical or, Min/Product logical and; bool Average is a TypeError;
* reducescatter gives rank r rows ``sum(counts[:r])`` .. ``sum(counts[:r+1])`` of the allreduce,
  where ``counts[r] = N // size + (r < N % size)``;
* alltoall gives rank r every source rank's block of rows for r, in source rank order.

The inputs are chosen so that every result is exact: floats are multiples of 2**-10 of magnitude
at most 4 (products use a few small dyadic values), so float32 sums are exact in any order and
the comparison can be exact too.

This module imports no deep-learning framework: the torch helpers import torch when called.
"""

from __future__ import annotations

import contextlib
import sys
import zlib
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import gradsync
from gradsync import Average, Max, Min, Product, Sum

#: The world size, known at collection time (before gradsync.init()), for parametrizing by rank.
#: (tests/parallel/conftest.py imported gradsync before this starts MPI, as gradsync needs.)
WORLD_SIZE = MPI.COMM_WORLD.Get_size()

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {
    "float16": np.dtype(np.float16), "bfloat16": BF16, "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64), "uint8": np.dtype(np.uint8), "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16), "int32": np.dtype(np.int32), "int64": np.dtype(np.int64),
    "uint16": np.dtype(np.uint16), "uint32": np.dtype(np.uint32), "uint64": np.dtype(np.uint64),
    "bool": np.dtype(np.bool_),
}
FLOATS = ("float16", "bfloat16", "float32", "float64")
UNSIGNED = ("uint16", "uint32", "uint64")
INTS = ("uint8", "int8", "int16", "int32", "int64") + UNSIGNED
OPS = (Average, Sum, Min, Max, Product)


def valid(dtype: str, op) -> bool:
    """Whether ``op`` applies to ``dtype`` (every pair but the Average of bool)."""
    return not (dtype == "bool" and op == Average)


def dtype_op_params(dtypes=DTYPES, ops=OPS, only_valid: bool = True) -> list:
    """``pytest.param(dtype, op)`` for every pair (the valid ones only, by default), with ids
    such as ``float32-Sum``."""
    return [pytest.param(d, op, id=f"{d}-{op.name}") for d in dtypes for op in ops
            if valid(d, op) or not only_valid]


def pair_params(pairs) -> list:
    """``pytest.param(dtype, op)`` for each ``(dtype, op)`` of ``pairs``, with ids as above."""
    return [pytest.param(d, op, id=f"{d}-{op.name}") for d, op in pairs]


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
    elif op == Sum or (op == Average and dtype in ("int64", "uint64")):
        lo, hi = info.min // 4, info.max // 4  # the sum of up to 4 ranks fits the dtype
    else:  # Min, Max, and Average of the narrow ints, which must not overflow (int64 accumulator)
        lo, hi = info.min, info.max
    return np.asarray(rng.integers(lo, hi, size=shape, dtype=dt, endpoint=True))


def all_inputs(case: str, dtype: str, shape, op=Sum) -> list[np.ndarray]:
    """Every rank's input; ``shape`` is every rank's shape, or a list of one shape per rank."""
    shapes = shape if isinstance(shape, list) else [shape] * WORLD_SIZE
    return [make(case, r, dtype, shapes[r], op) for r in range(WORLD_SIZE)]


def reference_allreduce(inputs: list[np.ndarray], op, prescale=1.0, postscale=1.0) -> np.ndarray:
    """What an allreduce of ``inputs`` (one per rank) with ``op`` and the factors must give."""
    dtype = inputs[0].dtype
    if dtype == np.bool_:
        stacked = np.stack(inputs)
        result = stacked.any(axis=0) if op in (Sum, Max) else stacked.all(axis=0)
        return np.asarray(result, dtype=dtype)
    if name_of(dtype) in FLOATS:
        return _floating_reference(inputs, op, prescale, postscale)
    assert prescale == postscale == 1.0
    stacked = np.stack([x.astype(object) for x in inputs])  # Python's exact integers
    if op == Sum:
        result = stacked.sum(axis=0)
    elif op == Average:
        result = stacked.sum(axis=0) // len(inputs)  # floor of the exact mean
    else:
        result = {Min: stacked.min, Max: stacked.max, Product: stacked.prod}[op](axis=0)
    result = np.asarray(result)
    info = np.iinfo(dtype)
    assert result.size == 0 or (info.min <= result.min() and result.max() <= info.max), \
        "test bug: the reference overflows"
    return result.astype(dtype)


def _floating_reference(inputs: list[np.ndarray], op, prescale: float, postscale: float) -> np.ndarray:
    dtype = inputs[0].dtype
    wide = np.float64 if dtype == np.float64 else np.float32
    stacked = np.stack([x.astype(wide) * wide(prescale) for x in inputs])
    if op in (Sum, Average):
        result = stacked.sum(axis=0)
    else:
        result = {Min: stacked.min, Max: stacked.max, Product: stacked.prod}[op](axis=0)
    # Average: the sum times postscale / size, one factor (docs/architecture.md: the 1/size is
    # folded into the unpack's scale); exact at 1, 2 and 4 ranks, within one ulp of sum / size else.
    scale = postscale / len(inputs) if op == Average else postscale
    result = np.asarray(result * wide(scale), dtype=wide)
    return result.astype(dtype)  # the one rounding to float16/bfloat16


def rows_of(rows: int, rank: int, size: int) -> slice:
    """The rows reducescatter gives ``rank`` of ``size``: the first ``rows % size`` get one more."""
    counts = [rows // size + (r < rows % size) for r in range(size)]
    start = sum(counts[:rank])
    return slice(start, start + counts[rank])


def alltoall_splits(case: str, rank: int) -> list[int]:
    """Rank ``rank``'s uneven splits for ``case``: 0 to 3 rows per destination, zeros included."""
    return rng_for(case + ".splits", rank).integers(0, 4, size=WORLD_SIZE).tolist()


def reference_alltoall(inputs: list[np.ndarray], splits: list[list[int]],
                       rank: int) -> tuple[np.ndarray, list[int]]:
    """What ``rank`` receives: from each source, its block of rows for ``rank``, in source order;
    and how many rows came from each source."""
    blocks = []
    for source, rows in zip(inputs, splits):
        start = sum(rows[:rank])
        blocks.append(source[start:start + rows[rank]])
    return np.concatenate(blocks), [rows[rank] for rows in splits]


def assert_array(got, want: np.ndarray, rtol: float = 0.0, atol: float = 0.0) -> None:
    """``got`` is a numpy array of ``want``'s dtype and shape, equal (or within the tolerance)."""
    assert isinstance(got, np.ndarray), f"got a {type(got)}, not an ndarray"
    assert got.dtype == want.dtype, f"dtype {got.dtype}, want {want.dtype}"
    assert got.shape == want.shape, f"shape {got.shape}, want {want.shape}"
    if name_of(want.dtype) in FLOATS:
        got, want = got.astype(np.float64), want.astype(np.float64)
    if rtol or atol:
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    else:
        np.testing.assert_array_equal(got, want)


def assert_fragments(error: BaseException, *fragments: str) -> None:
    """``error``'s message holds every fragment."""
    for fragment in fragments:
        assert fragment in str(error), f"{fragment!r} not in {str(error)!r}"


@contextlib.contextmanager
def raises(error: type[BaseException], *fragments: str):
    """``with raises(Error, *fragments):`` the block raises ``Error`` whose message holds every
    fragment."""
    with pytest.raises(error) as caught:
        yield
    assert_fragments(caught.value, *fragments)


def assert_rejected_before_sending(error: type[BaseException], call, name: str, *fragments: str,
                                   group: bool = False) -> None:
    """``call()`` raises ``error`` whose message holds every fragment, and queued nothing: ``name``
    is free right after, for an allreduce (a grouped allreduce with ``group``). Every rank is
    expected to make the same mistake; the collective runs before the message is checked, so a
    rank whose message differs fails without leaving the others waiting for it."""
    with pytest.raises(error) as caught:
        call()
    x = np.arange(6, dtype=np.float32)
    freed = gradsync.grouped_allreduce([x], name=name, op=Sum)[0] if group else \
        gradsync.allreduce(x, name=name, op=Sum)
    assert_fragments(caught.value, *fragments)
    assert_array(freed, x * WORLD_SIZE)


@dataclass(frozen=True)
class Joined:
    result: object  # what the op returned on this rank (None on the rank that joined)
    last: int  # what join() returned: the rank that joined last


def beside_a_joined_rank(joined: int, op) -> Joined:
    """Rank ``joined`` joins at once; every other rank runs ``op()`` and joins after it."""
    if gradsync.rank() == joined:
        return Joined(None, gradsync.join())
    try:
        result = op()
    finally:
        last = gradsync.join()  # whatever happened: the joined rank waits for this
    return Joined(result, last)


def assert_unnamed_ops_pair_up(rank: int, size: int, wrap=np.asarray) -> None:
    """Three unnamed Sum allreduces of ``wrap(float64 array)`` (a framework's tensor) and an unnamed
    broadcast_object give every rank the reductions of the same ops of the other ranks: were the
    automatic names shifted on one rank, they would pair wrongly or stall (a StallError)."""
    for i in range(3):
        out = gradsync.allreduce(wrap(np.full(2, float(rank + i))), op=Sum)
        assert_array(np.asarray(out), np.full(2, float(sum(r + i for r in range(size)))))
    assert gradsync.broadcast_object({"from": rank}, root_rank=0) == {"from": 0}


def to_torch(a: np.ndarray):
    """A torch tensor holding a copy of ``a`` (bfloat16 through int16)."""
    import torch

    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def to_numpy(t, dtype: str) -> np.ndarray:
    """``t`` as numpy, after checking that it is a torch tensor of ``dtype`` (a gradsync name)."""
    import torch

    assert isinstance(t, torch.Tensor), f"returns a {type(t)}, not a torch.Tensor"
    assert t.dtype == getattr(torch, dtype), f"dtype {t.dtype}, want {dtype}"
    t = t.contiguous()
    return t.view(torch.int16).numpy().view(BF16) if t.dtype == torch.bfloat16 else t.numpy()


def assert_no_framework_was_imported(session: pytest.Session) -> None:
    """For the last test of a numpy-only file: nothing in this job (gradsync included) imported
    torch or jax (or jaxlib), nor any of their submodules: the core imports an adapter only when
    it first sees one of its arrays. Skips when the session also collected tests marked ``torch``
    or ``jax`` (a run of several files), where those are expected in ``sys.modules``."""
    if any(item.get_closest_marker("torch") or item.get_closest_marker("jax") for item in session.items):
        # (worded without the framework's name: a numpy-only run refuses skips "for want of torch")
        pytest.skip("this session also runs tests marked for a framework, whose imports it expects")
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "jax", "jaxlib"))
    assert not loaded, f"every op ran on numpy arrays, yet a framework was imported: {loaded[:5]}"
