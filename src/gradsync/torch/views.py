"""numpy views of torch tensors' memory that leave the tensor as it was (:func:`numpy_view`), for
the torch adapter, its device runtime and torch.distributed's messages."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from ..arrays import dtypes

#: gradsync's name of each torch dtype it moves (the torch adapter's dtype names; the numpy dtype of
#: a name is :data:`gradsync.arrays.dtypes.NUMPY_DTYPES`'s, bfloat16 ml_dtypes').
DTYPE_NAMES = {
    torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
    torch.float64: "float64", torch.uint8: "uint8", torch.int8: "int8", torch.int16: "int16",
    torch.int32: "int32", torch.int64: "int64", torch.uint16: "uint16", torch.uint32: "uint32",
    torch.uint64: "uint64", torch.bool: "bool",
}


def numpy_view(x: torch.Tensor) -> np.ndarray:
    """A numpy array on the memory of ``x`` (a CPU tensor, or pinned host memory, of any shape and
    strides): the same shape, strides and values, bfloat16 as ml_dtypes' bfloat16, writes visible in
    ``x``; it keeps ``x`` alive. Unlike ``Tensor.numpy()``, it leaves ``x``'s storage resizable:
    torch marks a storage that ``numpy()`` has seen as not resizable for good, and code that resizes
    a tensor it passed to a collective (DDP's buckets in torch's batched PowerSGD hook, a buffer
    freed with ``untyped_storage().resize_(0)``) then fails, where gloo leaves it as it was.

    Raises:
        RuntimeError, TypeError: as ``Tensor.numpy()`` raises them, for a tensor it refuses (a CUDA
            or sparse tensor, a conjugate or negative view, a dtype numpy lacks), naming the fix.
            (A dtype gradsync does not move, complex for one, gets ``Tensor.numpy()``'s view.)
    """
    name = DTYPE_NAMES.get(x.dtype)
    if name is None or not x.is_cpu or x.layout is not torch.strided or x.is_conj() or x.is_neg():
        return x.detach().numpy()  # torch's own view of a dtype gradsync does not move; else raises
    dtype = dtypes.NUMPY_DTYPES[name]
    if x.is_contiguous():
        span = x.nbytes
        if span == 0:
            return np.empty(x.shape, dtype)
        memory = (ctypes.c_char * span).from_address(x.data_ptr())
        memory.tensor = x  # the array's base keeps the tensor, and so its storage, alive
        return np.ndarray(x.shape, dtype, memory)
    item = dtype.itemsize
    shape, strides = x.shape, x.stride()
    span = item  # bytes from the first element to the end of the last
    for size, stride in zip(shape, strides):
        if size == 0:
            return np.empty(shape, dtype)
        span += (size - 1) * stride * item
    memory = (ctypes.c_char * span).from_address(x.data_ptr())
    memory.tensor = x
    return np.ndarray(shape, dtype, memory, 0, [stride * item for stride in strides])
