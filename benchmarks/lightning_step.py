"""Lightning step time: GradsyncStrategy vs Lightning's own "ddp" (gloo) vs gradsync without Lightning.

One launch measures all three, side by side, on the same model, in the same processes, the order
rotated on every repeat (so that neither always runs first or last):

    mpiexec -n 2 python benchmarks/lightning_step.py [--model mlp|cnn|transformer] [--steps 30] [--repeats 3]

* ``gradsync-strategy``: ``Trainer(strategy=GradsyncStrategy())``;
* ``ddp``: ``Trainer(strategy="ddp", devices=<ranks on this host>)``: Lightning's DDP on gloo,
  its rendezvous through Lightning's MPIEnvironment (it reads the ranks from mpi4py);
* ``gradsync-plain``: a plain loop with ``gradsync.DistributedOptimizer``, no Lightning, fed by
  the same DataLoader over a DistributedSampler as Lightning's runs.

The models are benchmarks/train_step.py's (``build_model``): batch 32 per rank, SGD with momentum,
``torch.set_num_threads(1)``. A step's time is the interval between two consecutive ends of a
training batch (Lightning: ``on_train_batch_end``; plain: after ``step()``), loading from an
in-memory tensor through a DataLoader included in all three; the first ``--warmup`` steps of each run are dropped.
Rank 0 prints each configuration's median over every repeat's steps, the ratios, and the load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from train_step import BATCH, build_model, make_optimizer, sample_batch

import gradsync
from gradsync.lightning import GradsyncStrategy


class Timed(L.LightningModule):
    """The benchmark model, cross-entropy on random labels, and the time of every batch end."""

    def __init__(self, model_kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.net = build_model(model_kind)
        self.ends: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.ends.append(time.perf_counter())

    def configure_optimizers(self):
        return make_optimizer("sgd", self.net)


def dataset(model_kind: str, steps: int) -> TensorDataset:
    """``steps`` batches of 32 per rank (all ranks' samples: Lightning shards them)."""
    samples = steps * BATCH * gradsync.size()
    return TensorDataset(*sample_batch(model_kind, samples, torch.Generator().manual_seed(1)))


def lightning_steps(strategy, model_kind: str, data: TensorDataset, devices: int) -> list[float]:
    """Step times (ms) of one Trainer.fit over ``data``."""
    module = Timed(model_kind)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=1,
                        enable_progress_bar=False, logger=False, enable_checkpointing=False,
                        enable_model_summary=False)
    trainer.fit(module, DataLoader(data, batch_size=BATCH))
    return [1e3 * (b - a) for a, b in zip(module.ends, module.ends[1:])]


def plain_steps(model_kind: str, data: TensorDataset) -> list[float]:
    """Step times (ms) of the same training with gradsync.DistributedOptimizer and no Lightning,
    fed as Lightning feeds it: a DataLoader over a shuffling DistributedSampler."""
    torch.manual_seed(0)
    model = build_model(model_kind)
    optimizer = gradsync.DistributedOptimizer(make_optimizer("sgd", model),
                                              named_parameters=model.named_parameters())
    gradsync.broadcast_parameters(model.state_dict(), root_rank=0)
    sampler = DistributedSampler(data, num_replicas=gradsync.size(), rank=gradsync.rank())
    ends = []
    for x, y in DataLoader(data, batch_size=BATCH, sampler=sampler):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        ends.append(time.perf_counter())
    return [1e3 * (b - a) for a, b in zip(ends, ends[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["mlp", "cnn", "transformer"], default="mlp")
    parser.add_argument("--steps", type=int, default=30, help="steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps dropped at the start of each run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration")
    args = parser.parse_args()
    torch.set_num_threads(1)
    gradsync.init()
    data = dataset(args.model, args.steps + args.warmup + 1)
    runs = {
        "gradsync-strategy": lambda: lightning_steps(GradsyncStrategy(), args.model, data, 1),
        "ddp": lambda: lightning_steps("ddp", args.model, data, gradsync.local_size()),
        "gradsync-plain": lambda: plain_steps(args.model, data),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for repeat in range(args.repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            times[name] += runs[name]()[args.warmup:]
    if gradsync.rank() == 0:
        report(times, args)


def report(times: dict[str, list[float]], args: argparse.Namespace) -> None:
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"model={args.model} ranks={gradsync.size()} batch={BATCH}/rank steps={args.steps}x"
          f"{args.repeats} load={' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    for name, median in medians.items():
        print(f"{name:18s} median {median:8.2f} ms/step  ({len(times[name])} steps)")
    strategy = medians["gradsync-strategy"]
    print(f"gradsync-strategy / ddp            = {strategy / medians['ddp']:.3f}")
    print(f"gradsync-strategy / gradsync-plain = {strategy / medians['gradsync-plain']:.3f}")


if __name__ == "__main__":
    main()
