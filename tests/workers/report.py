"""One JSON line per rank: what a worker observed, for the test that launched the job to assert on.

A worker calls ``report(rank=..., **values)`` once; the test parses the job's output with
``mpi_launch.reports`` (one report per rank, by rank), so it asserts values, not counts of lines.
"""

import json
import os

#: What starts a report in a job's output.
PREFIX = "GRADSYNC_REPORT "


def report(**values) -> None:
    """Print ``values`` (JSON-serialisable, with a ``rank``) as one report line, in one write, so
    that the launcher never interleaves it with another rank's output."""
    os.write(1, f"{PREFIX}{json.dumps(values, sort_keys=True)}\n".encode())
