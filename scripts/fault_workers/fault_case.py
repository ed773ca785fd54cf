"""One scenario of scripts/fault_matrix.py, run on every rank:  fault_case.py SCENARIO

Every rank prints, each as one line prefixed ``rank R:`` (times are time.time(), in seconds):

- ``START <t>``: the fault was caused or the call made here (the matrix measures from the earliest);
- ``ERROR <type> <t> | <first line>``: a gradsync call (or an optimizer call) raised here;
- ``RESULT <t> | <text>``: the scenario's outcome where success is the expected outcome;
- ``WARN <t> | <first line>``: a stall warning logged by gradsync on this rank;
- ``USABLE yes|no | <detail>``: whether a collective after the error gave the exact expected value.

Settings come from the environment (the matrix sets short stall and failure timeouts).
"""

import logging
import os
import sys
import time

import numpy as np

import gradsync as gs

SCENARIO = sys.argv[1]
NEEDS_TORCH = SCENARIO.startswith(("optimizer.", "input.sparse", "failure.user_exception"))
if NEEDS_TORCH:  # before init: importing torch on a loaded machine takes seconds
    import torch

    torch.set_num_threads(1)

gs.init()
rank, size = gs.rank(), gs.size()


def say(line: str) -> None:
    sys.stdout.write(f"rank {rank}: {line}\n")  # one write: the lines of the ranks do not interleave
    sys.stdout.flush()


def start() -> None:
    say(f"START {time.time():.3f}")


def report(exc: BaseException) -> None:
    say(f"ERROR {type(exc).__name__} {time.time():.3f} | {str(exc).splitlines()[0]}")


def result(text: str) -> None:
    say(f"RESULT {time.time():.3f} | {text}")


def usable(name: str = "after") -> None:
    """Every rank allreduces its rank under ``name``; the exact sum proves the job still works."""
    got = gs.allreduce(np.full(4, rank, np.int64), name=name, op=gs.Sum)
    ok = bool(np.all(got == sum(range(size))))
    say(f"USABLE {'yes' if ok else 'no'} | allreduce {name!r} after the error gave {got.tolist()}")


def expect_error(call) -> BaseException | None:
    """Run ``call``, report what it raises (None when it returned)."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the matrix reports whatever was raised
        report(exc)
        return exc
    say(f"RESULT {time.time():.3f} | no error raised")
    return None


# ---- 1. mismatches: every rank submits 'mm' with its own value ---------------------------------

def mismatch(**kwargs_of_rank) -> None:
    start()
    expect_error(lambda: gs.allreduce(**kwargs_of_rank, name="mm"))
    usable("mm")


MISMATCHES = {
    "shape": lambda: mismatch(tensor=np.zeros((rank + 1, 2))),
    "dtype": lambda: mismatch(tensor=np.zeros(3, (np.float32, np.float64)[rank % 2])),
    "op": lambda: mismatch(tensor=np.zeros(3), op=(gs.Sum, gs.Max)[rank % 2]),
    "prescale": lambda: mismatch(tensor=np.zeros(3), prescale_factor=1.0 + rank),
    "postscale": lambda: mismatch(tensor=np.zeros(3), postscale_factor=1.0 + rank),
}


def mismatch_root() -> None:
    start()
    expect_error(lambda: gs.broadcast(np.zeros(3), rank, name="mm"))
    usable("mm")


def mismatch_process_set() -> None:
    """Rank 0 submits 'mm' on the set [0, 1], the others on the global set: a stall report, then
    gradsync stops on every rank; usable means shutdown() and init() start it over."""
    pair = gs.add_process_set([0, 1])
    start()
    expect_error(lambda: gs.allreduce(np.zeros(2), name="mm", process_set=pair if rank == 0 else
                                      gs.global_process_set))
    gs.shutdown()
    gs.init()
    usable("mm")


# ---- 2. stall: the ranks wait on different names --------------------------------------------------

class _WarnLine(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if "stall" in record.getMessage():
            say(f"WARN {record.created:.3f} | {record.getMessage().splitlines()[0]}")


def stall() -> None:
    logging.getLogger("gradsync").addHandler(_WarnLine())
    start()
    expect_error(lambda: gs.allreduce(np.ones(2), name=f"grad.only_on_rank_{rank}"))


# ---- 3. an exception in user code --------------------------------------------------------------

def user_exception() -> None:
    """Rank 1 raises before its second backward; its interpreter exit runs gradsync.shutdown().

    Rank 0 fails in step() or, when the news arrives during its backward(), in a gradient hook."""
    model = torch.nn.Linear(8, 2)
    opt = gs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    for step in range(2):
        if rank == 1 and step == 1:
            start()
            raise ValueError("user code failed on rank 1")

        def train_step() -> None:
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()  # may already fail, from a gradient hook
            opt.step()

        if expect_error(train_step) is not None:
            sys.exit(3)


# ---- 5. join -----------------------------------------------------------------------------------

def join_uneven() -> None:
    """Rank r has r + 1 steps; the last rank's join() call is the start."""
    for _ in range(rank + 1):
        gs.allreduce(np.ones(2), name="step", op=gs.Sum)
    if rank == size - 1:
        start()
    last = gs.join()
    result(f"join() returned {last} (the last rank to join)")
    usable()


def join_broadcast_from_joined_root() -> None:
    if rank == 0:
        gs.join()
    else:
        start()
        expect_error(lambda: gs.broadcast(np.ones(2), root_rank=0, name="from.joined"))
        gs.join()
    usable()


