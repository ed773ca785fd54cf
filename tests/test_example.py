"""The README's examples train to the promised accuracy on 2 ranks; the torch one resumes from its
checkpoint, the JAX one gives the same accuracy with its update inside jit and outside."""

import re

import pytest

from mpi_launch import REPO, run_mpi

pytestmark = pytest.mark.mpi
EXAMPLE = REPO / "examples" / "train_digits.py"
JAX_EXAMPLE = REPO / "examples" / "train_digits_jax.py"


def final_accuracy(output: str) -> float:
    last = output.strip().splitlines()[-1]
    match = re.fullmatch(r"test_accuracy=([0-9.]+)", last)
    assert match, f"last line is not test_accuracy=<float>: {last!r}"
    return float(match.group(1))


@pytest.mark.torch
def test_digits_example_trains_and_resumes(tmp_path):
    checkpoint = str(tmp_path / "digits.pt")
    first = run_mpi(EXAMPLE, 2, "--epochs", "20", "--checkpoint", checkpoint, timeout=240).stdout
    assert final_accuracy(first) >= 0.95, first

    resumed = run_mpi(EXAMPLE, 2, "--epochs", "22", "--checkpoint", checkpoint, "--resume",
                      timeout=240).stdout
    assert "resuming from" in resumed and "at epoch 21" in resumed, resumed
    assert "epoch 1/22" not in resumed, "resume must not start again from epoch 1"
    assert "epoch 22/22" in resumed, resumed
    assert final_accuracy(resumed) >= 0.95, resumed


@pytest.mark.jax
def test_jax_digits_example_trains_with_its_update_in_jit_and_on_the_host():
    in_jit = run_mpi(JAX_EXAMPLE, 2, timeout=240).stdout
    assert final_accuracy(in_jit) >= 0.95, in_jit
    on_host = run_mpi(JAX_EXAMPLE, 2, "--update", "host", "--epochs", "3", timeout=240).stdout
    three_epochs = [line for line in in_jit.splitlines() if line.startswith("epoch 3/")]
    assert three_epochs and three_epochs[0].replace("3/20", "3/3") in on_host, on_host
