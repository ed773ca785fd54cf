"""N-rank training with DistributedOptimizer equals one process training on the concatenated batch.

Every rank also trains the single-process reference itself (same seed, whole global batch).
:func:`train` returns how far its parameters are from the reference's, whether every rank holds
exactly the same parameters (an allgather compared bit for bit), and the names of the gradient
responses of each step. tests/parallel/test_training.py checks these; run as a script (the
launch tests: srun, two hosts) it checks them itself and every rank reports (tests/workers/report.py)
its ``rank``, ``size``, ``worst`` difference and whether the ranks are ``identical``. With --num-groups N it also checks that every step's gradients moved in
exactly N grouped responses (one per reduction group). With --ddp the ranks train instead as an
unchanged torch script does: ``torch.distributed`` on gradsync's backend
(``init_process_group(backend="gradsync", init_method="gradsync://")``) and torch's own
``DistributedDataParallel`` (:func:`train_ddp`); each rank then also reports the ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE`` the rendezvous exported, beside gradsync's local rank and size, and
(``env_before_init``) torchrun's four variables as a torchrun script reads them: after
``import gradsync.torch``, before ``gradsync.init()`` and ``init_process_group``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from report import report

import gradsync

#: torchrun's rank variables, in the order ``env_before_init`` reports them.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class Settings:
    steps: int = 6
    optimizer: str = "sgd"  # or "adam"
    passes: int = 1  # backward_passes_per_step
    batch: int = 8  # samples per rank per backward pass
    num_groups: int = 0  # DistributedOptimizer num_groups


@dataclass(frozen=True)
class Outcome:
    worst: float  # max |parameter - single-process parameter| after the last step
    identical: bool  # every rank holds bit-identical parameters
    gradient_responses: list[list[tuple[str, ...]]]  # per step: the names of each gradient response
    trained: int  # the number of parameters DistributedOptimizer reduces


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.LayerNorm(32),
        torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    model[0].bias.requires_grad_(False)  # a frozen parameter must be skipped consistently
    return model


def make_optimizer(model: torch.nn.Module, settings: Settings) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if settings.optimizer == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)


class _Responses:
    """The names of every response the coordinator executes: it wraps ``run`` of the
    coordinator's response execution (``Coordinator.execution``)."""

    def __init__(self) -> None:
        self.execution = gradsync.process.runtime.get().coordinator.execution
        self.executed: list[tuple[str, ...]] = []
        run = self.execution.run
        self.execution.run = lambda responses, replied_ns: (
            self.executed.extend(response.names for response in responses), run(responses, replied_ns))[1]

    def take_gradients(self) -> list[tuple[str, ...]]:
        grads = [names for names in self.executed if names[0].startswith("grad.")]
        self.executed.clear()
        return grads

    def close(self) -> None:
        del self.execution.run


