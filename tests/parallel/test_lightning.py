"""gradsync.lightning under mpiexec: the Trainer and Fabric strategies train as one process would.

Every rank also runs the reference itself: single-process Lightning (a single-device strategy)
on the concatenated batch, i.e. the same global batches, in float64 (tests/parallel/
lightning_reference.py). Logging references are numpy.
"""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest

pytestmark = [pytest.mark.torch, pytest.mark.lightning]
RANKS = (1, 2, 4)
TIMEOUT = 240

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")
torchmetrics = pytest.importorskip("torchmetrics")

from lightning.pytorch.callbacks import GradientAccumulationScheduler  # noqa: E402
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402
from lightning.pytorch.strategies import SingleDeviceStrategy  # noqa: E402
from lightning_reference import PER_RANK_BATCH, QUIET, Logged, Regression, validate_logged  # noqa: E402
from lightning_reference import data as _data  # noqa: E402
from lightning_reference import loader as _loader  # noqa: E402
from lightning_reference import net as _net  # noqa: E402
from lightning_reference import params as _params  # noqa: E402
from lightning_reference import shuffled_as_lightning as _shuffled_as_lightning  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import gradsync  # noqa: E402
from gradsync.lightning import GradsyncStrategy  # noqa: E402  (registers strategy="gradsync")

torch.set_num_threads(1)


def _fit(strategy, batch: int, dataset: TensorDataset, ckpt_path=None, model=None, **trainer_args):
    model = model or Regression(seed_offset=gradsync.rank())
    trainer = L.Trainer(strategy=strategy, devices=1, **QUIET, **trainer_args)
    alone = isinstance(strategy, SingleDeviceStrategy)
    loader = _shuffled_as_lightning(dataset, batch) if alone else _loader(dataset, batch)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return model, trainer


TRAINING_CASES = {
    "plain": dict(),
    "clip-norm": dict(gradient_clip_val=0.05, gradient_clip_algorithm="norm"),
    "clip-value": dict(gradient_clip_val=0.01, gradient_clip_algorithm="value"),
    # 3 batches per epoch: a full window of 2 and the epoch's last batch alone
    "accumulate-clip-norm": dict(accumulate_grad_batches=2, gradient_clip_val=0.05),
}


@pytest.mark.parametrize("case_name", list(TRAINING_CASES))
def test_trainer_matches_one_process_on_the_concatenated_batch(case_name, size):
    args = dict(TRAINING_CASES[case_name], max_epochs=2)
    dataset = _data(3 * PER_RANK_BATCH * size)
    model, trainer = _fit("gradsync", PER_RANK_BATCH, dataset, **args)
    reference, _ = _fit(SingleDeviceStrategy(device="cpu"), PER_RANK_BATCH * size, dataset,
                        model=Regression(), **args)
    optimizer = trainer.optimizers[0]
    assert type(optimizer).__name__ == "DistributedSGD"
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)  # StepLR stepped twice
    np.testing.assert_allclose(_params(model), _params(reference), rtol=1e-6, atol=1e-9)


