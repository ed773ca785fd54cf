"""Data types gradsync moves, and the rules for reducing them.

Reductions are computed in an *accumulator* dtype that the backend supports exactly
(:func:`accumulator`; the backend says only which dtypes it reduces natively: MPI all but the
16-bit floats, NCCL all but int16):

==========================  =====================  =================================================
tensor dtype                accumulator            why
==========================  =====================  =================================================
float16, bfloat16 (MPI)     float32                MPI has no 16-bit floating-point type; summing
                                                   in float32 and rounding once is also more exact.
                                                   (NCCL sums them natively, in 16 bits.)
int8/16/32, uint8/16/32     int64 for ``Average``  the sum must not overflow before the division.
uint64                      itself for ``Average`` (int64 would not hold it)
int16, uint16 (NCCL)        int32                  NCCL has no 16-bit integer type; int32 sums
                                                   taken modulo 2**16 are the 16-bit sums.
bool                        uint8 (logical ops)    Sum/Max are logical OR, Min/Product logical AND.
everything else             itself
==========================  =====================  =================================================

Integer ``Average`` is the floor of the exact mean (``numpy.floor_divide`` of the sum by the
number of ranks), as ``torch.div(..., rounding_mode="floor")``; the same on every rank.
"""

from __future__ import annotations

import numpy as np


class _NumpyDtypes(dict):
    """name -> numpy dtype, with bfloat16's (from ml_dtypes) added on its first lookup: importing
    ml_dtypes costs ~0.5 s of CPU, which every process (and every elastic restart) would pay at
    ``import gradsync`` for a dtype most jobs never use. Other lookups are plain dict lookups."""

    def __missing__(self, name: str) -> np.dtype:
        if name != "bfloat16":
            raise KeyError(name)
        import ml_dtypes

        self[name] = dtype = np.dtype(ml_dtypes.bfloat16)
        _NAMES[dtype] = name
        return dtype


#: numpy dtype of each supported dtype name (bfloat16 through ml_dtypes, imported on first use:
#: test a name against SUPPORTED, not ``in NUMPY_DTYPES``).
NUMPY_DTYPES: dict[str, np.dtype] = _NumpyDtypes({
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "uint8": np.dtype(np.uint8),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint16": np.dtype(np.uint16),
    "uint32": np.dtype(np.uint32),
    "uint64": np.dtype(np.uint64),
    "bool": np.dtype(np.bool_),
})

SUPPORTED = ("float16", "bfloat16", "float32", "float64", "uint8", "int8", "int16", "int32", "int64",
             "uint16", "uint32", "uint64", "bool")
FLOATING = frozenset({"float16", "bfloat16", "float32", "float64"})
INTEGER = frozenset({"uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64"})


#: gradsync name of each supported numpy dtype (dtype_name's fast path: one dict lookup per op).
_NAMES: dict[np.dtype, str] = {dtype: name for name, dtype in NUMPY_DTYPES.items()}


def is_bfloat16(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is ml_dtypes' bfloat16 (without importing ml_dtypes: an array of that dtype
    exists only once it was imported)."""
    return np.dtype(dtype).name == "bfloat16"


def dtype_name(dtype: np.dtype) -> str:
    """The gradsync name of a numpy dtype ('float32', 'bfloat16', ...), or its str if unsupported."""
    name = _NAMES.get(dtype) if isinstance(dtype, np.dtype) else None
    if name is not None:
        return name
    dtype = np.dtype(dtype)
    if is_bfloat16(dtype):
        return "bfloat16"
    return dtype.name


#: What MPI reduces natively: everything but the 16-bit floats (MPI has no such type).
MPI_NATIVE = frozenset(SUPPORTED) - {"float16", "bfloat16"}
_WIDER = {"float16": "float32", "bfloat16": "float32", "int16": "int32", "uint16": "int32"}


def accumulator(dtype: str, average: bool, native: frozenset[str] = MPI_NATIVE) -> np.dtype:
    """The numpy dtype in which a reduction of ``dtype`` is computed (see the module table),
    by a backend that reduces the dtypes in ``native`` as they are (default: MPI's): bool as 0/1
    uint8, an integer Average in int64 (the floor of the exact mean needs the exact sum; uint64's
    in itself), a dtype the backend lacks in the next wider one (float16, bfloat16 -> float32;
    int16, uint16 -> int32, whose sums modulo 2**16 are the wrapped 16-bit sums), everything else
    in itself."""
    if dtype == "bool":
        return np.dtype(np.uint8)
    if average and dtype in INTEGER and dtype != "uint64":
        return np.dtype(np.int64)
    if dtype not in native:
        return NUMPY_DTYPES[_WIDER[dtype]]
    return NUMPY_DTYPES[dtype]
