"""One rank dies (or its coordinator fails); the others must fail with RankFailureError, not hang.

    rank_dies.py MODE VICTIM WHEN

MODE: ``exit`` (os._exit(3)), ``exit0`` (os._exit(0)), ``kill`` (SIGKILL to itself), or ``coordinator``
(nobody dies: before init() this worker patches the coordinator's cycle so that rank VICTIM's
coordinator thread raises at its FAULT_CYCLE-th cycle; the library itself has no fault hook).
WHEN: ``pending`` (the others wait on an allreduce the victim never submits), ``training``
(DistributedOptimizer steps; the victim dies before its 4th backward), ``data`` (the victim dies
inside a 128 MiB allreduce that the others are inside too), ``steps`` (small allreduces in a loop),
``set`` (ranks 1.. form a process set; its members wait on an allreduce on it, rank 0 on the global
set, and the victim never submits either).

The victim prints ``DIED <time>`` just before it dies; every other rank prints one line
``ERROR <type> <time> | <first line of the message>`` when its gradsync call fails (time.time(),
in seconds). A rank then waits LINGER seconds before exiting: its exit aborts the MPI job (that is
the behaviour under test), which would otherwise cut short a slower survivor's report.
"""

import sys
import threading
import time

import numpy as np
from fault_lines import FaultLines

import gradsync

MODE, VICTIM, WHEN = sys.argv[1], int(sys.argv[2]), sys.argv[3]  # argv[4]: the test's token
LINGER = 1.5
FAULT_CYCLE = 5


def inject_coordinator_fault() -> None:
    """Make the global set's coordinator of world rank VICTIM raise at its FAULT_CYCLE-th cycle."""
    from gradsync.engine.coordinator import Coordinator

    cycle, count = Coordinator.cycle, [0]

    def faulty_cycle(self):
        if self.world_rank == VICTIM and self.process_set_id == 0:
            count[0] += 1
            if count[0] == FAULT_CYCLE:
                raise RuntimeError(f"fault injected at cycle {FAULT_CYCLE}")
        return cycle(self)

    Coordinator.cycle = faulty_cycle


if MODE == "coordinator":
    inject_coordinator_fault()
if WHEN == "training":
    # Imported before init(): a multi-second import holding the GIL after init() would delay this
    # rank's liveness messages against the short failure timeout of these tests.
    import torch

gradsync.init()
rank, size = gradsync.rank(), gradsync.size()
lines = FaultLines(rank, MODE)


def pending() -> None:
    if rank == VICTIM:
        time.sleep(0.5)
        lines.die()
    gradsync.synchronize(gradsync.allreduce_async(np.ones(4), name="pending"))


def training() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    optimizer = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                              model.named_parameters())
    lines.train(model, optimizer, VICTIM)


def data() -> None:
    big = np.ones(32 << 20, np.float32)  # 128 MiB: the allreduce takes far longer than 2 ms
    if rank == VICTIM:
        backend = gradsync.process.runtime.get().backend
        real = backend.allreduce

        def dying_allreduce(buffer, op, logical=False):
            if buffer.nbytes >= big.nbytes:
                threading.Timer(0.002, lines.die).start()
            return real(buffer, op, logical)

        backend.allreduce = dying_allreduce
    gradsync.allreduce_(big, name="big", op=gradsync.Sum)


def in_a_set() -> None:
    members = gradsync.add_process_set(range(1, size))
    if rank == VICTIM:
        time.sleep(0.5)
        lines.die()
    process_set = members if rank in members.ranks else gradsync.global_process_set
    gradsync.synchronize(gradsync.allreduce_async(np.ones(4), name="pending", process_set=process_set))


def steps() -> None:
    for _ in range(1000):
        gradsync.allreduce(np.ones(4), name="step")


gradsync.allreduce(np.ones(4), name="warm")  # every rank is up
try:
    {"pending": pending, "training": training, "data": data, "steps": steps, "set": in_a_set}[WHEN]()
except gradsync.GradsyncError as exc:
    lines.error(exc)
    try:  # the next call fails too, at once
        gradsync.allreduce(np.ones(4), name="after")
    except gradsync.GradsyncError as again:
        lines.again(again)
    time.sleep(LINGER)
    sys.exit(1)
lines.say("COMPLETED without an error")
