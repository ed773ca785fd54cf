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
    handle._set_result(7)
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
    handle._set_result("out")
    for thread in threads:
        thread.join(10.0)
    assert results == ["out"] * 5
    assert handle.wait() == "out" and handle.wait() == "out"  # waiting again returns at once


def test_the_first_completion_wins():
    handle = Handle("x")
    handle._set_error(CollectiveError("lost"))
    handle._set_result("late")
    for _ in range(2):
        with pytest.raises(CollectiveError, match="lost"):
            handle.wait(1.0)
    other = Handle("y")
    other._set_result("first")
    other._set_error(CollectiveError("late"))
    assert other.wait() == "first"


def test_a_group_returns_its_members_in_order():
    members = [Handle(f"g.{i}") for i in range(3)]
    group = GroupHandle("g", members)
    for i in (2, 0):
        members[i]._set_result(i)
    assert not group.done()
    members[1]._set_result(1)
    assert group.done() and group.wait(1.0) == [0, 1, 2]
