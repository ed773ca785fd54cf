"""gradsync.metrics: exact results at 1, 2 and 4 ranks (tests/workers/metrics_check.py), errors."""

import pytest

import gradsync
from gradsync import metrics
from mpi_launch import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_metrics_match_exact_references(ranks):
    out = run_mpi("metrics_check.py", ranks, timeout=120).stdout
    assert out.count("metrics_check rank") == ranks, out
    assert out.count("ok check_metric_is_the_weighted_mean_over_every_rank") == ranks, out
    assert out.count("torch not imported") == ranks, out


@pytest.mark.mpi
@pytest.mark.torch
def test_metrics_accept_torch_scalars():
    out = run_mpi("metrics_check.py", 2, "--torch", timeout=120).stdout
    assert out.count("ok torch_check_torch_scalars") == 2, out


def test_before_init_every_collective_helper_raises_not_initialized():
    assert not gradsync.is_initialized()
    with pytest.raises(gradsync.NotInitializedError):
        metrics.allreduce_scalar(1.0)
    with pytest.raises(gradsync.NotInitializedError):
        metrics.average_scalars({"a": 1.0})
    metric = metrics.Metric("x")
    with pytest.raises(gradsync.NotInitializedError):
        metric.update(1.0)
    with pytest.raises(gradsync.NotInitializedError):
        metric.compute()
