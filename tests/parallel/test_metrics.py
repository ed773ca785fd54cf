"""gradsync.metrics against exact references (python Fractions of dyadic inputs).

Rank r's inputs are multiples of powers of two, so every sum gradsync forms in float64 is exact and
its one division is correctly rounded: the results must equal ``float(Fraction)`` exactly. The
last test checks that nothing imported torch: metrics need no framework (their torch scalars are
tested in test_ops_torch.py).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from reference import assert_no_framework_was_imported, raises

import gradsync
from gradsync import metrics

_OPS = (gradsync.Average, gradsync.Sum, gradsync.Min, gradsync.Max, gradsync.Product)


@pytest.mark.parametrize("op", _OPS, ids=lambda op: op.name)
def test_allreduce_scalar_of_ints_is_a_python_float_of_the_exact_result(case, rank, size, op):
    values = [r + 1 for r in range(size)]  # rank r contributes r + 1 (an int)
    want = {"Average": float(Fraction(sum(values), size)), "Sum": float(sum(values)), "Min": 1.0,
            "Max": float(size), "Product": float(np.prod(values))}[op.name]
    got = metrics.allreduce_scalar(rank + 1, name=case, op=op)
    assert type(got) is float and got == want


def test_allreduce_scalar_averages_integers_exactly_not_by_floor_division(case, rank, size):
    assert metrics.allreduce_scalar(np.int64(rank), name=case) == (size - 1) / 2


def test_allreduce_scalar_unnamed_of_a_numpy_float(rank, size):
    assert metrics.allreduce_scalar(np.float32(0.5) * rank) == 0.25 * (size - 1)


@pytest.mark.parametrize(("bad", "fragment"), [([1.0, 2.0], "shape (2,)"), ("1.0", "not a real number")],
                         ids=["a-list", "a-str"])
def test_allreduce_scalar_of_a_non_scalar_is_a_type_error_before_anything_is_sent(case, rank, size,
                                                                                  bad, fragment):
    with raises(TypeError, f"rank {rank}", repr(case), fragment):
        metrics.allreduce_scalar(bad, name=case)
    assert metrics.allreduce_scalar(1.0, name=case, op=gradsync.Sum) == size  # the name is free


def test_average_scalars_averages_every_key_exactly_in_sorted_key_order(case, rank, size):
    def values(r):
        return {"loss": Fraction(r, 4), "count": -r, "scale": Fraction(1, 2 ** r), "one": 1}

    got = metrics.average_scalars({k: float(v) for k, v in reversed(values(rank).items())}, name=case)
    want = {k: float(sum(Fraction(values(r)[k]) for r in range(size)) / size) for k in sorted(values(0))}
    assert got == want and list(got) == sorted(want)


def test_average_scalars_of_nothing_is_an_empty_dict(case):
    assert metrics.average_scalars({}, name=case) == {}


def _needs_two_ranks(size: int) -> None:
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")


def test_average_scalars_with_different_keys_is_a_value_error_on_every_rank(case, rank, size):
    _needs_two_ranks(size)
    with raises(ValueError, f"rank {rank}", repr(case), "ranks passed different keys",
                "rank 0: ['acc', 'loss']", "rank 1: ['accuracy', 'loss']"):
        metrics.average_scalars({"loss": 1.0, ("acc" if rank == 0 else "accuracy"): 0.5}, name=case)


def test_average_scalars_with_different_numbers_of_keys_is_a_collective_error(case, rank, size):
    _needs_two_ranks(size)
    with raises(gradsync.CollectiveError, repr(case), "disagree on shape"):
        metrics.average_scalars({f"k{i}": 1.0 for i in range(rank + 1)}, name=case)


def test_average_scalars_with_a_key_that_is_not_a_str_is_a_type_error(case, rank):
    with raises(TypeError, f"rank {rank}", "str keys"):
        metrics.average_scalars({1: 2.0}, name=case)


def _updates(r: int) -> list[tuple[Fraction, int]]:
    """Rank r's (value, weight) updates: r of them, so rank 0 has none."""
    return [(Fraction(2 * r + k, 8), r + k + 1) for k in range(r)]


def _updated_metric(rank: int) -> metrics.Metric:
    metric = metrics.Metric("m")
    for value, weight in _updates(rank):
        metric.update(float(value), weight=weight)
    return metric


def test_a_metric_is_the_weighted_mean_of_every_ranks_updates(rank, size):
    if size == 1:
        pytest.skip("rank 0 has no updates")
    metric = _updated_metric(rank)
    pairs = [p for r in range(size) for p in _updates(r)]
    got = metric.compute()
    assert metric.local_weight == sum(w for _, w in _updates(rank))
    assert type(got) is float and got == float(sum(v * w for v, w in pairs) / sum(w for _, w in pairs))


def test_reading_a_metric_again_or_adding_weight_0_changes_nothing(rank, size):
    if size == 1:
        pytest.skip("rank 0 has no updates")
    metric = _updated_metric(rank)
    first = metric.compute()
    again = metric.compute()
    metric.update(rank, weight=0.0)
    assert again == first and metric.compute() == first


def test_a_reset_metric_starts_from_nothing(rank, size):
    metric = _updated_metric(rank)
    metric.update(1.0)
    metric.reset()
    metric.update(4.0 * rank)
    assert metric.compute() == 2.0 * (size - 1)


def test_a_metric_without_any_update_is_a_value_error_on_every_rank(rank):
    with raises(ValueError, f"rank {rank}", "'empty'", "total weight 0"):
        metrics.Metric("empty").compute()


def test_an_array_metric_averages_each_element(size, rank):
    metric = metrics.Metric("per_class", shape=(3,))
    metric.update(np.array([rank, 2 * rank, 1.0]), weight=2)
    metric.update([0.0, 0.0, 1.0])
    got = metric.compute()
    total = 3 * size
    assert isinstance(got, np.ndarray) and got.dtype == np.float64, got
    assert got.tolist() == [float(Fraction(2 * sum(range(size)), total)),
                            float(Fraction(4 * sum(range(size)), total)), 1.0]


def test_metric_misuse_is_rejected_on_the_calling_rank_without_changing_the_metric(rank):
    metric = metrics.Metric("misuse")
    with raises(ValueError, f"rank {rank}", "'misuse'", "shape (2,)", "shape is ()"):
        metric.update([1.0, 2.0])
    for bad in (-1.0, float("nan"), float("inf")):
        with raises(ValueError, "'misuse'", "weight="):
            metric.update(1.0, weight=bad)
    with raises(TypeError, "'misuse'", "not a real number"):
        metric.update(None)
    assert metric.local_weight == 0.0


def test_a_metric_needs_a_non_empty_name_and_a_tuple_shape():
    with raises(TypeError, "non-empty str"):
        metrics.Metric("")
    with raises(TypeError, "shape must be a tuple"):
        metrics.Metric("x", shape=3)


def test_no_test_of_this_file_imported_torch_or_jax(request):
    assert_no_framework_was_imported(request.session)
