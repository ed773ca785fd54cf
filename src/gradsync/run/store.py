"""The state directory shared by the elastic driver and its workers: what lives there and how.

The driver creates the directory and passes it to every worker as ``GRADSYNC_ELASTIC_STATE_DIR``
(with ``GRADSYNC_ELASTIC_RESTART``, the number of launches before this one). In it:

* ``committed.pt``: the state of the last ``commit()``, written by rank 0 only, atomically (a
  temporary file in the same directory, then ``os.replace``), so a reader sees the previous commit
  or the new one, never part of one. A restarted job starts from it.
* ``hosts_updated``: written by the driver when hosts were added; rank 0 checks for it at each
  ``commit()`` and every rank then raises ``HostsUpdatedInterrupt`` at that commit.
* ``failures/rank-<r>.txt``: one line per worker that stopped with an exception (its host and the
  error), so the driver's log and final error can name the failure.
* ``timing.jsonl``: when each launch passed each phase of a start (wall-clock seconds), one JSON
  line per event, from the driver (``launched``, ``ended``) and rank 0 of each launch
  (``process_start``, ``init_start``, ``init_end``, ``resume_start``, ``resume_end``,
  ``first_commit``); :func:`recovery_phases` turns them into the phases of a recovery.

This module imports neither MPI nor a deep-learning framework: the driver uses it too.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

STATE_DIR_ENV = "GRADSYNC_ELASTIC_STATE_DIR"
RESTART_ENV = "GRADSYNC_ELASTIC_RESTART"
COMMITTED = "committed.pt"
HOSTS_UPDATED = "hosts_updated"
FAILURES = "failures"
TIMING = "timing.jsonl"
# The exit status of workers that stopped at a commit because hosts were added (EX_TEMPFAIL):
# the driver relaunches at the new size without counting a failure.
EXIT_HOSTS_UPDATED = 75


def state_dir() -> Path | None:
    """The directory of ``GRADSYNC_ELASTIC_STATE_DIR``, or None when the job runs without the driver."""
    path = os.environ.get(STATE_DIR_ENV)
    return Path(path) if path else None


def restart_count() -> int:
    """``GRADSYNC_ELASTIC_RESTART``: how many launches of this job came before this one (0 without)."""
    return int(os.environ.get(RESTART_ENV, "0"))


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(temporary path)`` and move the result onto ``path`` with ``os.replace``.

    The temporary file is in ``path``'s directory (so the replace is atomic on POSIX) and is
    removed if ``write`` raises; the error propagates.
    """
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(handle)
    try:
        write(Path(temporary))
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def record_failure(directory: Path, rank: int, error: BaseException) -> None:
    """Write ``failures/rank-<rank>.txt``: this host, the error's type and first line."""
    first_line = (str(error).splitlines() or [""])[0]
    text = f"rank {rank} on {socket.gethostname()}: {type(error).__name__}: {first_line}\n"
    failures = directory / FAILURES
    failures.mkdir(exist_ok=True)
    write_atomically(failures / f"rank-{rank}.txt", lambda path: path.write_text(text))


def read_failures(directory: Path) -> list[str]:
    """The failure lines the workers of the last launch wrote, sorted by rank."""
    files = sorted((directory / FAILURES).glob("rank-*.txt"),
                   key=lambda path: int(path.stem.split("-")[1]))
    return [path.read_text().strip() for path in files]


def clear_launch_files(directory: Path) -> None:
    """Remove the previous launch's failure records and host-update flag (the commit stays)."""
    for path in (directory / FAILURES).glob("rank-*.txt"):
        path.unlink()
    (directory / HOSTS_UPDATED).unlink(missing_ok=True)


def record_time(directory: Path, event: str, launch: int, when: float | None = None,
                cpu: float | None = None) -> None:
    """Append ``{"event", "launch", "time", "cpu"}`` to ``timing.jsonl``: ``when`` (default now) in
    wall-clock seconds since the epoch, comparable across the processes of one host; ``cpu`` the
    recording process's CPU seconds (``time.process_time()``) at that moment, when known."""
    record = {"event": event, "launch": launch, "time": time.time() if when is None else when}
    line = json.dumps(record if cpu is None else dict(record, cpu=cpu))
    with open(directory / TIMING, "a") as out:
        out.write(line + "\n")


def process_start_time() -> float | None:
    """When this process started, on the wall clock (10 ms steps): its start in /proc (clock ticks
    since boot) moved onto ``time.time()`` through ``CLOCK_BOOTTIME``, the clock /proc counts in.
    None where /proc or that clock is missing."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, IndexError, AttributeError):
        return None
    return time.time() - since_boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # stat field 22


#: The phases of a recovery: (name, the event it starts at, the event it ends at).
PHASES = (("relaunch", "ended", "launched"), ("launcher", "launched", "process_start"),
          ("imports", "process_start", "init_start"), ("init", "init_start", "init_end"),
          ("setup", "init_end", "resume_start"), ("restore", "resume_start", "resume_end"),
          ("first_step", "resume_end", "first_commit"))


def recovery_phases(directory: Path, launch: int, clock: str = "time") -> dict[str, float]:
    """Seconds of each phase of ``PHASES`` from the end of launch ``launch - 1`` to the first commit
    of ``launch``, read from ``timing.jsonl``; a phase whose events are missing is left out.

    ``relaunch``: the driver's reaction to the job's end; ``launcher``: mpiexec or srun starting
    the processes; ``imports``: the interpreter and the script up to ``gradsync.init()``; ``init``:
    ``MPI_Init`` and ``gradsync.init()``; ``setup``: the script from there to ``run`` (model,
    optimizer); ``restore``: loading and syncing the commit; ``first_step``: to the end of the
    first ``commit()``. ``total`` is the end of the old launch to that first commit. With
    ``clock="cpu"``, rank 0's CPU seconds in each of its phases (``imports`` on: a process starts
    at 0), and ``total`` their sum.
    """
    path = directory / TIMING
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    when = {e["event"]: e[clock] for e in events
            if e["launch"] == launch and e["event"] != "ended" and clock in e}
    ended = [e[clock] for e in events if e["launch"] == launch - 1 and e["event"] == "ended" and clock in e]
    if ended:
        when["ended"] = ended[-1]
    phases = {name: when[end] - when[start] for name, start, end in PHASES
              if start in when and end in when}
    if clock == "cpu":
        phases["total"] = sum(phases.values())
    elif "ended" in when and "first_commit" in when:
        phases["total"] = when["first_commit"] - when["ended"]
    return phases
