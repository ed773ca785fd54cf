"""``python -m gradsync.check``: what it reports alone and under mpiexec, and how it fails.

Under srun (with the right and a wrong --mpi plugin) and on two hosts it runs in test_slurm.py and
test_two_hosts.py.
"""

from __future__ import annotations

import ast
import re
import sys

import pytest

from cluster import run_job
from gradsync.check import RankInfo, layout, ranges
from mpi_launch import flavour, mpiexec, verdicts

CHECK = [sys.executable, "-m", "gradsync.check"]


def report_lines(output: str) -> dict[str, str]:
    """The ``key  value`` lines of the report, by key."""
    lines = {}
    for line in output.splitlines():
        key, _, value = line.partition("  ")
        if value and not key.startswith(" "):
            lines[key.strip()] = value.strip()
    return lines


def test_alone_it_reports_the_setup_and_passes():
    result = run_job(CHECK, timeout=120)
    report = report_lines(result.stdout)
    for key in ("gradsync", "MPI library", "MPI", "thread level", "launcher", "allreduce", "hosts",
                "NCCL", "CuPy", "torch", "GPUs", "collectives", "bandwidth"):
        assert key in report, result.stdout
    assert report["thread level"] == "MPI_THREAD_MULTIPLE"
    assert report["launcher"] == "none; MPI world size 1"
    assert report["hosts"] == "1 host(s), 1 rank(s)"
    assert ("Open MPI" if flavour() == "openmpi" else "MPICH") in report["MPI library"]
    assert re.match(r"(\d+\.\d+\.\d+ \(/.*libnccl\.so\.2, .*\)|not found \()", report["NCCL"]), \
        report["NCCL"]
    assert result.stdout.rstrip().endswith("PASS"), result.stdout


@pytest.mark.mpi
def test_under_mpiexec_rank_0_reports_the_layout_and_the_job_passes():
    result = run_job([mpiexec(), "-n", "2", *CHECK], timeout=120)
    report = report_lines(result.stdout)
    launcher = "Open MPI mpirun/mpiexec" if flavour() == "openmpi" else "Hydra mpiexec (MPICH, Intel MPI)"
    assert report["launcher"] == f"{launcher}, started 2 processes; MPI world size 2", result.stdout
    assert report["hosts"] == "1 host(s), 2 rank(s)"
    assert "ranks 0-1, local_rank 0-1 of 2, cross_rank 0, 0 GPU(s)" in result.stdout
    assert report["collectives"].endswith("on 2 rank(s): results as expected")
    assert "bus bandwidth" in report["bandwidth"]
    assert verdicts(result.stdout) == ["PASS"], "only rank 0 prints the verdict"


def test_a_stuck_step_aborts_with_fail_instead_of_hanging():
    # A probe far too large for a 1 s limit stands in for a rank that never answers.
    result = run_job([*CHECK, "--timeout", "1", "--probe-mib", "256", "--iterations", "100"],
                     timeout=120, check=False)
    assert result.returncode != 0
    assert "FAIL: rank 0: no progress for 1 s while" in result.stdout, result.stdout
    assert "PASS" not in result.stdout


def nccl_status_with(library: str) -> tuple[str, list[str]]:
    """check.nccl_status() in a fresh process (a process keeps the first NCCL it loads)."""
    out = run_job([sys.executable, "-c", "from gradsync.check import nccl_status; "
                   "print(repr(nccl_status()))"], timeout=60,
                  env={"GRADSYNC_NCCL_LIBRARY": library}).stdout
    return ast.literal_eval(out.strip().splitlines()[-1])


def test_an_unusable_nccl_is_reported_with_the_reason_never_an_error(tmp_path):
    fake = tmp_path / "libnccl.so.2"
    fake.write_bytes(b"not a shared library")
    text, problems = nccl_status_with(str(fake))
    assert text.startswith("not found (pip install gradsync[nccl-cu12]"), text
    assert len(problems) == 1 and problems[0].startswith(f"GRADSYNC_NCCL_LIBRARY={fake}: "), problems
    text, problems = nccl_status_with(str(tmp_path / "missing.so"))
    assert text.startswith("not found") and "no such file" in problems[0], problems


def test_layout_groups_ranks_by_host_and_warns_about_gpu_sharing():
    infos = [RankInfo(0, "a", 0, 3, 0, 2, 2), RankInfo(1, "a", 1, 3, 0, 1, 2),
             RankInfo(2, "a", 2, 3, 0, 1, 2), RankInfo(3, "b", 0, 1, 1, 2, 0)]
    lines, warnings = layout(infos)
    assert lines == ["  a  ranks 0-2, local_rank 0-2 of 3, cross_rank 0, 2 GPU(s)",
                     "  b  ranks 3, local_rank 0 of 1, cross_rank 1, 0 GPU(s)"]
    assert len(warnings) == 1 and "host a: 3 ranks but 2 GPU(s)" in warnings[0]
    assert "torch.cuda.set_device(gradsync.local_rank())" in warnings[0]


def test_layout_warns_when_shared_memory_disagrees_with_host_names():
    # Two machines that both call themselves "node": MPI sees two hosts of one rank each.
    _, warnings = layout([RankInfo(0, "node", 0, 1, 0, 2, 0), RankInfo(1, "node", 0, 1, 1, 2, 0)])
    assert any("shared-memory grouping" in w for w in warnings), warnings


def test_ranges_compress_rank_lists():
    assert ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert ranges([3]) == "3"
