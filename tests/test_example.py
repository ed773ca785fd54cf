"""The README's example trains to the promised accuracy on 2 ranks and resumes from its checkpoint."""

import re

import pytest

from mpi_launch import REPO, run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.torch]
EXAMPLE = REPO / "examples" / "train_digits.py"


def final_accuracy(output: str) -> float:
    last = output.strip().splitlines()[-1]
    match = re.fullmatch(r"test_accuracy=([0-9.]+)", last)
    assert match, f"last line is not test_accuracy=<float>: {last!r}"
    return float(match.group(1))


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
