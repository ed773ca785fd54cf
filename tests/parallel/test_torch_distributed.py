"""The torch.distributed backend "gradsync": every call of ``torch.distributed`` on a group created
by ``init_process_group(backend="gradsync", init_method="gradsync://")`` against numpy references
(tests/parallel/reference.py) or a single-process run; DDP against one process on the whole batch.

Every rank builds every rank's input from the test's name, so each rank computes its reference
itself. The collectives of a test run before its assertions (see tests/parallel/conftest.py).
"""

from __future__ import annotations

import datetime
import functools
import inspect
import os
import threading
import time

import numpy as np
import pytest
from reference import (
    WORLD_SIZE,
    all_inputs,
    alltoall_splits,
    assert_array,
    make,
    raises,
    reference_allreduce,
    reference_alltoall,
    to_numpy,
    to_torch,
)

import gradsync
from gradsync import Average, Max, Min, Product, Sum

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
RANKS = (1, 2, 3)

import gradsync.torch  # noqa: E402,F401 - registers the backend

OPS = {"SUM": Sum, "AVG": Average, "PRODUCT": Product, "MIN": Min, "MAX": Max}
DTYPES = ("float16", "bfloat16", "float32", "float64", "uint8", "int32", "int64", "bool")
PAIRS = [pytest.param(d, o, id=f"{d}-{o}") for d in DTYPES for o in OPS if not (d == "bool" and o == "AVG")]
BITWISE = {"BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}
ROOTS = [pytest.param(r, id=f"root{r}") for r in range(WORLD_SIZE)]


@pytest.fixture(scope="module", autouse=True)
def process_group():
    """The default group on gradsync, for this file (destroyed after it: other files do not
    expect one)."""
    dist.init_process_group(backend="gradsync", init_method="gradsync://")
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_the_default_group_takes_rank_and_size_from_gradsync(rank, size, process_group):
    assert (dist.get_rank(), dist.get_world_size()) == (rank, size)
    assert dist.get_backend() == "gradsync"
    assert process_group.group_name and process_group.group_name == dist.group.WORLD.group_name


def test_the_rendezvous_refuses_a_rank_other_than_gradsyncs(rank, size):
    from torch.distributed.rendezvous import rendezvous

    store, got_rank, got_size = next(rendezvous("gradsync://"))
    with raises(ValueError, "rank=", f"gradsync's rank is {rank}"):
        next(rendezvous("gradsync://", rank=rank + 1, world_size=size))
    assert (got_rank, got_size) == (rank, size)


def test_the_rendezvous_sets_torchruns_rank_variables_for_code_that_reads_them(rank, size):
    """After init_process_group, as under torchrun: a script's ``os.environ["LOCAL_RANK"]`` and
    torch's own ``get_node_local_rank()`` give this rank's place (no port, no GROUP_RANK)."""
    assert os.environ["RANK"] == str(rank) and os.environ["WORLD_SIZE"] == str(size)
    assert os.environ["LOCAL_RANK"] == str(gradsync.local_rank())
    assert os.environ["LOCAL_WORLD_SIZE"] == str(gradsync.local_size())
    assert dist.get_node_local_rank() == gradsync.local_rank()
    assert "MASTER_PORT" not in os.environ and "GROUP_RANK" not in os.environ


def test_the_rendezvous_leaves_a_variable_someone_else_set_and_updates_its_own(rank):
    from gradsync.torch import distributed as backend

    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    environ, exported = {n: os.environ.get(n) for n in names}, dict(backend._exported)
    try:
        os.environ["LOCAL_RANK"] = "7"  # the user's own value
        backend._exported["RANK"] = os.environ["RANK"] = "99"  # an earlier rendezvous's (an elastic reset)
        backend.export_launcher_variables(rank, 5, 3, 4)
        assert os.environ["LOCAL_RANK"] == "7"
        assert [os.environ[n] for n in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")] == [str(rank), "5", "4"]
    finally:
        backend._exported.clear()
        backend._exported.update(exported)
        for name, value in environ.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def test_torchruns_rank_variables_come_from_the_launcher_before_any_rendezvous(monkeypatch):
    """What ``import gradsync.torch`` exports for a script that reads ``LOCAL_RANK`` before
    ``init_process_group``: the launcher's rank, size and place on the host (Hydra's here)."""
    from gradsync.torch import distributed as backend

    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    monkeypatch.setattr(backend, "_exported", {})
    for name in names:
        monkeypatch.delenv(name, raising=False)
    backend.export_from_launcher({"PMI_SIZE": "4", "PMI_RANK": "3", "MPI_LOCALRANKID": "1",
                                  "MPI_LOCALNRANKS": "2"})
    assert [os.environ[n] for n in names] == ["3", "4", "1", "2"]
    backend.export_from_launcher({})  # no launcher: nothing changes
    assert [os.environ[n] for n in names] == ["3", "4", "1", "2"]


def test_nothing_is_registered_where_torch_distributed_is_unavailable(monkeypatch):
    from gradsync.torch import distributed as backend

    monkeypatch.setattr(dist, "is_available", lambda: False)
    monkeypatch.setattr(dist.Backend, "_plugins", {})
    backend.register()
    assert dist.Backend._plugins == {}


@pytest.mark.parametrize(("dtype", "op"), PAIRS)
def test_all_reduce_gives_the_reduction_of_every_ranks_tensor(case, rank, dtype, op):
    inputs = all_inputs(case, dtype, (3, 5), OPS[op])
    tensor = to_torch(inputs[rank])
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op))
    assert_array(to_numpy(tensor, dtype), reference_allreduce(inputs, OPS[op]))


