"""``horovod.tensorflow``'s build flags and topology ops, answered for gradsync.tensorflow.

gradsync.tensorflow moves every tensor through host memory with MPI (docs/tensorflow.md), so it
reports MPI built and nothing else: no NCCL, Gloo, oneCCL, DDL or ROCm path, and no GPU
(``cuda_built`` False), whatever TensorFlow itself was built with.
"""

from __future__ import annotations

import tensorflow as tf

from ..process import runtime


def mpi_built() -> bool:
    """True: gradsync always runs on MPI (through mpi4py)."""
    return True


def mpi_enabled() -> bool:
    """True once :func:`gradsync.init` has started MPI."""
    return runtime.is_initialized()


def nccl_built() -> int:
    """0: gradsync.tensorflow reduces TensorFlow tensors in host memory, never with NCCL."""
    return 0


def gloo_built() -> bool:
    """False: gradsync has no Gloo controller (nor oneCCL, DDL or ROCm paths: the ``*_built``
    functions below answer the same)."""
    return False


ccl_built = ddl_built = rocm_built = gloo_enabled = gloo_built


def cuda_built() -> bool:
    """False: gradsync.tensorflow copies a GPU tensor through the host; it has no CUDA path."""
    return False


def _global_only(process_set_id: int, what: str) -> None:
    if process_set_id != 0:
        raise ValueError(f"gradsync: rank {runtime.rank()}: gradsync.tensorflow.{what} answers for "
                         f"the global process set (id 0) only, not id {process_set_id}; use "
                         "process_set.size() / process_set.rank()")


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """``size()`` as an int32 tensor (``horovod.tensorflow.size_op``).

    Raises:
        ValueError: ``process_set_id`` other than 0 (the global set).
    """
    _global_only(process_set_id, "size_op")
    return tf.constant(runtime.size(), tf.int32, name=name)


def rank_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """``rank()`` as an int32 tensor (``horovod.tensorflow.rank_op``).

    Raises:
        ValueError: ``process_set_id`` other than 0 (the global set).
    """
    _global_only(process_set_id, "rank_op")
    return tf.constant(runtime.rank(), tf.int32, name=name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    """``local_size()`` as an int32 tensor (``horovod.tensorflow.local_size_op``)."""
    return tf.constant(runtime.local_size(), tf.int32, name=name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """``local_rank()`` as an int32 tensor (``horovod.tensorflow.local_rank_op``)."""
    return tf.constant(runtime.local_rank(), tf.int32, name=name)
