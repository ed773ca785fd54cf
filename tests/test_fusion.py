"""Fusion: which ready allreduces share a buffer (plan_allreduce), and packing them into it.

Single process, no MPI.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from gradsync.arrays import dtypes
from gradsync.engine import fusion
from gradsync.engine.protocol import Kind, ReduceOp, Request, Response
from gradsync.executors import plan as planning
from gradsync.executors.memory import HOST, FusionBuffers


def request(name, count=10, dtype="float32", op=ReduceOp.Sum, prescale=1.0, postscale=1.0,
            rank=0):
    return Request(name, Kind.ALLREDUCE, rank, dtype, (count,), op, -1, prescale, postscale)


def plan(requests, threshold=1 << 20):
    """The plan as a list of name tuples (checking the responses' other fields on the way)."""
    responses = fusion.plan_allreduce(list(requests), threshold)
    for response in responses:
        assert response == Response(Kind.ALLREDUCE, response.names)  # no error, no first_dims
    return [response.names for response in responses]


# ---- how much room a request takes -----------------------------------------------------------

@pytest.mark.parametrize("dtype, op, itemsize", [
    ("float32", ReduceOp.Sum, 4),
    ("float64", ReduceOp.Average, 8),
    ("float16", ReduceOp.Sum, 4),      # reduced in float32
    ("bfloat16", ReduceOp.Max, 4),     # reduced in float32
    ("int8", ReduceOp.Sum, 1),
    ("int8", ReduceOp.Average, 8),     # averaged in int64, so the sum cannot overflow
    ("uint8", ReduceOp.Average, 8),
    ("int32", ReduceOp.Average, 8),
    ("int64", ReduceOp.Average, 8),
    ("bool", ReduceOp.Sum, 1),         # logical ops on 0/1 uint8
])
def test_a_request_takes_its_accumulator_bytes(dtype, op, itemsize):
    assert fusion.nbytes(request("t", count=7, dtype=dtype, op=op)) == 7 * itemsize


def test_a_multi_dimensional_or_empty_request_counts_its_elements():
    assert fusion.nbytes(Request("t", Kind.ALLREDUCE, 0, "float64", (3, 4, 5))) == 3 * 4 * 5 * 8
    assert fusion.nbytes(Request("t", Kind.ALLREDUCE, 0, "float32", ())) == 4
    assert fusion.nbytes(Request("t", Kind.ALLREDUCE, 0, "float32", (2, 0))) == 0


# ---- grouping ----------------------------------------------------------------------------------

def test_nothing_ready_plans_nothing():
    assert plan([]) == []


def test_small_tensors_of_one_kind_share_one_buffer_in_submission_order():
    assert plan([request("a"), request("b"), request("c")]) == [("a", "b", "c")]


@pytest.mark.parametrize("field, values", [
    ("dtype", ("float32", "float64")),
    ("op", (ReduceOp.Sum, ReduceOp.Max)),
    ("prescale", (1.0, 0.5)),
    ("postscale", (1.0, 2.0)),
])
def test_tensors_differing_in_dtype_op_or_scale_factors_are_not_fused(field, values):
    one, other = ({field: value} for value in values)
    requests = [request("a", **one), request("b", **other), request("c", **one),
                request("d", **other)]
    assert plan(requests) == [("a", "c"), ("b", "d")]


def test_responses_come_in_the_order_of_their_first_request():
    requests = [request("i", dtype="int32"), request("f"), request("j", dtype="int32"),
                request("d", dtype="float64"), request("g")]
    assert plan(requests) == [("i", "j"), ("f", "g"), ("d",)]


def test_a_buffer_holds_at_most_threshold_bytes():
    # 100 float32 = 400 bytes each.
    requests = [request(name, count=100) for name in "abcde"]
    assert plan(requests, threshold=1000) == [("a", "b"), ("c", "d"), ("e",)]
    assert plan(requests, threshold=1200) == [("a", "b", "c"), ("d", "e")]  # exactly full is fine


def test_the_threshold_counts_accumulator_bytes():
    # 200 float16 are 400 bytes in memory but 800 in the float32 buffer.
    requests = [request("a", count=200, dtype="float16"), request("b", count=200, dtype="float16")]
    assert plan(requests, threshold=1000) == [("a",), ("b",)]
    assert plan(requests, threshold=1600) == [("a", "b")]


def test_a_tensor_larger_than_the_threshold_is_reduced_alone():
    requests = [request("small1"), request("big", count=1000), request("small2")]
    # The big one neither joins nor closes the open buffer; the buffer comes first (first request).
    assert plan(requests, threshold=1000) == [("small1", "small2"), ("big",)]


def test_a_tensor_of_exactly_the_threshold_fits_in_a_buffer():
    assert plan([request("a", count=250), request("b", count=1)], threshold=1000) == \
        [("a",), ("b",)]
    assert plan([request("a", count=250)], threshold=1000) == [("a",)]


def test_a_full_buffer_is_followed_by_a_new_one_for_the_same_key():
    requests = [request("a", count=200), request("x", dtype="int64"), request("b", count=200),
                request("y", dtype="int64"), request("c", count=50)]
    # a (800 B) + b (800 B) > 1000: b opens a new float32 buffer, which c then joins.
    assert plan(requests, threshold=1000) == [("a",), ("x", "y"), ("b", "c")]


@pytest.mark.parametrize("seed", range(20))
def test_requests_of_one_key_are_grouped_as_by_the_general_rule(seed):
    """plan_allreduce's one-key loop (every request of one dtype, op and scale) gives the groups
    of the per-key table it stands in for, big and zero-byte tensors included."""
    rng = np.random.default_rng(seed)
    ready = [request(f"t{i}", count=int(c)) for i, c in enumerate(rng.choice([0, 1, 60, 250, 400], 40))]
    sizes = [fusion.nbytes(r) for r in ready]
    keys = [r.fusion_key() for r in ready]
    general = [tuple(r.name for r in group) for group in fusion._pack(ready, sizes, keys, 1000)]
    assert plan(ready, threshold=1000) == general


def test_threshold_zero_disables_fusion():
    requests = [request(name, count=1) for name in "abc"]
    assert plan(requests, threshold=0) == [("a",), ("b",), ("c",)]


def test_the_default_threshold_fuses_a_megabyte():
    requests = [request(f"t{i}", count=1024) for i in range(300)]  # 4 kB each, 1.2 MB in all
    groups = plan(requests)
    assert [len(g) for g in groups] == [256, 44]
    assert [name for group in groups for name in group] == [r.name for r in requests]


# ---- buffers, pack and unpack -----------------------------------------------------------------

def test_fusion_buffers_are_reused_per_dtype_and_grown_on_demand():
    buffers = FusionBuffers()
    a = buffers.get(np.dtype(np.float32), 10)
    assert a.shape == (10,) and a.dtype == np.float32 and a.flags.c_contiguous
    b = buffers.get(np.dtype(np.float32), 5)
    assert np.shares_memory(a, b)  # reused
    c = buffers.get(np.dtype(np.float32), 100)
    assert c.shape == (100,)
    assert not np.shares_memory(a, c)  # grown
    assert buffers.get(np.dtype(np.float32), 0).shape == (0,)
    assert not np.shares_memory(c, buffers.get(np.dtype(np.int64), 10))  # one buffer per dtype


def test_copy_packs_any_strides_into_the_flat_buffer():
    source = np.arange(12, dtype=np.int32).reshape(3, 4).T  # not contiguous
    buffer = np.zeros(12, np.int64)
    HOST.copy(source, buffer, 1.0)
    assert buffer.tolist() == source.ravel().tolist()


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_copy_prescales_16_bit_floats_in_float32(dtype):
    """The inputs are scaled in the buffer's float32, not rounded to 16 bits before the sum."""
    source = np.array([1.0009765625, 0.58203125, 1.74609375, -3.0]).astype(dtype)
    buffer = np.empty(4, np.float32)
    HOST.copy(source, buffer, 3.0)
    assert buffer.tolist() == (source.astype(np.float32) * np.float32(3.0)).tolist()


def test_floor_divide_gives_the_floor_of_integer_averages():
    buffer = np.array([-3, 3, -4, 5, -1], np.int64)  # sums over 2 ranks
    HOST.floor_divide(buffer, 2)
    assert buffer.tolist() == [-2, 1, -2, 2, -1]  # floor, not truncation towards zero


def test_copy_scales_and_rounds_once_into_a_strided_target():
    base = np.zeros((2, 6), np.float16)
    target = base[:, ::2]
    buffer = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 2049.0], np.float32)
    HOST.copy(buffer, target, 0.5)
    assert target.tolist() == [[0.5, 1.0, 1.5], [2.0, 2.5, 1024.0]]
    assert base[:, 1::2].tolist() == [[0.0] * 3] * 2  # the elements between are untouched


