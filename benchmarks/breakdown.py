"""Where a training step's exchange time goes: timers around gradsync's parts, per step.

:func:`install` wraps, in this process only (the benchmarks' own instrumentation; the library is
unchanged), the functions that one step's gradient exchange passes through:

* ``host_fn``: the adapter's function at the framework's boundary, the whole exchange as the
  framework sees it: the XLA custom call's Python body (jax), the ``tf.numpy_function``'s host
  function (tensorflow), ``gradsync.keras._torch.grouped_allreduce`` (torch: the train step is eager; every gradient's
  in-place allreduce, submitted and waited for);
* ``negotiate``: the coordinator's negotiation cycles (:meth:`Negotiator.cycle`): one small
  allreduce that every rank must reach, so it also holds the **waiting** for the slower rank;
* ``copies``: the core's fusion copies (:func:`gradsync.executors.plan.pack` and ``unpack``:
  gradients into the fusion buffer and the results out, the Average's scale folded in);
* ``allreduce``: the data's allreduce itself (:meth:`MpiBackend.allreduce`: shared memory or MPI);
* ``other`` (derived): ``host_fn`` less the three above: submission, handles, the Python of the
  adapter and of the cycle.

What the step costs beyond ``host_fn`` (the op boundary: the framework handing its tensors to
Python and taking the results back, a copy where it does not alias, and the two ranks' cores
contending for memory) is the step time less the floor less ``host_fn``. The parts are wall
times, whichever thread ran them (the calling thread when the coordinator runs the cycle there,
else the coordinator's thread while the caller waits): the step waits for all of them. On a machine
shared with other jobs they grow with its load, as the step does: read them against the step's
wall time of the same launches. Each timer adds about a microsecond per call.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

PARTS = ("host_fn", "negotiate", "copies", "allreduce")
_totals = dict.fromkeys(PARTS, 0.0)
_steps: list[dict[str, float]] = []


def _timed(part: str, function: Callable) -> Callable:
    """``function`` adding its wall time to ``part``."""
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            _totals[part] += time.perf_counter() - start

    return wrapper


def _wrap_body(part: str, function: Callable, position: int) -> Callable:
    """``function`` with its argument ``position`` (a callable: the host function) timed."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        args = list(args)
        args[position] = _timed(part, args[position])
        return function(*args, **kwargs)

    return wrapper


def install(framework: str) -> None:
    """Wrap the core's parts and ``framework``'s boundary (``jax``, ``tensorflow`` or ``torch``);
    call before the train step is built (traced) and before ``gradsync.init()``."""
    from gradsync.backends.mpi import MpiBackend
    from gradsync.engine.negotiation import Negotiator
    from gradsync.executors import host

    Negotiator.cycle = _timed("negotiate", Negotiator.cycle)
    MpiBackend.allreduce = _timed("allreduce", MpiBackend.allreduce)
    host.pack = _timed("copies", host.pack)
    host.unpack = _timed("copies", host.unpack)
    if framework == "jax":
        from gradsync.jax import xla_ffi

        xla_ffi.call = _wrap_body("host_fn", xla_ffi.call, 0)
    elif framework == "tensorflow":
        from gradsync.tensorflow import mpi_ops

        mpi_ops.call_on_host = _wrap_body("host_fn", mpi_ops.call_on_host, 1)
    elif framework == "torch":
        from gradsync.keras import _torch

        _torch.grouped_allreduce = _timed("host_fn", _torch.grouped_allreduce)


def per_step(step: Callable[[], object]) -> Callable[[], object]:
    """``step`` that records how much of each part it took."""

    def recorded() -> object:
        before = dict(_totals)
        try:
            return step()
        finally:
            _steps.append({part: _totals[part] - before[part] for part in PARTS})

    return recorded


def line(steps: int) -> str:
    """``breakdown_us host_fn=<us> negotiate=<us> copies=<us> allreduce=<us> other=<us>``: medians
    of the last ``steps`` recorded steps (the timed ones); ``other`` is host_fn less the rest."""
    timed = _steps[-steps:]
    median = {part: statistics.median(s[part] for s in timed) * 1e6 for part in PARTS}
    other = statistics.median((s["host_fn"] - s["negotiate"] - s["copies"] - s["allreduce"]) * 1e6
                              for s in timed)
    return "breakdown_us " + " ".join(f"{p}={median[p]:.1f}" for p in PARTS) + f" other={other:.1f}"


def table(entries: list[tuple[str, list[float], list[float], list[dict[str, float]]]]) -> None:
    """Print where each gradsync configuration's step goes beyond its floor, in wall ms of rank 0
    (medians over launches of each launch's median). ``entries``: (label, the configuration's step
    us per launch, its floor's, the launches' :func:`line` fields)."""
    print("\ngradsync's step, wall ms of rank 0 (medians over launches): above = step - floor; boundary ="
          " above - host_fn\n(the op boundary, the framework's copies, the two ranks contending)")
    print(f"{'configuration':44s} {'step':>6s} {'floor':>6s} {'above':>6s} {'host_fn':>7s} "
          f"{'negotiate':>9s} {'copies':>6s} {'allreduce':>9s} {'other':>6s} {'boundary':>8s}")
    for label, steps, floor_steps, launches in entries:
        if not launches:
            continue
        step, floor = statistics.median(steps) / 1e3, statistics.median(floor_steps) / 1e3
        part = {k: statistics.median(p[k] for p in launches) / 1e3 for k in launches[0]}
        print(f"{label:44s} {step:6.2f} {floor:6.2f} {step - floor:6.2f} {part['host_fn']:7.2f} "
              f"{part['negotiate']:9.2f} {part['copies']:6.2f} {part['allreduce']:9.2f} "
              f"{part['other']:6.2f} {step - floor - part['host_fn']:8.2f}", flush=True)
