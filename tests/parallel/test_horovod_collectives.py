"""gradsync.torch's collectives take Horovod's arguments and give Horovod's results.

Where Horovod differs from gradsync's core ops (``average=``, integer scaling and averaging, the
alltoall's received splits, barrier's argument, remove_process_set's answer), the expected value
is written out from Horovod's documented rule.
"""

import re
import warnings

import pytest

torch = pytest.importorskip("torch")
import gradsync  # noqa: E402
import gradsync.torch as hvd  # noqa: E402

pytestmark = pytest.mark.torch


def rank_tensor(dtype=torch.float32, shape=(3, 2)):
    return torch.full(shape, float(hvd.rank() + 1)).to(dtype)


def total_of_ranks():
    return sum(q + 1 for q in range(hvd.size()))


@pytest.mark.parametrize("call", ["allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
                                  "grouped_allreduce", "grouped_allreduce_",
                                  "grouped_allreduce_async", "grouped_allreduce_async_"])
@pytest.mark.parametrize("average", [True, False])
def test_every_allreduce_form_takes_the_deprecated_average_argument(call, average):
    grouped = call.startswith("grouped")
    arg = [rank_tensor()] if grouped else rank_tensor()
    with pytest.warns(DeprecationWarning, match="average"):
        result = getattr(hvd, call)(arg, average=average)
    if call.endswith("async") or call.endswith("async_"):
        result = hvd.synchronize(result)
    result = result[0] if grouped else result
    expected = total_of_ranks() / (hvd.size() if average else 1)
    assert torch.equal(result, torch.full((3, 2), float(expected)))


def test_op_and_average_together_are_refused():
    with pytest.raises(ValueError, match="supersedes"):
        hvd.allreduce(rank_tensor(), average=True, op=hvd.Sum)


def test_positional_arguments_are_in_horovods_order():
    # allreduce_(tensor, average, name, op): the call Horovod's own barrier test makes
    result = hvd.allreduce_(torch.ones(1, dtype=torch.int32), None, "positional", hvd.Sum)
    assert result.item() == hvd.size()
    # reducescatter(tensor, name, compression, op, process_set, prescale_factor, postscale_factor)
    tensor = torch.ones(hvd.size() * 2)
    out = hvd.reducescatter(tensor, "rs.positional", hvd.Compression.none, hvd.Sum,
                            hvd.global_process_set, 2.0, 0.5)
    assert torch.equal(out, torch.full((2,), float(hvd.size())))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_integer_average_truncates_toward_zero_as_horovod(dtype):
    n = hvd.size()
    tensor = torch.tensor([-7 * (hvd.rank() + 1), 5 + hvd.rank(), -1], dtype=dtype)
    every = [torch.tensor([-7 * (q + 1), 5 + q, -1], dtype=torch.float64) for q in range(n)]
    expected = (sum(every) * (1.0 / n)).to(dtype)  # Horovod: sum * (1/size) in float64, truncated
    assert torch.equal(hvd.allreduce(tensor, op=hvd.Average), expected)
    assert torch.equal(hvd.allreduce_(tensor.clone(), op=hvd.Average), expected)


def test_integer_scale_factors_apply_in_float64_and_truncate():
    n = hvd.size()
    tensor = torch.tensor([7, -7, 3], dtype=torch.int32)
    prescaled = hvd.allreduce(tensor, op=hvd.Sum, prescale_factor=0.45)
    assert torch.equal(prescaled, (tensor.double() * 0.45).to(torch.int32) * n)
    postscaled = hvd.allreduce(tensor, op=hvd.Sum, postscale_factor=0.45)
    assert torch.equal(postscaled, (tensor.double() * n * 0.45).to(torch.int32))
    scattered = hvd.reducescatter(torch.full((n,), 5, dtype=torch.int64), op=hvd.Sum,
                                  prescale_factor=0.5)
    assert torch.equal(scattered, torch.full((1,), 2 * n, dtype=torch.int64))


