"""The ``torch.distributed`` process group of the "gradsync" backend.

A :class:`GradsyncProcessGroup` is a Python ``dist.ProcessGroup`` on one gradsync process set (the
global set for the default group, one set per ``new_group``): every call submits to gradsync's
engine (negotiation, fusion, shared memory, MPI) through the public async ops and returns a Work
whose future completes from the group's completion thread (:mod:`.work`). Collectives are named
``torch.<group name>.<call>.<n>`` (for the calls the response cache serves, ``n`` modulo
:data:`SLOTS`): torch requires every rank of a group to issue its calls in the same order, so the
n-th call has the same name on every rank.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ...process import runtime
from ...process.polling import await_ranks
from ...process_sets import ProcessSet, global_process_set
from . import movement, reductions
from .point_to_point import PointToPoint
from .work import Completer, seconds, waited_at_once

BACKEND = "gradsync"
#: Engine names per call kind that rotate (:meth:`GradsyncProcessGroup.next_name`): 60 is divided
#: by every period up to 6 and by 10, 12, 15, 20 and 30.
SLOTS = 60
#: The calls whose collectives the response cache serves (allreduce, broadcast, reducescatter).
ROTATING = frozenset({"allreduce", "allreduce_coalesced", "reduce", "broadcast", "reduce_scatter"})


class GradsyncProcessGroup(dist.ProcessGroup):
    """A torch process group whose collectives run on gradsync's engine over ``process_set``.

    Args:
        rank: this process's rank in the group. size: the group's number of ranks.
        process_set: the registered gradsync process set of the group's ranks.
        world_ranks: the group's world ranks, in group-rank order (sorted).
        p2p_comm: the group's own MPI communicator for send and recv (None: they raise).
        timeout: the group's ``timeout`` (seconds; None: none): a call not finished that long
            after it was made fails with a timeout error (:class:`.work.Deadlines`), as gloo's.
    """

    def __init__(self, rank: int, size: int, process_set: ProcessSet, world_ranks: Sequence[int],
                 p2p_comm: Any = None, timeout: float | None = None) -> None:
        super().__init__(rank, size)
        self.process_set = process_set
        self._world_ranks = list(world_ranks)
        self._group_name = ""
        self._group_desc = ""
        self._counts: dict[str, int] = {}
        self._count_lock = threading.Lock()
        self._queue: Any = None  # the queue of the process set's coordinator (next_name)
        self.completer = Completer(f"pg{process_set.process_set_id}", timeout)
        self._p2p = PointToPoint(p2p_comm, f"pg{process_set.process_set_id}", timeout)

    # -- what the calls need
    def next_name(self, call: str) -> str:
        """The engine name of this group's next call (the same on every rank, see the module).

        The calls the response cache serves (:data:`ROTATING`) take their names from
        :data:`SLOTS` names per call kind, in turn: a loop that repeats a pattern of calls whose
        length divides :data:`SLOTS` gives each slot the same tensor signature every time, which
        the cache then negotiates with one bit. A slot still in flight from :data:`SLOTS` calls
        ago (many asynchronous calls outstanding) is waited for first, here, so that the name is
        free; which name a call gets depends only on the group's program order."""
        with self._count_lock:
            n = self._counts.get(call, 0)
            self._counts[call] = n + 1
        if call not in ROTATING:
            return f"torch.{self._group_name}.{call}.{n}"
        name = f"torch.{self._group_name}.{call}.{n % SLOTS}"
        queue = self._queue
        if queue is None or queue.closed:  # the set's coordinator's; a new one after a restart
            queue = self._queue = self._coordinator().queue
        for handle in queue.handles_named(name):
            try:
                handle.wait()
            except Exception:  # noqa: BLE001 - its own Work reports it; here only the name matters
                pass
        return name

    def _coordinator(self) -> Any:
        return runtime.get().coordinator_for(self.process_set, "gradsync: torch.distributed")

    def world_rank(self, group_rank: int) -> int:
        """The world rank of the group's rank ``group_rank`` (a root)."""
        if not 0 <= group_rank < len(self._world_ranks):
            raise ValueError(f"gradsync: root rank {group_rank} is not a rank of this group "
                             f"(0 .. {len(self._world_ranks) - 1})")
        return self._world_ranks[group_rank]

    # -- names and identity (c10d bookkeeping, DeviceMesh and FSDP2 read them)
    def getBackendName(self) -> str:  # noqa: N802 - the C++ trampoline's name
        return BACKEND

    def name(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    @property
    def _device_types(self) -> list[torch.device]:
        """CPU and CUDA tensors (torch's object collectives pick the CPU when it is listed)."""
        return [torch.device("cpu"), torch.device("cuda")]

    #: torch's batch_isend_irecv coalesces the messages of a backend that says so (NCCL's); this
    #: group posts each message at once instead (read through :meth:`_get_backend`).
    supports_coalescing = False

    def _get_backend(self, device: Any = None) -> GradsyncProcessGroup:
        """The group's backend for ``device``: the group itself (a Python process group has no C++
        backends; torch >= 2.15's ``batch_isend_irecv`` asks for one)."""
        return self

    def shutdown(self) -> None:
        """End the completion threads and free the send/recv communicator
        (``destroy_process_group``); gradsync itself keeps running."""
        self.completer.close()
        self._p2p.close()

    def abort(self) -> None:
        self.shutdown()

    # -- reductions
    def allreduce(self, tensors: Any, opts: Any = None) -> Any:
        with waited_at_once(opts) as blocking:
            return reductions.allreduce(self, _listed(tensors), opts, blocking)

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> Any:
        return reductions.allreduce_coalesced(self, tensors, opts)

    def reduce(self, tensors: Any, opts: Any) -> Any:
        with waited_at_once(opts):
            return reductions.reduce(self, tensors, opts)

    def reduce_scatter(self, outputs: Any, input_lists: Any, opts: Any = None) -> Any:
        return reductions.reduce_scatter(self, outputs, input_lists, opts)

    def reduce_scatter_single(self, output: Any, tensor: Any, opts: Any = None) -> Any:
        with waited_at_once(opts):
            return reductions.reduce_scatter_tensors(self, [output], [tensor], opts,
                                                     "reduce_scatter_tensor")

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return reductions.reduce_scatter_tensors(self, outputs, inputs, opts, "reduce_scatter_tensor")

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement
    def broadcast(self, tensors: Any, opts: Any) -> Any:
        with waited_at_once(opts):
            return movement.broadcast(self, _listed(tensors), opts)

    def allgather(self, output_lists: Any, inputs: Any, opts: Any = None) -> Any:
        with waited_at_once(opts):
            return movement.allgather(self, output_lists, inputs, opts)

    def allgather_coalesced(self, output_lists: Any, inputs: Any, opts: Any = None) -> Any:
        """``all_gather_coalesced``, whose ``output_lists[r][i]`` receives rank r's ``inputs[i]``."""
        by_input = [[outputs[i] for outputs in output_lists] for i in range(len(inputs))]
        return movement.allgather(self, by_input, inputs, opts, "all_gather_coalesced")

    def all_gather_single(self, output: Any, tensor: Any, opts: Any = None) -> Any:
        with waited_at_once(opts):
            return movement.allgather_into(self, [output], [tensor], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return movement.allgather_into(self, outputs, inputs, opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_lists: Any, inputs: Any, opts: Any) -> Any:
        return movement.gather(self, output_lists, inputs, opts)

    def scatter(self, outputs: Any, input_lists: Any, opts: Any) -> Any:
        return movement.scatter(self, outputs, input_lists, opts)

    def alltoall(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return movement.alltoall(self, outputs, inputs, opts)

    def all_to_all_single(self, output: Any, tensor: Any, output_splits: Any, input_splits: Any,
                          opts: Any = None) -> Any:
        return movement.alltoall_single(self, output, tensor, output_splits, input_splits, opts)

    alltoall_base = all_to_all_single

    def barrier(self, opts: Any = None) -> Any:
        return movement.barrier(self, opts)

    # -- point to point, beside the engine (see point_to_point)
    def send(self, tensors: Any, dst: int, tag: int = 0) -> Any:
        return self._p2p.send(_listed(tensors), dst, tag)

    def recv(self, tensors: Any, src: int, tag: int = 0) -> Any:
        return self._p2p.recv(_listed(tensors), src, tag)

    def recv_anysource(self, tensors: Any, tag: int = 0) -> Any:
        return self._p2p.recv(_listed(tensors), None, tag)

    def __repr__(self) -> str:
        return (f"<GradsyncProcessGroup {self._group_name!r} rank {self.rank()} of {self.size()}, "
                f"{self.process_set}>")


def _listed(tensors: Any) -> list[torch.Tensor]:
    """A call's tensors as a list (torch passes a list; a bare tensor is accepted too)."""
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def create(opts: Any, pg_options: Any = None) -> GradsyncProcessGroup:
    """The backend's creator (``Backend.register_backend(..., extended_api=True)``): the group of
    ``opts.global_ranks_in_group`` (empty: the default group, every rank), on its process set.

    Raises:
        ValueError: torch's rank or size disagree with gradsync's; group ranks that are not sorted.
        torch.distributed.DistBackendError: a member of the group did not create it within the
            group's timeout (:func:`gradsync.process.polling.await_ranks`; the message names the
            missing ranks).
    """
    runtime.init()  # no-op when running; the rendezvous already initialised gradsync for the default group
    rt = runtime.get()
    ranks = list(opts.global_ranks_in_group) or list(range(rt.size))
    if ranks != sorted(ranks):
        raise ValueError(f"gradsync: a process group's ranks must be in increasing order, got {ranks}")
    if not (len(ranks) == opts.group_size and 0 <= opts.group_rank < len(ranks)
            and ranks[opts.group_rank] == rt.rank):
        hint = ""
        if rt.size == 1 < opts.group_size:  # torchrun's processes, or others no MPI launcher started
            hint = ("; gradsync's ranks are MPI's: start the script with `mpiexec -n N` or `srun` "
                    "(under torchrun each process is an MPI job of one rank)")
        group = f"group {ranks}" if opts.global_ranks_in_group else "the default group"
        raise ValueError(f"gradsync: rank {rt.rank}: torch says rank {opts.group_rank} of "
                         f"{opts.group_size} in {group}, but this is gradsync's rank {rt.rank} "
                         f"of {rt.size}{hint}")
    others = _devices_of_other_backends()
    if others:
        warnings.warn(f"gradsync: rank {rt.rank}: the backend list gives {others} to another backend, "
                      "but torch uses the process group that gradsync's backend returns for every "
                      "device: their collectives run on gradsync too. Name gradsync alone, or leave "
                      "it out", stacklevel=2)
    timeout = seconds(getattr(opts, "timeout", None))
    what = f"new_group({ranks})" if opts.global_ranks_in_group else "init_process_group"
    try:  # the members' collective calls below would wait forever for a member that never comes
        await_ranks(rt.control, rt.rank, ranks, timeout, what)
    except TimeoutError as error:
        raise dist.DistBackendError(str(error)) from error
    process_set = _process_set(rt, ranks)
    return GradsyncProcessGroup(opts.group_rank, opts.group_size, process_set, ranks, _p2p_comm(rt, ranks),
                                timeout)


def _devices_of_other_backends() -> dict[str, str]:
    """The devices that the backend list of the group torch is making (``"cpu:gloo,cuda:gradsync"``,
    read from the frame of torch's ``_new_process_group_helper``, which calls the creator) gives to
    a backend other than gradsync; empty where there is none or the frame is not found."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "_new_process_group_helper":
        frame = frame.f_back
    config = frame.f_locals.get("backend_config") if frame is not None else None
    if config is None:
        return {}
    return {str(device): str(backend) for device, backend in config.get_device_backend_map().items()
            if str(backend).lower() != "gradsync"}


def _p2p_comm(rt: Any, ranks: list[int]) -> Any:
    """A new communicator of ``ranks`` for the group's send and recv, made collectively by the
    group's members (on the user thread's communicator, which the coordinators do not use)."""
    if len(ranks) == rt.size:
        return rt.control.Dup()
    group = rt.control.Get_group().Incl(ranks)
    comm = rt.control.Create_group(group)
    group.Free()
    return comm


def _process_set(rt: Any, ranks: list[int]) -> ProcessSet:
    """The process set of ``ranks``: the global set, or one registered by the group's members (torch
    calls the creator on members only), shared by the torch groups of the same ranks. A set the
    user registered is not borrowed: the user may remove it."""
    if ranks == list(range(rt.size)):
        return global_process_set
    for ident, state in list(rt.process_sets.items()):
        if ident >= runtime.MEMBER_SET_IDS and state.process_set.ranks == ranks:
            return state.process_set
    return rt.add_member_process_set(ProcessSet(ranks))
