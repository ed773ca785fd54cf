"""All configuration of gradsync, parsed in one place.

Each setting is an environment variable with the ``GRADSYNC_`` prefix and the keyword argument of
:func:`gradsync.init` of the same name in lower case (without the prefix). Keyword arguments win over
the environment; the environment wins over the defaults in :data:`SETTINGS`. Where Horovod has a
variable for the same setting (``HOROVOD_FUSION_THRESHOLD``, ...), it is read when the ``GRADSYNC_``
one is unset, so a Horovod job's environment keeps working (:func:`horovod_value`).
docs/configuration.md lists the same table.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from .errors import GradsyncError


@dataclasses.dataclass(frozen=True)
class Setting:
    """One configuration knob: its field name, type, default, unit and meaning."""

    field: str
    parse: Callable[[str], Any]
    default: Any
    unit: str
    help: str
    horovod: str = ""  # Horovod's variable for the same setting, read when GRADSYNC_<FIELD> is unset

    @property
    def env(self) -> str:
        return "GRADSYNC_" + self.field.upper()


def parse_bool(text: str) -> bool:
    """'1', 'true', 'yes', 'on' -> True; '0', 'false', 'no', 'off', '' -> False (any case)."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected 1/0/true/false, got {text!r}")


WAIT_POLICIES = ("sleep", "mpi")  # gradsync.engine.waiting: how a rank waits in a negotiation exchange

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "fusion_threshold", int, 1 << 20, "bytes",
        "Largest fusion buffer. Ready tensors of the same dtype and op are packed together up to this "
        "size; a tensor larger than it is reduced alone, in place, without a copy. 0 disables fusion.",
        horovod="HOROVOD_FUSION_THRESHOLD",
    ),
    Setting(
        "small_gradient_bytes", int, 256 << 10, "bytes",
        "DistributedOptimizer (PyTorch) copies gradients smaller than this into buckets of up to 25 MiB "
        "(DDP's bucket_cap_mb; the fusion threshold if larger), cut in reverse parameter order per "
        "(device, dtype), as DDP's, and allreduces each bucket "
        "once all its gradients are ready: one collective per bucket instead of one per gradient. "
        "Larger gradients are allreduced alone, in place. Only without a comm_hook, "
        "gradient_as_bucket_view, groups, compression or Adasum. 0: every gradient alone.",
    ),
    Setting(
        "cycle_time", float, 1.0, "milliseconds",
        "The least time from the end of one negotiation cycle to the start of the next: asynchronous "
        "requests that arrive within it (gradients during backward) are negotiated together in the "
        "next cycle, and requests still waiting for other ranks are negotiated again after it (at once "
        "while a thread waits for one of them and the last cycle made progress). A request that "
        "arrives after it has passed, a blocking op, and synchronize() of a handle not yet done start "
        "a cycle at once; with no pending work the coordinator sleeps until a request arrives.",
        horovod="HOROVOD_CYCLE_TIME",
    ),
    Setting(
        "caller_runs", parse_bool, True, "bool",
        "A blocking op (and synchronize() of a handle whose collective has not started) runs the "
        "negotiation cycle and the collective in the calling thread when the coordinator thread is "
        "idle, instead of handing them to it and waiting: no thread hand-off on the fast path. "
        "Only where the process set has moved no GPU tensor, and only with rank failure detection off "
        "(GRADSYNC_RANK_FAILURE_TIMEOUT_SECONDS=0) or on one rank: a rank lost while a caller is inside a "
        "blocking MPI call would leave that thread blocked for good. Off: the coordinator thread runs "
        "every cycle.",
    ),
    Setting(
        "wait_policy", str, "mpi", "name",
        "How a rank waits in a negotiation exchange for ranks that have not reached it: 'mpi' (the "
        "blocking MPI_Allreduce: the MPI's own wait, which polls) or 'sleep' (a nonblocking "
        "MPI_Iallreduce, tested for 50 us, then tested between sleeps of 20 us doubling up to 0.5 ms, "
        "leaving the core free meanwhile; measured no faster here, see docs/configuration.md). Data "
        "collectives always block. Must be the same on every rank.",
    ),
    Setting(
        "shared_memory_bytes", int, 2 << 20, "bytes",
        "When every rank of a process set runs on one host, a host allreduce of at least "
        "GRADSYNC_SHARED_MEMORY_THRESHOLD bytes runs through shared memory (a file in /dev/shm) instead of "
        "MPI_Allreduce (each rank reduces one slice, reading the others' data where it lies; about half "
        "the memory traffic, see docs/benchmarks.md#shared-memory-allreduce-issue-25). This is each "
        "rank's segment of that memory (larger buffers go through it in chunks); the file takes size x "
        "this many bytes "
        "of /dev/shm. 0: always MPI_Allreduce. Must be the same on every rank.",
    ),
    Setting(
        "shared_memory_threshold", int, 512 << 10, "bytes",
        "The least bytes a host allreduce takes the shared-memory path with (GRADSYNC_SHARED_MEMORY_BYTES); "
        "smaller ones stay with MPI_Allreduce, whose latency is lower. Must be the same on every rank.",
    ),
    Setting(
        "shutdown_timeout", float, 30.0, "seconds",
        "How long shutdown() waits for the other ranks to reach shutdown before giving up with a "
        "warning.",
    ),
    Setting(
        "stall_check_time_seconds", float, 60.0, "seconds",
        "After this long, rank 0 warns about every collective that some ranks submitted and others did "
        "not, listing both groups of ranks. 0 disables the stall inspector (and, unless rank failure "
        "detection is on, the idle heartbeat it needs: an idle coordinator then sleeps until work arrives).",
        horovod="HOROVOD_STALL_CHECK_TIME_SECONDS",
    ),
    Setting(
        "stall_shutdown_time_seconds", float, 0.0, "seconds",
        "After this long stalled, gradsync shuts down on every rank and every pending collective fails "
        "with the stall report (StallError). 0: never; only the warning.",
        horovod="HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
    ),
    Setting(
        "rank_failure_timeout_seconds", float, 30.0, "seconds",
        "A rank whose process died or hung is declared lost within this time: every pending and later "
        "operation on the other ranks fails with RankFailureError naming it, and gradsync aborts the "
        "MPI job at exit (non-zero exit status). Also makes an idle coordinator join a negotiation "
        "cycle every quarter of it (at most every 15 s). 0 disables detection; otherwise at least 0.5.",
    ),
    Setting(
        "join_divisor", str, "size", "name",
        "What Average divides by while some ranks have called join(): 'size' (the world size, as "
        "Horovod and DDP's default divide_by_initial_world_size=True) or 'contributors' (the ranks "
        "that have not joined).",
    ),
    Setting(
        "cache_capacity", int, 1024, "entries",
        "Response cache size. A collective seen before (same name, dtype, shape, op, ...) is negotiated "
        "with one bit in a small bitwise allreduce instead of a gather and broadcast of its description. "
        "0 disables the cache.",
        horovod="HOROVOD_CACHE_CAPACITY",
    ),
    Setting(
        "hierarchical_allreduce", parse_bool, False, "bool",
        "Allreduce in three stages: reduce within each host over shared memory, allreduce across hosts "
        "among the local rank 0 processes, broadcast within each host.",
        horovod="HOROVOD_HIERARCHICAL_ALLREDUCE",
    ),
    Setting(
        "timeline", str, "", "path",
        "Write a Chrome trace (chrome://tracing, Perfetto) of every collective's phases to this file. "
        "Empty: no timeline.",
        horovod="HOROVOD_TIMELINE",
    ),
    Setting(
        "autotune", parse_bool, False, "bool",
        "Tune the fusion threshold and cycle time on the running job from measured throughput, and log "
        "the chosen values.",
        horovod="HOROVOD_AUTOTUNE",
    ),
    Setting(
        "autotune_window", float, 2.0, "seconds",
        "How long autotune measures each candidate setting.",
    ),
    Setting(
        "gpu_operations", str, "", "name",
        "How collectives of GPU tensors move data: 'NCCL' (device buffers, NCCL on a CUDA stream of "
        "its own) or 'MPI' (through pinned host buffers and MPI; lets several ranks share one GPU). "
        "Empty: NCCL when the NCCL library loads, else MPI. Must be the same on every rank.",
        horovod="HOROVOD_GPU_OPERATIONS",
    ),
    Setting(
        "log_level", str, "WARNING", "name",
        "Level of the 'gradsync' logger: DEBUG, INFO, WARNING, ERROR.",
        horovod="HOROVOD_LOG_LEVEL",
    ),
)

