"""Running a worker's checks so that a failure ends the whole MPI job instead of hanging it."""

import os
import traceback

from mpi4py import MPI

import gradsync


def run_checks(namespace: dict, prefix: str = "check_") -> int:
    """Run every function of ``namespace`` whose name starts with ``prefix``, in name order.

    Prints ``rank R: ok NAME`` after each; on any failure prints the traceback and aborts the job
    (the other ranks would otherwise wait for this one forever). Then shuts gradsync down and
    returns how many checks ran.
    """
    rank = gradsync.rank()
    checks = [v for k, v in sorted(namespace.items()) if k.startswith(prefix) and callable(v)]
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