def test_premul_sum_multiplies_each_rank_s_tensor_by_the_factor_first(case, rank):
    inputs = all_inputs(case, "float64", (7,))
    tensor = to_torch(inputs[rank])
    dist.all_reduce(tensor, op=dist._make_nccl_premul_sum(0.25))
    assert_array(tensor.numpy(), reference_allreduce(inputs, Sum, prescale=0.25))


@pytest.mark.parametrize("dtype", ("uint8", "int32", "int64", "bool"))
@pytest.mark.parametrize("op", BITWISE)
def test_bitwise_all_reduce_folds_every_ranks_bits(case, rank, op, dtype):
    inputs = all_inputs(case, dtype, (4, 3), Max)
    tensor = to_torch(inputs[rank])
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op))
    assert_array(to_numpy(tensor, dtype), functools.reduce(BITWISE[op], inputs))


def _sparse_input(case, rank):
    """Rank ``rank``'s sparse (4, 3) tensor: rows 0 .. rank - 1 (none on rank 0), values from ``case``."""
    dense = np.zeros((4, 3))
    dense[:rank] = make(case, rank, "float64", (rank, 3))
    return torch.from_numpy(dense).to_sparse(1)


def test_all_reduce_of_a_sparse_tensor_sums_every_ranks_rows_as_gloo_does(case, rank, size):
    tensor = _sparse_input(case, rank)
    dist.all_reduce(tensor)
    want = sum(_sparse_input(case, r).to_dense().numpy() for r in range(size))
    assert tensor.is_sparse
    assert_array(tensor.to_dense().numpy(), want)


def test_a_sparse_tensor_is_only_summed(case, rank):
    with raises(TypeError, "sparse", "SUM"):
        dist.all_reduce(_sparse_input(case, rank), op=dist.ReduceOp.MAX)


def test_a_bitwise_op_on_floats_is_refused_naming_the_op():
    with raises(TypeError, "BAND", "integer or bool"):
        dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND)


@pytest.mark.parametrize("dtype", ("bfloat16", "float64", "int16", "bool"))
@pytest.mark.parametrize("root", ROOTS)
def test_broadcast_gives_every_rank_the_roots_tensor(case, rank, root, dtype):
    inputs = all_inputs(case, dtype, (2, 3))
    tensor = to_torch(inputs[rank])
    dist.broadcast(tensor, src=root)
    assert_array(to_numpy(tensor, dtype), inputs[root])


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_tensors_a_collective_was_given_stay_resizable_as_on_gloo(case, rank, size, dtype):
    """A collective leaves its tensors' storage resizable (torch's ``numpy()`` would mark it not
    resizable for good): DDP's buckets are resized by torch's batched PowerSGD hook, buffers freed
    with ``untyped_storage().resize_(0)``."""
    inputs = all_inputs(case, dtype, (4,))
    reduced, broadcast, sent = (to_torch(inputs[rank]).clone() for _ in range(3))  # torch owns their memory
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
    dist.broadcast(broadcast, src=0)
    tensors = {"all_reduce": reduced, "broadcast": broadcast}
    if size > 1:
        received = torch.empty_like(sent)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, (rank + 1) % size),
                                            dist.P2POp(dist.irecv, received, (rank - 1) % size)]):
            work.wait()
        tensors.update(isend=sent, irecv=received)
    values = {call: tensor.clone() for call, tensor in tensors.items()}
    for call, tensor in tensors.items():
        tensor.resize_(8)  # raised "Trying to resize storage that is not resizable" before
        tensor.untyped_storage().resize_(0)
        assert tensor.untyped_storage().nbytes() == 0, call
    assert_array(to_numpy(values["all_reduce"], dtype), reference_allreduce(inputs, Max))
    assert_array(to_numpy(values["broadcast"], dtype), inputs[0])
    if size > 1:
        assert_array(to_numpy(values["irecv"], dtype), inputs[(rank - 1) % size])


@pytest.mark.parametrize("dtype", ("float16", "float32", "int8", "bool"))
def test_all_gather_gives_every_ranks_tensor_in_rank_order(case, rank, size, dtype):
    inputs = all_inputs(case, dtype, (2, 2))
    outputs = [torch.empty((2, 2), dtype=getattr(torch, dtype)) for _ in range(size)]
    dist.all_gather(outputs, to_torch(inputs[rank]))
    for got, want in zip(outputs, inputs):
        assert_array(to_numpy(got, dtype), want)


def test_all_gather_coalesced_gives_rank_r_s_tensors_in_list_r(case, rank, size):
    inputs = [all_inputs(f"{case}.{i}", "int32", (i + 1,)) for i in range(2)]  # inputs[i][rank]
    outputs = [[torch.empty(i + 1, dtype=torch.int32) for i in range(2)] for _ in range(size)]
    dist.all_gather_coalesced(outputs, [to_torch(inputs[i][rank]) for i in range(2)])
    for r in range(size):
        for i in range(2):
            assert_array(outputs[r][i].numpy(), inputs[i][r])


def test_all_gather_of_uneven_sizes_gives_each_rank_its_own_size(case, rank, size):
    inputs = all_inputs(case, "float32", [(r + 1, 2) for r in range(size)])
    outputs = [torch.empty((r + 1, 2)) for r in range(size)]
    dist.all_gather(outputs, to_torch(inputs[rank]))
    for got, want in zip(outputs, inputs):
        assert_array(got.numpy(), want)


