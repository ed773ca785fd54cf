"""Timeline: a Chrome trace of every collective's phases (open it in Perfetto or chrome://tracing).

Enable with ``GRADSYNC_TIMELINE=<path>``. With ``{rank}`` in the path every rank writes its own file
(``trace.{rank}.json``); otherwise rank 0 alone writes ``path``. Each tensor gets a row; its phases are

==========================  ===================================================================
NEGOTIATE                   from submission until the cycle's responses named it ready everywhere
WAIT_FOR_DATA               from then until its collective started (behind earlier responses of
                            the same cycle; on the host the data itself is ready at submission)
MEMCPY_IN_FUSION_BUFFER     packing it (and its fusion buffer's other tensors) into the buffer
ALLREDUCE / BROADCAST /     the MPI collective itself (a group's members share one span of
ALLGATHER / ALLTOALL /      their fused buffer)
REDUCESCATTER
MEMCPY_OUT_FUSION_BUFFER    unpacking the results (with the scale factors folded in)
==========================  ===================================================================

plus ``CYCLE`` instant markers on the coordinator row and, from DistributedOptimizer, a ``BACKWARD``
span per step (from the first to the last gradient hook). Times are microseconds since ``init()``.

``python -m gradsync.timeline trace.json`` summarises a trace: time per phase, and the fraction of
ALLREDUCE time that overlapped backward computation.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections import defaultdict

COORDINATOR_ROW = 0


class Timeline:
    """Buffered writer of trace events; thread-safe. Timestamps are ``time.perf_counter_ns()``."""

    def __init__(self, path: str, rank: int, mark_cycles: bool = True) -> None:
        self.rank = rank
        self.mark_cycles = mark_cycles  # False: :meth:`marker` (the CYCLE markers) writes nothing
        self._origin = time.perf_counter_ns()
        self._lock = threading.Lock()
        self._rows: dict[str, int] = {}
        self._buffer: list[str] = []
        self._file = open(path, "w")  # noqa: SIM115 - kept open until close()
        self._file.write("[\n")
        self._buffer.append(self._meta(COORDINATOR_ROW, "coordinator"))

    def span(self, row: str, phase: str, start_ns: int, end_ns: int, args: dict | None = None) -> None:
        """A phase of ``row`` (a tensor name) from ``start_ns`` to ``end_ns``."""
        event = {"name": phase, "ph": "X", "pid": self.rank, "tid": self._row(row),
                 "ts": (start_ns - self._origin) / 1000, "dur": max(end_ns - start_ns, 0) / 1000}
        if args:
            event["args"] = args
        self._emit(event)

    def marker(self, name: str, at_ns: int, args: dict | None = None) -> None:
        """An instant event on the coordinator row (none when ``mark_cycles`` is off)."""
        if not self.mark_cycles:
            return
        event = {"name": name, "ph": "i", "s": "t", "pid": self.rank, "tid": COORDINATOR_ROW,
                 "ts": (at_ns - self._origin) / 1000}
        if args:
            event["args"] = args
        self._emit(event)

    def close(self) -> None:
        with self._lock:
            if self._file.closed:
                return
            self._flush()
            self._file.write("{}]\n")
            self._file.close()

    def _row(self, name: str) -> int:
        row = self._rows.get(name)
        if row is None:
            with self._lock:
                row = self._rows.get(name)
                if row is None:
                    row = self._rows[name] = len(self._rows) + 1
                    self._buffer.append(self._meta(row, name))
        return row

    def _meta(self, row: int, name: str) -> str:
        return json.dumps({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": row,
                           "args": {"name": name}})

    def _emit(self, event: dict) -> None:
        with self._lock:
            if self._file.closed:
                return
            self._buffer.append(json.dumps(event))
            if len(self._buffer) >= 4096:
                self._flush()

    def _flush(self) -> None:
        if self._buffer:
            self._file.write(",\n".join(self._buffer) + ",\n")
            self._file.flush()
            self._buffer.clear()


def open_timeline(path: str, rank: int, mark_cycles: bool = True) -> Timeline | None:
    """The timeline this rank writes for ``GRADSYNC_TIMELINE=path``, or None (see module docstring)."""
    if not path:
        return None
    if "{rank}" in path:
        return Timeline(path.format(rank=rank), rank, mark_cycles)
    return Timeline(path, rank, mark_cycles) if rank == 0 else None


def open_for(path: str, process_set_id: int, rank: int, mark_cycles: bool = True) -> Timeline | None:
    """The timeline of one process set's coordinator: ``path`` for the global set, one file per
    other set (``path.setN``: each set has its own coordinator), or None without a path."""
    if path and process_set_id:
        path = f"{path}.set{process_set_id}"
    return open_timeline(path, rank, mark_cycles)


def record_collective(timeline: Timeline, entries: list, replied_ns: int, started_ns: int,
                      phases: tuple[tuple[str, int], ...]) -> None:
    """The spans of one executed response (or batch) for each of its ``entries`` (objects with a
    ``request.name`` and ``submitted_ns``): NEGOTIATE until the reply, WAIT_FOR_DATA until its
    execution started, then ``phases``, (name, end time) each starting where the previous ended."""
    for entry in entries:
        name = entry.request.name
        timeline.span(name, "NEGOTIATE", entry.submitted_ns, replied_ns)
        timeline.span(name, "WAIT_FOR_DATA", replied_ns, started_ns)
        begin = started_ns
        for phase, end in phases:
            timeline.span(name, phase, begin, end, {"tensors": len(entries)})
            begin = end


# ---- analysis --------------------------------------------------------------------------------------

def load(path: str) -> list[dict]:
    """The events of a trace file, also one whose writer did not close it (a job that crashed)."""
    text = open(path).read().rstrip()
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    return [e for e in json.loads(text) if e]


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _overlap(spans: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    total = 0.0
    for start, end in spans:
        for a, b in cover:
            total += max(0.0, min(end, b) - max(start, a))
    return total


def summarize(events: list[dict]) -> dict:
    """Per phase: count and total/mean microseconds; and the allreduce/backward overlap.

    A fused buffer's collective appears once per tensor in it; the overlap counts it once.
    """
    phases: dict[str, list[float]] = defaultdict(list)
    backward: dict[int, list[tuple[float, float]]] = defaultdict(list)
    allreduce: dict[int, set[tuple[float, float]]] = defaultdict(set)
    for event in events:
        if event.get("ph") != "X":
            continue
        phases[event["name"]].append(event["dur"])
        interval = (event["ts"], event["ts"] + event["dur"])
        if event["name"] == "BACKWARD":
            backward[event["pid"]].append(interval)
        elif event["name"] == "ALLREDUCE":
            allreduce[event["pid"]].add(interval)
    total = sum(b - a for spans in allreduce.values() for a, b in spans)
    overlapped = sum(_overlap(list(spans), _merge(backward[pid])) for pid, spans in allreduce.items())
    return {
        "phases": {name: {"count": len(d), "total_us": sum(d), "mean_us": sum(d) / len(d)}
                   for name, d in sorted(phases.items())},
        "allreduce_us": total,
        "overlapped_us": overlapped,
        "overlap_fraction": overlapped / total if total else 0.0,
    }


def main(argv: list[str] | None = None) -> None:
    """``python -m gradsync.timeline trace.json [...]``: print the summary of each trace."""
    parser = argparse.ArgumentParser(prog="python -m gradsync.timeline",
                                     description="Summarise a gradsync timeline (Chrome trace).")
    parser.add_argument("traces", nargs="+")
    args = parser.parse_args(argv)
    for path in args.traces:
        summary = summarize(load(path))
        print(f"{path}")
        print(f"  {'phase':26s} {'count':>8s} {'total ms':>10s} {'mean us':>10s}")
        for name, row in summary["phases"].items():
            print(f"  {name:26s} {row['count']:8d} {row['total_us'] / 1e3:10.2f} {row['mean_us']:10.1f}")
        print(f"  allreduce time overlapping backward: {summary['overlapped_us'] / 1e3:.2f} ms of "
              f"{summary['allreduce_us'] / 1e3:.2f} ms ({100 * summary['overlap_fraction']:.1f} %)")


if __name__ == "__main__":
    main()
