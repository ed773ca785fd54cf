"""The launcher's output, passed on as it comes, and the hosts its reports name for failed workers.

A worker killed by a signal writes no failure record (:mod:`gradsync.run.store`), but the MPI
launcher reports it, with its host:

* MPICH's Hydra (stdout): ``=   PID 595 RUNNING AT node7`` in its "BAD TERMINATION" block;
* srun (stderr): ``srun: error: node7: task 1: Killed`` (the tasks srun itself then ended, with
  ``--kill-on-bad-exit``, are reported as ``Terminated`` and are not counted);
* Open MPI's prterun (stderr): ``... process rank 1 with PID 0 on node node7 exited on signal 9``,
  wrapped over two lines (so each line is also read joined to the one before it).

:class:`LauncherOutput` copies the launcher's stdout and stderr to the driver's own, byte for byte
and without waiting for line ends, and collects the hosts those lines name.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from typing import BinaryIO

FAILED_WORKER = (
    re.compile(r"^=\s+PID \d+ RUNNING AT (?P<host>\S+)\s*$"),
    re.compile(r"^srun: error: (?P<host>[^:\s]+): tasks? [\d,\-]+: (?!Terminated)"),
    re.compile(r"\bwith PID \d+ on node (?P<host>\S+) exited on signal \d+"),
)


def failed_hosts(line: str) -> set[str]:
    """The host a launcher's report ``line`` names as running a failed worker (empty if none)."""
    return {match["host"] for pattern in FAILED_WORKER if (match := pattern.search(line))}


class LauncherOutput:
    """Copies ``job``'s stdout and stderr pipes to this process's, in two threads, and collects
    the hosts of failed workers that the lines name (:func:`failed_hosts`)."""

    def __init__(self, job: subprocess.Popen):
        self.hosts: set[str] = set()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._copy, args=(source, sink), daemon=True)
                         for source, sink in ((job.stdout, sys.stdout), (job.stderr, sys.stderr))]
        for thread in self._threads:
            thread.start()

    def _copy(self, source: BinaryIO, sink) -> None:
        pending, last = b"", ""
        while chunk := os.read(source.fileno(), 1 << 16):
            _write(sink, chunk)
            *lines, pending = (pending + chunk).split(b"\n")
            last = self._scan(lines, last)
        self._scan([pending], last)
        source.close()

    def _scan(self, lines: list[bytes], last: str) -> str:
        """Collect the hosts that ``lines``, each alone and joined to the one before (``last``
        first), name; returns the last line."""
        for raw in lines:
            line = raw.decode(errors="replace").rstrip("\r")
            named = failed_hosts(line) | failed_hosts(f"{last} {line}")
            if named:
                with self._lock:
                    self.hosts |= named
            last = line
        return last

    def finish(self, timeout: float = 5.0) -> set[str]:
        """Wait (up to ``timeout`` s per pipe) for the copies to reach the end; the hosts named."""
        for thread in self._threads:
            thread.join(timeout)
        with self._lock:
            return set(self.hosts)


def _write(sink, chunk: bytes) -> None:
    """Write ``chunk`` to the text stream ``sink`` (through its binary buffer when it has one)."""
    if hasattr(sink, "buffer"):
        sink.flush()
        sink.buffer.write(chunk)
        sink.buffer.flush()
    else:
        sink.write(chunk.decode(errors="replace"))
        sink.flush()
