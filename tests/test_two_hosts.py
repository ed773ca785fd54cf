"""gradsync across two hosts: the network namespaces gsA and gsB, joined by a veth pair over TCP.

mpiexec runs inside gsA and starts the ranks on gsB through scripts/nsrsh (the stand-in for ssh),
with Open MPI or MPICH, whichever mpi4py loads here (CI runs this module under both). As root, the
module creates the namespaces when they do not exist and removes the ones it created.
"""

from __future__ import annotations

import re

import pytest

from cluster import run_two_hosts, start_namespaces, stop_namespaces, veth_bytes
from mpi_launch import assert_trained_like_one_process, reports, verdicts

pytestmark = [pytest.mark.mpi, pytest.mark.full]  # the full suite only: tests/conftest.py


@pytest.fixture(scope="module", autouse=True)
def two_hosts():
    created = start_namespaces()
    yield
    if created:
        stop_namespaces()


def topology(output: str) -> dict[int, tuple[str, str, str, str]]:
    """rank -> (host, local, cross, size) from tests/workers/topology_check.py's lines."""
    rows = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in output.splitlines()
            if line.startswith("topology ")]
    return {int(r["rank"]): (r["host"], r["local"], r["cross"], r["size"]) for r in rows}


@pytest.mark.parametrize("per_host, expected", [
    (1, {0: ("gsA", "0/1", "0/2", "2"), 1: ("gsB", "0/1", "1/2", "2")}),
    (2, {0: ("gsA", "0/2", "0/2", "4"), 1: ("gsA", "1/2", "0/2", "4"),
         2: ("gsB", "0/2", "1/2", "4"), 3: ("gsB", "1/2", "1/2", "4")}),
])
def test_ranks_on_different_hosts_get_their_local_and_cross_ranks(per_host, expected):
    out = run_two_hosts(per_host, "topology_check.py", timeout=120).stdout
    assert topology(out) == expected, out


@pytest.mark.torch
def test_training_over_tcp_equals_single_process_training():
    before = veth_bytes()
    assert_trained_like_one_process(run_two_hosts(1, "train_equivalence.py").stdout, 2)
    # The gradients really crossed the veth link (not some shared-memory shortcut between the
    # namespaces): 6 steps of a 1.6k-parameter model's float32 gradients, at the very least.
    assert veth_bytes() - before > 6 * 1_600 * 4, "no traffic between the hosts"


def test_hierarchical_allreduce_equals_the_flat_one_on_two_hosts_of_two_ranks():
    before = veth_bytes()
    out = run_two_hosts(2, "hierarchical_check.py",
                        env={"GRADSYNC_HIERARCHICAL_ALLREDUCE": "1"}).stdout
    passed = dict(re.findall(r"hierarchical_check rank (\d+): (\d+) cases passed", out))
    assert sorted(passed) == ["0", "1", "2", "3"], out
    # Each backend's 2.4 MB random allreduce needs gsA's partial sum on gsB at least once.
    assert veth_bytes() - before > 2 * 2_400_000, "the allreduces did not cross the link"


@pytest.mark.torch
def test_hierarchical_training_on_two_hosts_equals_single_process_training():
    out = run_two_hosts(2, "train_equivalence.py",
                        env={"GRADSYNC_HIERARCHICAL_ALLREDUCE": "1"}).stdout
    assert_trained_like_one_process(out, 4)


@pytest.mark.torch
def test_torch_ddp_on_the_gradsync_backend_across_two_hosts_equals_single_process_training():
    """DDP through init_method="gradsync://" with two ranks on each host: the rendezvous exports
    each rank's place on its own host (LOCAL_RANK 0 and 1 on both; from import gradsync.torch on,
    as the launcher's), and training equals one process on the whole batch."""
    out = run_two_hosts(2, "train_equivalence.py", "--ddp").stdout
    assert_trained_like_one_process(out, 4)
    for rank, values in reports(out, 4).items():
        assert (values["env_local_rank"], values["env_local_world_size"]) == (str(rank % 2), "2"), \
            (rank, values)
        assert values["env_before_init"] == [str(rank), "4", str(rank % 2), "2"], (rank, values)


def test_the_self_check_reports_both_hosts_and_passes():
    out = run_two_hosts(1, "-m", "gradsync.check", timeout=120).stdout
    assert "hosts          2 host(s), 2 rank(s)" in out, out
    assert "gsA  ranks 0, local_rank 0 of 1, cross_rank 0" in out
    assert "gsB  ranks 1, local_rank 0 of 1, cross_rank 1" in out
    assert verdicts(out) == ["PASS"], out
