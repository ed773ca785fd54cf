"""Caller runs (GRADSYNC_CALLER_RUNS): a blocking op, or synchronize() of a handle whose
collective has not run, runs the negotiation cycle and the collective in the calling thread when
the coordinator thread is idle. Every test runs with it on and off (the ``caller_runs`` fixture
switches the session's coordinator), and the results must be the same: which thread runs a cycle
changes when cycles happen, never what they decide."""

import threading
import time

import numpy as np
import pytest

import gradsync


@pytest.fixture(params=[True, False], ids=["caller-runs", "coordinator-runs"])
def caller_runs(request):
    """The session's coordinator with caller runs on or off (read when an op is submitted)."""
    coordinator = gradsync.process.runtime.get().coordinator
    before = coordinator.caller_runs
    coordinator.caller_runs = request.param
    yield request.param
    coordinator.caller_runs = before


def mine(rank: int, n: int = 1024) -> np.ndarray:
    return np.arange(n, dtype=np.float64) + 1000.0 * rank


def everyone(n: int = 1024) -> list[np.ndarray]:
    return [mine(r, n) for r in range(gradsync.size())]


def test_blocking_ops_give_the_reference_results(caller_runs):
    rank, size = gradsync.rank(), gradsync.size()
    np.testing.assert_allclose(gradsync.allreduce(mine(rank), name="cr.avg"), np.mean(everyone(), 0))
    np.testing.assert_allclose(gradsync.allreduce(mine(rank), name="cr.sum", op=gradsync.Sum),
                               np.sum(everyone(), 0))
    np.testing.assert_array_equal(gradsync.broadcast(mine(rank), root_rank=size - 1, name="cr.bc"),
                                  mine(size - 1))
    np.testing.assert_array_equal(gradsync.allgather(mine(rank, 3), name="cr.ag"),
                                  np.concatenate(everyone(3)))
    grouped = gradsync.grouped_allreduce([mine(rank, 5), mine(rank, 7)], name="cr.group", op=gradsync.Sum)
    np.testing.assert_allclose(grouped[0], np.sum(everyone(5), 0))
    np.testing.assert_allclose(grouped[1], np.sum(everyone(7), 0))
    gradsync.barrier()


def test_async_ops_submitted_in_rank_dependent_order_then_a_blocking_one(caller_runs):
    rank = gradsync.rank()
    names = [f"cr.order.{i}" for i in range(6)]
    order = names if rank % 2 == 0 else names[::-1]
    handles = {name: gradsync.allreduce_async(mine(rank, 64) + i, name=name, op=gradsync.Sum)
               for i, name in sorted(enumerate(names), key=lambda pair: order.index(pair[1]))}
    blocking = gradsync.allreduce(mine(rank, 8), name="cr.order.blocking", op=gradsync.Sum)
    np.testing.assert_allclose(blocking, np.sum(everyone(8), 0))
    for i, name in enumerate(names):  # waited for in the other order than submitted, on odd ranks
        np.testing.assert_allclose(gradsync.synchronize(handles[name]),
                                   np.sum(everyone(64), 0) + i * gradsync.size())


def test_blocking_ops_run_their_cycles_in_the_caller_only_when_on(caller_runs, cycle_threads):
    rank = gradsync.rank()
    for i in range(20):
        gradsync.allreduce(mine(rank, 16), name=f"cr.where.{i}")
    in_caller = [name for name in cycle_threads if name == threading.current_thread().name]
    if caller_runs:  # the background thread may be inside an idle heartbeat cycle now and then
        assert in_caller, cycle_threads
    else:
        assert not in_caller and cycle_threads, cycle_threads


@pytest.mark.torch
def test_horovod_blocking_ops_are_submitted_as_the_callers_turn(caller_runs, monkeypatch):
    # gradsync.torch's blocking ops are synchronize(*_async(...)): with caller runs they submit in
    # the caller's turn, so the push wakes no thread (wake=False) and the cycle runs in the caller.
    torch = pytest.importorskip("torch")
    import gradsync.torch as hvd

    queue = gradsync.process.runtime.get().coordinator.queue
    wakes: list[bool] = []
    push_all = queue.push_all

    def recorded(entries, wake=True):
        wakes.append(wake)
        return push_all(entries, wake)

    monkeypatch.setattr(queue, "push_all", recorded)
    rank, size = gradsync.rank(), gradsync.size()
    for i in range(10):
        tensor = torch.arange(16, dtype=torch.float64) + 1000.0 * rank
        hvd.allreduce_(tensor, op=hvd.Sum, name=f"cr.hvd.{i}")
        torch.testing.assert_close(tensor, torch.from_numpy(np.sum(everyone(16), 0)))
        gathered = hvd.allgather(torch.full((1,), float(rank)), name=f"cr.hvd.ag.{i}")
        torch.testing.assert_close(gathered, torch.arange(size, dtype=torch.float32))
    assert len(wakes) == 20
    if caller_runs:  # the background thread may be inside an idle heartbeat cycle now and then
        assert wakes.count(True) <= 2, wakes
    else:
        assert all(wakes), wakes


