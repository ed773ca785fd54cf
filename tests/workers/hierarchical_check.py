"""Hierarchical allreduce gives exactly the flat allreduce's results.

Run under any launcher and rank layout, with GRADSYNC_HIERARCHICAL_ALLREDUCE=1 in the environment
(the tests: 4 ranks on one host, and 2 hosts x 2 ranks).

1. Backend: an MpiBackend over the host topology (reduce within the host, allreduce among the local
   rank 0 processes, broadcast within the host) against a flat MpiBackend, for every accumulator
   dtype and op, on exact-valued inputs (bit-identical results, equal to a numpy reference built
   from every rank's inputs) and on random floats (close). Counting wrappers around the
   communicators prove the three stages ran and the flat MPI_Allreduce did not.
2. End to end: the same collectives through gradsync (small tensors fused, a large one alone, every
   op and dtype) with ``init()`` (hierarchical from the environment), then again after shutdown
   with ``init(hierarchical_allreduce=False)``: bit-identical to each other, and the large sum equal
   to the numpy reference.

Prints ``hierarchical_check rank R: N cases passed``; aborts the whole job on any failure.
"""

from __future__ import annotations

import itertools
import os
import sys
import traceback
from collections import Counter

import numpy as np
from mpi4py import MPI

import gradsync as gs
from gradsync import Average, Max, Min, Product, Sum
from gradsync.backends.mpi import MpiBackend
from gradsync.process import runtime

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
PASSED = 0
OPS = (Sum, Min, Max, Product)


def expect(condition: bool, what: str) -> None:
    global PASSED
    assert condition, f"rank {RANK}: {what}"
    PASSED += 1


class Counting:
    """Passes every method call on to ``comm`` and counts the calls by method name."""

    def __init__(self, comm: MPI.Comm) -> None:
        self._comm = comm
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str):
        attr = getattr(self._comm, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted


def inputs(rank: int, case: int, dtype: str, n: int, op, logical: bool = False) -> np.ndarray:
    """Rank ``rank``'s input of a case: small values whose sums and products are exact."""
    rng = np.random.default_rng([rank, case])
    if logical or dtype == "bool":
        values = rng.integers(0, 2, n)
        return values.astype(np.bool_ if dtype == "bool" else dtype)
    if op is Product:
        values = rng.choice([1, 2] if dtype == "uint8" else [-2, -1, 1, 2], n)
    elif dtype in ("float16", "float32", "float64"):
        values = rng.integers(-64, 64, n) / 8
    else:
        values = rng.integers(0 if dtype == "uint8" else -8, 8, n)
    return values.astype(dtype)


def reference(case: int, dtype: str, n: int, op, logical: bool = False) -> np.ndarray:
    """What a backend allreduce (Average is a plain sum there) must give, from every rank's input."""
    everyone = np.stack([inputs(r, case, dtype, n, op, logical) for r in range(SIZE)])
    if logical:
        reduce = np.max if op in (Sum, Max) else np.min
    else:
        reduce = {Sum: np.sum, Average: np.sum, Min: np.min, Max: np.max, Product: np.prod}[op]
    return reduce(everyone, axis=0).astype(dtype)


def check_backend() -> None:
    world = MPI.COMM_WORLD
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=RANK)
    cross = world.Split(color=local.Get_rank(), key=RANK)
    local_counted = Counting(local)
    cross_counted = Counting(cross) if local.Get_rank() == 0 else None
    if cross_counted is None:
        cross.Free()
    hier_world = Counting(world.Dup())
    hierarchical = MpiBackend(hier_world, local=local_counted, cross=cross_counted)
    flat = MpiBackend(world.Dup())
    expect(hierarchical.hierarchical and not flat.hierarchical, "hierarchical flag")

    cases = itertools.count()
    for dtype, op, n in itertools.product(("float32", "float64", "int32", "int64", "int8", "uint8"),
                                          (*OPS, Average), (0, 1, 1000)):
        case = next(cases)
        a, b = inputs(RANK, case, dtype, n, op), inputs(RANK, case, dtype, n, op)
        hierarchical.allreduce(a, op)
        flat.allreduce(b, op)
        expect(np.array_equal(a, b), f"{dtype} {op.name} n={n}: hierarchical {a[:4]} != flat {b[:4]}")
        expect(np.array_equal(a, reference(case, dtype, n, op)), f"{dtype} {op.name} n={n} reference")
    for op in OPS:  # bool tensors travel as 0/1 uint8 with logical ops
        case = next(cases)
        a, b = (inputs(RANK, case, "uint8", 500, op, logical=True) for _ in range(2))
        hierarchical.allreduce(a, op, logical=True)
        flat.allreduce(b, op, logical=True)
        expect(np.array_equal(a, b) and np.array_equal(a, reference(case, "uint8", 500, op, True)),
               f"logical {op.name}")
    a = np.random.default_rng([RANK, 7]).standard_normal(300_000)
    b = a.copy()
    hierarchical.allreduce(a, Sum)
    flat.allreduce(b, Sum)
    expect(np.allclose(a, b, rtol=1e-12, atol=1e-12), "random float64 sums agree")

    local_size = local.Get_size()
    calls = local_counted.calls
    expect(calls["Reduce"] > 0 and calls["Bcast"] > 0 if local_size > 1
           else calls["Reduce"] == calls["Bcast"] == 0,
           f"stages 1 and 3 on the host (local size {local_size}): {dict(calls)}")
    if cross_counted is not None:
        used = cross_counted.calls["Allreduce"]
        expect(used > 0 if cross.Get_size() > 1 else used == 0,
               f"stage 2 across {cross.Get_size()} hosts: {dict(cross_counted.calls)}")
    expect(hier_world.calls["Allreduce"] == 0, "the hierarchical backend never used the flat allreduce")
    hierarchical.close()
    hier_world.Free()
    flat.comm.Free()