@pytest.mark.parametrize("stacked", (False, True), ids=("concatenated", "stacked"))
def test_all_gather_into_tensor_concatenates_or_stacks(case, rank, size, stacked):
    inputs = all_inputs(case, "float64", (2, 3))
    output = torch.empty((size, 2, 3) if stacked else (2 * size, 3), dtype=torch.float64)
    dist.all_gather_into_tensor(output, to_torch(inputs[rank]))
    want = np.stack(inputs) if stacked else np.concatenate(inputs)
    assert_array(output.numpy(), want)


@pytest.mark.parametrize("op", ("SUM", "AVG", "MAX"))
def test_reduce_scatter_gives_rank_r_the_reduction_of_block_r(case, rank, size, op):
    blocks = [all_inputs(f"{case}.{r}", "float64", (2, 2), OPS[op]) for r in range(size)]
    output = torch.empty((2, 2), dtype=torch.float64)
    dist.reduce_scatter(output, [to_torch(blocks[r][rank]) for r in range(size)],
                        op=getattr(dist.ReduceOp, op))
    assert_array(output.numpy(), reference_allreduce(blocks[rank], OPS[op]))


def test_outputs_made_in_inference_mode_are_written(case, rank, size):
    """Lightning's validation loop runs under torch.inference_mode(): its all_gather outputs are
    inference tensors, which the completion thread (not in that mode) must still fill."""
    inputs = all_inputs(case, "float64", (3,))
    with torch.inference_mode():
        listed = [torch.empty(3, dtype=torch.float64) for _ in range(size)]
        concatenated = torch.empty(3 * size, dtype=torch.float64)
        dist.all_gather(listed, to_torch(inputs[rank]))
        dist.all_gather_into_tensor(concatenated, to_torch(inputs[rank]))
    assert_array(torch.stack(listed).numpy(), np.stack(inputs))
    assert_array(concatenated.numpy(), np.concatenate(inputs))


@pytest.mark.parametrize("op", ("SUM", "BXOR"))
def test_reduce_scatter_tensor_gives_rank_r_the_reduction_of_its_rows(case, rank, size, op):
    inputs = all_inputs(case, "int64", (2 * size, 3), Max)
    output = torch.empty((2, 3), dtype=torch.int64)
    dist.reduce_scatter_tensor(output, to_torch(inputs[rank]), op=getattr(dist.ReduceOp, op))
    mine = [x[2 * rank:2 * rank + 2] for x in inputs]
    want = functools.reduce(np.bitwise_xor, mine) if op == "BXOR" else sum(mine)
    assert_array(output.numpy(), want)


def test_all_to_all_sends_tensor_r_to_rank_r(case, rank, size):
    inputs = [all_inputs(f"{case}.{r}", "float32", [(d + r + 1,) for d in range(size)])
              for r in range(size)]  # inputs[source][destination]: sizes differ by both
    outputs = [torch.empty(rank + r + 1) for r in range(size)]
    dist.all_to_all(outputs, [to_torch(inputs[rank][d]) for d in range(size)])
    for source, got in enumerate(outputs):
        assert_array(got.numpy(), inputs[source][rank])


def test_all_to_all_single_with_uneven_splits(case, rank, size):
    splits = [alltoall_splits(case, r) for r in range(size)]
    inputs = [make(case, r, "float64", (sum(splits[r]), 2)) for r in range(size)]
    want, received = reference_alltoall(inputs, splits, rank)
    output = torch.empty((sum(received), 2), dtype=torch.float64)
    dist.all_to_all_single(output, to_torch(inputs[rank]), output_split_sizes=received,
                           input_split_sizes=splits[rank])
    assert_array(output.numpy(), want)


def test_all_to_all_single_without_splits_splits_evenly(case, rank, size):
    inputs = all_inputs(case, "int32", (2 * size, 2))
    output = torch.empty((2 * size, 2), dtype=torch.int32)
    dist.all_to_all_single(output, to_torch(inputs[rank]))
    assert_array(output.numpy(), np.concatenate([x[2 * rank:2 * rank + 2] for x in inputs]))


@pytest.mark.parametrize("root", ROOTS)
def test_reduce_gives_the_root_the_reduction_and_leaves_the_others_alone(case, rank, root):
    inputs = all_inputs(case, "float32", (3,))
    tensor = to_torch(inputs[rank])
    dist.reduce(tensor, dst=root, op=dist.ReduceOp.SUM)
    assert_array(tensor.numpy(), reference_allreduce(inputs, Sum) if rank == root else inputs[rank])


@pytest.mark.parametrize("root", ROOTS)
def test_gather_gives_the_root_every_ranks_tensor(case, rank, size, root):
    inputs = all_inputs(case, "int64", (2,))
    outputs = [torch.empty(2, dtype=torch.int64) for _ in range(size)] if rank == root else None
    dist.gather(to_torch(inputs[rank]), gather_list=outputs, dst=root)
    if rank == root:
        for got, want in zip(outputs, inputs):
            assert_array(got.numpy(), want)


@pytest.mark.parametrize("root", ROOTS)
def test_scatter_gives_rank_r_the_roots_tensor_r(case, rank, size, root):
    pieces = all_inputs(case, "float16", (3, 2))  # piece r goes to rank r
    output = torch.empty((3, 2), dtype=torch.float16)
    dist.scatter(output, [to_torch(p) for p in pieces] if rank == root else None, src=root)
    assert_array(to_numpy(output, "float16"), pieces[rank])


def test_barrier_waits_for_the_last_rank(rank, size):
    if size == 1:
        pytest.skip("one rank waits for nobody")
    if rank == size - 1:
        time.sleep(0.3)
    started = time.perf_counter()
    dist.barrier()
    waited = time.perf_counter() - started
    assert rank == size - 1 or waited > 0.2