def test_sharded_optimizer_state_with_clipping_matches_one_process(size):
    """strategy="gradsync_zero": ZeroRedundancyOptimizer, clipped by the norm over every shard."""
    args = dict(max_epochs=2, gradient_clip_val=0.05)
    dataset = _data(3 * PER_RANK_BATCH * size)
    model, trainer = _fit("gradsync_zero", PER_RANK_BATCH, dataset, **args)
    reference, _ = _fit(SingleDeviceStrategy(device="cpu"), PER_RANK_BATCH * size, dataset,
                        model=Regression(), **args)
    assert type(trainer.optimizers[0]).__name__ == "ZeroRedundancySGD"
    np.testing.assert_allclose(_params(model), _params(reference), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("options, atol", [
    (dict(comm_hook=gradsync.allreduce_hook), 1e-9),  # buckets, plain average: the same numbers
    (dict(compression=gradsync.Compression.fp16), 1e-3),  # gradients travel as float16
], ids=["allreduce-hook", "fp16-compression"])
def test_communication_options_pass_through_to_the_optimizer(options, atol, size):
    dataset = _data(3 * PER_RANK_BATCH * size)
    model, trainer = _fit(GradsyncStrategy(**options), PER_RANK_BATCH, dataset, max_epochs=1)
    reference, _ = _fit(SingleDeviceStrategy(device="cpu"), PER_RANK_BATCH * size, dataset,
                        model=Regression(), max_epochs=1)
    every_rank = gradsync.allgather_object(_params(model))
    assert all(np.array_equal(every_rank[0], params) for params in every_rank)
    np.testing.assert_allclose(_params(model), _params(reference), rtol=0, atol=atol)


class TwoOptimizers(Regression):
    """Manual optimization: one SGD per layer, both stepped after one manual_backward."""

    def __init__(self, seed_offset: int = 0):
        super().__init__(seed_offset)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.step()

    def configure_optimizers(self):
        return (torch.optim.SGD(self.net[0].parameters(), lr=0.1, momentum=0.9),
                torch.optim.Adam(self.net[2].parameters(), lr=0.01))


def test_manual_optimization_with_two_optimizers_matches_one_process(size):
    dataset = _data(3 * PER_RANK_BATCH * size)
    model, trainer = _fit("gradsync", PER_RANK_BATCH, dataset, model=TwoOptimizers(gradsync.rank()),
                          max_epochs=2)
    reference, _ = _fit(SingleDeviceStrategy(device="cpu"), PER_RANK_BATCH * size, dataset,
                        model=TwoOptimizers(), max_epochs=2)
    assert [type(o).__name__ for o in trainer.optimizers] == ["DistributedSGD", "DistributedAdam"]
    np.testing.assert_allclose(_params(model), _params(reference), rtol=1e-6, atol=1e-9)


class Single(Regression):
    def __init__(self, seed_offset: int = 0):
        super().__init__(seed_offset)
        self.net = self.net.float()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x.float()).float(), y.float())


def _precision(name: str):
    """Trainer arguments: bf16-mixed, or float16 autocast with a GradScaler on the CPU (which
    Trainer(precision="16-mixed") would turn into bf16-mixed there)."""
    if name == "bf16-mixed":
        return dict(precision=name)
    return dict(plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))])


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed-scaled"])
def test_mixed_precision_matches_one_process(precision, size):
    """float32 parameters, 16-bit compute (16-mixed: with a GradScaler, and clipping, which
    unscales first): every rank holds the same parameters, and they are one process's up to
    16-bit rounding (a weight gradient's sum over the batch is rounded in 16 bits, over each
    rank's share here, over the whole batch there)."""
    dataset = _data(3 * PER_RANK_BATCH * size)
    args = dict(max_epochs=1, gradient_clip_val=0.05)
    model, trainer = _fit("gradsync", PER_RANK_BATCH, dataset, model=Single(gradsync.rank()),
                          **args, **_precision(precision))
    reference, _ = _fit(SingleDeviceStrategy(device="cpu"), PER_RANK_BATCH * size, dataset,
                        model=Single(), **args, **_precision(precision))
    assert (trainer.precision_plugin.scaler is not None) == (precision == "16-mixed-scaled")
    every_rank = gradsync.allgather_object(_params(model))
    assert all(np.array_equal(every_rank[0], params) for params in every_rank)
    np.testing.assert_allclose(_params(model), _params(reference), rtol=0, atol=5e-3)


def test_a_gradient_accumulation_schedule_is_followed(size):
    """GradientAccumulationScheduler: 1, then 2, then 4 batches per step, as one process."""
    dataset = _data(4 * PER_RANK_BATCH * size)

    def fit(strategy, batch, model):
        schedule = GradientAccumulationScheduler({0: 1, 1: 2, 2: 4})
        return _fit(strategy, batch, dataset, model=model, max_epochs=3, callbacks=[schedule])

    model, trainer = fit("gradsync", PER_RANK_BATCH, Regression(gradsync.rank()))
    reference, _ = fit(SingleDeviceStrategy(device="cpu"), PER_RANK_BATCH * size, Regression())
    assert trainer.global_step == 4 + 2 + 1
    np.testing.assert_allclose(_params(model), _params(reference), rtol=1e-6, atol=1e-9)