def test_float_average_is_the_core_average():
    assert torch.equal(hvd.allreduce(rank_tensor()), gradsync.allreduce(rank_tensor()))


def test_alltoall_returns_received_splits_in_the_dtype_of_splits_and_output_alone_without():
    n = hvd.size()
    tensor = torch.arange(2 * n, dtype=torch.float32)
    for splits, dtype in ((torch.full((n,), 2, dtype=torch.int32), torch.int32),
                          (torch.full((n,), 2, dtype=torch.int64), torch.int64),
                          ([2] * n, torch.int32)):
        output, received = hvd.alltoall(tensor, splits)
        assert received.dtype == dtype and received.tolist() == [2] * n
        assert output.shape == (2 * n,)
    alone = hvd.alltoall(tensor)
    assert isinstance(alone, torch.Tensor) and alone.shape == (2 * n,)


def test_alltoall_refuses_floating_point_splits_with_a_value_error():
    with pytest.raises(ValueError, match="splits must hold integers"):
        hvd.alltoall(torch.zeros(hvd.size()), torch.ones(hvd.size()))


def test_reducescatter_refuses_adasum_with_a_runtime_error():
    with pytest.raises(RuntimeError, match="Adasum"):
        hvd.reducescatter(torch.ones(hvd.size() * 2), op=hvd.Adasum)


def test_collective_errors_are_horovod_internal_errors():
    assert issubclass(gradsync.CollectiveError, hvd.HorovodInternalError)
    assert issubclass(hvd.HorovodInternalError, RuntimeError)


def test_barrier_takes_the_process_set_first():
    n = hvd.size()
    if n < 2:
        pytest.skip("a process set of one rank would be every rank")
    evens = hvd.add_process_set([q for q in range(n) if q % 2 == 0])
    try:
        if evens.included():
            hvd.barrier(evens)
        hvd.barrier()
    finally:
        assert hvd.remove_process_set(evens) is True


def test_remove_process_set_answers_false_where_horovod_does():
    assert hvd.remove_process_set(hvd.global_process_set) is False
    assert hvd.remove_process_set(hvd.ProcessSet([0])) is False  # never registered


def test_join_takes_a_device_and_returns_the_last_rank():
    last = hvd.join(-1)
    assert 0 <= last < hvd.size()
    assert hvd.allgather_object(last) == [last] * hvd.size()


HOROVOD_REFUSES_JOIN = {
    "allgather": lambda name: hvd.allgather(torch.ones(2, 3), name=name),
    "grouped_allgather": lambda name: hvd.grouped_allgather([torch.ones(2, 3)], name=name),
    "broadcast": lambda name: hvd.broadcast(torch.ones(2, 3), 1, name=name),
    "broadcast_": lambda name: hvd.broadcast_(torch.ones(2, 3), 1, name=name),
    "alltoall": lambda name: hvd.alltoall(torch.ones(2 * hvd.size(), 3), name=name),
    "reducescatter": lambda name: hvd.reducescatter(torch.ones(2 * hvd.size(), 3), name=name),
    "grouped_reducescatter": lambda name: hvd.grouped_reducescatter([torch.ones(2 * hvd.size(), 3)],
                                                                    name=name),
}


@pytest.mark.parametrize("cached", [False, True], ids=["first-call", "cached"])
@pytest.mark.parametrize("op", sorted(HOROVOD_REFUSES_JOIN))
def test_beside_a_joined_rank_these_fail_on_every_other_rank_as_horovods_do(op, cached):
    """Horovod fails allgather, broadcast, alltoall and reducescatter while a rank has joined
    ("... is not supported with Join"); so do gradsync.torch's, on every rank that called them,
    also when the response cache already knows the collective; join then completes."""
    if hvd.size() == 1:
        pytest.skip("needs a rank that joins and one that does not")
    name = f"refuse.{op}.{cached}"
    call = HOROVOD_REFUSES_JOIN[op]
    if cached:
        call(name)  # every rank: now the response cache holds it
    error = None
    if hvd.rank() != 0:
        try:
            call(name)
        except gradsync.CollectiveError as exc:
            error = str(exc)
    last = hvd.join()  # every rank, whatever happened above: no rank is left waiting
    assert last != 0
    assert hvd.allgather_object(last) == [last] * hvd.size()
    if hvd.rank() != 0:
        kind = op.removeprefix("grouped_").rstrip("_")
        assert error is not None, f"{op} ran beside a joined rank"
        assert re.search(rf"rank {hvd.rank()}: .*{name}.*rank 0 called join\(\); Horovod's {kind} "
                         "does not run beside a joined rank", error), error