_BY_FIELD = {s.field: s for s in SETTINGS}
# Horovod values that mean something else here: HOROVOD_TIMELINE=DYNAMIC opens no file at init (the
# timeline starts with gradsync.torch.start_timeline()), and Horovod's extra log levels.
_HOROVOD_VALUES = {("timeline", "DYNAMIC"): "", ("log_level", "TRACE"): "DEBUG",
                   ("log_level", "FATAL"): "CRITICAL"}


def horovod_value(setting: Setting, environ: dict[str, str]) -> str | None:
    """The value Horovod's variable gives ``setting`` in ``environ`` (translated where Horovod's
    meaning differs, see docs/configuration.md), or None when Horovod has no say.

    ``HOROVOD_STALL_CHECK_DISABLE=1`` sets the stall check time to 0 (off), as in Horovod.
    """
    if setting.field == "stall_check_time_seconds" and environ.get(
            "HOROVOD_STALL_CHECK_DISABLE", "").strip() in ("1", "true", "True"):
        return "0"
    if not setting.horovod or setting.horovod not in environ:
        return None
    raw = environ[setting.horovod]
    return _HOROVOD_VALUES.get((setting.field, raw.strip().upper()), raw)
MIN_FAILURE_TIMEOUT = 0.5  # seconds; below it the liveness periods derived from it become too short