def test_object_collectives_move_python_objects(rank, size):
    gathered = [None] * size
    dist.all_gather_object(gathered, {"rank": rank})
    listed = [f"from {rank}", rank] if rank == 0 else [None, None]
    dist.broadcast_object_list(listed, src=0)
    at_root = [None] * size if rank == 0 else None
    dist.gather_object(("g", rank), at_root, dst=0)
    scattered = [None]
    dist.scatter_object_list(scattered, [f"to {r}" for r in range(size)] if rank == 0 else None, src=0)
    assert gathered == [{"rank": r} for r in range(size)]
    assert listed == ["from 0", 0]
    assert rank != 0 or at_root == [("g", r) for r in range(size)]
    assert scattered == [f"to {rank}"]


def test_async_op_returns_a_work_whose_future_has_the_result(case, rank):
    inputs = all_inputs(case, "float64", (4,))
    tensor = to_torch(inputs[rank])
    work = dist.all_reduce(tensor, async_op=True)
    value = work.get_future().wait()
    work.wait()
    assert_array(tensor.numpy(), reference_allreduce(inputs, Sum))
    assert work.is_completed() and value[0] is tensor


def test_a_pending_future_completes_off_the_calling_thread(case, rank, size):
    if size == 1:
        pytest.skip("one rank's collective may finish before its future is chained")
    late = size - 1  # submits last: the others' futures are still pending when chained
    if rank == late:
        time.sleep(0.2)
    work = dist.all_reduce(torch.ones(2), async_op=True)
    threads = []
    chained = work.get_future().then(lambda fut: threads.append(threading.get_ident()) or fut.value())
    chained.wait()
    assert rank == late or threads[0] != threading.get_ident()


def test_wait_with_a_timeout_raises_when_the_collective_is_still_pending(rank, size):
    if size == 1:
        pytest.skip("one rank's collective does not wait for another")
    late = size - 1
    if rank == late:
        time.sleep(0.5)
    work = dist.all_reduce(torch.ones(2), async_op=True)
    timed_out = None
    if rank != late:
        try:
            work.wait(timeout=datetime.timedelta(seconds=0.05))
        except RuntimeError as error:  # as gloo's "Operation timed out!"
            timed_out = error
    work.wait()
    assert rank == late or (isinstance(timed_out, dist.DistBackendError)
                            and isinstance(timed_out, TimeoutError) and f"rank {rank}" in str(timed_out))


def test_coalesced_all_reduces_reduce_every_tensor(case, rank):
    inputs = [all_inputs(f"{case}.{i}", "float32", (i + 1, 2)) for i in range(3)]
    tensors = [to_torch(x[rank]) for x in inputs]
    with dist._coalescing_manager(async_ops=True) as manager:
        for tensor in tensors:
            dist.all_reduce(tensor)
    manager.wait()
    for tensor, x in zip(tensors, inputs):
        assert_array(tensor.numpy(), reference_allreduce(x, Sum))


def test_coalesced_all_gathers_and_reduce_scatters(case, rank, size):
    inputs = [all_inputs(f"{case}.{i}", "float64", (size, i + 1)) for i in range(2)]
    gathered = [torch.empty((size * size, i + 1), dtype=torch.float64) for i in range(2)]
    scattered = [torch.empty((1, i + 1), dtype=torch.float64) for i in range(2)]
    with dist._coalescing_manager():
        for i in range(2):
            dist.all_gather_into_tensor(gathered[i], to_torch(inputs[i][rank]))
    with dist._coalescing_manager():
        for i in range(2):
            dist.reduce_scatter_tensor(scattered[i], to_torch(inputs[i][rank]))
    for i in range(2):
        assert_array(gathered[i].numpy(), np.concatenate(inputs[i]))
        assert_array(scattered[i].numpy(), reference_allreduce(inputs[i], Sum)[rank:rank + 1])


def test_functional_collectives_return_the_reduction_and_the_concatenation(case, rank, size):
    """``torch.distributed._functional_collectives`` (DTensor's and tensor parallelism's calls): new
    tensors from the group's all_reduce, all_gather_into_tensor and reduce_scatter_tensor."""
    import torch.distributed._functional_collectives as funcol

    x = all_inputs(case, "float32", (size, 3))
    mine = to_torch(x[rank])
    assert_array(funcol.all_reduce(mine, "sum", dist.group.WORLD).numpy(), reference_allreduce(x, Sum))
    assert_array(funcol.all_gather_tensor(mine, 0, dist.group.WORLD).numpy(), np.concatenate(x))
    assert_array(funcol.reduce_scatter_tensor(mine, "sum", 0, dist.group.WORLD).numpy(),
                 reference_allreduce(x, Sum)[rank:rank + 1])
    assert_array(mine.numpy(), x[rank])  # the input is left as it was


def test_a_compiled_function_s_functional_all_reduce_runs_on_the_group(case, rank):
    """``torch.compile`` traces the functional collective into its graph (no graph break), which
    calls the group at run time."""
    import torch.distributed._functional_collectives as funcol

    @torch.compile(backend="aot_eager", fullgraph=True)
    def doubled_then_summed(tensor):
        return funcol.all_reduce(tensor * 2, "sum", dist.group.WORLD)

    x = all_inputs(case, "float32", (WORLD_SIZE, 4))
    assert_array(doubled_then_summed(to_torch(x[rank])).numpy(), reference_allreduce(2 * x, Sum))


