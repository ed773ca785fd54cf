"""grouped_allreduce, reducescatter, grouped_reducescatter and alltoall on real MPI jobs.

The checks live in tests/workers/collectives_check.py (numpy references for every dtype and op,
numpy and torch, in place or not, async and blocking, uneven and empty splits; validation and
mismatch errors; a group waiting for its last member; a joined rank). Each rank prints
``collectives_check rank R: N cases passed`` once every check passed, and aborts the job otherwise.
"""

from __future__ import annotations

import json
import re

import pytest

from mpi_launch import run_mpi

pytestmark = pytest.mark.mpi
SUMMARY = re.compile(r"collectives_check rank (\d+): (\d+) cases passed")


def passed_cases(output: str) -> dict[int, int]:
    return {int(rank): int(count) for rank, count in SUMMARY.findall(output)}


@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_new_op_matches_the_numpy_reference(n):
    result = run_mpi("collectives_check.py", n, timeout=300)
    passed = passed_cases(result.stdout)
    assert sorted(passed) == list(range(n)), f"not every rank finished:\n{result.stdout}"
    assert min(passed.values()) > 2000, result.stdout  # no section silently stopped checking


@pytest.mark.torch
@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_new_op_on_torch_tensors(n):
    result = run_mpi("collectives_check.py", n, "check_torch", timeout=300)
    passed = passed_cases(result.stdout)
    assert sorted(passed) == list(range(n)), f"not every rank finished:\n{result.stdout}"
    assert min(passed.values()) > 100, result.stdout


@pytest.mark.parametrize("env", [{"GRADSYNC_CACHE_CAPACITY": "0"}, {"GRADSYNC_CACHE_CAPACITY": "3"},
                                 {"GRADSYNC_FUSION_THRESHOLD": "0"}],
                         ids=["no-cache", "tiny-cache", "no-fusion"])
def test_groups_stay_whole_without_cache_with_evictions_and_without_fusion(env):
    """No cache: negotiated in full; 3 entries: groups larger than the cache keep being evicted;
    threshold 0: a group is still one fused response."""
    sections = ["check_grouped_allreduce_every_dtype_and_op", "check_grouped_reducescatter",
                "check_group_waits_for_its_last_member", "check_mismatches", "check_with_a_joined_rank"]
    result = run_mpi("collectives_check.py", 2, *sections, timeout=300, env=env)
    passed = passed_cases(result.stdout)
    assert sorted(passed) == [0, 1], result.stdout
    assert min(passed.values()) > 1000, result.stdout


def test_timeline_names_the_new_phases(tmp_path):
    pattern = str(tmp_path / "trace.{rank}.json")
    sections = ["check_alltoall_every_dtype", "check_grouped_reducescatter",
                "check_group_waits_for_its_last_member"]
    run_mpi("collectives_check.py", 2, *sections, timeout=300, env={"GRADSYNC_TIMELINE": pattern})
    for rank in (0, 1):
        events = json.loads((tmp_path / f"trace.{rank}.json").read_text())
        phases = {(e["name"], e["args"].get("tensors")) for e in events
                  if e.get("ph") == "X" and "tensors" in e.get("args", {})}
        names = {name for name, _ in phases}
        assert {"ALLTOALL", "REDUCESCATTER", "ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER",
                "MEMCPY_OUT_FUSION_BUFFER"} <= names, names
        # A group of five reducescatters moves in one call; the late group of three in one buffer.
        assert ("REDUCESCATTER", 5) in phases and ("ALLREDUCE", 3) in phases, phases