# ---- 6. DistributedOptimizer ---------------------------------------------------------------------

def model_and_optimizer(**kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    return model, gs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          model.named_parameters(), **kwargs)


def loss(model):
    return model(torch.full((3, 4), float(rank))).sum()


def optimizer_second_backward() -> None:
    model, opt = model_and_optimizer(backward_passes_per_step=1)
    loss(model).backward()
    start()
    expect_error(lambda: loss(model).backward())
    opt.step()
    usable()


def optimizer_gradient_changed_in_flight() -> None:
    model, opt = model_and_optimizer(synchronize_in_backward=False)  # Horovod's timing
    loss(model).backward()
    model[2].bias.grad.mul_(2.0)  # while its allreduce is in flight
    start()
    expect_error(opt.step)
    opt.zero_grad()
    loss(model).backward()
    opt.step()
    usable()


def optimizer_two_over_one_parameter() -> None:
    model, _ = model_and_optimizer()
    start()
    expect_error(lambda: gs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                 model.named_parameters()))
    usable()


def optimizer_scheduler_first() -> None:
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    start()
    expect_error(lambda: gs.DistributedOptimizer(opt, model.named_parameters()))
    usable()


# ---- 7. bad input: rejected on rank 0 only, so the name must still pair up afterwards -------------

def rejected_on_rank_0(call) -> None:
    if rank == 0:
        start()
        expect_error(call)
    usable("bad")


def input_duplicate_name() -> None:
    x = np.ones(3)
    if rank == 0:
        first = gs.allreduce_async(x, name="bad", op=gs.Sum)
        start()
        expect_error(lambda: gs.allreduce_async(x, name="bad"))
    gs.barrier()
    if rank != 0:
        first = gs.allreduce_async(x, name="bad", op=gs.Sum)
    ok = bool(np.all(gs.synchronize(first) == size))
    say(f"USABLE {'yes' if ok else 'no'} | the first 'bad' completed with the exact sum")


def input_non_member() -> None:
    pair = gs.add_process_set([0, 1])
    if rank == size - 1:
        start()
        expect_error(lambda: gs.allreduce(np.ones(2), name="bad", process_set=pair))
    usable("bad")


# ---- 8. beside user code -------------------------------------------------------------------------

def forked_child() -> None:
    if rank == 0:
        start()
        pid = os.fork()
        if pid == 0:
            expect_error(lambda: gs.allreduce(np.ones(2), name="from.child"))
            os._exit(0)
        os.waitpid(pid, 0)
    usable()


def user_mpi_traffic() -> None:
    from mpi4py import MPI

    start()
    handles = [gs.allreduce_async(np.full(1000, float(rank)), name=f"bg.{i}", op=gs.Sum) for i in range(50)]
    mine = np.full(1000, float(rank + 1))
    for _ in range(20):
        MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, mine)
        mine /= size
    theirs = all(np.all(gs.synchronize(h) == sum(range(size))) for h in handles)
    ok = theirs and np.allclose(mine, sum(range(1, size + 1)) / size)
    result(f"20 user MPI Allreduces on COMM_WORLD beside 50 gradsync allreduces: "
           f"{'all exact' if ok else 'WRONG'}")


# ---- 9. shutdown ---------------------------------------------------------------------------------

def other_rank_stops(how: str) -> None:
    if rank == size - 1:
        time.sleep(0.5)
        start()
        if how == "shutdown":
            gs.shutdown()
        sys.exit(0)  # interpreter exit runs gradsync.shutdown() too
    expect_error(lambda: gs.allreduce(np.ones(2), name="pending"))


def init_after_shutdown() -> None:
    gs.shutdown()
    start()
    expect_error(lambda: gs.allreduce(np.ones(2), name="after.shutdown"))
    gs.init()
    usable()


SCENARIOS = {
    **{f"mismatch.{field}": run for field, run in MISMATCHES.items()},
    "mismatch.root": mismatch_root,
    "mismatch.process_set": mismatch_process_set,
    "stall": stall,
    "failure.user_exception": user_exception,
    "join.uneven": join_uneven,
    "join.broadcast_from_joined_root": join_broadcast_from_joined_root,
    "optimizer.second_backward": optimizer_second_backward,
    "optimizer.gradient_changed_in_flight": optimizer_gradient_changed_in_flight,
    "optimizer.two_over_one_parameter": optimizer_two_over_one_parameter,
    "optimizer.scheduler_first": optimizer_scheduler_first,
    "input.dtype": lambda: rejected_on_rank_0(lambda: gs.allreduce(np.ones(2, np.complex64), name="bad")),
    "input.sparse": lambda: rejected_on_rank_0(lambda: gs.allreduce(torch.eye(3).to_sparse(), name="bad")),
    "input.duplicate_name": input_duplicate_name,
    "input.root_rank": lambda: rejected_on_rank_0(lambda: gs.broadcast(np.ones(2), size, name="bad")),
    "input.non_member": input_non_member,
    "beside.forked_child": forked_child,
    "beside.user_mpi": user_mpi_traffic,
    "shutdown.other_rank_shuts_down": lambda: other_rank_stops("shutdown"),
    "shutdown.other_rank_exits": lambda: other_rank_stops("exit"),
    "shutdown.init_after_shutdown": init_after_shutdown,
}

SCENARIOS[SCENARIO]()
gs.shutdown()