def test_a_new_group_reduces_among_its_members_only(case, rank, size):
    members = list(range(max(1, size - 1)))  # every rank but the last (at 1 rank: rank 0)
    group = dist.new_group(members)
    inputs = all_inputs(case, "float64", (3,))
    tensor = to_torch(inputs[rank])
    if rank in members:
        dist.all_reduce(tensor, group=group)
        assert dist.get_rank(group) == members.index(rank)
    assert_array(tensor.numpy(), reference_allreduce(inputs[:len(members)], Sum) if rank in members
                 else inputs[rank])


def test_gradsync_can_register_the_ranks_of_a_torch_subgroup_again(case, rank, size):
    """A torch group's process set is known to its members only: the other ranks would not agree
    that gradsync.add_process_set of the same ranks repeats it (and would wait for the members)."""
    members = [0]
    dist.new_group(members)
    process_set = gradsync.add_process_set(members)
    try:
        got = gradsync.allreduce(np.ones(2), op=Sum, process_set=process_set) if rank in members else None
    finally:
        gradsync.remove_process_set(process_set)
    assert rank not in members or (got == 1.0).all()


def test_subgroups_by_enumeration_reduce_within_each_subgroup(case, rank, size):
    parities = [list(range(start, size, 2)) for start in range(min(2, size))]  # evens, odds
    mine, _ = dist.new_subgroups_by_enumeration(parities)
    inputs = all_inputs(case, "float32", (3,))
    tensor = to_torch(inputs[rank])
    dist.all_reduce(tensor, group=mine)
    assert_array(tensor.numpy(), reference_allreduce([inputs[r] for r in parities[rank % 2]], Sum))


def test_overlapping_subgroups_have_one_id_on_every_member_and_reduce_apart(case, rank, size):
    """Every pair of ranks as a group (at 3 ranks: {0,1}, {0,2}, {1,2}, so each rank's member-only
    sets are made in another order): the members of a pair agree on its process set's id, no rank
    has two sets of one id, and each pair reduces among its own ranks."""
    pairs = [[a, b] for a in range(size) for b in range(a + 1, size)]
    groups = [dist.new_group(pair) for pair in pairs]
    inputs = all_inputs(case, "float64", (2,))
    ids, sums = {}, {}
    for pair, group in zip(pairs, groups):
        if rank in pair:
            tensor = to_torch(inputs[rank])
            dist.all_reduce(tensor, group=group)
            ids[tuple(pair)], sums[tuple(pair)] = group.process_set.process_set_id, tensor.numpy()
    every = [None] * size
    dist.all_gather_object(every, ids)
    for pair in pairs:
        assert len({every[r][tuple(pair)] for r in pair}) == 1, (pair, every)
    for ranks_ids in every:  # unique among a rank's sets (disjoint pairs, at 4 ranks, may share one)
        assert len(set(ranks_ids.values())) == len(ranks_ids), every
    for pair, got in sums.items():
        assert_array(got, reference_allreduce([inputs[r] for r in pair], Sum))


def test_a_second_group_of_every_rank_works_beside_the_default_one(case, rank):
    group = dist.new_group(list(range(dist.get_world_size())))
    inputs = all_inputs(case, "int64", (2,), Max)
    a, b = to_torch(inputs[rank]), to_torch(inputs[rank])
    dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(b, op=dist.ReduceOp.MIN)
    assert group.group_name != dist.group.WORLD.group_name
    assert_array(a.numpy(), reference_allreduce(inputs, Max))
    assert_array(b.numpy(), reference_allreduce(inputs, Min))


def test_more_asynchronous_calls_in_flight_than_names_each_get_their_own_result(case, rank):
    """More outstanding all_reduces than the group's rotating names (group.SLOTS): a call whose
    name is still in flight waits for it, and every call still gets its own tensor's reduction."""
    from gradsync.torch.distributed.group import SLOTS

    count = 2 * SLOTS + 7
    inputs = [all_inputs(f"{case}-{i}", "float64", (i % 5 + 1,)) for i in range(count)]
    tensors = [to_torch(per_rank[rank]) for per_rank in inputs]
    works = [dist.all_reduce(tensor, async_op=True) for tensor in tensors]
    for work in works:
        work.wait()
    for tensor, per_rank in zip(tensors, inputs):
        assert_array(tensor.numpy(), reference_allreduce(per_rank, Sum))


def _disagreeing_call(call: str, what: str, rank: int, size: int):
    """A ``call`` on which the ranks disagree on ``what``: rank 0's tensor is float64 and the
    others' float32, or rank r's has r + 1 elements (all_gather_into_tensor: r + 1 columns, as
    rows of another length are a legal uneven gather). all_reduce waits on its Work, the gather
    blocks."""
    dtype = torch.float64 if what == "dtype" and rank == 0 else torch.float32
    columns = rank + 1 if what == "shape" else 2
    if call == "all_reduce":
        tensor = torch.ones(columns, dtype=dtype)
        return lambda: dist.all_reduce(tensor, async_op=True).wait()
    tensor, output = torch.ones((1, columns), dtype=dtype), torch.empty((size, columns), dtype=dtype)
    return lambda: dist.all_gather_into_tensor(output, tensor)


@pytest.mark.parametrize("what", ("shape", "dtype"))
@pytest.mark.parametrize("call", ("all_reduce", "all_gather_into_tensor"))
def test_ranks_that_disagree_all_get_the_error_and_the_group_still_works(rank, size, call, what):
    if size == 1:
        pytest.skip("one rank agrees with itself")
    with pytest.raises(gradsync.CollectiveError) as caught:
        _disagreeing_call(call, what, rank, size)()
    after = torch.ones(2)
    dist.all_reduce(after)
    message = str(caught.value)
    assert what in message and all(f"rank {r}" in message for r in range(size)), message
    assert_array(after.numpy(), np.full(2, float(size), np.float32))