def test_gradsyncs_own_allgather_still_runs_beside_a_joined_rank():
    if hvd.size() == 1:
        pytest.skip("needs a rank that joins and one that does not")
    gathered = None
    if hvd.rank() != 0:
        gathered = gradsync.allgather(torch.full((1, 2), float(hvd.rank())), name="core.allgather.join")
    hvd.join()  # every rank before any assertion: no rank is left waiting
    if hvd.rank() != 0:
        assert gathered.tolist() == [[float(r)] * 2 for r in range(1, hvd.size())]


def test_sparse_allreduce_async_equals_the_dense_allreduce():
    r = hvd.rank()
    dense = torch.zeros(6, 2)
    dense[r % 6] = r + 1.0
    dense[5] = 1.0
    handle = hvd.sparse_allreduce_async(dense.to_sparse(), name="sparse.check", op=hvd.Average)
    result = handle()
    assert result.is_sparse
    assert torch.allclose(result.to_dense(), hvd.allreduce(dense, op=hvd.Average))
    with pytest.raises(TypeError, match="sparse"):
        hvd.sparse_allreduce_async(dense, name="sparse.dense", op=hvd.Sum)


def test_grouped_allgather_gathers_every_member():
    n, r = hvd.size(), hvd.rank()
    members = [torch.full((r + 1, 2), float(r)), torch.full((1,), float(r))]  # one dtype: fused
    handle = hvd.grouped_allgather_async(members, name="grouped.gather")
    first, second = hvd.synchronize(handle)
    assert first.shape == (n * (n + 1) // 2, 2)
    assert second.tolist() == [float(q) for q in range(n)]


def test_adasum_allreduce_of_cpu_tensors_matches_the_core():
    if hvd.size() & (hvd.size() - 1):
        pytest.skip("Adasum needs a power-of-two number of ranks")
    tensor = torch.linspace(-1, 1, 7, dtype=torch.float64) * (hvd.rank() + 1)
    assert torch.equal(hvd.allreduce(tensor, op=hvd.Adasum),
                       gradsync.allreduce(tensor.clone(), op=gradsync.Adasum))


def test_timeline_starts_and_stops_at_run_time(tmp_path_factory):
    path = hvd.broadcast_object(str(tmp_path_factory.mktemp("timeline") / "trace.json"))
    hvd.start_timeline(path, mark_cycles=False)
    hvd.allreduce(torch.ones(3), name="timeline.check")
    hvd.stop_timeline()
    if hvd.rank() == 0:
        from gradsync.timeline import load

        events = load(path)
        assert any(e.get("args", {}).get("name") == "timeline.check" for e in events)
        assert not any(e.get("name") == "CYCLE" for e in events)
    hvd.barrier()


def test_build_flags_answer_for_gradsync():
    assert hvd.mpi_built() and hvd.mpi_enabled() and hvd.mpi_threads_supported()
    assert not (hvd.gloo_built() or hvd.gloo_enabled() or hvd.ddl_built() or hvd.ccl_built()
                or hvd.rocm_built())
    assert hvd.cuda_built() == torch.backends.cuda.is_built()
    homogeneous = hvd.allgather_object(hvd.local_size())
    assert hvd.is_homogeneous() == (len(set(homogeneous)) == 1)


def test_no_warning_without_average():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = hvd.allreduce(rank_tensor(), op=hvd.Sum)
    assert torch.equal(result, torch.full((3, 2), float(total_of_ranks())))
