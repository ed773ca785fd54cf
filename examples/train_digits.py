"""Data-parallel training of a small MLP on scikit-learn's digits data set with gradsync.

Every rank trains the same model on its own shard of the training set; gradsync averages the
gradients while backward runs, so N ranks take the same steps as one process with an N-times larger
batch. Lines marked ``# gradsync:`` are the ones that make the script data-parallel.

    mpiexec -n 2 python examples/train_digits.py             # 2 ranks
    mpiexec -n 2 python examples/train_digits.py --resume    # continue from the last checkpoint
    mpiexec -n 2 python examples/train_digits.py --comm-hook powersgd --powersgd-rank 2
    mpiexec -n 2 python examples/train_digits.py --zero      # optimizer state sharded (ZeRO-1)
    python examples/train_digits.py                          # a single process works too

Rank 0 draws a progress bar on stderr (``--no-progress``: none) and prints one line per epoch on
stdout; the last line it prints is ``test_accuracy=<float>``.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
from digits import load_split
from torch import nn
from tqdm import tqdm

import gradsync
from gradsync.metrics import Metric


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20,
                        help="total epochs, counting those a resumed checkpoint already trained")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step on each rank")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="learning rate of one process; multiplied by the number of ranks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default="checkpoints/digits.pt")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--zero", action="store_true",
                        help="gradsync.ZeroRedundancyOptimizer: each rank keeps the optimizer "
                             "state of its shard of the parameters only (docs/sharding.md)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: one GPU per process, the host's GPUs taken in turn by local_rank()")
    parser.add_argument("--comm-hook", choices=["none", "allreduce", "fp16", "bf16", "powersgd"],
                        default="none", help="how gradient buckets travel (docs/comm-hooks.md); "
                        "PowerSGD's own state is not in the checkpoint: --resume restarts it")
    parser.add_argument("--powersgd-rank", type=int, default=2,
                        help="rank of PowerSGD's low-rank approximation of each weight matrix")
    parser.add_argument("--powersgd-start-iter", type=int, default=10,
                        help="steps of plain allreduce before PowerSGD starts compressing")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (rank 0 draws one on stderr, also under mpiexec)")
    return parser.parse_args()


def comm_hook(args: argparse.Namespace):
    """The DistributedOptimizer comm_hook that --comm-hook names (None: one allreduce per gradient)."""
    if args.comm_hook == "powersgd":
        return gradsync.PowerSGD(rank=args.powersgd_rank, start_iter=args.powersgd_start_iter)
    return {"none": None, "allreduce": gradsync.allreduce_hook, "fp16": gradsync.fp16_compress_hook,
            "bf16": gradsync.bf16_compress_hook}[args.comm_hook]


def progress_bar(total: int, rank: int, disable: bool) -> tqdm:
    """Rank 0's progress bar, on stderr (stdout carries the results). Under mpiexec no rank's stderr
    is a terminal, though the launcher forwards it to one, so the bar is drawn anyway, at most once
    per second there, so that a log file it lands in gets a line a second, not one per step."""
    on_terminal = sys.stderr.isatty()
    return tqdm(total=total, file=sys.stderr, disable=disable or rank != 0, desc="training",
                unit="step", mininterval=0.1 if on_terminal else 1.0, ncols=None if on_terminal else 80)


def load_data() -> tuple[torch.Tensor, ...]:
    """The same train/test split on every rank (digits.py), as torch tensors."""
    return tuple(torch.from_numpy(a) for a in load_split(np.int64))


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Accuracy on the whole test set: each rank scores its shard, then the counts are summed."""
    x, y = x[gradsync.rank()::gradsync.size()], y[gradsync.rank()::gradsync.size()]
    model.eval()
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).double().mean().item()
    model.train()
    # gradsync: the accuracy over all ranks' shards, each weighted by its number of samples.
    test_accuracy = Metric("test_accuracy")
    test_accuracy.update(accuracy, weight=len(y))
    return test_accuracy.compute()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # one process per core: keep torch from oversubscribing it
    gradsync.init()  # gradsync: start the background coordinator
    rank, size = gradsync.rank(), gradsync.size()
    device = torch.device("cpu")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit(f"rank {rank}: --device cuda, but torch sees no CUDA GPU "
                     "(torch.cuda.is_available() is False)")
        # gradsync: one process per GPU; local_rank() numbers the processes on this host.
        device = torch.device("cuda", gradsync.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)

    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = (t.to(device) for t in load_data())
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    loss_fn = nn.CrossEntropyLoss()
    # gradsync: the batch is `size` times larger than one process's, so is the learning rate.
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=0.9)
    # gradsync: gradients are averaged across ranks during backward(); step() waits for them.
    # With --zero each rank keeps the optimizer state of its own shard of the parameters only.
    if args.zero:
        if args.comm_hook != "none":
            raise SystemExit("--zero takes no --comm-hook (ZeroRedundancyOptimizer reduce-scatters)")
        opt = gradsync.ZeroRedundancyOptimizer(opt, named_parameters=model.named_parameters())
    else:
        opt = gradsync.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                            comm_hook=comm_hook(args))

    start_epoch, optimizer_state = 0, None
    if args.resume and rank == 0:  # only rank 0 reads the file; the broadcasts below share it
        if os.path.exists(args.checkpoint):
            state = torch.load(args.checkpoint, map_location=device)
            model.load_state_dict(state["model"])
            optimizer_state = state["optimizer"]
            start_epoch = state["epoch"] + 1
            print(f"resuming from {args.checkpoint} at epoch {start_epoch + 1}", flush=True)
        else:
            print(f"no checkpoint at {args.checkpoint}; starting from scratch", flush=True)
    # gradsync: every rank starts from rank 0's weights, optimizer state and epoch.
    gradsync.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer_state = gradsync.broadcast_object(optimizer_state, root_rank=0, name="opt_state")
    if optimizer_state is not None:  # the whole state: a ZeRO rank keeps its shard's part
        opt.load_state_dict(optimizer_state)
        for group in opt.param_groups:  # the run may have a different number of ranks
            group["lr"] = args.lr * size
    start_epoch = gradsync.broadcast_object(start_epoch, root_rank=0, name="start_epoch")

    # Every rank takes the same number of full batches per epoch (the remainder is dropped), so no
    # rank waits at a gradient allreduce that another rank never reaches.
    steps = len(y_train) // size // args.batch_size
    progress = progress_bar((args.epochs - start_epoch) * steps, rank, args.no_progress)
    # gradsync: per-sample means over every rank's batches, averaged across ranks when read.
    train_loss, train_acc = Metric("train_loss"), Metric("train_accuracy")
    for epoch in range(start_epoch, args.epochs):
        # A permutation shared by all ranks (same seed), then disjoint shards: indices[rank::size].
        epoch_rng = torch.Generator().manual_seed(args.seed + epoch)
        order = torch.randperm(len(y_train), generator=epoch_rng)
        shard = order[rank::size][:steps * args.batch_size].to(device)
        train_loss.reset()
        train_acc.reset()
        for batch in shard.split(args.batch_size):
            x, y = x_train[batch], y_train[batch]
            opt.zero_grad()
            logits = model(x)
            loss = loss_fn(logits, y)
            loss.backward()
            opt.step()
            train_loss.update(loss.item(), weight=len(y))
            train_acc.update((logits.argmax(1) == y).double().mean().item(), weight=len(y))
            progress.update()

        # gradsync: read the metrics (a collective: every rank computes them, rank 0 prints).
        loss_now, acc_now = train_loss.compute(), train_acc.compute()
        test_acc = evaluate(model, x_test, y_test)
        if args.zero:  # gradsync: every rank sends its shard of the optimizer state to rank 0
            opt.consolidate_state_dict(to=0)
        if rank == 0:  # gradsync: one rank writes the checkpoint
            os.makedirs(os.path.dirname(args.checkpoint) or ".", exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch},
                       args.checkpoint + ".tmp")
            os.replace(args.checkpoint + ".tmp", args.checkpoint)  # never leave a half-written file
            progress.write(f"epoch {epoch + 1}/{args.epochs}: train_loss={loss_now:.4f} "
                           f"train_accuracy={acc_now:.4f} test_accuracy={test_acc:.4f}", file=sys.stdout)
    progress.close()

    final = evaluate(model, x_test, y_test)
    if rank == 0:
        print(f"test_accuracy={final:.4f}", flush=True)


if __name__ == "__main__":
    main()
