"""gradsync.torch.views.numpy_view: the numpy view through which every torch collective reads and
writes a CPU tensor, against torch's own ``Tensor.numpy()`` (the reference), and the one thing it
must do differently: leave the tensor's storage resizable."""

from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from gradsync.torch.views import numpy_view  # noqa: E402

DTYPES = ("float16", "bfloat16", "float32", "float64", "complex64", "bool", "uint8", "int8", "int16",
          "int32", "int64")
VIEWS = {  # a name, and the view of a 4x6 tensor it takes
    "whole": lambda t: t,
    "row": lambda t: t[2],
    "column": lambda t: t[:, 3],
    "transposed": lambda t: t.t(),
    "every other": lambda t: t[1:, ::2],
    "expanded": lambda t: t[:1].expand(3, 6),
    "scalar": lambda t: t[1, 1],
    "empty": lambda t: t[:, 6:],
}


def _reference(tensor: torch.Tensor) -> np.ndarray:
    """torch's numpy() of a copy (bfloat16 through int16): the values and shape numpy_view must give."""
    copy = tensor.clone()
    if copy.dtype == torch.bfloat16:
        return copy.view(torch.int16).numpy()
    return copy.numpy()


@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_view_has_the_tensors_shape_values_and_memory(dtype, view):
    base = (torch.arange(24, dtype=torch.float64).reshape(4, 6) % 7).to(getattr(torch, dtype))
    tensor = VIEWS[view](base)
    array = numpy_view(tensor)
    want = _reference(tensor)
    assert array.shape == tuple(tensor.shape)
    assert array.dtype.itemsize == tensor.element_size()
    got = array.view(np.int16) if dtype == "bfloat16" else array
    np.testing.assert_array_equal(got, want)
    if tensor.numel() and view != "expanded":  # writes land in the tensor
        array[...] = array.flat[0] if array.ndim else array
        assert bool((tensor == tensor.reshape(-1)[0]).all())


def test_the_storage_stays_resizable_and_the_view_keeps_the_tensor_alive():
    tensor = torch.arange(6.0)
    array = numpy_view(tensor[2:])
    del tensor  # the view holds the tensor, so its memory stays valid
    np.testing.assert_array_equal(array, [2.0, 3.0, 4.0, 5.0])
    other = torch.ones(4, requires_grad=True)
    numpy_view(other)
    other.detach().resize_(16)  # Tensor.numpy() would have made this raise
    other.detach().untyped_storage().resize_(0)


@pytest.mark.parametrize("make", [
    pytest.param(lambda: torch.ones(2, dtype=torch.complex64).conj(), id="conjugate view"),
    pytest.param(lambda: torch.ones(2, dtype=torch.complex64).conj().imag, id="negative view"),
    pytest.param(lambda: torch.ones(2).to_sparse(), id="sparse"),
])
def test_a_tensor_numpy_refuses_is_refused_with_torchs_words(make):
    tensor = make()
    with pytest.raises((RuntimeError, TypeError)) as expected:
        tensor.numpy()
    with pytest.raises(type(expected.value), match=re.escape(str(expected.value))):
        numpy_view(tensor)
