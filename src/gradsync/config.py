"""All configuration of gradsync, parsed in one place: one :class:`Setting` per knob in :data:`SETTINGS`.

Each setting is an environment variable with the ``GRADSYNC_`` prefix and the keyword argument of
:func:`gradsync.init` of the same name in lower case (without the prefix). Keyword arguments win over
the environment; the environment wins over the setting's default. Where Horovod has a variable for
the same setting (``HOROVOD_FUSION_THRESHOLD``, ...), it is read when the ``GRADSYNC_`` one is unset,
so a Horovod job's environment keeps working (:func:`horovod_value`). Each entry also says how its
value is checked and, for the settings every rank must share, why (:func:`check_shared`).
:class:`Config`, what the engine reads, is made from the table: one field per setting, with its
default. docs/configuration.md lists the same table (:func:`markdown_table`; tests/test_docs.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from .errors import GradsyncError

Check = Callable[[Any], "str | None"]  # a parsed value -> what it must be ("must ..."), or None if fine


def anything(value: Any) -> None:
    """The check of a setting that takes any value it parses to."""
    return None


def not_negative(value: float) -> str | None:
    return "must not be negative" if value < 0 else None


def one_of(*choices: str) -> Check:
    """The check of a setting that names one of ``choices``."""
    def check(value: str) -> str | None:
        return None if value in choices else f"must be one of {', '.join(map(repr, choices))}"
    return check


def off_or_at_least(least: float) -> Check:
    """The check of a setting that is 0 (off) or at least ``least`` seconds."""
    def check(value: float) -> str | None:
        return None if value == 0 or value >= least else f"must be 0 (off) or at least {least} s"
    return check


def gpu_operations(value: str) -> str | None:
    """NCCL or MPI in any case, or empty (gradsync.arrays.device.resolve_gpu_operations reads it)."""
    if value.strip().lower() in ("", "nccl", "mpi"):
        return None
    return "must be NCCL or MPI (or empty: NCCL when it loads)"


def parse_bool(text: str) -> bool:
    """'1', 'true', 'yes', 'on' -> True; '0', 'false', 'no', 'off', '' -> False (any case)."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected 1/0/true/false, got {text!r}")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One configuration knob: the keyword of ``init()`` and field of :class:`Config`, its type,
    default, unit and meaning, how its value is checked, Horovod's variable for it, and why every
    rank must agree on it ("" when each rank may choose its own)."""

    keyword: str
    type: type
    default: Any
    unit: str
    doc: str
    check: Check = anything
    horovod: str = ""  # Horovod's variable for the same setting, read when GRADSYNC_<KEYWORD> is unset
    must_match: str = ""

    @property
    def env(self) -> str:
        return "GRADSYNC_" + self.keyword.upper()

    def parse(self, text: str) -> Any:
        """The value of ``text`` (a variable, or a keyword as a string); ValueError if it does not parse."""
        return parse_bool(text) if self.type is bool else self.type(text)


WAIT_POLICIES = ("sleep", "mpi")  # gradsync.engine.waiting: how a rank waits in a negotiation exchange
MIN_FAILURE_TIMEOUT = 0.5  # seconds; below it the liveness periods derived from it become too short

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "fusion_threshold", int, 1 << 20, "bytes",
        "Largest fusion buffer. Ready tensors of the same dtype and op are packed together up to this "
        "size; a tensor larger than it is reduced alone, in place, without a copy. 0 disables fusion.",
        horovod="HOROVOD_FUSION_THRESHOLD",
        check=not_negative,
        must_match="each rank plans the fused buffers of cached collectives by itself",
    ),
    Setting(
        "small_gradient_bytes", int, 256 << 10, "bytes",
        "DistributedOptimizer (PyTorch) copies gradients smaller than this into buckets of up to 25 MiB "
        "(DDP's bucket_cap_mb; the fusion threshold if larger), cut in reverse parameter order per "
        "(device, dtype), as DDP's, and allreduces each bucket "
        "once all its gradients are ready: one collective per bucket instead of one per gradient. "
        "Larger gradients are allreduced alone, in place; gradients on a GPU all go into buckets "
        "(copies cost microseconds there, a collective costs the host far more). Only without a comm_hook, "
        "gradient_as_bucket_view, groups, compression or Adasum. 0: every gradient alone.",
        check=not_negative,
        must_match="which gradients share buckets",
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
        check=not_negative,
    ),
    Setting(
        "caller_runs", bool, True, "bool",
        "A blocking op (and synchronize() or wait() of a handle whose collective has not started) runs "
        "the negotiation cycle and the collective in the calling thread when the coordinator thread is "
        "idle, instead of handing them to it and waiting: no thread hand-off on the fast path. Only "
        "where the process set has moved no GPU tensor. The caller waits for the other ranks with "
        "nonblocking MPI calls that it leaves at its wait's timeout or once a lost rank is declared "
        "(rank failure detection), handing the rest of the cycle to the coordinator thread, as it "
        "does with anything that would block (an allreduce over 64 KiB, a full negotiation). Off: "
        "the coordinator thread runs every cycle.",
    ),
    Setting(
        "wait_policy", str, "mpi", "name",
        "How a rank waits in a negotiation exchange (a nonblocking allreduce) for ranks that "
        "have not reached it: 'mpi' (MPI_Wait: the MPI's own wait, which polls) or 'sleep' (tested "
        "for 50 us, then tested between sleeps of 20 us doubling up to 0.5 ms, leaving the core free "
        "meanwhile; measured no faster here, see docs/configuration.md). Data collectives always "
        "wait inside MPI. Must be the same on every rank.",
        check=one_of(*WAIT_POLICIES),
        must_match="a nonblocking exchange matches no blocking one",
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
        check=not_negative,
        must_match="which allreduces go through shared memory",
    ),
    Setting(
        "shared_memory_threshold", int, 512 << 10, "bytes",
        "The least bytes a host allreduce takes the shared-memory path with (GRADSYNC_SHARED_MEMORY_BYTES); "
        "smaller ones stay with MPI_Allreduce, whose latency is lower. Must be the same on every rank.",
        check=not_negative,
        must_match="which allreduces go through shared memory",
    ),
    Setting(
        "shutdown_timeout", float, 30.0, "seconds",
        "How long shutdown() waits for the other ranks to reach shutdown before giving up with a "
        "warning.",
        check=not_negative,
    ),
    Setting(
        "stall_check_time_seconds", float, 60.0, "seconds",
        "After this long, rank 0 warns about every collective that some ranks submitted and others did "
        "not, listing both groups of ranks. 0 disables the stall inspector (and, unless rank failure "
        "detection is on, the idle heartbeat it needs: an idle coordinator then sleeps until work arrives).",
        horovod="HOROVOD_STALL_CHECK_TIME_SECONDS",
        check=not_negative,
    ),
    Setting(
        "stall_shutdown_time_seconds", float, 0.0, "seconds",
        "After this long stalled, gradsync shuts down on every rank and every pending collective fails "
        "with the stall report (StallError). 0: never; only the warning.",
        horovod="HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
        check=not_negative,
    ),
    Setting(
        "rank_failure_timeout_seconds", float, 30.0, "seconds",
        "A rank whose process died or hung is declared lost within this time: every pending and later "
        "operation on the other ranks fails with RankFailureError naming it, and gradsync aborts the "
        "MPI job at exit (non-zero exit status). Also makes an idle coordinator join a negotiation "
        "cycle every quarter of it (at most every 15 s). 0 disables detection; otherwise at least 0.5.",
        check=off_or_at_least(MIN_FAILURE_TIMEOUT),
        must_match="failure detection needs the same periods on every rank",
    ),
    Setting(
        "join_divisor", str, "size", "name",
        "What Average divides by while some ranks have called join(): 'size' (the world size, as "
        "Horovod and DDP's default divide_by_initial_world_size=True) or 'contributors' (the ranks "
        "that have not joined).",
        check=one_of("size", "contributors"),
        must_match="what Average divides by",
    ),
    Setting(
        "cache_capacity", int, 1024, "entries",
        "Response cache size. A collective seen before (same name, dtype, shape, op, ...) is negotiated "
        "with one bit in a small bitwise allreduce instead of a gather and broadcast of its description. "
        "0 disables the cache.",
        horovod="HOROVOD_CACHE_CAPACITY",
        check=not_negative,
        must_match="a cached collective is one bit at the same place on every rank",
    ),
    Setting(
        "hierarchical_allreduce", bool, False, "bool",
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
        "autotune", bool, False, "bool",
        "Tune the fusion threshold and cycle time on the running job from measured throughput, and log "
        "the chosen values.",
        horovod="HOROVOD_AUTOTUNE",
    ),
    Setting(
        "autotune_window", float, 2.0, "seconds",
        "How long autotune measures each candidate setting.",
        check=not_negative,
    ),
    Setting(
        "gpu_operations", str, "", "name",
        "How collectives of GPU tensors move data: 'NCCL' (device buffers, NCCL on a CUDA stream of "
        "its own) or 'MPI' (through pinned host buffers and MPI; lets several ranks share one GPU). "
        "Empty: NCCL when the NCCL library loads, else MPI. Must be the same on every rank.",
        horovod="HOROVOD_GPU_OPERATIONS",
        check=gpu_operations,
    ),
    Setting(
        "log_level", str, "WARNING", "name",
        "Level of the 'gradsync' logger: DEBUG, INFO, WARNING, ERROR.",
        horovod="HOROVOD_LOG_LEVEL",
    ),
)


_BY_KEYWORD = {s.keyword: s for s in SETTINGS}
MUST_MATCH = tuple(s for s in SETTINGS if s.must_match)
# Horovod values that mean something else here: HOROVOD_TIMELINE=DYNAMIC opens no file at init (the
# timeline starts with gradsync.torch.start_timeline()), and Horovod's extra log levels.
_HOROVOD_VALUES = {("timeline", "DYNAMIC"): "", ("log_level", "TRACE"): "DEBUG",
                   ("log_level", "FATAL"): "CRITICAL"}


def horovod_value(setting: Setting, environ: dict[str, str]) -> str | None:
    """The value Horovod's variable gives ``setting`` in ``environ`` (translated where Horovod's
    meaning differs, see docs/configuration.md), or None when Horovod has no say.

    ``HOROVOD_STALL_CHECK_DISABLE=1`` sets the stall check time to 0 (off), as in Horovod.
    """
    if setting.keyword == "stall_check_time_seconds" and environ.get(
            "HOROVOD_STALL_CHECK_DISABLE", "").strip() in ("1", "true", "True"):
        return "0"
    if not setting.horovod or setting.horovod not in environ:
        return None
    raw = environ[setting.horovod]
    return _HOROVOD_VALUES.get((setting.keyword, raw.strip().upper()), raw)


def _given(setting: Setting, overrides: dict[str, Any], environ: dict[str, str]) -> tuple[Any, str] | None:
    """The raw value given for ``setting`` and where it came from (the keyword, GRADSYNC_ variable or
    Horovod's variable, first found), or None when none gives it."""
    if overrides.get(setting.keyword) is not None:
        return overrides[setting.keyword], f"init({setting.keyword}=...)"
    if setting.env in environ:
        return environ[setting.env], setting.env
    horovod = horovod_value(setting, environ)
    return None if horovod is None else (horovod, setting.horovod or setting.env)


def _value(setting: Setting, raw: Any, source: str) -> Any:
    """``raw`` parsed and checked; ValueError naming ``source`` and ``raw`` otherwise."""
    try:
        value = raw if isinstance(raw, bool) else setting.parse(str(raw))
    except ValueError as exc:
        raise ValueError(f"{source}={raw!r} is not a valid {setting.unit} value: {exc}") from None
    problem = setting.check(value)
    if problem is not None:
        raise ValueError(f"{source}={raw!r} {problem}")
    return value


def _resolve(cls, overrides: dict[str, Any] | None = None, environ: dict[str, str] | None = None) -> Config:
    """Build the configuration from keyword ``overrides``, then ``environ``, then the defaults.

    Raises:
        TypeError: an unknown keyword in ``overrides``.
        ValueError: a value that does not parse, or that its setting's check refuses, naming the
            variable (or keyword) and the value.
    """
    environ = os.environ if environ is None else environ
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(_BY_KEYWORD))
    if unknown:
        raise TypeError(f"gradsync.init() got unknown settings {unknown}; known: {sorted(_BY_KEYWORD)}")
    values = {}
    for setting in SETTINGS:
        given = _given(setting, overrides, environ)
        values[setting.keyword] = setting.default if given is None else _value(setting, *given)
    return cls(**values)


