"""Data-parallel training of a small MLP on scikit-learn's digits with Lightning and gradsync.

A plain LightningModule; the Trainer gets ``strategy="gradsync"`` and the script is launched by
MPI. Every rank trains on its own share of the training set (Lightning's DistributedSampler);
gradsync averages the gradients while backward runs, so N ranks take the same steps as one process
with an N-times larger batch. Lines marked ``# gradsync:`` are the ones that make it data-parallel.

    mpiexec -n 2 python examples/train_digits_lightning.py              # 2 ranks
    mpiexec -n 2 python examples/train_digits_lightning.py --zero       # sharded optimizer state
    mpiexec -n 1 python examples/train_digits_lightning.py --resume --epochs 25   # any rank count
    python examples/train_digits_lightning.py                           # one process works too

The last line rank 0 prints is ``test_accuracy=<float>``.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import numpy as np
import torch
import torchmetrics
from digits import load_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradsync
import gradsync.lightning  # noqa: F401  gradsync: registers Trainer(strategy="gradsync")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20,
                        help="total epochs, counting those a resumed checkpoint already trained")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step on each rank")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="learning rate of one process; multiplied by the number of ranks")
    parser.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=)")
    parser.add_argument("--precision", default="32-true", help="Trainer(precision=), e.g. bf16-mixed")
    parser.add_argument("--zero", action="store_true",
                        help="strategy gradsync_zero: each rank keeps its shard's optimizer state")
    parser.add_argument("--checkpoint", default="checkpoints/digits_lightning.ckpt")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args()


class Digits(L.LightningModule):
    """An MLP 64 -> 128 -> 10, SGD with momentum and a cosine schedule over the epochs."""

    def __init__(self, lr: float, epochs: int):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        self.test_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        # gradsync: sync_dist averages the epoch's loss over the ranks through gradsync.
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.test_accuracy.update(self.net(x).argmax(1), y)  # synced over the ranks at compute()
        self.log("test_accuracy", self.test_accuracy)

    def configure_optimizers(self):
        # gradsync: the same update as one process on the N-times larger batch needs N times its
        # learning rate (linear scaling), as in examples/train_digits.py.
        lr = self.hparams.lr * gradsync.size()
        optimizer = torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, self.hparams.epochs)]


def loaders(batch_size: int) -> tuple[DataLoader, DataLoader]:
    """The same split on every rank (digits.py). Lightning gives each rank its share (a
    DistributedSampler) under the gradsync strategy."""
    x_train, y_train, x_test, y_test = (torch.from_numpy(a) for a in load_split(np.int64))
    return (DataLoader(TensorDataset(x_train, y_train), batch_size=batch_size, shuffle=True),
            DataLoader(TensorDataset(x_test, y_test), batch_size=256))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # one core per rank
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        strategy="gradsync_zero" if args.zero else "gradsync",  # gradsync: the one change
        accelerator="cpu", max_epochs=args.epochs, accumulate_grad_batches=args.accumulate,
        precision=args.precision, logger=False, enable_checkpointing=False,
        enable_model_summary=False, enable_progress_bar=not args.no_progress)
    train, test = loaders(args.batch_size)
    model = Digits(args.lr, args.epochs)
    resume = args.checkpoint if args.resume else None
    if resume and trainer.is_global_zero:
        print(f"resuming from {resume}", flush=True)
    trainer.fit(model, train, ckpt_path=resume)
    train_loss = float(trainer.callback_metrics["train_loss"])  # averaged over the ranks
    os.makedirs(os.path.dirname(args.checkpoint) or ".", exist_ok=True)
    trainer.save_checkpoint(args.checkpoint)  # written by rank 0; loads at any number of ranks
    [result] = trainer.test(model, test, verbose=False)
    if trainer.is_global_zero:
        print(f"epochs={trainer.current_epoch} steps={trainer.global_step} "
              f"train_loss={train_loss:.4f}")
        print(f"test_accuracy={result['test_accuracy']:.4f}", flush=True)


if __name__ == "__main__":
    main()