class Recording(Regression):
    """Keeps the first layer's gradient after every backward pass."""

    def __init__(self):
        super().__init__()
        self.grads = []

    def on_after_backward(self):
        self.grads.append(self.net[0].weight.grad.detach().clone().numpy())


def test_accumulating_batches_are_not_averaged_until_the_step(size):
    """accumulate_grad_batches=3: after the first two backward passes of a step each rank holds its
    own gradient (nothing was reduced); the third pass ends with the average on every rank."""
    dataset = _data(6 * PER_RANK_BATCH * size)
    model = Recording()
    _, trainer = _fit("gradsync", PER_RANK_BATCH, dataset, model=model, max_epochs=1,
                      accumulate_grad_batches=3)
    assert trainer.global_step == 2 and len(model.grads) == 6
    every_rank = gradsync.allgather_object(model.grads)  # [rank][pass] -> gradient
    for index in range(6):
        grads = [ranks[index] for ranks in every_rank]
        same = all(np.array_equal(grads[0], g) for g in grads)
        assert same == (index % 3 == 2 or size == 1), f"pass {index}: same on every rank: {same}"


class LoggedWithMetrics(Logged):
    """Also feeds torchmetrics and logs them."""

    def __init__(self):
        super().__init__()
        self.total = torchmetrics.SumMetric().set_dtype(torch.float64)
        self.average = torchmetrics.MeanMetric().set_dtype(torch.float64)

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        (x,) = batch
        self.total.update(x)
        self.average.update(x)
        self.log("metric_sum", self.total, batch_size=len(x))
        self.log("metric_mean", self.average, batch_size=len(x))


def test_sync_dist_sums_means_and_torchmetrics_equal_numpy(size):
    trainer = L.Trainer(strategy="gradsync", devices=1, **QUIET)
    metrics, values = validate_logged(trainer, LoggedWithMetrics(), size)
    # Lightning hands a Metric's value on in float32
    assert metrics["metric_sum"] == pytest.approx(values.sum(), rel=1e-6)
    assert metrics["metric_mean"] == pytest.approx(values.mean(), rel=1e-6)