@dataclasses.dataclass(frozen=True)
class Config:
    """Resolved configuration of one ``gradsync.init()``; see :data:`SETTINGS` for meanings."""

    fusion_threshold: int = 1 << 20
    small_gradient_bytes: int = 256 << 10
    cycle_time: float = 1.0
    caller_runs: bool = True
    wait_policy: str = "mpi"
    shared_memory_bytes: int = 2 << 20
    shared_memory_threshold: int = 512 << 10
    shutdown_timeout: float = 30.0
    stall_check_time_seconds: float = 60.0
    stall_shutdown_time_seconds: float = 0.0
    rank_failure_timeout_seconds: float = 30.0
    join_divisor: str = "size"
    cache_capacity: int = 1024
    hierarchical_allreduce: bool = False
    timeline: str = ""
    autotune: bool = False
    autotune_window: float = 2.0
    gpu_operations: str = ""
    log_level: str = "WARNING"

    @classmethod
    def resolve(cls, overrides: dict[str, Any] | None = None,
                environ: dict[str, str] | None = None) -> Config:
        """Build the configuration from keyword ``overrides``, then ``environ``, then defaults.

        Raises:
            TypeError: an unknown keyword in ``overrides``.
            ValueError: a value that does not parse, or is negative, naming the variable.
        """
        environ = os.environ if environ is None else environ
        overrides = dict(overrides or {})
        unknown = sorted(set(overrides) - set(_BY_FIELD))
        if unknown:
            raise TypeError(f"gradsync.init() got unknown settings {unknown}; "
                            f"known: {sorted(_BY_FIELD)}")
        values = {}
        for setting in SETTINGS:
            if setting.field in overrides and overrides[setting.field] is not None:
                raw, source = overrides[setting.field], f"init({setting.field}=...)"
            elif setting.env in environ:
                raw, source = environ[setting.env], setting.env
            elif horovod_value(setting, environ) is not None:
                raw, source = horovod_value(setting, environ), setting.horovod or setting.env
            else:
                values[setting.field] = setting.default
                continue
            try:
                value = raw if isinstance(raw, bool) else setting.parse(str(raw))
            except ValueError as exc:
                raise ValueError(f"{source}={raw!r} is not a valid {setting.unit} value: {exc}") from None
            if setting.field == "join_divisor" and value not in ("size", "contributors"):
                raise ValueError(f"{source}={raw!r} must be 'size' or 'contributors'")
            if setting.field == "rank_failure_timeout_seconds" and 0 < value < MIN_FAILURE_TIMEOUT:
                raise ValueError(f"{source}={raw!r} must be 0 (off) or at least {MIN_FAILURE_TIMEOUT} s")
            if setting.field == "wait_policy" and value not in WAIT_POLICIES:
                raise ValueError(f"{source}={raw!r} must be one of {', '.join(WAIT_POLICIES)}")
            if setting.field == "gpu_operations" and value.strip().lower() not in ("", "nccl", "mpi"):
                raise ValueError(f"{source}={raw!r} must be NCCL or MPI (or empty: NCCL when it loads)")
            if isinstance(value, (int, float)) and value < 0:
                raise ValueError(f"{source}={raw!r} must not be negative ({setting.unit})")
            values[setting.field] = value
        return cls(**values)