# ---- the plan of one response ------------------------------------------------------------------

class Member:
    """An entry as the planner sees it: a request and this rank's source and target."""

    def __init__(self, request, source, target=None):
        self.request, self.source = request, source
        self.target = source if target is None else target


def context(rank=0, size=2, divisor=2, traits=None):
    return planning.Context(rank, size, divisor, HOST, traits or planning.Traits())


def test_a_lone_contiguous_tensor_is_reduced_in_its_own_memory():
    x = np.ones(6, np.float32)
    plan = planning.make_plan(Response(Kind.ALLREDUCE, ("a",)), [Member(request("a", 6, op=ReduceOp.Sum), x)],
                       context())
    assert plan.in_place and plan.packs == () and plan.unpacks == ()
    strided = np.ones(12, np.float32)[::2]
    plan = planning.make_plan(Response(Kind.ALLREDUCE, ("a",)), [Member(request("a", 6), strided)], context())
    assert not plan.in_place and plan.dtype == np.float32  # packed into a fusion buffer


def test_a_lone_out_of_place_tensor_is_sent_from_its_input_where_the_backend_reads_a_source():
    source, target = np.ones(6, np.float32), np.empty(6, np.float32)
    source.flags.writeable = False  # read, never written
    response = Response(Kind.ALLREDUCE, ("a",))
    mpi = planning.Traits(reduces_from_source=True)
    average = request("a", 6, op=ReduceOp.Average)
    plan = planning.make_plan(response, [Member(average, source, target)], context(traits=mpi))
    assert plan.in_place and plan.from_source and plan.packs == ()
    assert plan.unpacks != ()  # the Average's scale, on the output
    without = planning.make_plan(response, [Member(request("a", 6), source, target)], context())
    assert not without.from_source and without.packs != ()  # copied into the output first
    prescaled = planning.make_plan(response, [Member(request("a", 6, prescale=2.0), source, target)],
                                   context(traits=mpi))
    assert not prescaled.from_source and prescaled.packs != ()  # the prescale is applied in the copy
    strided = np.ones(12, np.float32)[::2]
    plan = planning.make_plan(response, [Member(request("a", 6), strided, target)], context(traits=mpi))
    assert not plan.from_source and plan.packs != ()


