"""``init_process_group(backend="gradsync")`` with no ``init_method``, as a torchrun script calls it
once its backend name is changed: it rendezvous at ``gradsync://`` where torch's default
``env://`` cannot run (no ``MASTER_ADDR``/``MASTER_PORT``), and keeps ``env://`` where it can
and for every other backend. Each test makes and destroys its own default group.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
from reference import raises

import gradsync

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
RANKS = (1, 2)

import gradsync.torch  # noqa: E402,F401 - registers the backend
from gradsync.torch.distributed import uses_only_gradsync  # noqa: E402
from gradsync.torch.distributed.group import GradsyncProcessGroup  # noqa: E402


@pytest.fixture
def no_master(monkeypatch):
    """No MASTER_ADDR and no MASTER_PORT (as under mpiexec or srun); the default group made in
    the test is destroyed after it."""
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def default_store_type() -> str:
    """The default group's store under torch's PrefixStores."""
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return type(store).__name__


def summed_over_ranks(rank: int) -> torch.Tensor:
    tensor = torch.full((3,), float(rank + 1))
    dist.all_reduce(tensor)
    return tensor


@pytest.mark.parametrize("backend", ["gradsync", "GRADSYNC", "cpu:gradsync,cuda:gradsync"])
def test_without_init_method_and_master_addr_the_rendezvous_is_gradsyncs(no_master, rank, size, backend):
    dist.init_process_group(backend)  # torch's default would be env://, which needs MASTER_ADDR
    assert (dist.get_rank(), dist.get_world_size()) == (rank, size)
    assert default_store_type() == "GradsyncStore"  # gradsync://'s store, over MPI: no port
    assert summed_over_ranks(rank).tolist() == [size * (size + 1) / 2] * 3


def test_torchs_own_init_process_group_is_served_however_it_was_imported(no_master, rank, size):
    """pytorch/examples' scripts import it by name, some before a line ``import gradsync.torch``
    added last: the function is torch's own, not a wrapper that such an import would miss."""
    from torch.distributed.distributed_c10d import init_process_group

    assert init_process_group is dist.init_process_group
    assert not hasattr(init_process_group, "_gradsync")
    init_process_group(backend="gradsync", timeout=None, world_size=size, rank=rank)
    assert default_store_type() == "GradsyncStore"
    assert summed_over_ranks(rank).tolist() == [size * (size + 1) / 2] * 3


def test_an_explicit_env_init_method_without_master_addr_rendezvous_at_gradsync(no_master, rank, size):
    dist.init_process_group(backend="gradsync", init_method="env://")
    assert (dist.get_rank(), dist.get_world_size()) == (rank, size)
    assert default_store_type() == "GradsyncStore"  # gradsync://'s store, over MPI: no port
    assert summed_over_ranks(rank).tolist() == [size * (size + 1) / 2] * 3


def test_with_master_addr_and_port_set_torchs_env_rendezvous_stays(no_master, monkeypatch, rank, size):
    """A site or Lightning that exports both gets torch's default: a TCPStore on rank 0."""
    port = None
    if rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(gradsync.broadcast_object(port, root_rank=0)))
    dist.init_process_group(backend="gradsync")
    assert default_store_type() == "TCPStore"
    assert dist.get_backend() == "gradsync"
    assert summed_over_ranks(rank).tolist() == [size * (size + 1) / 2] * 3


def test_the_default_store_is_shared_by_every_rank(no_master, rank, size):
    """What one rank sets in the store torch got from gradsync://, every rank reads, and counters
    add up across ranks, as in torch's TCPStore."""
    dist.init_process_group("gradsync", timeout=timedelta(seconds=60))
    store = dist.distributed_c10d._get_default_store()
    store.set(f"shared/{rank}", str(10 * rank))
    assert [store.get(f"shared/{other}") for other in range(size)] == [
        str(10 * other).encode() for other in range(size)]
    store.add("shared/count", rank + 1)
    dist.barrier()
    assert store.add("shared/count", 0) == size * (size + 1) // 2


def test_torchs_store_barrier_passes_on_every_rank(no_master, monkeypatch, rank, size):
    """``TORCH_DIST_INIT_BARRIER=1``: init_process_group and new_group wait in c10d's store
    barrier, which counts the ranks in the store (with a store of each process's own, every rank
    but the last to arrive would wait out the timeout)."""
    monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", "1")
    dist.init_process_group("gradsync", timeout=timedelta(seconds=60))
    group = dist.new_group(list(range(size)))
    store = dist.distributed_c10d._get_default_store()  # the rendezvous's, under "default_pg/"
    prefix = dist.distributed_c10d.STORE_BASED_BARRIER_PREFIX
    # every rank checked in through the store, for the default group and for the new one
    assert store.underlying_store.add(f"{prefix}:{dist.group.WORLD.group_name}", 0) == size
    assert store.add(f"{prefix}:{group.group_name}", 0) == size
    tensor = torch.ones(2)
    dist.all_reduce(tensor, group=group)
    assert tensor.tolist() == [size] * 2


