"""Process sets on numpy arrays, against numpy references computed from the members' known inputs.

Runs at any world size. Sets: ``evens`` (world ranks 0, 2, ...; registered through
init(process_sets=...)) and ``odds`` (1, 3, ...; not created at one rank), disjoint.
"""

import time

import numpy as np
from harness import run_checks
from mpi4py import MPI

import gradsync
from gradsync import dtypes
from gradsync.fusion import split_rows

if MPI.COMM_WORLD.Get_size() > 1:
    evens = gradsync.ProcessSet(range(0, MPI.COMM_WORLD.Get_size(), 2))
    gradsync.init(process_sets=[evens])
else:  # at one rank the only set is the global one: the ops on it run, registration is not tested
    evens = gradsync.global_process_set
    gradsync.init()
rank, size = gradsync.rank(), gradsync.size()
odds = gradsync.add_process_set(range(1, size, 2)) if size > 1 else None
mine = evens if rank % 2 == 0 else odds  # the disjoint set this rank belongs to


def data(world_rank, dtype):
    values = (np.arange(6).reshape(2, 3) + world_rank) % 3
    if dtype == "bool":
        values = values % 2
    return values.astype(dtypes.NUMPY_DTYPES[dtype])


def reference(members, dtype, op):
    stacked = np.stack([data(r, dtype).astype(np.float64) for r in members])
    if op == gradsync.Sum:
        out = stacked.max(0) if dtype == "bool" else stacked.sum(0)
    elif op == gradsync.Max:
        out = stacked.max(0)
    else:  # Average: floor of the mean for integers
        out = stacked.sum(0) / len(members)
        if dtype in dtypes.INTEGER:
            out = np.floor(out)
    return out.astype(dtypes.NUMPY_DTYPES[dtype])


def refused(call, text, error=ValueError):
    """``call()`` raises ``error`` whose message contains ``text``."""
    try:
        call()
    except error as exc:
        assert text in str(exc), exc
    else:
        raise AssertionError(f"expected {error.__name__} with {text!r}")


def check_registration():
    if size == 1:
        return
    assert evens.process_set_id == 1 and (odds is None or odds.process_set_id == 2), (evens, odds)
    assert gradsync.global_process_set.process_set_id == 0
    assert gradsync.global_process_set.ranks == list(range(size))
    assert evens.included() == (rank % 2 == 0) and evens.size() == len(range(0, size, 2))
    assert mine.included() and mine.rank() == rank // 2, (mine, mine.rank())
    assert mine.size() == len(range(rank % 2, size, 2))
    for bad, text in [(lambda: gradsync.add_process_set(list(evens.ranks)), "already has the ranks"),
                      (lambda: gradsync.add_process_set(evens), "already registered"),
                      (lambda: gradsync.add_process_set([0, size]), f"ranks [{size}]"),
                      (lambda: gradsync.ProcessSet([]), "at least one rank"),
                      (lambda: gradsync.ProcessSet([1, 1]), "distinct")]:
        refused(bad, text)


def check_ops_outside_the_set_are_refused():
    if size == 1:
        return
    unregistered = gradsync.ProcessSet([0])
    refused(lambda: gradsync.allreduce(np.ones(2), name="x", process_set=unregistered),
            "is not registered")
    if rank % 2 == 0:
        return
    for call in (lambda: gradsync.allreduce(np.ones(2), name="outside", process_set=evens),
                 lambda: gradsync.barrier(process_set=evens),
                 lambda: gradsync.broadcast_object(1, root_rank=0, process_set=evens)):
        refused(call, f"rank {rank} is not a member of ProcessSet(id 1, ranks {evens.ranks})")


def check_allreduce_every_dtype_on_each_set():
    for dtype in dtypes.SUPPORTED:
        for op in (gradsync.Sum, gradsync.Max, gradsync.Average):
            if dtype == "bool" and op == gradsync.Average:
                continue
            out = gradsync.allreduce(data(rank, dtype), name=f"ar.{dtype}.{op.name}", op=op,
                                     process_set=mine)
            expected = reference(mine.ranks, dtype, op)
            assert out.dtype == expected.dtype and np.array_equal(out, expected), (dtype, op, out,
                                                                                   expected)


def check_grouped_reducescatter_alltoall_every_dtype_on_each_set():
    """The newer collectives on the set, against numpy: rows are split among the set's members in
    world-rank order, splits count the set's members."""
    members, me = mine.ranks, mine.rank()
    for dtype in dtypes.SUPPORTED:
        op = gradsync.Sum
        numpy_dtype = dtypes.NUMPY_DTYPES[dtype]
        group = gradsync.grouped_allreduce([data(rank, dtype), data(rank, dtype)[0]], op=op,
                                           name=f"gar.{dtype}", process_set=mine)
        expected = reference(members, dtype, op)
        assert np.array_equal(group[0], expected) and np.array_equal(group[1], expected[0]), dtype
        tall = np.concatenate([data(rank, dtype)] * 3)  # 6 rows: split as evenly as possible
        rows = split_rows(6, len(members))
        start = sum(rows[:me])
        full = np.concatenate([reference(members, dtype, op)] * 3)
        out = gradsync.reducescatter(tall, op=op, name=f"rs.{dtype}", process_set=mine)
        assert np.array_equal(out, full[start:start + rows[me]]), (dtype, out)
        outs = gradsync.grouped_reducescatter([tall, tall[:1]], op=op, name=f"grs.{dtype}",
                                              process_set=mine)
        assert np.array_equal(outs[0], full[start:start + rows[me]]), dtype
        # alltoall: member i sends j + 1 rows of value 10 * i + j to member j.
        send = np.concatenate([np.full((j + 1, 2), 10 * me + j) for j in range(len(members))])
        send = send.astype(numpy_dtype) if dtype != "bool" else (send % 2).astype(bool)
        out, received = gradsync.alltoall(send, splits=[j + 1 for j in range(len(members))],
                                          name=f"a2a.{dtype}", process_set=mine)
        want = np.concatenate([np.full((me + 1, 2), 10 * i + me) for i in range(len(members))])
        want = want.astype(numpy_dtype) if dtype != "bool" else (want % 2).astype(bool)
        assert list(received) == [me + 1] * len(members), received
        assert np.array_equal(out, want), (dtype, out, want)