def needs_two_ranks(size: int) -> None:
    if size == 1:
        pytest.skip("a message needs another rank")


@pytest.mark.parametrize("dtype", ("bfloat16", "float64", "int16", "bool"))
def test_isend_and_irecv_pass_a_tensor_around_the_ring(case, rank, size, dtype):
    needs_two_ranks(size)
    inputs = all_inputs(case, dtype, (2, 3))
    received = torch.empty((2, 3), dtype=getattr(torch, dtype))
    works = [dist.irecv(received, src=(rank - 1) % size), dist.isend(to_torch(inputs[rank]), dst=(rank + 1) % size)]
    for work in works:
        work.wait()
    assert_array(to_numpy(received, dtype), inputs[(rank - 1) % size])


def test_recv_into_a_strided_view_from_any_source_returns_the_sender(case, rank, size):
    needs_two_ranks(size)
    inputs = all_inputs(case, "float32", (3, 2))
    if rank == 1:
        dist.send(to_torch(inputs[1].T.copy()), dst=0, tag=7)
    if rank == 0:
        base = torch.zeros(3, 2)
        sender = dist.recv(base.t(), tag=7)
        assert sender == 1
        assert_array(base.numpy(), inputs[1])


def test_messages_of_one_source_and_tag_arrive_in_the_order_sent(rank, size):
    needs_two_ranks(size)
    if rank == 1:
        works = [dist.isend(torch.full((2,), float(i)), dst=0, tag=3) for i in range(4)]
        for work in works:
            work.wait()
    if rank == 0:
        got = [torch.empty(2) for _ in range(4)]
        works = [dist.irecv(t, src=1, tag=3) for t in got]
        for work in works:
            work.wait()
        assert [t[0].item() for t in got] == [0.0, 1.0, 2.0, 3.0]


def test_batch_isend_irecv_exchanges_with_both_neighbours(case, rank, size):
    needs_two_ranks(size)
    inputs = all_inputs(case, "int64", (4,))
    left, right = torch.empty(4, dtype=torch.int64), torch.empty(4, dtype=torch.int64)
    ops = [dist.P2POp(dist.isend, to_torch(inputs[rank]), (rank + 1) % size),
           dist.P2POp(dist.isend, to_torch(inputs[rank]), (rank - 1) % size),
           dist.P2POp(dist.irecv, left, (rank - 1) % size), dist.P2POp(dist.irecv, right, (rank + 1) % size)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert_array(left.numpy(), inputs[(rank - 1) % size])
    assert_array(right.numpy(), inputs[(rank + 1) % size])


def test_a_pending_receive_does_not_hold_back_a_barrier(rank, size):
    needs_two_ranks(size)
    if rank == 0:
        received = torch.zeros(1)
        work = dist.irecv(received, src=size - 1)
        dist.barrier()
        work.wait()
        assert received.item() == 5.0
    else:
        dist.barrier()
        if rank == size - 1:
            dist.send(torch.full((1,), 5.0), dst=0)


def batch(r: int, step: int, rows: int = 3) -> tuple:
    """Rank ``r``'s batch of ``step`` (float64)."""
    g = torch.Generator().manual_seed(1000 * step + r)
    return (torch.randn(rows, 4, generator=g, dtype=torch.float64),
            torch.randn(rows, 2, generator=g, dtype=torch.float64))


class TwoHeads(torch.nn.Module):
    """A small model with a head that ``forward(x, use_b=False)`` leaves unused."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(4, 5).double()
        self.a = torch.nn.Linear(5, 2).double()
        self.b = torch.nn.Linear(5, 2).double()

    def forward(self, x, use_b: bool = True):
        h = torch.tanh(self.body(x))
        return self.a(h) + self.b(h) if use_b else self.a(h)


def trained_alone(steps: int, size: int, use_b: bool = True, accumulate: int = 1) -> list:
    """The parameters of one process trained on every rank's batches together."""
    model = TwoHeads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        for micro in range(accumulate):
            xs, ys = zip(*(batch(r, accumulate * step + micro) for r in range(size)))
            loss = torch.nn.functional.mse_loss(model(torch.cat(xs), use_b), torch.cat(ys)) / accumulate
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach() for p in model.parameters()]