def _models(rank: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """This rank's model and the single-process reference, from the same seed; the ranks' models
    start from different weights, which the broadcast (or DDP's) must equalise."""
    model, reference = make_model(0), make_model(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank * 0.5)
    return model, reference


def _steps(settings: Settings, rank: int, size: int, reference: torch.nn.Module,
           train_step: Callable[[torch.Tensor, torch.Tensor, torch.nn.Module], None]) -> float:
    """``settings.steps`` steps, each on one global batch of ``settings.passes`` micro-batches of
    ``size * settings.batch`` samples: ``train_step(xs, ys, loss_fn)`` trains this rank on its
    share (``[passes, batch, ...]``), then the reference trains alone on the whole batch."""
    reference_optimizer = make_optimizer(reference, settings)
    data, loss_fn = torch.Generator().manual_seed(1234), torch.nn.CrossEntropyLoss()
    for _ in range(settings.steps):
        xs = torch.randn(settings.passes, size * settings.batch, 12, generator=data)
        ys = torch.randint(0, 3, (settings.passes, size * settings.batch), generator=data)
        mine = slice(rank * settings.batch, (rank + 1) * settings.batch)
        train_step(xs[:, mine], ys[:, mine], loss_fn)
        reference_optimizer.zero_grad()
        for micro in range(settings.passes):
            (loss_fn(reference(xs[micro]), ys[micro]) / settings.passes).backward()
        reference_optimizer.step()


def _worst(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """max |parameter - single-process parameter|."""
    return max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train(settings: Settings) -> Outcome:
    """Train on every rank and, alone, the single-process reference; needs gradsync.init()."""
    rank, size = gradsync.rank(), gradsync.size()
    model, reference = _models(rank)
    gradsync.broadcast_parameters(model.state_dict(), root_rank=0)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = gradsync.DistributedOptimizer(make_optimizer(model, settings), named_parameters=named,
                                              backward_passes_per_step=settings.passes,
                                              num_groups=settings.num_groups)
    gradsync.broadcast_optimizer_state(optimizer, root_rank=0)
    responses, per_step = _Responses(), []

    def train_step(xs: torch.Tensor, ys: torch.Tensor, loss_fn: torch.nn.Module) -> None:
        optimizer.zero_grad()
        for micro in range(settings.passes):
            (loss_fn(model(xs[micro]), ys[micro]) / settings.passes).backward()
        optimizer.step()
        per_step.append(responses.take_gradients())

    try:
        _steps(settings, rank, size, reference, train_step)
    finally:
        responses.close()
    everyone = gradsync.allgather(_flat(model).reshape(1, -1))
    identical = all(torch.equal(everyone[0], everyone[r]) for r in range(size))
    return Outcome(_worst(model, reference), identical, per_step, len(named))


def train_ddp(settings: Settings) -> Outcome:
    """:func:`train` as torch's DDP on gradsync's ``torch.distributed`` backend: DDP broadcasts
    rank 0's parameters at construction and averages the gradients in backward (``no_sync`` for
    all but the last of ``settings.passes`` micro-batches); the ranks' parameters are compared
    through ``dist.all_gather``. Needs gradsync.init() (the rendezvous would call it too)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import gradsync.torch  # noqa: F401 - registers backend "gradsync" and init_method "gradsync://"

    dist.init_process_group(backend="gradsync", init_method="gradsync://")
    rank, size = dist.get_rank(), dist.get_world_size()
    model, reference = _models(rank)
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(model, settings)

    def train_step(xs: torch.Tensor, ys: torch.Tensor, loss_fn: torch.nn.Module) -> None:
        optimizer.zero_grad()
        for micro in range(settings.passes):
            with ddp.no_sync() if micro < settings.passes - 1 else contextlib.nullcontext():
                (loss_fn(ddp(xs[micro]), ys[micro]) / settings.passes).backward()
        optimizer.step()

    _steps(settings, rank, size, reference, train_step)
    flat = _flat(model)
    everyone = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(everyone, flat)
    identical = all(torch.equal(everyone[0], other) for other in everyone)
    dist.destroy_process_group()
    trained = sum(1 for p in model.parameters() if p.requires_grad)
    return Outcome(_worst(model, reference), identical, [], trained)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default=Settings.optimizer)
    parser.add_argument("--passes", type=int, default=Settings.passes, help="backward_passes_per_step")
    parser.add_argument("--batch", type=int, default=Settings.batch, help="samples per rank per backward pass")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--num-groups", type=int, default=Settings.num_groups, help="DistributedOptimizer num_groups")
    parser.add_argument("--ddp", action="store_true", help="torch's DDP on gradsync's torch.distributed backend")
    args = parser.parse_args()
    torch.set_num_threads(1)
    before_init = {}
    if args.ddp:  # a torchrun script reads its place before init_process_group (to pick its GPU)
        importlib.import_module("gradsync.torch")  # as its first line, import gradsync.torch, does
        before_init = {"env_before_init": [os.environ.get(name) for name in TORCHRUN_VARIABLES]}
    gradsync.init()
    rank, size = gradsync.rank(), gradsync.size()
    settings = Settings(args.steps, args.optimizer, args.passes, args.batch, args.num_groups)
    outcome = train_ddp(settings) if args.ddp else train(settings)
    print(f"rank {rank}: max |param - single-process param| = {outcome.worst:.3g}; identical on all ranks: "
          f"{outcome.identical}", flush=True)
    assert outcome.worst <= args.tolerance, f"rank {rank}: parameters differ from single-process by {outcome.worst}"
    assert outcome.identical, f"rank {rank}: ranks hold different parameters"
    assert np.isfinite(outcome.worst)
    if args.num_groups:
        for grads in outcome.gradient_responses:
            assert len(grads) == args.num_groups and all(
                name.startswith("grad.group.") for names in grads for name in names), grads
            assert sum(len(names) for names in grads) == outcome.trained, grads
    local = {}
    if args.ddp:  # what the rendezvous exported for scripts that read torchrun's variables
        local = {"local_rank": gradsync.local_rank(), "local_size": gradsync.local_size(),
                 "env_local_rank": os.environ.get("LOCAL_RANK"),
                 "env_local_world_size": os.environ.get("LOCAL_WORLD_SIZE")}
    gradsync.shutdown()
    report(rank=rank, size=size, worst=outcome.worst, identical=outcome.identical, **local, **before_init)


if __name__ == "__main__":
    main()
