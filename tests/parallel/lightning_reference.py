"""What the Lightning files of tests/parallel share: a tiny float64 regression, its data, and the
loaders that make one process's batches equal every rank's batches together.

DistributedSampler (no shuffling) gives rank r the samples r, r + size, ...: batch i of every rank
together is exactly batch i of one process whose batch is ``size`` times larger. Imported by the
files that need Lightning (test_lightning.py, test_torch_distributed_lightning.py), after their
``importorskip``.
"""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

PER_RANK_BATCH = 2
QUIET = dict(enable_progress_bar=False, logger=False, enable_checkpointing=False,
             enable_model_summary=False, accelerator="cpu", num_sanity_val_steps=0)


def data(samples: int, seed: int = 0) -> TensorDataset:
    """``samples`` rows of float64 inputs (4 columns) and targets (1 column)."""
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.normal(size=(samples, 4)))
    y = torch.from_numpy(rng.normal(size=(samples, 1)))
    return TensorDataset(x, y)


def net() -> torch.nn.Module:
    """The regression's network, the same on every call (seeded)."""
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


class Regression(L.LightningModule):
    """A tiny float64 MLP, SGD with momentum and a StepLR schedule (the LR changes every epoch)."""

    def __init__(self, seed_offset: int = 0):
        super().__init__()
        self.net = net()
        if seed_offset:  # ranks start apart: setup must broadcast rank 0's parameters
            with torch.no_grad():
                for p in self.net.parameters():
                    p.add_(seed_offset)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


def loader(dataset: TensorDataset, batch: int) -> DataLoader:
    """A rank's loader before Lightning adds its DistributedSampler."""
    return DataLoader(dataset, batch_size=batch, shuffle=False)


def shuffled_as_lightning(dataset: TensorDataset, batch: int) -> DataLoader:
    """One process's loader in the order Lightning gives a distributed run: it always shuffles
    training data with a DistributedSampler (seed 0, reseeded per epoch), whose permutation rank r
    reads from position r in steps of size; so batch i of every rank together is positions
    i * batch .. (i + 1) * batch of the same permutation."""
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    return DataLoader(dataset, batch_size=batch, sampler=sampler)


def params(module: torch.nn.Module) -> np.ndarray:
    """Every parameter of ``module``, flattened into one array."""
    return np.concatenate([p.detach().reshape(-1).numpy() for p in module.parameters()])


class Logged(L.LightningModule):
    """Logs, per validation batch, the batch's mean, sum and max (``sync_dist``) and gathers the
    batch from every rank (``all_gather``)."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(1, 1)
        self.gathered = []

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        self.log("mean", x.mean(), sync_dist=True, batch_size=len(x))
        self.log("sum", x.sum(), sync_dist=True, reduce_fx="sum", batch_size=len(x))
        self.log("max", x.max(), sync_dist=True, reduce_fx="max", batch_size=len(x))
        self.gathered.append(self.all_gather(x))


def validate_logged(trainer: L.Trainer, module: Logged, size: int) -> tuple[dict, np.ndarray]:
    """Validate ``module`` on 16 values, check its logged mean, sum and max and its gathered
    batches against numpy; returns (the logged metrics, the values)."""
    values = np.random.default_rng(3).normal(size=16)
    dataset = TensorDataset(torch.from_numpy(values))
    [metrics] = trainer.validate(module, DataLoader(dataset, batch_size=PER_RANK_BATCH))
    assert metrics["mean"] == pytest.approx(values.mean(), rel=1e-12)
    assert metrics["sum"] == pytest.approx(values.sum(), rel=1e-12)
    assert metrics["max"] == pytest.approx(values.max(), rel=1e-12)
    gathered = torch.stack(module.gathered)  # (batches, ranks, batch)
    assert gathered.shape == (16 // size // PER_RANK_BATCH, size, PER_RANK_BATCH)
    np.testing.assert_array_equal(np.sort(gathered.numpy().reshape(-1)), np.sort(values))
    return metrics, values
