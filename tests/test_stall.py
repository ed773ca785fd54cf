"""The stall inspector, alone (report text, when to ask) and on real jobs (warning, then shutdown)."""

import re

import pytest

from gradsync.engine.liveness import LivenessTiming
from gradsync.engine.stall_inspector import StallClock, StallInspector, heartbeat_interval
from mpi_launch import run_mpi


def test_report_lists_submitting_and_missing_ranks():
    inspector = StallInspector(size=4, check_time=60, shutdown_time=0)
    report, shut = inspector.inspect({"grad.w": {0, 2}, "fresh": {1}, "done": {0, 1, 2, 3}},
                                     {"grad.w": 75.0, "fresh": 5.0, "done": 99.0})
    assert not shut
    assert "'grad.w' (waiting 75.0 s): submitted by rank(s) [0, 2], missing on rank(s) [1, 3]" in report
    assert "fresh" not in report and "done" not in report
    assert report.endswith("set GRADSYNC_STALL_SHUTDOWN_TIME_SECONDS to make them fail with this report "
                           "after that many seconds.")


def test_a_process_sets_report_names_world_ranks():
    inspector = StallInspector(size=3, check_time=1, shutdown_time=0, process_set_id=2,
                               world_ranks=(1, 4, 6))
    report, _ = inspector.inspect({"x": {0, 2}}, {"x": 5.0}, elsewhere={"x": {1: 0}})
    assert ("'x' (waiting 5.0 s): submitted by rank(s) [1, 6], missing on rank(s) [4]; ranks disagree "
            "on process set: rank 1: process set 2, rank 6: process set 2, rank 4: process set 0") in report


def test_report_says_when_it_shuts_down():
    inspector = StallInspector(size=2, check_time=1, shutdown_time=3)
    assert inspector.inspect({"x": {0}}, {"x": 2.0})[1] is False
    report, shut = inspector.inspect({"x": {0}}, {"x": 3.5})
    assert shut and "GRADSYNC_STALL_SHUTDOWN_TIME_SECONDS=3" in report


def test_nothing_stalled_no_report():
    assert StallInspector(2, 1, 0).inspect({"x": {0, 1}}, {"x": 9.0}) == (None, False)


def test_clock_asks_after_check_time_then_every_check_time_and_at_shutdown():
    clock = StallClock(check_time=10, shutdown_time=25)
    assert not clock.due(0.0, 9.9)
    assert clock.due(0.0, 10.0)
    assert not clock.due(0.0, 15.0)
    assert clock.due(0.0, 20.0)
    assert clock.due(0.0, 25.0)  # the shutdown time: ask at once, not at the next check
    assert not clock.due(0.0, 26.0)
    assert not clock.due(None, 27.0)  # nothing pending
    assert not StallClock(0, 0).due(0.0, 1e9)  # disabled


def test_heartbeat_only_when_the_inspector_is_on():
    assert heartbeat_interval(0) is None
    assert heartbeat_interval(60) == 15
    assert heartbeat_interval(1) == 0.25
    assert heartbeat_interval(3600) == 15


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=pytest.mark.full)])
@pytest.mark.parametrize("cache", ["1024", "0"])
def test_stall_warns_then_shuts_down_every_rank(ranks, cache):
    env = {"GRADSYNC_STALL_CHECK_TIME_SECONDS": "1", "GRADSYNC_STALL_SHUTDOWN_TIME_SECONDS": "3",
           "GRADSYNC_CACHE_CAPACITY": cache, "IDLE_SECONDS": "8"}
    out = run_mpi("stall_check.py", ranks, env=env, timeout=90).stdout
    last = ranks - 1
    have = list(range(ranks - 1))
    # The warning, from rank 0, names the tensor and both groups of ranks.
    assert re.search(rf"'only.some' \(waiting \d+\.\d s\): submitted by rank\(s\) {re.escape(str(have))}, "
                     rf"missing on rank\(s\) \[{last}\]", out), out
    # Then every waiting rank failed with the report, within the shutdown time plus a heartbeat or two.
    times = [float(t) for t in re.findall(r"StallError after (\d+\.\d) s", out)]
    assert len(times) == ranks - 1, out
    assert all(3.0 <= t <= 6.0 for t in times), times
    assert "GRADSYNC_STALL_SHUTDOWN_TIME_SECONDS=3" in out
    assert f"rank {last}: after the stall: StallError" in out, out



