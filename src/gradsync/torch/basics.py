"""Horovod's basic API (``horovod.common.basics`` as ``horovod.torch`` exports it) on gradsync.

Starting and stopping, topology, the build flags, the dynamic timeline, process sets and the
reduction ops, with the signatures of horovod.torch 0.28.1. The flags answer for gradsync: it
always runs on MPI (mpi4py), has no Gloo, DDL, oneCCL or ROCm path, and reports NCCL when its
NCCL binding finds a library at run time (gradsync is not compiled against it).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ..backends import nccl_api as nccl
from ..engine.protocol import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from ..errors import GradsyncError
from ..process import runtime
from ..process.runtime import (
    cross_rank,
    cross_size,
    is_initialized,
    local_rank,
    local_size,
    rank,
    size,
)
from ..process_sets import ProcessSet, add_process_set, global_process_set
from ..process_sets import remove_process_set as _remove_process_set

HorovodInternalError = GradsyncError
"""What Horovod raises when a collective fails: here every gradsync runtime error (a RuntimeError:
CollectiveError, ShutdownError, StallError, RankFailureError, ...) is one."""

__all__ = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size",
    "cross_size", "rank", "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported",
    "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built",
    "ccl_built", "cuda_built", "rocm_built", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "HorovodInternalError", "handle_average_backwards_compatibility",
]


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | str | None = None,
         **settings: Any) -> None:
    """Start gradsync, as ``horovod.torch.init`` (see :func:`gradsync.init` for ``settings``).

    Args:
        comm: None (every rank of MPI_COMM_WORLD), an mpi4py communicator (duplicated), or a list
            of world ranks: those ranks form the job, numbered in the list's order (every world
            rank must call init; an empty list means every rank).
        process_sets: process sets to register at once, or ``"dynamic"`` (accepted for Horovod's
            sake: gradsync always lets you add sets later).

    Raises:
        ValueError: ranks outside the world, repeated, or this rank not among them; a
            ``process_sets`` string other than "dynamic". Others as :func:`gradsync.init`.
    """
    if runtime.is_initialized():
        return
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError(f"gradsync: init(process_sets={process_sets!r}): expected a list of "
                             "ProcessSet objects, None or 'dynamic'")
        process_sets = None
    if comm is not None and not hasattr(comm, "Get_rank"):
        comm = _communicator_of(list(comm))
    runtime.init(comm, list(process_sets) if process_sets else None, **settings)


def _communicator_of(ranks: list[int]):
    """A communicator of the world ranks ``ranks`` (in their order); None for an empty list."""
    if not ranks:
        return None
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    me, everyone = world.Get_rank(), world.Get_size()
    if len(set(ranks)) != len(ranks) or any(not 0 <= r < everyone for r in ranks):
        raise ValueError(f"gradsync: rank {me}: init(comm={ranks}): ranks must be distinct world "
                         f"ranks 0 .. {everyone - 1}")
    member = me in ranks
    comm = world.Split(0 if member else MPI.UNDEFINED, key=ranks.index(me) if member else 0)
    if not member:
        raise ValueError(f"gradsync: rank {me}: init(comm={ranks}): this rank is not in the list; "
                         "only the listed ranks may initialise")
    return comm


def shutdown() -> None:
    """Stop gradsync on every rank, as ``horovod.torch.shutdown`` (see :func:`gradsync.shutdown`)."""
    runtime.shutdown()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing the timeline (Chrome trace) to ``file_path``, as Horovod's ``start_timeline``.

    Rank 0 writes ``file_path`` (every rank its own with ``{rank}`` in the path), each other
    process set ``file_path.set<id>``; a timeline already being written is closed first. Needs no
    ``HOROVOD_TIMELINE`` / ``GRADSYNC_TIMELINE`` setting. ``mark_cycles``: also write a CYCLE
    marker per negotiation cycle. Spans of DistributedOptimizers created before the call (their
    BACKWARD rows) are not recorded. See docs/timeline.md for the phases.

    Raises:
        NotInitializedError: before ``init()`` (Horovod: ValueError).
    """
    runtime.get().replace_timelines(str(file_path), bool(mark_cycles))


def stop_timeline() -> None:
    """Stop writing the timeline and close its files, as Horovod's ``stop_timeline``.

    Raises:
        NotInitializedError: before ``init()`` (Horovod: ValueError).
    """
    runtime.get().replace_timelines("")


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks (Horovod's ``is_homogeneous``).

    Raises:
        NotInitializedError: before ``init()``.
    """
    return runtime.get().homogeneous


def mpi_threads_supported() -> bool:
    """True: gradsync needs MPI_THREAD_MULTIPLE and ``init()`` checks for it, so you may mix
    gradsync with your own mpi4py calls.

    Raises:
        NotInitializedError: before ``init()`` (Horovod: ValueError).
    """
    runtime.get()
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    """True once gradsync is initialised: MPI is then its controller and data path."""
    return runtime.is_initialized()


def mpi_built() -> bool:
    """True: gradsync always runs on MPI (through mpi4py)."""
    return True


def gloo_enabled() -> bool:
    """False: gradsync has no Gloo controller."""
    return False


def gloo_built() -> bool:
    """False: gradsync has no Gloo controller."""
    return False


def nccl_built() -> int:
    """NCCL's version code (``NCCL_VERSION_CODE``, e.g. 21903 for 2.19.3) when gradsync's NCCL
    binding loads a library, else 0; as Horovod's, so ``if hvd.nccl_built() >= 2700`` works.
    gradsync loads NCCL at run time (see :func:`gradsync.nccl_built`); needs neither a GPU nor
    ``init()``, never raises."""
    version = nccl.nccl_version()
    if version is None:
        return 0
    major, minor, patch = version
    return major * 10000 + minor * 100 + patch if (major, minor) >= (2, 9) else \
        major * 1000 + minor * 100 + patch


def ddl_built() -> bool:
    """False: gradsync has no IBM DDL path."""
    return False


def ccl_built() -> bool:
    """False: gradsync has no oneCCL path."""
    return False


def cuda_built() -> bool:
    """True when this torch is built with CUDA: gradsync then reduces CUDA tensors (docs/gpu.md)."""
    return bool(torch.backends.cuda.is_built())


def rocm_built() -> bool:
    """False: gradsync's GPU path is CUDA's (NCCL); ROCm builds of torch are untested."""
    return False


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (collective over every rank), as Horovod's: True if it was
    removed, False (and nothing done) for the global set or a set that is not registered.

    See :func:`gradsync.remove_process_set`, which raises instead of returning False.
    """
    if process_set.process_set_id is None or process_set.process_set_id == 0:
        return False
    _remove_process_set(process_set)
    return True


def handle_average_backwards_compatibility(op: ReduceOp | None, average: bool | None) -> ReduceOp:
    """The op that Horovod's deprecated ``average=`` argument stands for.

    ``op`` wins when given; ``average=True`` means Average and ``average=False`` Sum (with a
    DeprecationWarning, as Horovod 0.19+); neither means Average.

    Raises:
        ValueError: both ``op`` and ``average`` given (as Horovod).
    """
    if op is not None:
        if average is not None:
            raise ValueError("gradsync: the op parameter supersedes average; give only one of them")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average

