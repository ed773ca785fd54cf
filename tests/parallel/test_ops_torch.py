"""allreduce, broadcast and allgather on torch tensors: results are torch tensors of the input's
dtype, equal to the numpy references of tests/parallel/reference.py (test_ops.py runs the same
ops on numpy arrays); and gradsync.metrics on torch scalars (test_metrics.py: on numbers)."""

from __future__ import annotations

import numpy as np
import pytest
from reference import (
    WORLD_SIZE,
    all_inputs,
    assert_array,
    assert_unnamed_ops_pair_up,
    dtype_op_params,
    reference_allreduce,
    to_numpy,
    to_torch,
)

import gradsync as gs
from gradsync import Average, Max, Min, Sum, metrics

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")

# The torch adapter does the same at any world size; the numpy files cover 4 ranks.
RANKS = (1, 2)

_DTYPES = ("float32", "bfloat16", "int64", "bool")
_PAIRS = dtype_op_params(_DTYPES, (Sum, Average, Min, Max))
ROOTS = [pytest.param(r, id=f"root{r}") for r in range(WORLD_SIZE)]


@pytest.mark.parametrize(("dtype", "op"), _PAIRS)
def test_allreduce_of_a_torch_tensor_is_a_torch_tensor_holding_the_reduction(case, rank, dtype, op):
    inputs = all_inputs(case, dtype, (4, 6), op)
    got = gs.allreduce(to_torch(inputs[rank]), name=case, op=op)
    assert_array(to_numpy(got, dtype), reference_allreduce(inputs, op))


@pytest.mark.parametrize(("dtype", "op"), _PAIRS)
def test_allreduce_in_place_of_a_torch_tensor_returns_it_holding_the_reduction(case, rank, dtype, op):
    inputs = all_inputs(case, dtype, (4, 6), op)
    tensor = to_torch(inputs[rank])
    assert gs.allreduce_(tensor, name=case, op=op) is tensor
    assert_array(to_numpy(tensor, dtype), reference_allreduce(inputs, op))


@pytest.mark.parametrize(("dtype", "op"), _PAIRS)
def test_allreduce_in_place_of_a_transposed_torch_view_writes_through(case, rank, dtype, op):
    inputs = all_inputs(case, dtype, (4, 6), op)
    base = to_torch(inputs[rank])
    gs.allreduce_(base.t(), name=case, op=op)
    assert_array(to_numpy(base, dtype), reference_allreduce(inputs, op))


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("root", ROOTS)
def test_broadcast_in_place_of_a_torch_tensor_gives_the_roots_tensor(case, rank, root, dtype):
    inputs = all_inputs(case, dtype, (3, 5))
    tensor = to_torch(inputs[rank])
    assert gs.broadcast_(tensor, root, name=case) is tensor
    assert_array(to_numpy(tensor, dtype), inputs[root])


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("root", ROOTS)
def test_broadcast_in_place_of_a_strided_torch_view_writes_through_to_its_base(case, rank, root, dtype):
    inputs = all_inputs(case, dtype, (3, 5))
    base = to_torch(inputs[rank])
    gs.broadcast_(base[:, ::2], root, name=case)
    want_base = inputs[rank].copy()
    want_base[:, ::2] = inputs[root][:, ::2]
    assert_array(to_numpy(base, dtype), want_base)


@pytest.mark.parametrize("dtype", _DTYPES)
def test_allgather_of_torch_tensors_concatenates_every_ranks_rows(case, rank, size, dtype):
    inputs = all_inputs(case, dtype, [(r % 3, 2) for r in range(size)])
    got = gs.allgather(to_torch(inputs[rank]), name=case)
    assert_array(to_numpy(got, dtype), np.concatenate(inputs))


def test_an_unsupported_torch_dtype_is_a_type_error_naming_the_tensor_and_the_rank(case, rank):
    with pytest.raises(TypeError) as caught:
        gs.allreduce(torch.zeros(3, dtype=torch.complex64), name=case)
    for fragment in ("complex64", repr(case), f"rank {rank}"):
        assert fragment in str(caught.value)


# ---- gradsync.metrics on torch scalars -----------------------------------------------------------

def test_allreduce_scalar_of_a_torch_scalar_is_a_python_float(case, rank, size):
    got = metrics.allreduce_scalar(torch.tensor(float(rank)), name=case)
    assert type(got) is float and got == (size - 1) / 2


def test_a_metric_takes_detached_torch_scalars(size, rank):
    metric = metrics.Metric("t.metric")
    loss = (torch.ones(2, requires_grad=True) * rank).sum()  # 2 * rank
    metric.update(loss.detach(), weight=2)
    metric.update(loss.item())
    assert metric.compute() == float(size - 1)


def test_a_metric_update_with_a_tensor_that_requires_grad_is_a_type_error():
    loss = (torch.ones(2, requires_grad=True) * 3).sum()
    with pytest.raises(TypeError) as caught:
        metrics.Metric("t.metric").update(loss)
    assert "'t.metric'" in str(caught.value) and "requires grad" in str(caught.value)


def test_average_scalars_of_torch_scalars(case, rank, size):
    assert metrics.average_scalars({"loss": torch.tensor(2.0 * rank)}, name=case) == {"loss": float(size - 1)}


def test_a_torch_tensor_rejected_on_one_rank_takes_no_name(rank, size):
    """A sparse tensor rejected on rank 0 only, before naming: the next unnamed ops of every rank
    still pair up (test_beside_user_code.py: the same for numpy arrays)."""
    if rank == 0:
        with pytest.raises(TypeError, match="sparse_coo") as caught:
            gs.allreduce(torch.eye(3).to_sparse())
        assert "sparse_as_dense=True" in str(caught.value), caught.value
    assert_unnamed_ops_pair_up(rank, size, wrap=torch.from_numpy)
