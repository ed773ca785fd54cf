"""The PyTorch adapter against independent references, on real MPI jobs.

- N-rank training equals single-process training on the concatenated batch (within 1e-5), and every
  rank ends with bit-identical parameters, also with the gradients reduced in groups (num_groups);
- the first step's check that every rank holds the same parameters.

DistributedOptimizer's other behaviours and misuse errors: tests/parallel/test_optimizer.py.
"""

import pytest

from mpi_launch import run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.torch]


@pytest.mark.parametrize("ranks", [2, 4])
def test_sgd_training_equals_single_process(ranks):
    out = run_mpi("train_equivalence.py", ranks, "--optimizer", "sgd", timeout=180).stdout
    assert out.count("EQUIVALENT") == ranks, out


@pytest.mark.parametrize("ranks", [2, 4])
def test_training_with_num_groups_equals_single_process(ranks):
    out = run_mpi("train_equivalence.py", ranks, "--num-groups", "2", timeout=180).stdout
    assert out.count("EQUIVALENT") == ranks, out


def test_num_groups_with_gradient_accumulation_and_adam():
    out = run_mpi("train_equivalence.py", 2, "--optimizer", "adam", "--passes", "2",
                  "--num-groups", "3", timeout=180).stdout
    assert out.count("EQUIVALENT") == 2, out


def test_adam_with_gradient_accumulation_equals_single_process():
    out = run_mpi("train_equivalence.py", 2, "--optimizer", "adam", "--passes", "2",
                  timeout=180).stdout
    assert out.count("EQUIVALENT") == 2, out


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_the_first_step_warns_when_ranks_hold_different_parameters(ranks):
    # A stall (a check that only some ranks submit) fails the job within seconds, not at the timeout.
    env = {"GRADSYNC_STALL_CHECK_TIME_SECONDS": "2", "GRADSYNC_STALL_SHUTDOWN_TIME_SECONDS": "10"}
    out = run_mpi("parameter_check.py", ranks, env=env, timeout=120).stdout
    assert out.count("parameter_check rank") == ranks, out