def assert_trains_like_one_process(model, optimizer, rank: int, size: int, atol: float,
                                   rtol: float = 0.0, use_b: bool = True) -> None:
    """Three steps of the DDP-wrapped :class:`TwoHeads` ``model`` on this rank's batches, then its
    parameters against :func:`trained_alone` on every rank's batches together."""
    for step in range(3):
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(model(x, use_b), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    for got, want in zip(model.module.parameters(), trained_alone(3, size, use_b)):
        torch.testing.assert_close(got.detach(), want, rtol=rtol, atol=atol)


DDP_OPTIONS = {
    "default": {},
    "bucket-view": {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.0001},
    "unused": {"find_unused_parameters": True},
    "static": {"static_graph": True},
}


@pytest.mark.parametrize("option", DDP_OPTIONS)
def test_ddp_trains_like_one_process_on_the_whole_batch(rank, size, option):
    from torch.nn.parallel import DistributedDataParallel

    use_b = option != "unused"
    model = DistributedDataParallel(TwoHeads(), **DDP_OPTIONS[option])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert_trains_like_one_process(model, optimizer, rank, size, atol=1e-12, rtol=1e-12, use_b=use_b)


def test_ddp_no_sync_accumulates_and_reduces_on_the_next_backward(rank, size):
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(TwoHeads())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        with model.no_sync():
            x, y = batch(rank, 2 * step)
            (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
        x, y = batch(rank, 2 * step + 1)
        (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    for got, want in zip(model.module.parameters(), trained_alone(2, size, accumulate=2)):
        torch.testing.assert_close(got.detach(), want, rtol=1e-12, atol=1e-12)


def test_ddp_with_torchs_fp16_compress_hook_trains_like_one_process_to_fp16_precision(rank, size):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(TwoHeads())
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert_trains_like_one_process(model, optimizer, rank, size, atol=2e-3)


@pytest.mark.parametrize("hook,tolerance", [("ALLREDUCE", 1e-12), ("FP16_COMPRESS", 2e-3)])
def test_ddp_builtin_comm_hooks_train_like_one_process(rank, size, hook, tolerance):
    # torch's C++ FP16_COMPRESS hook would stop backward at an INTERNAL ASSERT on a Python group.
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(TwoHeads())
    model._register_builtin_comm_hook(getattr(dist.BuiltinCommHookType, hook))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert_trains_like_one_process(model, optimizer, rank, size, atol=tolerance)


def test_torch_zero_redundancy_optimizer_trains_like_one_process(rank, size):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(TwoHeads())
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    assert_trains_like_one_process(model, optimizer, rank, size, atol=1e-12, rtol=1e-12)


def test_torchmetrics_sync_gives_the_metric_of_every_ranks_data(case, rank, size):
    torchmetrics = pytest.importorskip("torchmetrics")
    inputs = [all_inputs(f"{case}.{k}", "float64", [(2 * r + 1,) for r in range(size)]) for k in range(2)]
    mean_squared = torchmetrics.MeanSquaredError().set_dtype(torch.float64)
    concatenated = torchmetrics.CatMetric().set_dtype(torch.float64)
    mean_squared.update(to_torch(inputs[0][rank]), to_torch(inputs[1][rank]))
    concatenated.update(to_torch(inputs[0][rank]))
    got_mse, got_cat = mean_squared.compute(), concatenated.compute()
    predictions, targets = np.concatenate(inputs[0]), np.concatenate(inputs[1])
    np.testing.assert_allclose(got_mse.item(), np.mean((predictions - targets) ** 2), rtol=1e-12)
    assert_array(got_cat.reshape(-1).numpy(), predictions)  # one element: CatMetric gives a 0-d tensor


def trained_alone_per_rank(steps_of: list[int], model: torch.nn.Module) -> list:
    """One process's parameters after each step's gradient: the sum over the ranks that still
    have a batch at that step of their mean loss, divided by the number of ranks (DDP's join)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(max(steps_of)):
        losses = [torch.nn.functional.mse_loss(model(batch(r, step)[0]), batch(r, step)[1])
                  for r, steps in enumerate(steps_of) if step < steps]
        (sum(losses) / len(steps_of)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach() for p in model.parameters()]


def test_ddp_join_lets_ranks_with_fewer_batches_shadow_the_others(rank, size):
    from torch.nn.parallel import DistributedDataParallel

    steps_of = [2 + r for r in range(size)]  # rank r has 2 + r batches
    model = DistributedDataParallel(TwoHeads())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join():
        for step in range(steps_of[rank]):
            x, y = batch(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    for got, want in zip(model.module.parameters(), trained_alone_per_rank(steps_of, TwoHeads())):
        torch.testing.assert_close(got.detach(), want, rtol=1e-12, atol=1e-12)


def test_a_failed_bucket_allreduce_fails_ddps_backward_in_the_callers_thread(rank, size, monkeypatch):
    """DDP's reducer (C++, in autograd's thread) reads its bucket from the Work's future: a failed
    allreduce must be that future's error, raised by backward() here, not an exception object
    handed over as the future's value. The failure is injected on every rank, before any data
    moves, so the ranks stay in step."""
    from torch.nn.parallel import DistributedDataParallel

    from gradsync.torch.distributed import reductions

    model = DistributedDataParallel(TwoHeads())

    def failing(*args, **kwargs):
        def fail():
            raise gradsync.CollectiveError("gradsync: injected: the bucket's allreduce failed")
        return fail

    monkeypatch.setattr(reductions, "_submit_allreduce", failing)
    x, y = batch(rank, 0)
    with pytest.raises(RuntimeError, match="CollectiveError: gradsync: injected"):
        torch.nn.functional.mse_loss(model(x), y).backward()
    monkeypatch.undo()
    after = torch.ones(2)
    dist.all_reduce(after)
    assert_array(after.numpy(), np.full(2, float(size), np.float32))

def square_model() -> torch.nn.Module:
    """Two layers of 4 x 4 weights: PowerSGD of rank 4 approximates their gradients exactly."""
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4)).double()


def square_batch(r: int, step: int) -> tuple:
    """Rank ``r``'s batch: 5 rows, so that each rank's weight gradients have full rank."""
    g = torch.Generator().manual_seed(7000 + 100 * step + r)
    return torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(5, 4, generator=g, dtype=torch.float64)


def test_powersgd_hook_whose_callbacks_wait_on_collectives_trains_like_one_process(rank, size):
    """PowerSGD's hook waits for an allreduce inside a future's callback: the callbacks must not run
    in the thread that completes the group's futures (it would wait for itself). At full rank its
    approximation is exact, so the training equals one process's."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(square_model())
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                        start_powerSGD_iter=2, min_compression_rate=0)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    alone = square_model()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, alone)]
    for step in range(4):
        x, y = square_batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        xs, ys = zip(*(square_batch(r, step) for r in range(size)))
        torch.nn.functional.mse_loss(alone(torch.cat(xs)), torch.cat(ys)).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for got, want in zip(model.module.parameters(), alone.parameters()):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-9, atol=1e-9)


