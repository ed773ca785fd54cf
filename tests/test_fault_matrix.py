"""scripts/fault_matrix.py (issue 3's fault matrix): its table, on one quick row, and its arithmetic."""

import re
import subprocess
import sys

import pytest

from mpi_launch import REPO, launch_env, mpiexec

sys.path.insert(0, str(REPO / "scripts"))
import fault_matrix  # noqa: E402

SCRIPT = REPO / "scripts" / "fault_matrix.py"


def cells(line: str) -> list[str]:
    assert line.startswith("| ") and line.endswith(" |"), line
    return [c.strip() for c in re.split(r"(?<!\\)\|", line[2:-2])]


def test_every_item_of_the_issue_has_a_row_and_ids_are_unique():
    assert sorted({row.id.split(".")[0] for row in fault_matrix.ROWS}) == [str(i) for i in range(1, 10)]
    assert len({row.id for row in fault_matrix.ROWS}) == len(fault_matrix.ROWS)


def test_time_is_from_the_earliest_fault_to_the_last_rank_error():
    row = fault_matrix.Row("x", "3 rank failure", "s", 3, ("exit", "2", "pending"), dies=True, nonzero=True)
    output = ("rank 2: DIED 100.000\n"
              "rank 1: ERROR RankFailureError 102.750 | gradsync: rank 1: rank 2 stopped | responding\n"
              "rank 0: ERROR RankFailureError 102.500 | gradsync: rank 0: rank 2 stopped | responding\n")
    got, ok = fault_matrix.summarise(row, 1, output)
    assert ok
    assert got == ["2.75", "RankFailureError", r"gradsync: rank 0: rank 2 stopped \| responding",
                   "1 (non-zero expected)", "—"]
    assert fault_matrix.summarise(row, 0, output)[1] is False  # a job that should have failed did not
    assert fault_matrix.summarise(row, None, output)[0][3].startswith("HUNG")


@pytest.mark.mpi
def test_one_quick_row_prints_a_markdown_table():
    if mpiexec() is None:
        pytest.skip("no mpiexec found")
    out = subprocess.run([sys.executable, str(SCRIPT), "--only", "7.dtype"], capture_output=True, text=True,
                         env=launch_env(), timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("|")]
    assert len(lines) == 3, out.stdout
    assert cells(lines[0]) == fault_matrix.HEADER
    assert cells(lines[1]) == ["---"] * len(fault_matrix.HEADER)
    item, scenario, ranks, flags, took, kind, message, status, usable = cells(lines[2])
    assert item == "7 bad input (7.dtype)" and ranks == "2" and flags == "(none)"
    assert 0 <= float(took) < 5, took
    assert kind == "TypeError"
    assert message.startswith("gradsync: rank 0: allreduce of tensor 'bad': dtype complex64 is not supported")
    assert len(message) <= fault_matrix.MESSAGE_WIDTH
    assert status == "0 (zero expected)" and usable == "yes (2/2 ranks)"
