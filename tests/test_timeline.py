"""The timeline: a valid Chrome trace with every phase, and the summary's arithmetic."""

import json

import pytest

from gradsync import timeline
from mpi_launch import PARALLEL, REPO, run_mpi, run_parallel


def test_summary_counts_fused_allreduce_once_and_measures_overlap():
    events = [
        {"name": "BACKWARD", "ph": "X", "pid": 0, "tid": 1, "ts": 0, "dur": 100},
        # one fused buffer of two tensors: the same interval twice, counted once
        {"name": "ALLREDUCE", "ph": "X", "pid": 0, "tid": 2, "ts": 50, "dur": 100},
        {"name": "ALLREDUCE", "ph": "X", "pid": 0, "tid": 3, "ts": 50, "dur": 100},
        {"name": "CYCLE", "ph": "i", "pid": 0, "tid": 0, "ts": 10},
    ]
    summary = timeline.summarize(events)
    assert summary["allreduce_us"] == 100
    assert summary["overlapped_us"] == 50
    assert summary["overlap_fraction"] == 0.5
    assert summary["phases"]["ALLREDUCE"]["count"] == 2


def test_unterminated_trace_still_loads(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('[\n{"name": "ALLREDUCE", "ph": "X", "pid": 0, "tid": 1, "ts": 1, "dur": 2},\n')
    assert timeline.load(str(path))[0]["dur"] == 2


@pytest.mark.torch
@pytest.mark.mpi
def test_training_writes_every_phase_per_rank(tmp_path):
    pattern = str(tmp_path / "trace.{rank}.json")
    # Every gradient its own allreduce (no small-gradient buckets): the engine fuses the small
    # ones, so the trace has the fusion copies too.
    run_mpi(REPO / "benchmarks" / "train_step.py", 2, "--steps", "3", "--warmup", "1",
            env={"GRADSYNC_TIMELINE": pattern, "GRADSYNC_SMALL_GRADIENT_BYTES": "0"}, timeout=180)
    for rank in (0, 1):
        events = json.loads((tmp_path / f"trace.{rank}.json").read_text())  # strict JSON
        names = {e.get("name") for e in events}
        assert {"NEGOTIATE", "WAIT_FOR_DATA", "MEMCPY_IN_FUSION_BUFFER", "ALLREDUCE",
                "MEMCPY_OUT_FUSION_BUFFER", "BACKWARD", "CYCLE", "thread_name"} <= names, names
        rows = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
        assert "grad.0.weight" in rows and "coordinator" in rows
        summary = timeline.summarize(events)
        assert summary["allreduce_us"] > 0
        assert 0.0 <= summary["overlap_fraction"] <= 1.0


@pytest.mark.mpi
def test_alltoall_reducescatter_and_groups_write_their_phases(tmp_path):
    """Tests of tests/parallel/test_collectives.py, traced: a group of five reducescatters moves in
    one call, the late group of three allreduces in one fusion buffer."""
    pattern = str(tmp_path / "trace.{rank}.json")
    tests = ("alltoall_with_uneven_splits or grouped_reducescatter_gives_each_member or "
             "no_member_of_a_group_runs")
    run_parallel(PARALLEL / "test_collectives.py", 2, "-k", tests, env={"GRADSYNC_TIMELINE": pattern})
    for rank in (0, 1):
        events = json.loads((tmp_path / f"trace.{rank}.json").read_text())
        phases = {(e["name"], e["args"].get("tensors")) for e in events
                  if e.get("ph") == "X" and "tensors" in e.get("args", {})}
        names = {name for name, _ in phases}
        assert {"ALLTOALL", "REDUCESCATTER", "ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER",
                "MEMCPY_OUT_FUSION_BUFFER"} <= names, names
        assert ("REDUCESCATTER", 5) in phases and ("ALLREDUCE", 3) in phases, phases