@pytest.mark.skipif(not hasattr(torch.cpu.Stream, "record_event"),
                    reason="this torch's FSDP2 does not run on CPU tensors (torch.cpu.Stream.record_event)")
def test_fsdp2_fully_shard_on_a_device_mesh_trains_like_one_process(rank, size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (size,))
    model, alone = square_model(), square_model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, alone)]
    for step in range(3):
        x, y = square_batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        xs, ys = zip(*(square_batch(r, step) for r in range(size)))
        torch.nn.functional.mse_loss(alone(torch.cat(xs)), torch.cat(ys)).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for got, want in zip(model.parameters(), alone.parameters()):
        torch.testing.assert_close(got.full_tensor().detach(), want.detach(), rtol=1e-12, atol=1e-12)


def test_distributed_checkpoint_saves_and_loads_a_sharded_model(tmp_path, rank, size):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    directory = [str(tmp_path)]
    dist.broadcast_object_list(directory, src=0)
    mesh = init_device_mesh("cpu", (size,))
    saved = fully_shard(square_model(), mesh=mesh)
    torch.manual_seed(2)  # other values than the saved ones
    loaded = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4)).double()
    fully_shard(loaded, mesh=mesh)
    dcp.save(saved.state_dict(), checkpoint_id=directory[0])
    state = loaded.state_dict()
    dcp.load(state, checkpoint_id=directory[0])
    loaded.load_state_dict(state)
    for got, want in zip(loaded.parameters(), square_model().parameters()):
        torch.testing.assert_close(got.full_tensor().detach(), want.detach(), rtol=0, atol=0)


def test_a_barrier_some_rank_makes_late_fails_after_its_timeout_and_completes_when_it_arrives(rank, size):
    """``dist.barrier(timeout=...)``, as gloo's: a rank whose barrier the others do not join within
    the timeout gets a timeout error then (not a hang); the barrier itself stays pending and
    completes once the late rank arrives, so the ranks stay in step."""
    if size < 2:
        pytest.skip("needs a second rank to be late")
    if "timeout" not in inspect.signature(dist.barrier).parameters:
        pytest.skip(f"torch {torch.__version__}'s dist.barrier takes no timeout")
    started = time.monotonic()
    if rank == 0:
        with raises(RuntimeError, "Timed out", "barrier"):
            dist.barrier(timeout=datetime.timedelta(seconds=1))
        waited = time.monotonic() - started
    else:
        time.sleep(2.5)
        dist.barrier()
        waited = 1.0
    dist.barrier()  # the next call of the group orders after the late barrier
    assert 1.0 <= waited < 2.5


def test_a_group_whose_barrier_timed_out_and_is_never_joined_can_be_destroyed(rank, size):
    """As in torch's test_barrier_timeout_full_group: rank 0 alone calls barrier on a group with a
    1 s timeout; it fails there, and ``destroy_process_group`` of that group returns on every
    rank (the barrier's thread is not waited for)."""
    if size < 2:
        pytest.skip("needs a rank that does not call")
    group = dist.new_group(timeout=datetime.timedelta(seconds=1))
    stale = f"torch.{group.group_name}.barrier.0"
    if rank == 0:
        with raises(RuntimeError, "Timed out"):
            dist.barrier(group=group)
    else:
        time.sleep(1.5)  # past rank 0's timeout
    started = time.monotonic()
    dist.destroy_process_group(group)
    took = time.monotonic() - started
    if rank != 0:  # join rank 0's barrier after all, so that it leaves no stall behind
        gradsync.barrier(name=stale)
    assert took < 1.0


def test_a_groups_timeout_fails_a_call_some_rank_makes_late(rank, size):
    """A group made with ``timeout=``: a blocking all_reduce that another rank has not joined
    within it fails with torch's DistBackendError naming the call; the late rank's call then
    completes, and the group keeps working."""
    if size < 2:
        pytest.skip("needs a second rank to be late")
    group = dist.new_group(timeout=datetime.timedelta(seconds=1))
    tensor = torch.ones(3)
    if rank == 0:
        with raises(dist.DistBackendError, "Timed out", "allreduce"):
            dist.all_reduce(tensor, group=group)
    else:
        time.sleep(2.5)
        dist.all_reduce(tensor, group=group)
    dist.barrier()  # on the default group, without a short timeout: rank 1 is here now
    after = torch.full((2,), float(rank))
    dist.all_reduce(after, group=group)
    dist.destroy_process_group(group)
    assert after.tolist() == [float(sum(range(size)))] * 2


def test_a_blocking_all_reduce_runs_its_cycle_in_the_calling_thread_and_an_async_one_does_not(
        rank, size, cycle_threads):
    """A blocking call (``async_op=False``) pushes without waking gradsync's coordinator thread, and
    its ``wait()`` runs the cycle itself (caller runs); an ``async_op=True`` call wakes the
    coordinator thread, which runs it whether or not anyone waits (as gloo's progress thread)."""
    threads = cycle_threads
    for i in range(10):
        tensor = torch.full((4,), float(rank + i))
        dist.all_reduce(tensor)
        assert tensor.tolist() == [float(sum(range(size)) + size * i)] * 4
    mine = threading.current_thread().name
    assert threads.count(mine) >= 8, threads
    threads.clear()
    work = dist.all_reduce(torch.ones(4), async_op=True)
    deadline = time.monotonic() + 30
    while not work.is_completed() and time.monotonic() < deadline:  # nobody waits: it still runs
        time.sleep(0.001)
    assert work.is_completed() and mine not in threads, threads
    work.wait()
