"""Lightning's own ``DDPStrategy(process_group_backend="gradsync")`` under mpiexec: torch's DDP on
gradsync's torch.distributed backend, started by Lightning's ``env://`` rendezvous.

Every rank also runs the reference itself: one process (Lightning's single-device strategy) on the
concatenated batch, in float64 (tests/parallel/lightning_reference.py); logging references are
numpy. Each test starts torch.distributed through Lightning and destroys it after.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.torch, pytest.mark.lightning]
RANKS = (1, 2)

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")
dist = pytest.importorskip("torch.distributed")

from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy  # noqa: E402
from lightning_reference import (  # noqa: E402
    PER_RANK_BATCH,
    QUIET,
    Logged,
    Regression,
    data,
    loader,
    params,
    shuffled_as_lightning,
    validate_logged,
)
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import gradsync  # noqa: E402
import gradsync.torch  # noqa: E402,F401 - registers the backend "gradsync"
from gradsync.lightning import GradsyncEnvironment  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def no_process_group_after():
    """Each test starts torch.distributed through Lightning; none is left for the next."""
    assert not dist.is_initialized()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def gradsync_ddp(environment=True) -> dict:
    """Trainer arguments of Lightning's DDPStrategy on gradsync: one device per process on this
    host, one node per host (Lightning's DDP reads its device by local rank)."""
    strategy = DDPStrategy(process_group_backend="gradsync",
                           cluster_environment=GradsyncEnvironment() if environment else None)
    return dict(strategy=strategy, devices=gradsync.local_size(), num_nodes=gradsync.cross_size())


class WrappedModel(L.Callback):
    """Keeps the type of the model the strategy trains (Lightning unwraps it after fit)."""

    def on_train_start(self, trainer, pl_module):
        trainer.wrapped_model_type = type(trainer.strategy.model)


def fit(trainer_args: dict, batch: int, dataset, model, **more):
    trainer = L.Trainer(**trainer_args, **QUIET, **more, callbacks=[WrappedModel()])
    alone = isinstance(trainer.strategy, SingleDeviceStrategy)
    trainer.fit(model, shuffled_as_lightning(dataset, batch) if alone else loader(dataset, batch))
    return trainer


def alone() -> dict:
    """Trainer arguments of the reference: one process, one CPU."""
    return dict(strategy=SingleDeviceStrategy(device="cpu"), devices=1)


@pytest.mark.parametrize("environment", [True, False], ids=["gradsync-environment", "lightnings-own"])
def test_ddp_strategy_trains_like_one_process_on_the_concatenated_batch(environment, size):
    """With GradsyncEnvironment, or with the environment Lightning detects itself (its
    MPIEnvironment under mpiexec); 2 epochs of SGD with momentum, StepLR, gradient clipping."""
    dataset = data(3 * PER_RANK_BATCH * size)
    model = Regression(seed_offset=gradsync.rank())  # DDP's setup broadcasts rank 0's parameters
    trainer = fit(gradsync_ddp(environment), PER_RANK_BATCH, dataset, model, max_epochs=2,
                  gradient_clip_val=0.05)
    assert dist.get_backend() == "gradsync" and dist.get_world_size() == size
    assert trainer.wrapped_model_type is DistributedDataParallel
    reference = Regression()
    fit(alone(), PER_RANK_BATCH * size, dataset, reference, max_epochs=2, gradient_clip_val=0.05)
    np.testing.assert_allclose(params(model), params(reference), rtol=1e-12, atol=1e-12)


def test_accumulated_batches_train_like_one_process(size):
    """accumulate_grad_batches=3: DDP's no_sync for two batches, the average on the third."""
    dataset = data(6 * PER_RANK_BATCH * size)
    model, reference = Regression(), Regression()
    fit(gradsync_ddp(), PER_RANK_BATCH, dataset, model, max_epochs=1, accumulate_grad_batches=3)
    fit(alone(), PER_RANK_BATCH * size, dataset, reference, max_epochs=1, accumulate_grad_batches=3)
    np.testing.assert_allclose(params(model), params(reference), rtol=1e-12, atol=1e-12)


def test_validate_syncs_logged_values_and_gathers_every_ranks_batch(size):
    """self.log(sync_dist=True) and all_gather: torch.distributed's all_reduce and all_gather on
    gradsync, under the validation loop's torch.inference_mode()."""
    validate_logged(L.Trainer(**gradsync_ddp(), **QUIET), Logged(), size)


def test_devices_other_than_the_processes_per_host_are_refused_naming_the_launch(size):
    if size == 1:
        pytest.skip("one process per host is devices=1")
    strategy = DDPStrategy(process_group_backend="gradsync", cluster_environment=GradsyncEnvironment())
    with pytest.raises(ValueError, match=rf"world size 1, but the job was launched with {size} processes"
                                         rf".*devices={size}"):
        L.Trainer(strategy=strategy, devices=1, max_epochs=1, **QUIET)
