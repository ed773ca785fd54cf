"""scripts/gpu_check.sh, the one-shot check of a GPU machine: what can be checked without a GPU."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"


def test_the_script_parses_and_is_strict():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)
    text = SCRIPT.read_text()
    assert "set -euo pipefail" in text and "${OUT:-./gpu-out}" in text
    # It installs nothing: no line runs pip (the messages may tell the user to).
    assert not re.search(r'^\s*(\S*python\S* -m )?pip3? install', text, re.M | re.I)


def test_without_a_gpu_it_says_so_and_exits_2(tmp_path):
    try:  # without torch (the numpy-only CI pass) the script must say so just the same
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, OUT=str(out), PYTHON=sys.executable))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "FAIL: no GPU" in result.stdout
    assert "FAIL: no GPU" in (out / "summary.txt").read_text()
