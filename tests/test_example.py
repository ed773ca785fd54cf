"""The README's examples train to the promised accuracy on 2 ranks; the torch one resumes from its
checkpoint (with DistributedOptimizer and with ZeroRedundancyOptimizer) and shows its progress bar
on rank 0 under mpiexec, the JAX one gives the same accuracy with its update inside jit and
outside, the Lightning one resumes at 1 rank from the checkpoint it wrote at 2."""

import re

import pytest

from mpi_launch import REPO, run_mpi

pytestmark = pytest.mark.mpi
EXAMPLE = REPO / "examples" / "train_digits.py"
JAX_EXAMPLE = REPO / "examples" / "train_digits_jax.py"
TF_EXAMPLE = REPO / "examples" / "train_digits_tf.py"
LIGHTNING_EXAMPLE = REPO / "examples" / "train_digits_lightning.py"
KERAS_EXAMPLE = REPO / "examples" / "train_digits_keras.py"


def final_accuracy(output: str) -> float:
    last = output.strip().splitlines()[-1]
    match = re.fullmatch(r"test_accuracy=([0-9.]+)", last)
    assert match, f"last line is not test_accuracy=<float>: {last!r}"
    return float(match.group(1))


@pytest.mark.torch
def test_digits_example_trains_and_resumes(tmp_path):
    checkpoint = str(tmp_path / "digits.pt")
    # No bar here: the job's stdout and stderr come merged, and the bar's stderr could land last.
    first = run_mpi(EXAMPLE, 2, "--epochs", "20", "--checkpoint", checkpoint, "--no-progress",
                    timeout=240).stdout
    assert final_accuracy(first) >= 0.95, first

    resumed = run_mpi(EXAMPLE, 2, "--epochs", "22", "--checkpoint", checkpoint, "--resume",
                      "--no-progress", timeout=240).stdout
    assert "resuming from" in resumed and "at epoch 21" in resumed, resumed
    assert "epoch 1/22" not in resumed, "resume must not start again from epoch 1"
    assert "epoch 22/22" in resumed, resumed
    assert final_accuracy(resumed) >= 0.95, resumed


@pytest.mark.full  # the fast suite trains the main example; ZeRO-1 is tested in tests/parallel/test_zero.py
@pytest.mark.torch
def test_digits_example_trains_and_resumes_with_sharded_optimizer_state(tmp_path):
    checkpoint = str(tmp_path / "digits.pt")
    first = run_mpi(EXAMPLE, 2, "--zero", "--epochs", "20", "--checkpoint", checkpoint,
                    "--no-progress", timeout=240).stdout
    assert final_accuracy(first) >= 0.95, first
    resumed = run_mpi(EXAMPLE, 2, "--zero", "--epochs", "22", "--checkpoint", checkpoint,
                      "--resume", "--no-progress", timeout=240).stdout
    assert "at epoch 21" in resumed and "epoch 22/22" in resumed, resumed
    assert final_accuracy(resumed) >= 0.95, resumed


@pytest.mark.full  # two more launches of the main example
@pytest.mark.torch  # the example is a torch script
def test_the_progress_bar_shows_on_rank_0_under_mpiexec_unless_switched_off(tmp_path):
    # Under mpiexec no rank's stderr is a terminal; the bar is drawn anyway, by rank 0 alone.
    # 2 epochs of 1347 // 2 ranks // 32 = 21 steps each: 42 steps.
    args = ("--epochs", "2", "--checkpoint", str(tmp_path / "digits.pt"))
    shown = run_mpi(EXAMPLE, 2, *args, timeout=240).stdout
    assert len(re.findall(r"training:   0%\|[^|]*\| 0/42 \[", shown)) == 1, shown  # one bar starts
    assert re.search(r"training: 100%\|[^|]*\| 42/42 \[", shown), shown
    assert "epoch 2/2:" in shown and re.search(r"test_accuracy=[0-9.]+", shown), shown
    hidden = run_mpi(EXAMPLE, 2, *args, "--no-progress", timeout=240).stdout
    assert "42/42" not in hidden and "training:" not in hidden, hidden
    assert final_accuracy(hidden) > 0.5, hidden


@pytest.mark.jax
def test_jax_digits_example_trains_with_its_update_in_jit_and_on_the_host():
    in_jit = run_mpi(JAX_EXAMPLE, 2, timeout=240).stdout
    assert final_accuracy(in_jit) >= 0.95, in_jit
    on_host = run_mpi(JAX_EXAMPLE, 2, "--update", "host", "--epochs", "3", timeout=240).stdout
    three_epochs = [line for line in in_jit.splitlines() if line.startswith("epoch 3/")]
    assert three_epochs and three_epochs[0].replace("3/20", "3/3") in on_host, on_host


@pytest.mark.tensorflow
def test_tensorflow_digits_example_trains_with_its_tape_in_a_tf_function():
    output = run_mpi(TF_EXAMPLE, 2, timeout=240, separate_stderr=True).stdout
    assert "epoch 20/20: " in output, output
    assert final_accuracy(output) >= 0.95, output


@pytest.mark.full  # Lightning is tested in tests/parallel/test_lightning.py
@pytest.mark.torch
@pytest.mark.lightning
def test_lightning_digits_example_trains_at_2_ranks_and_resumes_at_1(tmp_path):
    checkpoint = str(tmp_path / "digits.ckpt")
    # stdout alone: Lightning's warnings go to stderr, from any rank, at any time
    first = run_mpi(LIGHTNING_EXAMPLE, 2, "--checkpoint", checkpoint, "--no-progress",
                    timeout=240, separate_stderr=True).stdout
    assert "epochs=20 steps=440 " in first, first  # 1347 samples / 2 ranks / 32 = 22 steps an epoch
    assert final_accuracy(first) >= 0.95, first
    resumed = run_mpi(LIGHTNING_EXAMPLE, 1, "--checkpoint", checkpoint, "--resume", "--epochs", "22",
                      "--no-progress", timeout=240, separate_stderr=True).stdout
    # 2 more epochs at 1 rank: 1347 / 32 = 43 steps each
    assert "resuming from" in resumed and "epochs=22 steps=526 " in resumed, resumed
    assert final_accuracy(resumed) >= 0.95, resumed


@pytest.mark.keras
@pytest.mark.parametrize("backend", [pytest.param("jax", marks=pytest.mark.jax),
                                     pytest.param("torch", marks=pytest.mark.torch),
                                     pytest.param("tensorflow", marks=pytest.mark.tensorflow)])
def test_keras_digits_example_trains_on_each_backend(backend):
    out = run_mpi(KERAS_EXAMPLE, 2, "--epochs", "10", env={"KERAS_BACKEND": backend}, timeout=240).stdout
    assert final_accuracy(out) >= 0.95, out