def test_a_new_default_group_starts_with_none_of_an_earlier_ones_keys(no_master):
    dist.init_process_group("gradsync")
    dist.distributed_c10d._get_default_store().set("earlier", "1")
    dist.destroy_process_group()
    dist.init_process_group("gradsync")
    assert not dist.distributed_c10d._get_default_store().check(["earlier"])


def test_a_key_never_set_raises_torchs_store_error_naming_it(no_master, rank):
    dist.init_process_group("gradsync")
    store = dist.distributed_c10d._get_default_store()
    with raises(dist.DistStoreError, f"rank {rank}", "never-set", "0.2 s"):
        store.wait(["never-set"], timedelta(seconds=0.2))
    store.set_timeout(timedelta(seconds=0.2))
    with raises(dist.DistStoreError, f"rank {rank}", "never-set"):
        store.get("never-set")


def test_num_keys_and_delete_key_answer_through_torchs_prefix_store(no_master, rank, size):
    dist.init_process_group("gradsync")
    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    before = store.num_keys()
    dist.barrier()
    store.set(f"counted/{rank}", "1")
    dist.barrier()
    assert store.num_keys() == before + size
    dist.barrier()  # every rank counted before any deletes
    assert store.delete_key(f"counted/{rank}")
    assert not store.delete_key(f"counted/{rank}")


def test_after_gradsync_shutdown_the_store_and_the_group_say_what_happened(no_master, rank):
    """``gradsync.shutdown()`` before ``destroy_process_group()``: the store and the collectives
    raise errors that name the shutdown (not torch's internal assertion); init again after."""
    dist.init_process_group("gradsync")
    store = dist.distributed_c10d._get_default_store()
    gradsync.shutdown()
    try:
        with raises(dist.DistStoreError, f"rank {rank}", "gradsync.shutdown() was called"):
            store.get("anything")
        with raises(gradsync.NotInitializedError, "gradsync.shutdown() was called",
                    "dist.destroy_process_group() before shutdown()"):
            dist.all_reduce(torch.ones(2))
    finally:
        dist.destroy_process_group()
        gradsync.init()


def test_the_store_answers_as_torchs_hash_store(no_master, rank):
    """The same calls on the default store and on torch's own HashStore give the same answers
    (each rank on keys of its own)."""
    dist.init_process_group("gradsync")

    def answers(store) -> list:
        key = f"same/{rank}"
        return [store.compare_set(key, "expected", "new"), store.check([key]),
                store.compare_set(key, "", "first"), store.compare_set(key, "wrong", "second"),
                store.compare_set(key, "first", "second"), store.add(f"{key}/n", 5),
                store.add(f"{key}/n", -2), store.append(key, "+more"), store.get(key),
                store.multi_set([f"{key}/a", f"{key}/b"], ["1", b"2"]),
                store.multi_get([f"{key}/a", f"{key}/b"]), store.check([key, f"{key}/a"])]

    assert answers(dist.distributed_c10d._get_default_store()) == answers(dist.HashStore())


def test_another_backend_keeps_torchs_default_and_its_error(no_master):
    """A list that gives a device to another backend keeps torch's default, env://, and its error
    on every rank (instead of a wait): gradsync:// is taken only where gradsync is every device's
    backend; ``init_method="gradsync://"`` asks for it explicitly (the next test)."""
    with raises(ValueError, "MASTER_ADDR"):
        dist.init_process_group(backend="cpu:gloo,cuda:gradsync")
    assert not dist.is_initialized()


def test_gloo_rendezvous_at_gradsync_through_its_shared_store(no_master, rank, size):
    """gloo's ranks find each other through the store: gradsync's, shared over MPI, serves them
    under mpiexec with no MASTER_ADDR."""
    dist.init_process_group("gloo", init_method="gradsync://", timeout=timedelta(seconds=60))
    assert dist.get_backend() == "gloo"
    assert not isinstance(dist.distributed_c10d._get_default_group(), GradsyncProcessGroup)
    assert summed_over_ranks(rank).tolist() == [size * (size + 1) / 2] * 3


def test_a_list_that_gives_a_device_to_another_backend_warns_that_gradsync_serves_it(no_master, rank, size):
    """torch uses the process group a Python backend returns for every device: the CPU's
    collectives of "cpu:gloo,cuda:gradsync" run on gradsync, and the user is told so."""
    with pytest.warns(UserWarning, match=r"gives \{'cpu': 'gloo'\} to another backend"):
        dist.init_process_group("cpu:gloo,cuda:gradsync", init_method="gradsync://",
                                timeout=timedelta(seconds=60))
    assert isinstance(dist.distributed_c10d._get_default_group(), GradsyncProcessGroup)
    assert summed_over_ranks(rank).tolist() == [size * (size + 1) / 2] * 3


@pytest.mark.parametrize(("backend", "only_gradsync"), [
    ("gradsync", True), ("Gradsync", True), ("cpu:gradsync", True), ("cpu:gradsync, cuda:gradsync", True),
    (None, False), ("gloo", False), ("cpu:gloo,cuda:gradsync", False), ("gradsyncx", False),
])
def test_uses_only_gradsync_reads_torchs_backend_strings(backend, only_gradsync):
    assert uses_only_gradsync(backend) is only_gradsync