@pytest.mark.mpi
@pytest.mark.torch
@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=pytest.mark.full)])
def test_a_dist_all_reduce_one_rank_never_issues_fails_every_rank_from_torch(ranks):
    """torch.distributed on gradsync (tests/workers/torch_stall.py): the stall report names the
    torch call and the missing rank, and the waiting ranks' work.wait() raises the StallError."""
    env = {"GRADSYNC_STALL_CHECK_TIME_SECONDS": "1", "GRADSYNC_STALL_SHUTDOWN_TIME_SECONDS": "3",
           "IDLE_SECONDS": "8"}
    out = run_mpi("torch_stall.py", ranks, env=env, timeout=90).stdout
    last = ranks - 1
    assert re.search(rf"'torch\.0\.allreduce\.1\.0' \(waiting \d+\.\d s\): submitted by rank\(s\) "
                     rf"{re.escape(str(list(range(last))))}, missing on rank\(s\) \[{last}\]", out), out
    times = [float(t) for t in re.findall(r"StallError after (\d+\.\d) s", out)]
    assert len(times) == last and all(3.0 <= t <= 6.0 for t in times), out
    assert f"rank {last}: after the stall: StallError" in out, out

@pytest.mark.mpi
@pytest.mark.torch
def test_a_new_group_one_member_never_creates_fails_within_its_timeout():
    """tests/workers/torch_new_group_missing.py: rank 0's ``new_group([0, 1], timeout=2 s)``, which
    rank 1 never calls, raises torch's DistBackendError naming rank 1 after the timeout (the
    communicator's set-up, a collective call, would otherwise wait forever), and the default group
    still sums on both ranks afterwards."""
    out = run_mpi("torch_new_group_missing.py", 2, timeout=90).stdout
    error = re.search(r"rank 0: ERROR (\w+) (\d+\.\d+) \| ([^\n]*)", out)
    assert error is not None, out
    kind, took, message = error.group(1), float(error.group(2)), error.group(3)
    assert kind == "DistBackendError", out
    assert "rank 0: new_group([0, 1]): rank(s) [1] did not call it within 2 s" in message, out
    assert 2.0 <= took <= 6.0, out
    assert "rank 0: AFTER [2.0, 2.0]" in out and "rank 1: AFTER [2.0, 2.0]" in out, out


@pytest.mark.mpi
def test_a_name_submitted_on_different_process_sets_is_reported_as_a_stall():
    env = {"GRADSYNC_STALL_CHECK_TIME_SECONDS": "1", "GRADSYNC_STALL_SHUTDOWN_TIME_SECONDS": "3"}
    out = run_mpi("process_set_mismatch.py", 3, env=env, timeout=120, check=False).stdout
    times = [float(t) for t in re.findall(r"StallError after (\d+\.\d) s", out)]
    assert len(times) == 3, out
    assert max(times) < 15, out


def test_the_heartbeat_follows_the_shortest_deadline_that_is_on():
    assert heartbeat_interval(0, 30) == 7.5  # failure detection alone needs it too
    assert heartbeat_interval(60, 30) == 7.5
    assert heartbeat_interval(2, 30) == 0.5
    assert heartbeat_interval(0, 0) is None


@pytest.mark.parametrize("timeout", [0.5, 3, 30, 600])
def test_liveness_periods_detect_within_the_timeout_without_false_alarms(timeout):
    timing = LivenessTiming.from_timeout(timeout, heartbeat_interval(0, timeout))
    # Worst case to a verdict: blocked within a heartbeat, watching after suspect + a tick, silent
    # for `silence`, noticed a tick later.
    assert timing.heartbeat + timing.suspect + timing.tick + timing.silence + timing.tick <= timeout
    # A live rank's liveness messages are never further apart than the silence that condemns it.
    assert timing.heartbeat + timing.suspect + 2 * timing.tick < timing.silence