def check_broadcast_root_is_a_world_rank():
    root = mine.ranks[-1]
    out = gradsync.broadcast(np.full(3, float(rank)), root_rank=root, name="bc", process_set=mine)
    assert np.array_equal(out, np.full(3, float(root))), out
    other = odds if mine is evens else evens
    if other is not None:
        refused(lambda: gradsync.broadcast(np.zeros(1), root_rank=other.ranks[0], name="bad",
                                           process_set=mine),
                f"is not a member of process set {mine.process_set_id}")
    assert gradsync.broadcast_object({"r": rank}, root_rank=root, process_set=mine) == {"r": root}


def check_allgather_in_world_rank_order():
    rows = np.full((rank + 1, 2), rank, np.int32)
    out = gradsync.allgather(rows, name="ag", process_set=mine)
    expected = np.concatenate([np.full((r + 1, 2), r, np.int32) for r in mine.ranks])
    assert np.array_equal(out, expected), out
    assert gradsync.allgather_object(rank, process_set=mine) == mine.ranks


def check_unnamed_ops_count_per_set():
    # Ranks of the other set issue more unnamed ops on their set: names on this set stay aligned.
    for _ in range(1 + rank % 2):
        gradsync.allreduce(np.ones(1), process_set=mine)
    gradsync.allreduce(np.ones(1))  # global: the first unnamed allreduce of set 0 on every rank


def check_disjoint_sets_do_not_wait_for_each_other():
    """The odd ranks submit only after rank 0 tells them (over the user's own MPI traffic) that the
    even set finished: if a set waited for ranks outside it, this would deadlock."""
    if size < 2:
        return
    world = MPI.COMM_WORLD
    if rank % 2 == 0:
        out = gradsync.allreduce(np.ones(4), name="disjoint", op=gradsync.Sum, process_set=evens)
        assert np.array_equal(out, np.full(4, len(evens.ranks))), out
        if rank == 0:
            for odd in odds.ranks:
                world.send("evens done", dest=odd, tag=7)
    else:
        request = world.irecv(source=0, tag=7)
        deadline = time.monotonic() + 30
        while True:
            done, message = request.test()
            if done:
                break
            assert time.monotonic() < deadline, "the even set never finished on its own"
            time.sleep(0.01)
        assert message == "evens done"
        out = gradsync.allreduce(np.ones(4), name="disjoint", op=gradsync.Sum, process_set=odds)
        assert np.array_equal(out, np.full(4, len(odds.ranks))), out


def check_global_and_set_ops_interleave_in_any_order():
    handles = []
    order = [("set", mine), ("global", gradsync.global_process_set)]
    for label, process_set in (order if rank % 2 else order[::-1]):
        handles.append(gradsync.allreduce_async(np.full(2, 1.0), name=f"mix.{label}",
                                                op=gradsync.Sum, process_set=process_set))
    sums = sorted(float(gradsync.synchronize(h)[0]) for h in handles)
    assert sums == sorted([float(mine.size()), float(size)]), sums


def check_mismatch_inside_a_set_names_world_ranks():
    if mine.size() < 2:
        return
    shape = (2,) if mine.rank() == 0 else (3,)
    try:
        gradsync.allreduce(np.ones(shape), name="mismatch", process_set=mine)
    except gradsync.CollectiveError as exc:
        text = str(exc)
        assert "ranks disagree on shape" in text, text
        # world ranks: the set's first member has (2,), the others (3,)
        listed = ", ".join(f"rank {r}: {(2,) if i == 0 else (3,)}" for i, r in enumerate(mine.ranks))
        assert f"ranks disagree on shape: {listed} (in process set {mine.process_set_id}, world ranks " \
            f"{list(mine.ranks)})" in text, text
    else:
        raise AssertionError("a shape mismatch inside a set was not reported")
    gradsync.allreduce(np.ones(2), name="after-mismatch", process_set=mine)  # still usable


def check_join_in_a_set():
    last = gradsync.join(process_set=mine)
    assert last in mine.ranks, last


def check_zz_remove_and_add_again():
    if size == 1:
        return
    gradsync.remove_process_set(evens)
    assert evens.process_set_id is None
    if rank % 2 == 0:
        refused(lambda: gradsync.allreduce(np.ones(1), name="removed", process_set=evens),
                "is not registered")
    refused(lambda: gradsync.remove_process_set(gradsync.global_process_set), "cannot be removed")
    again = gradsync.add_process_set(range(0, size, 2))
    assert again.process_set_id == (3 if size > 1 else 2), again
    if rank % 2 == 0:
        out = gradsync.allreduce(np.ones(1), op=gradsync.Sum, name="again", process_set=again)
        assert out[0] == again.size(), out


count = run_checks(globals())
print(f"process_set_check rank {rank}: {count} checks passed", flush=True)
