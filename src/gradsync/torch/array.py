"""The :class:`gradsync.arrays.adapter.ArrayAdapter` for torch tensors (imported, and registered, on first
use)."""

from __future__ import annotations

import numpy as np
import torch

from ..arrays.adapter import TensorInfo, register
from .views import DTYPE_NAMES, numpy_view


class TorchAdapter:
    """torch.Tensor on the CPU (bfloat16 viewed through int16 as ml_dtypes.bfloat16) or on a CUDA device."""

    def info(self, x: torch.Tensor) -> TensorInfo:
        if x.layout != torch.strided:
            raise TypeError(f"a {x.layout} tensor cannot be reduced as it is: densify it "
                            "(tensor.to_dense()), allgather its indices and values, or, for "
                            "gradients, use DistributedOptimizer(..., sparse_as_dense=True)")
        # (the name's fallback and the device string made only where needed: each torch
        # attribute read is a C++ call, and this runs on every op)
        return TensorInfo(DTYPE_NAMES.get(x.dtype) or str(x.dtype).removeprefix("torch."),
                          tuple(x.shape), "cpu" if x.is_cpu else str(x.device))

    def host_view(self, x: torch.Tensor) -> np.ndarray:
        return numpy_view(x)

    def empty(self, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=like.dtype, device=like.device)

    def from_host(self, like: torch.Tensor, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array)

    def cast(self, x: torch.Tensor, dtype: str) -> torch.Tensor:
        return x.to(getattr(torch, dtype))

    def device_runtime(self, x: torch.Tensor):
        """gradsync.torch.device's runtime for CUDA tensors, None for CPU ones."""
        if x.device.type != "cuda":
            return None
        from .device import DEVICE

        return DEVICE


TORCH = TorchAdapter()
register("torch", TORCH)
