"""The torch collectives that gradsync.torch's own pieces share with its Horovod namespace.

:mod:`gradsync.torch.mpi_ops` (Horovod's API) and gradsync.torch's internals (the gradient
reducer, the optimizer's Adasum step) both build on these; the internals import them from here,
never from the compatibility layer.

* :func:`reduce_async`: a reduction of torch tensors on any device, with GPU staging where the core
  reduces in host memory only (reducescatter, Adasum) and Horovod's integer scaling (an integer
  ``Average`` is the sum times ``1/divisor`` in float64, truncated toward zero; scale factors
  apply to integers too).
* :func:`sparse_allreduce_async`: the sparse COO reduction (an allgather of indices and values).

Where an Average is finished here rather than in the core (integer scaling, the sparse values),
the divisor is the one the core decided for that negotiated collective
(:attr:`gradsync.Handle.divisor`: the set's size, or with ``GRADSYNC_JOIN_DIVISOR=contributors``
the ranks that had not joined), so dense, sparse and integer gradients are divided alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import ops
from ..engine.protocol import ReduceOp
from ..handles import GroupHandle, Handle
from ..process import runtime
from ..process_sets import ProcessSet, global_process_set

_INTEGER = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})


class Finishing:
    """A gradsync handle and the step that turns its result into the caller's (integer scaling,
    the copy back to the GPU or into an in-place tensor, received splits in their dtype). Works
    with :func:`gradsync.synchronize` and :func:`gradsync.poll` like the handle itself."""

    __slots__ = ("name", "_handle", "_finish", "_result", "_finished")

    def __init__(self, handle: Handle | GroupHandle, finish: Callable[[Any], Any]) -> None:
        self.name = handle.name
        self._handle, self._finish = handle, finish
        self._result, self._finished = None, False

    @property
    def divisor(self) -> int:
        """The Average divisor the core used (:attr:`gradsync.Handle.divisor`); 0 until done."""
        return self._handle.divisor

    def done(self) -> bool:
        """True once the collective has finished; never blocks."""
        return self._handle.done()

    def wait(self, timeout: float | None = None) -> Any:
        """The collective's finished result; raises as :meth:`gradsync.Handle.wait`."""
        if not self._finished:
            self._result = self._finish(self._handle.wait(timeout))
            self._finished = True
        return self._result


def grad_name(name: str) -> str:
    """The name of the collective that carries the gradient of collective ``name`` (Horovod's
    autograd functions)."""
    return f"{name}.grad"


def scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Horovod's integer scaling: multiplied in float64, truncated back to the dtype."""
    return (tensor.double() * factor).to(tensor.dtype)


def _core_reduce(inputs: list, name: str | None, op: ReduceOp, prescale: float, postscale: float,
                 in_place: bool, process_set: ProcessSet, scatter: bool, grouped: bool):
    if scatter:
        with ops.refusing_join():  # Horovod's reducescatter fails beside a joined rank
            if grouped:
                return ops.grouped_reducescatter_async(inputs, name, op, prescale, postscale, process_set)
            return ops.reducescatter_async(inputs[0], name, op, prescale, postscale, process_set)
    if grouped:
        call = ops.grouped_allreduce_async_ if in_place else ops.grouped_allreduce_async
        return call(inputs, name, op, prescale, postscale, process_set)
    call = ops.allreduce_async_ if in_place else ops.allreduce_async
    return call(inputs[0], name, op, prescale, postscale, process_set)