Config = dataclasses.make_dataclass(
    "Config", [(s.keyword, s.type, dataclasses.field(default=s.default)) for s in SETTINGS], frozen=True,
    namespace={"resolve": classmethod(_resolve), "__module__": __name__,
               "__doc__": "Resolved configuration of one ``gradsync.init()``: one field per entry of "
                          ":data:`SETTINGS`, named by its keyword, with its default."})


def markdown_table() -> str:
    """The settings as a Markdown table (variable, unit, default, meaning, Horovod's variable read
    when it is unset), for docs/configuration.md."""
    rows = ["| variable | unit | default | meaning | Horovod fallback |", "|---|---|---|---|---|"]
    rows += [f"| `{s.env}` | {s.unit} | `{s.default}` | {s.doc} | "
             f"{f'`{s.horovod}`' if s.horovod else '-'} |" for s in SETTINGS]
    return "\n".join(rows)


def check_shared(comm, config: Config) -> None:
    """Check that every rank of ``comm`` has the same value of each setting of :data:`MUST_MATCH`.
    Collective over ``comm``.

    Raises:
        GradsyncError: some differ, on every rank alike; the message names those settings, why each
            must match, and each rank's values of them.
    """
    mine = tuple(getattr(config, s.keyword) for s in MUST_MATCH)
    everyone = comm.allgather(mine)
    differ = [i for i, s in enumerate(MUST_MATCH) if len({values[i] for values in everyone}) > 1]
    if not differ:
        return
    names = " and ".join(f"{MUST_MATCH[i].env} ({MUST_MATCH[i].must_match})" for i in differ)
    listed = ", ".join(f"rank {rank}: " + ", ".join(f"{MUST_MATCH[i].keyword}={values[i]}" for i in differ)
                       for rank, values in enumerate(everyone))
    raise GradsyncError(f"gradsync: {names} must be the same on every rank; got {listed}")
