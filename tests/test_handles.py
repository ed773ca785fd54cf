"""Handle completion: one result or one error, seen by every waiter, with or without a timeout."""

from __future__ import annotations

import threading
import time

import pytest

from gradsync.errors import CollectiveError
from gradsync.handles import GroupHandle, Handle


def test_a_pending_handle_times_out_and_stays_pending():
    handle = Handle("x")
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="'x' did not finish within 0.05 s"):
        handle.wait(0.05)
    assert time.monotonic() - start >= 0.04
    assert not handle.done()
    handle.complete(7)
    assert handle.done() and handle.wait(0.0) == 7


def test_every_waiting_thread_gets_the_result():
    handle = Handle("x")
    results: list[object] = []

    def waiter() -> None:
        results.append(handle.wait(10.0))

    threads = [threading.Thread(target=waiter) for _ in range(5)]
    for thread in threads:
        thread.start()
    time.sleep(0.05)
    assert results == [] and not handle.done()
    handle.complete("out")
    for thread in threads:
        thread.join(10.0)
    assert results == ["out"] * 5
    assert handle.wait() == "out" and handle.wait() == "out"  # waiting again returns at once


def test_the_first_completion_wins():
    handle = Handle("x")
    handle.fail(CollectiveError("lost"))
    handle.complete("late")
    for _ in range(2):
        with pytest.raises(CollectiveError, match="lost"):
            handle.wait(1.0)
    other = Handle("y")
    other.complete("first")
    other.fail(CollectiveError("late"))
    assert other.wait() == "first"


def test_a_group_returns_its_members_in_order():
    members = [Handle(f"g.{i}") for i in range(3)]
    group = GroupHandle("g", members)
    for i in (2, 0):
        members[i].complete(i)
    assert not group.done()
    members[1].complete(1)
    assert group.done() and group.wait(1.0) == [0, 1, 2]


def test_a_wait_without_timeout_runs_the_cycles_through_the_runner_first():
    handle, calls = Handle("x"), []

    def runner(waited: Handle, deadline: float | None) -> None:  # caller runs: the cycles run here
        calls.append(("run", deadline))
        waited.complete(5)

    handle.on_wait(lambda: calls.append("hurry"), runner)
    assert handle.wait() == 5
    assert calls == [("run", None)] and not handle.waited  # done by the runner: nothing to hurry


def test_a_wait_with_a_timeout_runs_the_cycles_until_its_deadline_then_hurries_the_queue():
    handle, calls = Handle("x"), []
    handle.on_wait(lambda: calls.append("hurry"), lambda waited, deadline: calls.append(deadline))
    threading.Timer(0.05, handle.complete, args=("late",)).start()
    before = time.monotonic()
    assert handle.wait(10.0) == "late"
    # the runner left without completing it (the other ranks were late): the queue is hurried
    assert len(calls) == 2 and before + 10.0 <= calls[0] <= time.monotonic() + 10.0
    assert calls[1] == "hurry" and handle.waited
    calls.clear()
    assert handle.wait() == "late" and calls == []  # done: neither runs again


def test_a_handle_that_is_done_is_never_hurried():
    handle, calls = Handle("x"), []
    handle.on_wait(lambda: calls.append("hurry"))
    handle.fail(CollectiveError("gone"))
    with pytest.raises(CollectiveError, match="gone"):
        handle.wait()
    assert calls == [] and not handle.waited


def test_done_callbacks_run_once_on_completion_or_at_once_when_already_done():
    handle, seen = Handle("x"), []
    handle.add_done_callback(lambda h: seen.append(("first", h.wait(0.0))))
    handle.add_done_callback(lambda h: seen.append(("second", h.done())))
    assert seen == []
    handle.complete(3)
    handle.complete(4)  # a second completion changes nothing and calls nothing again
    handle.add_done_callback(lambda h: seen.append(("late", h.wait(0.0))))
    assert seen == [("first", 3), ("second", True), ("late", 3)]


def test_a_failed_handle_calls_back_and_a_raising_callback_is_dropped(caplog):
    handle, seen = Handle("x"), []
    handle.add_done_callback(lambda h: 1 / 0)
    handle.add_done_callback(lambda h: seen.append(h.done()))
    handle.fail(CollectiveError("lost"))
    assert seen == [True]
    assert "done callback" in caplog.text and "ZeroDivisionError" in caplog.text


def test_a_group_calls_back_once_its_last_member_is_done():
    members = [Handle("a"), Handle("b")]
    group, seen = GroupHandle("g", members), []
    group.add_done_callback(lambda g: seen.append(g.wait(0.0)))
    members[1].complete("B")
    assert seen == []
    members[0].complete("A")
    assert seen == [["A", "B"]]
    empty: list[object] = []
    GroupHandle("none", []).add_done_callback(lambda g: empty.append(g.name))
    assert empty == ["none"]


def test_a_timed_wait_ends_at_its_deadline_however_long_the_runner_took():
    handle = Handle("x")
    handle.on_wait(lambda: None, lambda waited, deadline: time.sleep(max(0.0, deadline - time.monotonic())))
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="'x'"):
        handle.wait(0.3)  # the runner used the whole timeout: the gate gets what is left, nothing
    assert time.monotonic() - start < 0.5
