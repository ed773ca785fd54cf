"""Running a worker's checks so that a failure ends the whole MPI job instead of hanging it."""

import os
import sys
import traceback

from mpi4py import MPI

import gradsync

#: Workers with numpy and torch halves run the torch half only when started with this flag.
TORCH_FLAG = "--torch"


def run_checks(namespace: dict, prefix: str = "check_", last: list | None = None) -> int:
    """Run every function of ``namespace`` whose name starts with ``prefix``, in name order, then
    the functions in ``last``.

    Prints ``rank R: ok NAME`` after each; on any failure prints the traceback and aborts the job
    (the other ranks would otherwise wait for this one forever). Then shuts gradsync down and
    returns how many checks ran.
    """
    rank = gradsync.rank()
    checks = [v for k, v in sorted(namespace.items()) if k.startswith(prefix) and callable(v)]
    checks += last or []
    try:
        for check in checks:
            check()
            print(f"rank {rank}: ok {check.__name__}", flush=True)
    except BaseException:
        traceback.print_exc()
        print(f"rank {rank}: FAILED", flush=True)
        MPI.COMM_WORLD.Abort(1)
        os._exit(1)
    gradsync.shutdown()
    return len(checks)


def torch_requested() -> bool:
    """Whether the worker was started with ``--torch`` (by a test marked ``torch``)."""
    return TORCH_FLAG in sys.argv[1:]


def run_numpy_or_torch_checks(namespace: dict) -> int:
    """For a worker with a numpy half (``check_*``) and a torch half (``torch_check_*``).

    Started with ``--torch``, it runs the torch half; otherwise the numpy half, after which torch
    must not have been imported by anything (gradsync included): it prints
    ``rank R: torch not imported`` or aborts the job. So the numpy half runs where torch is not
    installed, and proves there that it never needs it.
    """
    if torch_requested():
        return run_checks(namespace, prefix="torch_check_")
    count = run_checks(namespace, last=[check_torch_was_not_imported])
    print(f"rank {MPI.COMM_WORLD.Get_rank()}: torch not imported", flush=True)
    return count


def check_torch_was_not_imported() -> None:
    """Fails when torch or jax, or any of their submodules, is in ``sys.modules``."""
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "jax", "jaxlib"))
    assert not loaded, f"the numpy checks imported a framework: {loaded[:5]}"
