"""Autotune: pick the fusion threshold and cycle time from the running job's measured throughput.

With ``GRADSYNC_AUTOTUNE=1`` rank 0 scores each candidate setting by the bytes reduced per second of
wall time over a window of ``GRADSYNC_AUTOTUNE_WINDOW`` seconds. In a training loop every step reduces
the same bytes, so this score is proportional to steps per second. The search is coordinate-wise:
first every fusion threshold at the configured cycle time, then every cycle time at the best threshold.
The best setting is then kept for the rest of the job and logged. Rank 0 sends each new setting to all
ranks inside a negotiation reply, so every rank switches at the same cycle.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("gradsync")

FUSION_THRESHOLDS = (0, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)  # bytes
CYCLE_TIMES = (0.5, 1.0, 2.0, 5.0)  # milliseconds


class Autotuner:
    """Rank 0's search; call :meth:`record` after each executed collective, :meth:`poll` each cycle."""

    def __init__(self, fusion_threshold: int, cycle_time: float, window: float) -> None:
        self.window = window
        self.current = (fusion_threshold, cycle_time)
        self.scores: dict[tuple[int, float], float] = {}  # setting -> bytes per second
        self.done = False
        self._plan = [(t, cycle_time) for t in FUSION_THRESHOLDS]
        self._cycle_times_planned = False
        self._scoring = False  # the first window (the configured setting, warming up) is not scored
        self._start: float | None = None
        self._bytes = 0

    def record(self, nbytes: int) -> None:
        """Count ``nbytes`` reduced under the current setting; the window opens at the first call."""
        if self._start is None:
            self._start = time.perf_counter()
        self._bytes += nbytes

    def poll(self) -> tuple[int, float] | None:
        """The (fusion threshold, cycle time) to switch every rank to now, or None to keep going."""
        if self.done or self._start is None:
            return None
        elapsed = time.perf_counter() - self._start
        if elapsed < self.window:
            return None
        if self._scoring:
            self.scores[self.current] = self._bytes / elapsed
            log.info("gradsync autotune: fusion_threshold=%d bytes, cycle_time=%.1f ms: %.1f MB/s",
                     *self.current, self.scores[self.current] / 1e6)
        self._start, self._bytes = None, 0
        if not self._plan and not self._cycle_times_planned:
            threshold = max(self.scores, key=self.scores.get)[0]
            self._plan = [(threshold, c) for c in CYCLE_TIMES if (threshold, c) not in self.scores]
            self._cycle_times_planned = True
        if self._plan:
            self.current, self._scoring = self._plan.pop(0), True
            return self.current
        self.done = True
        self.current = max(self.scores, key=self.scores.get)
        log.warning("gradsync autotune: chose fusion_threshold=%d bytes, cycle_time=%.1f ms "
                    "(%.1f MB/s reduced; %d settings measured over %.1f s each)", *self.current,
                    self.scores[self.current] / 1e6, len(self.scores), self.window)
        return self.current