def reduce_async(tensors: Sequence[Any], in_place: bool, name: str | None, op: Any, prescale: float,
                 postscale: float, process_set: ProcessSet, scatter: bool = False,
                 grouped: bool = False) -> Handle | GroupHandle | Finishing:
    """Start an allreduce (``scatter``: a reducescatter) of ``tensors`` (one; ``grouped``: a
    group) with GPU staging and Horovod's integer scaling (module docstring).

    Args:
        tensors: torch tensors (or what :mod:`gradsync.ops` takes) of one dtype and device.
        in_place: write each result into its tensor. ``op``: a :class:`~gradsync.ReduceOp`.
        prescale, postscale: multiply before and after the reduction (integers: in float64,
            truncated).

    Returns:
        A handle for :func:`gradsync.synchronize`: the core's own when nothing is left to finish,
        else a :class:`Finishing`.

    Raises:
        As :func:`gradsync.allreduce_async` (or the reducescatter and grouped forms).
    """
    tensors = list(tensors)
    first = tensors[0] if tensors and isinstance(tensors[0], torch.Tensor) else None
    device = first.device if first is not None else None
    stage = device is not None and device.type == "cuda" and (scatter or op == ReduceOp.Adasum)
    integer = first is not None and first.dtype in _INTEGER and (
        op == ReduceOp.Average or prescale != 1.0 or postscale != 1.0)
    core_op, tail, average, inputs = op, postscale, False, tensors
    if integer:
        average = op == ReduceOp.Average
        core_op = ReduceOp.Sum if average else op
        if prescale != 1.0:
            inputs = [scaled(t, prescale) for t in tensors]
        prescale = postscale = 1.0
    if stage:
        inputs = [t.cpu() for t in inputs]
    core_in_place = in_place and all(a is b for a, b in zip(inputs, tensors))
    handle = _core_reduce(inputs, name, core_op, prescale, postscale, core_in_place, process_set,
                          scatter, grouped)
    if not integer and not stage and core_in_place == in_place:
        return handle

    def finish(result: Any) -> Any:
        factor = (tail / handle.divisor if average else tail) if integer else 1.0
        outputs = [_finish_one(t, r, factor, in_place)
                   for t, r in zip(tensors, result if grouped else [result])]
        return outputs if grouped else outputs[0]

    return Finishing(handle, finish)


def _finish_one(tensor: torch.Tensor, result: torch.Tensor, factor: float,
                in_place: bool) -> torch.Tensor:
    if factor != 1.0:
        result = scaled(result, factor)
    if result.device != tensor.device:
        result = result.to(tensor.device)
    if in_place and result is not tensor:
        return tensor.copy_(result)
    return result


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], name: str | None = None,
                             op: ReduceOp = ReduceOp.Average, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set
                             ) -> GroupHandle | Finishing:
    """In-place grouped allreduce of torch tensors on any device (:func:`reduce_async`); what the
    optimizer's Adasum step submits (CUDA tensors are staged through host memory)."""
    return reduce_async(tensors, True, name, op, prescale_factor, postscale_factor, process_set,
                        grouped=True)


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: ReduceOp,
                           process_set: ProcessSet = global_process_set) -> Callable[[], torch.Tensor]:
    """Start the reduction of a sparse COO tensor by allgathering its indices and values
    (``horovod.torch.sparse_allreduce_async``).

    Returns a function that waits and returns the sparse sum over ranks (uncoalesced: every
    rank's entries, in rank order; for ``op=Average`` divided by the divisor the core decided for
    the values' allgather, as for a dense gradient: :attr:`gradsync.Handle.divisor`), of
    ``tensor``'s shape. The indices are allgathered as ``name.indices``, the values as
    ``name.values``. A rank that has joined contributes no entries.

    Raises:
        TypeError: ``tensor`` is not sparse. Others as :func:`gradsync.allgather_async`.
    """
    if tensor.layout != torch.sparse_coo:
        raise TypeError(f"gradsync: rank {runtime.get().rank}: sparse_allreduce_async {name!r}: "
                        f"expected a sparse COO tensor, got layout {tensor.layout}")
    indices = ops.allgather_async(tensor._indices().t().contiguous(), name=f"{name}.indices",
                                  process_set=process_set)
    values = ops.allgather_async(tensor._values().contiguous(), name=f"{name}.values",
                                 process_set=process_set)

    def handle() -> torch.Tensor:
        gathered = ops.synchronize(values)
        if op == ReduceOp.Average:
            gathered = gathered / values.divisor
        return torch.sparse_coo_tensor(ops.synchronize(indices).t(), gathered, tensor.shape,
                                       check_invariants=False)

    return handle
