"""gradsync.metrics against exact references (python Fractions of dyadic inputs).

Rank r's inputs are multiples of powers of two, so every sum gradsync forms in float64 is exact and
its one division is correctly rounded: the results must equal ``float(Fraction)`` exactly.
With --torch, only the torch half: CPU torch scalars as inputs.
"""

from fractions import Fraction

import numpy as np
from harness import run_numpy_or_torch_checks, torch_requested

import gradsync
from gradsync import metrics

if torch_requested():
    import torch

    torch.set_num_threads(1)

gradsync.init()
rank, size = gradsync.rank(), gradsync.size()


def raises(exc_type, *fragments):
    """Context manager: the block raises ``exc_type`` with every fragment in its message."""

    class Raises:
        def __enter__(self):
            return self

        def __exit__(self, kind, exc, tb):
            assert kind is not None, f"no {exc_type.__name__} raised"
            assert issubclass(kind, exc_type), f"{kind.__name__} instead of {exc_type.__name__}: {exc}"
            for fragment in fragments:
                assert fragment in str(exc), f"{fragment!r} not in {exc}"
            return True

    return Raises()


def check_allreduce_scalar_every_op():
    values = [r + 1 for r in range(size)]  # rank r contributes r + 1 (an int)
    got = {op.name: metrics.allreduce_scalar(rank + 1, name=f"s.{op.name}", op=op)
           for op in (gradsync.Average, gradsync.Sum, gradsync.Min, gradsync.Max, gradsync.Product)}
    assert got == {"Average": float(Fraction(sum(values), size)), "Sum": float(sum(values)),
                   "Min": 1.0, "Max": float(size), "Product": float(np.prod(values))}, got
    assert all(type(v) is float for v in got.values()), got
    # the exact mean of integers, not the floor an integer allreduce would give
    assert metrics.allreduce_scalar(np.int64(rank), name="s.int") == (size - 1) / 2
    assert metrics.allreduce_scalar(np.float32(0.5) * rank) == 0.25 * (size - 1)  # unnamed


def check_allreduce_scalar_rejects_non_scalars_before_sending():
    with raises(TypeError, f"rank {rank}", "'s.bad'", "shape (2,)"):
        metrics.allreduce_scalar([1.0, 2.0], name="s.bad")
    with raises(TypeError, f"rank {rank}", "'s.bad'", "not a real number"):
        metrics.allreduce_scalar("1.0", name="s.bad")
    assert metrics.allreduce_scalar(1.0, name="s.bad", op=gradsync.Sum) == size  # the name is free


def check_average_scalars():
    values = {"loss": Fraction(rank, 4), "count": -rank, "scale": Fraction(1, 2 ** rank), "one": 1}
    got = metrics.average_scalars({k: float(v) for k, v in reversed(values.items())}, name="avg")
    every = [{"loss": Fraction(r, 4), "count": -r, "scale": Fraction(1, 2 ** r), "one": 1}
             for r in range(size)]
    want = {k: float(sum(Fraction(e[k]) for e in every) / size) for k in sorted(values)}
    assert got == want and list(got) == sorted(values), (got, want)
    assert metrics.average_scalars({}, name="avg.empty") == {}


def check_average_scalars_key_mismatch_fails_on_every_rank():
    if size == 1:
        return
    keys = {"loss": 1.0, ("acc" if rank == 0 else "accuracy"): 0.5}
    with raises(ValueError, f"rank {rank}", "'avg.keys'", "ranks passed different keys",
                "rank 0: ['acc', 'loss']", "rank 1: ['accuracy', 'loss']"):
        metrics.average_scalars(keys, name="avg.keys")
    with raises(gradsync.CollectiveError, "'avg.count'", "disagree on shape"):
        metrics.average_scalars({f"k{i}": 1.0 for i in range(rank + 1)}, name="avg.count")
    with raises(TypeError, f"rank {rank}", "str keys"):
        metrics.average_scalars({1: 2.0}, name="avg.bad")


def updates(r):
    """Rank r's (value, weight) updates: r of them, so rank 0 has none."""
    return [(Fraction(2 * r + k, 8), r + k + 1) for k in range(r)]


def check_metric_is_the_weighted_mean_over_every_rank():
    metric = metrics.Metric("m")
    for value, weight in updates(rank):
        metric.update(float(value), weight=weight)
    assert metric.local_weight == sum(w for _, w in updates(rank))
    pairs = [p for r in range(size) for p in updates(r)]
    if not pairs:  # one rank, which has no updates
        with raises(ValueError, "'m'", "total weight 0"):
            metric.compute()
        return
    want = sum(v * w for v, w in pairs) / sum(w for _, w in pairs)
    got = metric.compute()
    assert type(got) is float and got == float(want), (got, want)
    assert metric.compute() == got  # reading again changes nothing
    metric.update(rank, weight=0.0)  # weight 0 counts for nothing
    assert metric.compute() == got
    metric.reset()
    metric.update(4.0 * rank)
    assert metric.compute() == 2.0 * (size - 1)


def check_metric_without_any_update_fails_on_every_rank():
    metric = metrics.Metric("empty")
    with raises(ValueError, f"rank {rank}", "'empty'", "total weight 0"):
        metric.compute()


def check_array_metric():
    metric = metrics.Metric("per_class", shape=(3,))
    metric.update(np.array([rank, 2 * rank, 1.0]), weight=2)
    metric.update([0.0, 0.0, 1.0])
    got = metric.compute()
    assert isinstance(got, np.ndarray) and got.dtype == np.float64, got
    total = 3 * size
    assert got.tolist() == [float(Fraction(2 * sum(range(size)), total)),
                            float(Fraction(4 * sum(range(size)), total)), 1.0], got


def check_metric_misuse_is_rejected_locally():
    metric = metrics.Metric("misuse")
    with raises(ValueError, f"rank {rank}", "'misuse'", "shape (2,)", "shape is ()"):
        metric.update([1.0, 2.0])
    for bad in (-1.0, float("nan"), float("inf")):
        with raises(ValueError, "'misuse'", "weight="):
            metric.update(1.0, weight=bad)
    with raises(TypeError, "'misuse'", "not a real number"):
        metric.update(None)
    with raises(TypeError, "non-empty str"):
        metrics.Metric("")
    with raises(TypeError, "shape must be a tuple"):
        metrics.Metric("x", shape=3)
    assert metric.local_weight == 0.0


def torch_check_torch_scalars():
    got = metrics.allreduce_scalar(torch.tensor(float(rank)), name="t.scalar")
    assert type(got) is float and got == (size - 1) / 2, got
    metric = metrics.Metric("t.metric")
    loss = (torch.ones(2, requires_grad=True) * rank).sum()  # 2 * rank
    with raises(TypeError, "'t.metric'", "requires grad"):
        metric.update(loss)
    metric.update(loss.detach(), weight=2)
    metric.update(loss.item())
    assert metric.compute() == float(size - 1), metric.compute()
    avg = metrics.average_scalars({"loss": torch.tensor(2.0 * rank)}, name="t.avg")
    assert avg == {"loss": float(size - 1)}, avg


run_numpy_or_torch_checks(globals())
print(f"metrics_check rank {rank}: passed", flush=True)
