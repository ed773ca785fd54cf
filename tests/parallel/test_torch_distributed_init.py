"""``init_process_group(backend="gradsync")`` with no ``init_method``, as a torchrun script calls it
once its backend name is changed: it rendezvous at ``gradsync://`` where torch's default
``env://`` cannot run (no ``MASTER_ADDR``/``MASTER_PORT``), and keeps ``env://`` where it can
and for every other backend. Each test makes and destroys its own default group.
"""

from __future__ import annotations

import socket

import pytest
from reference import raises

import gradsync

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
RANKS = (1, 2)

import gradsync.torch  # noqa: E402,F401 - registers the backend
from gradsync.torch.distributed import uses_only_gradsync  # noqa: E402


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
    assert default_store_type() == "HashStore"  # gradsync://'s process-local store: no port
    assert summed_over_ranks(rank).tolist() == [size * (size + 1) / 2] * 3


def test_torchs_own_init_process_group_is_served_however_it_was_imported(no_master, rank, size):
    """pytorch/examples' scripts import it by name, some before a line ``import gradsync.torch``
    added last: the function is torch's own, not a wrapper that such an import would miss."""
    from torch.distributed.distributed_c10d import init_process_group

    assert init_process_group is dist.init_process_group
    assert not hasattr(init_process_group, "_gradsync")
    init_process_group(backend="gradsync", timeout=None, world_size=size, rank=rank)
    assert default_store_type() == "HashStore"
    assert summed_over_ranks(rank).tolist() == [size * (size + 1) / 2] * 3


def test_an_explicit_env_init_method_without_master_addr_rendezvous_at_gradsync(no_master, rank, size):
    dist.init_process_group(backend="gradsync", init_method="env://")
    assert (dist.get_rank(), dist.get_world_size()) == (rank, size)
    assert default_store_type() == "HashStore"  # gradsync://'s process-local store: no port
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


def test_another_backend_keeps_torchs_default_and_its_error(no_master):
    """gloo needs a store shared by the processes: no gradsync:// (its store is the process's
    own), torch's env:// error on every rank instead of a wait."""
    with raises(ValueError, "MASTER_ADDR"):
        dist.init_process_group(backend="cpu:gloo,cuda:gradsync")
    assert not dist.is_initialized()


@pytest.mark.parametrize(("backend", "only_gradsync"), [
    ("gradsync", True), ("Gradsync", True), ("cpu:gradsync", True), ("cpu:gradsync, cuda:gradsync", True),
    (None, False), ("gloo", False), ("cpu:gloo,cuda:gradsync", False), ("gradsyncx", False),
])
def test_uses_only_gradsync_reads_torchs_backend_strings(backend, only_gradsync):
    assert uses_only_gradsync(backend) is only_gradsync