def test_a_lone_float16_tensor_is_packed_into_float32_on_mpi_but_not_on_nccl():
    x = np.ones(4, np.float16)
    response = Response(Kind.ALLREDUCE, ("h",))
    plan = planning.make_plan(response, [Member(request("h", 4, dtype="float16"), x)], context())
    assert (plan.dtype, plan.in_place) == (np.float32, False)
    nccl = planning.Traits(frozenset(dtypes.SUPPORTED) - {"int16"}, frozenset(dtypes.FLOATING))
    plan = planning.make_plan(response, [Member(request("h", 4, dtype="float16"), x)], context(traits=nccl))
    assert (plan.dtype, plan.in_place) == (np.float16, True)


@pytest.mark.parametrize("dtype, divisor, averages, expected", [
    ("float32", 4, frozenset(), (ReduceOp.Sum, 0.5 / 4, 1)),            # MPI: Sum, divided in the unpack
    ("float32", 4, frozenset({"float32"}), (ReduceOp.Average, 0.5, 1)),  # ncclAvg divides itself
    ("float32", 3, frozenset({"float32"}), (ReduceOp.Sum, 0.5 / 3, 1)),  # joined ranks: not by the size
    ("int32", 4, frozenset({"float32"}), (ReduceOp.Sum, 1.0, 4)),        # integers: floor of the mean
])
def test_the_average_rule(dtype, divisor, averages, expected):
    post = 0.5 if dtype == "float32" else 1.0
    req = request("a", dtype=dtype, op=ReduceOp.Average, postscale=post)
    buffer = dtypes.accumulator(dtype, True)
    got = planning.reduction(req, buffer, divisor, 4, planning.Traits(averages=averages))
    assert (got.send_op, got.scale, got.floor_divisor) == expected