def test_a_handle_already_done_runs_no_cycle(caller_runs, cycle_threads):
    handle = gradsync.allreduce_async(mine(gradsync.rank(), 4), name="cr.done", op=gradsync.Sum)
    gradsync.synchronize(handle)
    ran = len(cycle_threads)
    np.testing.assert_allclose(gradsync.synchronize(handle), np.sum(everyone(4), 0))
    assert len(cycle_threads) == ran


def test_blocking_and_async_ops_from_two_threads(caller_runs):
    rank, rounds = gradsync.rank(), 15
    errors: list[BaseException] = []
    results: dict[str, np.ndarray] = {}

    def blocking():
        try:
            for i in range(rounds):
                results[f"a{i}"] = gradsync.allreduce(mine(rank, 32) + i, name=f"cr.two.a{i}",
                                                      op=gradsync.Sum)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=blocking)
    thread.start()
    handles = [gradsync.allreduce_async(mine(rank, 48) - i, name=f"cr.two.b{i}", op=gradsync.Sum)
               for i in range(rounds)]
    for i, handle in enumerate(handles):
        results[f"b{i}"] = gradsync.synchronize(handle)
    thread.join(120)
    assert not thread.is_alive() and not errors, errors
    size = gradsync.size()
    for i in range(rounds):
        np.testing.assert_allclose(results[f"a{i}"], np.sum(everyone(32), 0) + i * size)
        np.testing.assert_allclose(results[f"b{i}"], np.sum(everyone(48), 0) - i * size)


def test_a_disagreement_fails_the_blocking_op_on_every_rank(caller_runs):
    if gradsync.size() == 1:
        pytest.skip("needs two ranks to disagree")
    shape = 3 + gradsync.rank() % 2
    with pytest.raises(gradsync.CollectiveError, match="cr.bad"):
        gradsync.allreduce(np.zeros(shape), name="cr.bad")
    np.testing.assert_allclose(gradsync.allreduce(mine(gradsync.rank(), 4), name="cr.after"),
                               np.mean(everyone(4), 0))


def test_a_wait_with_a_timeout_leaves_at_its_deadline_and_the_collective_completes_later(caller_runs):
    # Rank 0 waits 0.3 s for a collective the others submit 1 s later: with caller runs its thread
    # runs cycles until the deadline, then leaves in the middle of one (the coordinator thread
    # finishes it); either way the wait times out on time and the collective completes later.
    rank, size = gradsync.rank(), gradsync.size()
    if rank != 0:
        time.sleep(1.0)
    handle = gradsync.allreduce_async(mine(rank, 32), name="cr.late", op=gradsync.Sum)
    if rank == 0 and size > 1:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="cr.late"):
            handle.wait(0.3)
        assert 0.3 <= time.monotonic() - start < 0.9
    np.testing.assert_allclose(gradsync.synchronize(handle), np.sum(everyone(32), 0))
    np.testing.assert_allclose(gradsync.allreduce(mine(rank, 8), name="cr.late.after", op=gradsync.Sum),
                               np.sum(everyone(8), 0))


def test_blocking_ops_run_in_the_caller_with_rank_failure_detection_on(cycle_threads):
    # The session runs with failure detection on (the default at 2 ranks and more): the caller's
    # waits are nonblocking MPI, which the watchdog's verdict can end (tests/test_failures.py).
    coordinator = gradsync.process.runtime.get().coordinator
    assert coordinator.caller_runs and coordinator.turns.guarded == (gradsync.size() > 1)
    rank = gradsync.rank()
    for i in range(20):
        np.testing.assert_allclose(gradsync.allreduce(mine(rank, 16), name=f"cr.guarded.{i}", op=gradsync.Sum),
                                   np.sum(everyone(16), 0))
    in_caller = [name for name in cycle_threads if name == threading.current_thread().name]
    assert len(in_caller) >= 10, cycle_threads


def test_a_large_allreduce_in_the_callers_turn_is_left_to_the_coordinator_thread(cycle_threads):
    # Past 64 KiB an allreduce blocks in MPI (or the shared memory's barriers): a caller whose
    # waits must stay leavable hands that part of the cycle to the coordinator thread.
    rank, n = gradsync.rank(), 1 << 15  # 256 KiB of float64
    result = gradsync.allreduce(mine(rank, n), name="cr.large", op=gradsync.Sum)
    np.testing.assert_allclose(result, np.sum(everyone(n), 0))
    if gradsync.size() > 1:
        assert "gradsync-coordinator" in cycle_threads, cycle_threads


def test_a_guarded_caller_leaves_a_parked_cycle_to_the_coordinator_thread():
    # A cycle parked by one caller may block in MPI (a full negotiation, a large allreduce): a
    # caller whose waits must stay leavable (failure detection on, above one rank) that finds one
    # leaves it to the coordinator thread instead of running it with the lock held.
    coordinator = gradsync.process.runtime.get().coordinator
    ran: list[str] = []
    with coordinator.lock:  # as a caller leaving its turn does, but without waking the thread
        coordinator._parked = lambda: ran.append(threading.current_thread().name) or True
    rank = gradsync.rank()
    np.testing.assert_allclose(gradsync.allreduce(mine(rank, 8), name="cr.parked", op=gradsync.Sum),
                               np.sum(everyone(8), 0))
    guarded = coordinator.turns.guarded
    assert ran == (["gradsync-coordinator"] if guarded else [threading.current_thread().name]), ran
