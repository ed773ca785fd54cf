"""A Horovod-style elastic training script (examples/elastic/pytorch) for tests/test_elastic.py.

Linear regression on 48 fixed samples, batch 2 per rank, SGD with momentum at ``0.05 * size()``
(rescaled by a reset callback, as Horovod's examples do), a commit after every step. Every rank
appends one JSON line per finished step to ``--log`` (launch, rank, size, epoch, step, the sample
indices it trained on, time); rank 0 saves the final parameters to ``--out``.

Faults, on the first launch only (``GRADSYNC_ELASTIC_RESTART`` 0):
  --kill RANK:STEP    that rank writes ``--kill-slots`` to ``--slots-file`` (the discovery script's
                      source), copies the last commit to ``--commit-copy``, logs the time and
                      SIGKILLs itself at the start of global step STEP.
  --grow-at STEP      rank 0 writes ``--grow-slots`` to ``--slots-file`` at that step and waits for
                      the driver's host-update flag, so the next commit raises HostsUpdatedInterrupt.
On every launch:
  --fail-always       rank 1 raises RuntimeError at step 1.
  --killed-always     rank 1 SIGKILLs itself at step 1.
"""

import os
import signal
import time

import elastic_worker
import torch

import gradsync.torch as hvd
from gradsync.run import store

parser = elastic_worker.parser()
parser.add_argument("--grow-at", type=int)
parser.add_argument("--grow-slots", default="localhost:3")
parser.add_argument("--fail-always", action="store_true")
parser.add_argument("--killed-always", action="store_true")
args = parser.parse_args()

torch.set_num_threads(1)
hvd.init()
LAUNCH = store.restart_count()
BATCH, BASE_LR = 2, 0.05
generator = torch.Generator().manual_seed(1)
inputs = torch.randn(48, 4, generator=generator)
targets = inputs @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(48, 1, generator=generator)
dataset = torch.utils.data.TensorDataset(inputs, targets, torch.arange(48))
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=BASE_LR * hvd.size(), momentum=0.9),
                                     named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=3)
loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)


def on_reset():
    for group in optimizer.param_groups:
        group["lr"] = BASE_LR * hvd.size()


def log(**entry):
    elastic_worker.log(args.log, **entry)


def faults(step):
    """The faults of the command line that are due at the start of global step ``step``."""
    if args.fail_always and hvd.rank() == 1 and step == 1:
        raise RuntimeError("worker failed on purpose")
    if args.killed_always and hvd.rank() == 1 and step == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    elastic_worker.kill_if_due(args, step)
    if LAUNCH == 0 and args.grow_at == step and hvd.rank() == 0:
        args.slots_file.write_text(args.grow_slots + "\n")
        deadline = time.monotonic() + 60
        while not (store.state_dir() / store.HOSTS_UPDATED).exists() and time.monotonic() < deadline:
            time.sleep(0.1)


state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0)
state.register_reset_callbacks([on_reset])


@hvd.elastic.run
def train(state):
    while state.epoch < args.epochs:
        for batch_idx, (x, y, indices) in enumerate(loader):
            faults(state.step)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            log(event="step", epoch=state.epoch, step=state.step, indices=indices.tolist(),
                lr=optimizer.param_groups[0]["lr"])
            state.sampler.record_batch(batch_idx, BATCH)
            state.step += 1
            state.commit()
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.commit()


train(state)
if hvd.rank() == 0 and args.out:
    torch.save({name: p.detach().clone() for name, p in model.state_dict().items()}, args.out)