def test_reducescatter_packs_rank_by_rank_and_receives_its_rows_of_every_member():
    a, b = np.arange(6.0).reshape(3, 2), np.arange(4.0)
    members = [Member(Request("g.0", Kind.REDUCESCATTER, 1, "float64", (3, 2), ReduceOp.Sum), a,
                      np.empty((1, 2))),
               Member(Request("g.1", Kind.REDUCESCATTER, 1, "float64", (4,), ReduceOp.Sum), b,
                      np.empty(2))]
    plan = planning.make_plan(Response(Kind.REDUCESCATTER, ("g.0", "g.1")), members, context(rank=1))
    # rank 0 gets rows 0-1 of a and 0-1 of b, rank 1 row 2 of a and rows 2-3 of b
    assert [(c.member, c.offset, c.count, c.rows) for c in plan.packs] == [
        (0, 0, 4, (0, 2)), (1, 4, 2, (0, 2)), (0, 6, 2, (2, 3)), (1, 8, 2, (2, 4))]
    assert plan.counts == (6, 4)
    assert [(c.member, c.offset, c.count) for c in plan.unpacks] == [(0, 0, 2), (1, 2, 2)]


def test_a_grouped_allgather_unpacks_each_ranks_rows_of_each_member():
    members = [Member(Request("g.0", Kind.ALLGATHER, 0, "int64", (2, 3)), np.zeros((2, 3), np.int64)),
               Member(Request("g.1", Kind.ALLGATHER, 0, "int64", (1,)), np.zeros(1, np.int64))]
    response = Response(Kind.ALLGATHER, ("g.0", "g.1"), first_dims=((2, 1), (1, 4)))
    plan = planning.make_plan(response, members, context())
    assert plan.out_shapes == ((3, 3), (5,))
    assert plan.counts == (2 * 3 + 1, 1 * 3 + 4)
    assert [(c.member, c.offset, c.count, c.rows) for c in plan.unpacks] == [
        (0, 0, 6, (0, 2)), (1, 6, 1, (0, 1)), (0, 7, 3, (2, 3)), (1, 10, 4, (1, 5))]


@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (3, 5), (1000,)])
@pytest.mark.parametrize("dtype", ["float32", "float16", "int8", "bool"])
def test_numpy_results_start_on_64_bytes_so_frameworks_take_them_without_a_copy(shape, dtype):
    """XLA's CPU client and TensorFlow's numpy_function take a host buffer in place only when it
    is 64-byte aligned; numpy's own buffers are 16-byte aligned."""
    from gradsync.arrays.dispatch import ALIGNMENT, NumpyAdapter

    result = NumpyAdapter().empty(np.zeros(2, dtype), shape)
    assert result.shape == shape and result.dtype == np.dtype(dtype) and result.flags.c_contiguous
    assert result.flags.writeable
    assert result.size == 0 or result.ctypes.data % ALIGNMENT == 0