def collectives() -> list[np.ndarray]:
    """Every op on several dtypes, submitted together (fused), and a large tensor alone, in place."""
    handles = []
    for i, (dtype, op) in enumerate(itertools.product(("float32", "float64", "float16", "int32",
                                                       "bool"), (*OPS, Average))):
        if dtype == "bool" and op is Average:
            continue
        handles.append(gs.allreduce_async(inputs(RANK, 100 + i, dtype, 37 + i, op),
                                          name=f"e2e.{i}", op=op))
    results = [np.asarray(gs.synchronize(h)) for h in handles]
    big = inputs(RANK, 999, "float32", 600_000, Sum)  # 2.4 MB: above the fusion threshold
    gs.allreduce_(big, name="e2e.big", op=Sum)
    expect(np.array_equal(big, reference(999, "float32", 600_000, Sum)), "large sum vs reference")
    return results + [big]


def check_end_to_end() -> None:
    expect(os.environ.get("GRADSYNC_HIERARCHICAL_ALLREDUCE") == "1",
           "the test sets GRADSYNC_HIERARCHICAL_ALLREDUCE=1")
    gs.init()
    expect(runtime.get().backend.hierarchical, "GRADSYNC_HIERARCHICAL_ALLREDUCE=1 is honoured")
    hierarchical = collectives()
    gs.shutdown()
    gs.init(hierarchical_allreduce=False)
    expect(not runtime.get().backend.hierarchical, "init(hierarchical_allreduce=False) is flat")
    flat = collectives()
    gs.shutdown()
    for i, (a, b) in enumerate(zip(hierarchical, flat, strict=True)):
        expect(a.dtype == b.dtype and np.array_equal(a, b), f"collective {i}: {a[:4]} != {b[:4]}")


if __name__ == "__main__":
    try:
        check_backend()
        check_end_to_end()
        sys.stdout.write(f"hierarchical_check rank {RANK}: {PASSED} cases passed\n")
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001 - whatever failed, the other ranks must not hang
        print(f"hierarchical_check rank {RANK} FAILED:\n{traceback.format_exc()}", file=sys.stderr,
              flush=True)
        MPI.COMM_WORLD.Abort(1)