class Doubling(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(1, 1)

    def predict_step(self, batch, batch_idx):
        return batch[0] * 2


def test_predict_gives_each_rank_its_share_of_the_data(size):
    values = np.arange(16.0)
    trainer = L.Trainer(strategy="gradsync", devices=1, **QUIET)
    loader = DataLoader(TensorDataset(torch.from_numpy(values)), batch_size=PER_RANK_BATCH)
    mine = torch.cat(trainer.predict(Doubling(), loader)).numpy()
    every_rank = gradsync.allgather_object(mine)
    assert len(mine) == 16 // size
    np.testing.assert_array_equal(np.sort(np.concatenate(every_rank)), values * 2)


@pytest.fixture
def shared_dir():
    """A directory of rank 0's, named to every rank (rank 0 writes checkpoints, every rank reads
    them), removed after the test; not pytest's tmp_path, which each rank's session prunes."""
    path = gradsync.broadcast_object(tempfile.mkdtemp(prefix="gradsync-lightning-")
                                     if gradsync.rank() == 0 else None, root_rank=0)
    yield path
    gradsync.barrier()
    if gradsync.rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("strategy", ["gradsync", "gradsync_zero"])
def test_a_checkpoint_resumes_at_this_and_at_one_rank_as_uninterrupted_training(strategy, size, shared_dir):
    """Saved after 2 epochs by rank 0 (ZeRO: the state consolidated there), resumed to 4 epochs
    here and by one process on the concatenated batch."""
    dataset = _data(2 * PER_RANK_BATCH * size)
    path = f"{shared_dir}/two_epochs.ckpt"
    _, trainer = _fit(strategy, PER_RANK_BATCH, dataset, max_epochs=2)
    trainer.save_checkpoint(path)
    resumed, _ = _fit(strategy, PER_RANK_BATCH, dataset, ckpt_path=path, max_epochs=4)
    uninterrupted, _ = _fit(strategy, PER_RANK_BATCH, dataset, max_epochs=4)
    one_process, _ = _fit(SingleDeviceStrategy(device="cpu"), PER_RANK_BATCH * size, dataset,
                          ckpt_path=path, model=Regression(), max_epochs=4)
    np.testing.assert_allclose(_params(resumed), _params(uninterrupted), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(_params(one_process), _params(uninterrupted), rtol=1e-6, atol=1e-9)


def test_devices_that_disagree_with_the_launch_are_refused(size):
    with pytest.raises(ValueError, match=r"devices=3 disagrees with the launch"):
        L.Trainer(strategy="gradsync", devices=3, **QUIET)
    with pytest.raises(ValueError, match=r"num_nodes=2 disagrees with the launch, which runs on 1 host"):
        L.Trainer(strategy="gradsync", devices=1, num_nodes=2, **QUIET)


def _fabric_train(fabric, batch: int, dataset, epochs: int = 1, state=None, accumulate=2, clip=0.05):
    """Fabric's loop: accumulate `accumulate` batches, clip by norm, SGD with momentum; loads
    `state` (a checkpoint path) first when given; returns (model, optimizer)."""
    model = _net()
    with torch.no_grad():
        model[0].weight.add_(fabric.global_rank)  # ranks start apart: setup broadcasts rank 0's
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    if state is not None:
        fabric.load(state, {"model": model, "optimizer": optimizer})
    loader = fabric.setup_dataloaders(_loader(dataset, batch))
    for _ in range(epochs):
        for i, (x, y) in enumerate(loader):
            stepping = (i + 1) % accumulate == 0
            with fabric.no_backward_sync(model, enabled=not stepping):
                fabric.backward(torch.nn.functional.mse_loss(model(x), y) / accumulate)
            if stepping:
                fabric.clip_gradients(model, optimizer, max_norm=clip)
                optimizer.step()
                optimizer.zero_grad()
    return model, optimizer


def _fabric(strategy):
    fabric = L.Fabric(strategy=strategy, devices=1, accelerator="cpu")
    fabric.launch()
    return fabric


def test_fabric_matches_one_process_and_resumes_from_its_checkpoint(size, shared_dir):
    """Accumulation (no_backward_sync) and clipping; a checkpoint saved here resumes here and in
    one process, both as one process trained without interruption."""
    dataset = _data(4 * PER_RANK_BATCH * size)
    path = f"{shared_dir}/fabric.ckpt"
    fabric = _fabric("gradsync")
    model, optimizer = _fabric_train(fabric, PER_RANK_BATCH, dataset)
    assert type(optimizer.optimizer).__name__ == "DistributedSGD"
    fabric.save(path, {"model": model, "optimizer": optimizer})
    resumed, _ = _fabric_train(fabric, PER_RANK_BATCH, dataset, state=path)
    alone = _fabric(L.fabric.strategies.SingleDeviceStrategy(device="cpu"))
    first_epoch, _ = _fabric_train(alone, PER_RANK_BATCH * size, dataset)
    uninterrupted, _ = _fabric_train(alone, PER_RANK_BATCH * size, dataset, epochs=2)
    resumed_alone, _ = _fabric_train(alone, PER_RANK_BATCH * size, dataset, state=path)
    np.testing.assert_allclose(_params(model), _params(first_epoch), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(_params(resumed), _params(uninterrupted), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(_params(resumed_alone), _params(uninterrupted), rtol=1e-6, atol=1e-9)


def test_fabric_refuses_devices_that_disagree_with_the_launch(size):
    with pytest.raises(ValueError, match=r"devices=3 disagrees with the launch"):
        L.Fabric(strategy="gradsync", devices=3, accelerator="cpu")
