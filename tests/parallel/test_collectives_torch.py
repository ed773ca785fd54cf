"""grouped_allreduce, reducescatter, grouped_reducescatter and alltoall on torch tensors of every
supported dtype: outputs are torch tensors of the input's dtype, equal to the numpy references of
tests/parallel/reference.py (test_collectives.py runs the same ops on numpy arrays)."""

from __future__ import annotations

import pytest
from reference import (
    DTYPES,
    all_inputs,
    alltoall_splits,
    assert_array,
    dtype_op_params,
    reference_allreduce,
    reference_alltoall,
    rows_of,
    to_numpy,
    to_torch,
)

import gradsync as gs
from gradsync.arrays import dtypes

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")

# The torch adapter does the same at any world size; the numpy files cover 4 ranks.
RANKS = (1, 2)

_GROUP_SHAPES = [(3, 5), (0,), (2, 1, 4), ()]


def test_every_supported_dtype_is_tested():
    assert set(DTYPES) == set(dtypes.SUPPORTED)


def _group(case: str, dtype: str, op):
    inputs = [all_inputs(f"{case}.{i}", dtype, s, op) for i, s in enumerate(_GROUP_SHAPES)]
    return inputs, [reference_allreduce(m, op) for m in inputs]


@pytest.mark.parametrize(("dtype", "op"), dtype_op_params(dtypes.SUPPORTED))
def test_grouped_allreduce_of_torch_tensors_gives_torch_tensors_of_each_members_allreduce(
        case, rank, dtype, op):
    inputs, wants = _group(case, dtype, op)
    got = gs.grouped_allreduce([to_torch(m[rank]) for m in inputs], name=case, op=op)
    assert len(got) == len(wants)
    for member, want in zip(got, wants):
        assert_array(to_numpy(member, dtype), want)


@pytest.mark.parametrize(("dtype", "op"), dtype_op_params(dtypes.SUPPORTED))
def test_grouped_allreduce_in_place_of_torch_tensors_returns_them_holding_the_results(case, rank, dtype, op):
    inputs, wants = _group(case, dtype, op)
    tensors = [to_torch(m[rank]) for m in inputs]
    got = gs.grouped_allreduce_(tensors, name=case, op=op)
    assert all(g is t for g, t in zip(got, tensors))
    for tensor, want in zip(tensors, wants):
        assert_array(to_numpy(tensor, dtype), want)


@pytest.mark.parametrize(("dtype", "op"), dtype_op_params(dtypes.SUPPORTED))
def test_reducescatter_of_a_torch_tensor_gives_this_ranks_rows(case, rank, size, dtype, op):
    shape = (2 * size + 1, 3)
    inputs = all_inputs(case, dtype, shape, op)
    got = gs.reducescatter(to_torch(inputs[rank]), name=case, op=op)
    assert_array(to_numpy(got, dtype), reference_allreduce(inputs, op)[rows_of(shape[0], rank, size)])


@pytest.mark.parametrize(("dtype", "op"), dtype_op_params(dtypes.SUPPORTED))
def test_grouped_reducescatter_of_one_torch_tensor_gives_this_ranks_rows(case, rank, size, dtype, op):
    shape = (2 * size + 1, 3)
    inputs = all_inputs(case, dtype, shape, op)
    got = gs.grouped_reducescatter([to_torch(inputs[rank])], name=case, op=op)
    assert_array(to_numpy(got[0], dtype), reference_allreduce(inputs, op)[rows_of(shape[0], rank, size)])


@pytest.mark.parametrize("dtype", dtypes.SUPPORTED)
def test_alltoall_of_a_torch_tensor_with_torch_splits_returns_torch_tensors(case, rank, size, dtype):
    splits = [alltoall_splits(case, r) for r in range(size)]
    inputs = all_inputs(case, dtype, [(sum(s), 2) for s in splits])
    got, received = gs.alltoall(to_torch(inputs[rank]), torch.tensor(splits[rank]), name=case)
    want, want_splits = reference_alltoall(inputs, splits, rank)
    assert_array(to_numpy(got, dtype), want)
    assert isinstance(received, torch.Tensor) and received.tolist() == want_splits, received
