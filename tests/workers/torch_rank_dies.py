"""rank_dies.py for the torch.distributed backend: one rank dies while the others train torch's
DDP on ``backend="gradsync"`` (or wait in ``dist.all_reduce``); they must fail, not hang.

    torch_rank_dies.py MODE VICTIM WHEN

MODE: ``exit`` (os._exit(3)) or ``kill`` (SIGKILL to itself). WHEN: ``training`` (DDP steps; the
victim dies before its 4th backward, while the others' backward waits on DDP's bucket allreduce,
which runs from autograd's thread and completes through a future) or ``pending`` (the others wait
in a blocking ``dist.all_reduce`` the victim never issues).

Prints the lines of rank_dies.py (tests/workers/fault_lines.py): ``DIED <time>`` on the victim; on every other rank ``ERROR
<type> <time> | <first line>`` when its torch call failed, then ``AGAIN <type> | <first line>``
for the next call, which must fail at once.
"""

import sys
import time

# Imported before gradsync.init(): a multi-second import holding the GIL after init() would delay
# this rank's liveness messages against the short failure timeout of these tests.
import torch
import torch.distributed as dist
from fault_lines import FaultLines
from torch.nn.parallel import DistributedDataParallel

import gradsync
import gradsync.torch  # noqa: F401 - registers the backend

MODE, VICTIM, WHEN = sys.argv[1], int(sys.argv[2]), sys.argv[3]  # argv[4]: the test's token
LINGER = 1.5

torch.set_num_threads(1)
dist.init_process_group(backend="gradsync", init_method="gradsync://")
lines = FaultLines(dist.get_rank(), MODE)
rank = lines.rank


def training() -> None:
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                                        torch.nn.Linear(32, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    lines.train(model, optimizer, VICTIM)


def pending() -> None:
    if rank == VICTIM:
        time.sleep(0.5)
        lines.die()
    dist.all_reduce(torch.ones(4))


dist.all_reduce(torch.ones(4))  # every rank is up
try:
    {"training": training, "pending": pending}[WHEN]()
except Exception as exc:  # noqa: BLE001 - what torch raises is what this reports
    lines.error(exc)
    try:  # the next call fails too, at once
        dist.all_reduce(torch.ones(4))
    except Exception as again:  # noqa: BLE001
        lines.again(again)
    time.sleep(LINGER)
    sys.exit(1)
lines.say("COMPLETED without an error")