def markdown_table() -> str:
    """The settings as a Markdown table (variable, unit, default, meaning, Horovod's variable read
    when it is unset), for docs/configuration.md."""
    rows = ["| variable | unit | default | meaning | Horovod fallback |", "|---|---|---|---|---|"]
    rows += [f"| `{s.env}` | {s.unit} | `{s.default}` | {s.help} | "
             f"{f'`{s.horovod}`' if s.horovod else '-'} |" for s in SETTINGS]
    return "\n".join(rows)


def check_shared(comm, config: Config) -> None:
    """Check the settings that every rank of ``comm`` must share (each rank plans cached fusion by
    itself; failure detection needs every rank's heartbeat). Collective over ``comm``.

    Raises:
        GradsyncError: they differ; the message lists each rank's values.
    """
    mine = (config.fusion_threshold, config.cache_capacity, config.join_divisor,
            config.rank_failure_timeout_seconds, config.small_gradient_bytes, config.wait_policy,
            config.shared_memory_bytes, config.shared_memory_threshold)
    everyone = comm.allgather(mine)
    if any(values != mine for values in everyone):
        listed = ", ".join(f"rank {r}: fusion_threshold={t}, cache_capacity={c}, join_divisor={j}, "
                           f"rank_failure_timeout_seconds={f:g}, small_gradient_bytes={b}, "
                           f"wait_policy={w}, shared_memory_bytes={m}, shared_memory_threshold={n}"
                           for r, (t, c, j, f, b, w, m, n) in enumerate(everyone))
        raise GradsyncError(f"gradsync: GRADSYNC_FUSION_THRESHOLD, GRADSYNC_CACHE_CAPACITY, "
                            f"GRADSYNC_JOIN_DIVISOR, GRADSYNC_RANK_FAILURE_TIMEOUT_SECONDS, "
                            f"GRADSYNC_SMALL_GRADIENT_BYTES (which gradients share buckets), "
                            f"GRADSYNC_WAIT_POLICY (a nonblocking exchange matches no blocking one), "
                            f"GRADSYNC_SHARED_MEMORY_BYTES and GRADSYNC_SHARED_MEMORY_THRESHOLD (which "
                            f"allreduces go through shared memory) must be "
                            f"the same on every rank; got {listed}")

