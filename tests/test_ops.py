"""Every public op, checked against an independent numpy reference on 1, 2 and 4 ranks.

The checks themselves live in tests/workers/ops_check.py (one MPI job runs them all); see its
docstring for what is covered and how the reference is computed. Each rank prints
``ops_check rank R: N cases passed`` once every check passed, and aborts the job otherwise. The jobs
run on numpy arrays alone and end by checking that nothing imported torch; the torch tensor section
runs in a job of its own, from the test marked ``torch``.
"""

from __future__ import annotations

import re

import pytest

from mpi_launch import run_mpi

# Not anchored to line starts: mpiexec may interleave the ranks' output.
SUMMARY = re.compile(r"ops_check rank (\d+): (\d+) cases passed")
NO_TORCH = re.compile(r"ops_check rank (\d+): \d+ cases passed; torch not imported")

# The sections of ops_check.py that involve allreduce, whose execution depends on fusion.
ALLREDUCE_SECTIONS = (
    "check_allreduce_every_dtype_and_op", "check_scale_factors", "check_zero_size_and_scalars",
    "check_non_contiguous", "check_large_tensors", "check_many_small_tensors_fused",
    "check_submission_order_differs_between_ranks",
)


def passed_cases(output: str) -> dict[int, int]:
    """rank -> number of cases that rank reported as passed, where every rank also reported that
    torch was never imported."""
    passed = {int(rank): int(count) for rank, count in SUMMARY.findall(output)}
    assert sorted(int(rank) for rank in NO_TORCH.findall(output)) == sorted(passed), output
    return passed


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_op_matches_the_numpy_reference(n):
    result = run_mpi("ops_check.py", n, timeout=180)
    passed = passed_cases(result.stdout)
    assert sorted(passed) == list(range(n)), f"not every rank finished:\n{result.stdout}"
    # Guards against sections that silently stopped checking anything.
    assert min(passed.values()) > 2000, result.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("threshold", ["0", "4096"])
def test_allreduce_is_right_whatever_the_fusion_threshold(threshold):
    """0 disables fusion (every tensor alone); 4 kB splits the small tensors over many buffers."""
    result = run_mpi("ops_check.py", 2, *ALLREDUCE_SECTIONS, timeout=180,
                     env={"GRADSYNC_FUSION_THRESHOLD": threshold})
    passed = passed_cases(result.stdout)
    assert sorted(passed) == [0, 1], result.stdout
    assert min(passed.values()) > 1000, result.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("capacity", ["0", "3"])
def test_every_op_is_right_without_or_with_a_tiny_response_cache(capacity):
    """0 negotiates everything in full; 3 entries force evictions while requests wait on their bits."""
    result = run_mpi("ops_check.py", 2, timeout=180, env={"GRADSYNC_CACHE_CAPACITY": capacity})
    passed = passed_cases(result.stdout)
    assert sorted(passed) == [0, 1], result.stdout
    assert min(passed.values()) > 2000, result.stdout


@pytest.mark.mpi
@pytest.mark.torch
@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_op_on_torch_tensors_matches_the_numpy_reference(n):
    result = run_mpi("ops_check.py", n, "check_torch", timeout=180)
    passed = {int(rank): int(count) for rank, count in SUMMARY.findall(result.stdout)}
    assert sorted(passed) == list(range(n)), f"not every rank finished:\n{result.stdout}"
    assert min(passed.values()) > 150, result.stdout
    assert "torch not imported" not in result.stdout
