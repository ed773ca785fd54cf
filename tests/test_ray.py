"""gradsync on Ray (gradsync.ray, docs/ray.md) on a Ray cluster of two nodes on this machine.

One ``ray.cluster_utils.Cluster`` (a head and a second node, one CPU each) serves the whole file;
each test starts its own job on it. Results are compared with independent references: an
allreduce with numpy's sum on the driver, training on two ranks with one process on the doubled
batch. Fault tests check the error, its time bound, and that shutdown leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import gradsync.ray.job  # noqa: E402
import gradsync.ray.stub  # noqa: E402
from gradsync.errors import GradsyncError  # noqa: E402
from gradsync.ray import GradsyncConfig, RayExecutor, WorkerError  # noqa: E402
from gradsync.run.launcher import find_mpiexec, flavour  # noqa: E402

pytestmark = pytest.mark.ray
EXAMPLE = Path(__file__).parent.parent / "examples" / "train_digits_ray.py"
MPI_FLAVOUR = flavour(find_mpiexec(None))
FAILURE_TIMEOUT_S = 3.0  # GRADSYNC_RANK_FAILURE_TIMEOUT_SECONDS in the fault tests


@pytest.fixture(scope="module")
def cluster():
    """A Ray cluster of two nodes of one CPU each, with this module's functions shipped by value.
    Ray Train's controller polls its workers every 0.2 s instead of 2 (each ``ray.train.report``
    waits for a poll: the example's 20 reports took 40 s of the 90 of its test)."""
    from ray.cluster_utils import Cluster

    environment = pytest.MonkeyPatch()
    environment.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")  # the nodes' processes inherit it
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes.add_node(num_cpus=1)
    ray.init(address=nodes.address, logging_level="warning", log_to_driver=False)
    nodes.wait_for_nodes()
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield nodes
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    ray.shutdown()
    nodes.shutdown()
    environment.undo()
    # Ray leaves the address of the cluster it started here, for a later ray.init() to join: gone.
    current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    if current.exists() and current.read_text().strip() == nodes.address:
        current.unlink()


def start(count: int = 2, env: dict[str, str] | None = None, **options) -> RayExecutor:
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=count,
                           placement_strategy="SPREAD", **options)
    executor.start(extra_env_vars={"OMP_NUM_THREADS": "1", **(env or {})})
    return executor


def job_processes(executor: RayExecutor) -> tuple[str, str]:
    """The strings that every process of the executor's job has on its command line: the job's
    token (the stubs, mpiexec) and the launcher's directory (mpiexec, its proxies)."""
    return executor._job.token, str(executor._job.workdir)


def assert_nothing_left(marks: tuple[str, ...], pids: list[int], within: float = 15.0) -> None:
    """No process whose command line has one of ``marks``, none of ``pids``, and no directory
    named by a mark, within ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        left = [pid for pid in pids if Path(f"/proc/{pid}").exists() and _state(pid) != "Z"]
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                if any(mark in line for mark in marks) and _state(int(entry.name)) != "Z":
                    left.append(int(entry.name))
        if not left and not any(Path(mark).exists() for mark in marks if mark.startswith("/")):
            return
        assert time.monotonic() < deadline, f"processes (or the launcher's directory) left: {left}"
        time.sleep(0.5)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


# ---- pure functions ------------------------------------------------------------------------------

def test_ranks_are_numbered_node_by_node_in_order_of_first_appearance():
    ranks, hosts = gradsync.ray.job.block_ranks(["b", "a", "b"], {"a": "hostA", "b": "hostB"})
    assert ranks == [0, 2, 1]
    assert hosts == {"hostB": 2, "hostA": 1}


def test_open_mpi_gets_the_nodes_host_names_unless_nodes_share_one_and_hydra_made_up_ones():
    nodes, made_up = ["a" * 20, "b" * 20, "a" * 20], {"a" * 20: "ray-" + "a" * 16, "b" * 20: "ray-" + "b" * 16}
    assert gradsync.ray.job.host_names(nodes, ["m1", "m2", "m1"], "openmpi") == (
        {"a" * 20: "m1", "b" * 20: "m2"}, False)
    assert gradsync.ray.job.host_names(nodes, ["vm", "vm", "vm"], "openmpi") == (made_up, True)
    assert gradsync.ray.job.host_names(nodes, ["m1", "m2", "m1"], "mpich") == (made_up, True)


def test_the_stub_hands_over_launch_variables_and_settings_but_not_the_channel():
    launch, settings = gradsync.ray.stub.identity(
        {"PMI_RANK": "1", "PMI_FD": "5", "MPI_LOCALNRANKS": "1", "OMPI_COMM_WORLD_RANK": "1",
         "PMIX_NAMESPACE": "x", "GRADSYNC_CYCLE_TIME": "2", "GRADSYNC_RAY_AUTHKEY": "00", "PATH": "/bin"})
    assert launch == {"PMI_RANK": "1", "PMI_FD": "5", "MPI_LOCALNRANKS": "1",
                      "OMPI_COMM_WORLD_RANK": "1", "PMIX_NAMESPACE": "x"}
    assert settings == {"GRADSYNC_CYCLE_TIME": "2"}


# ---- RayExecutor ---------------------------------------------------------------------------------

def where_and_sum(values: np.ndarray) -> tuple:
    import gradsync

    gradsync.init()
    total = gradsync.allreduce(values[gradsync.rank()], op=gradsync.Sum, name="values")
    return (gradsync.rank(), gradsync.size(), ray.get_runtime_context().get_node_id(), os.getpid(),
            total)


@pytest.mark.timeout(180)
def test_run_gives_ranks_on_distinct_nodes_whose_allreduce_is_numpys_sum(cluster):
    values = np.random.default_rng(0).standard_normal((2, 1000))
    executor = start()
    try:
        first = executor.run(where_and_sum, args=[values])
        again = executor.run(where_and_sum, kwargs={"values": values})
        marks, pids = job_processes(executor), [result[3] for result in first]
    finally:
        executor.shutdown()
    assert [result[:2] for result in first] == [(0, 2), (1, 2)]
    assert first[0][2] != first[1][2], "the two ranks ran on the same Ray node"
    for result in first + again:
        np.testing.assert_allclose(result[4], values.sum(axis=0), rtol=1e-12)
    assert [result[3] for result in again] == pids, "a second run() started new processes"
    assert_nothing_left(marks, pids)


class Counter:
    """A stateful executable: its rank, and a count that execute() calls advance."""

    def __init__(self, start: int) -> None:
        import gradsync

        gradsync.init()
        self.rank, self.count = gradsync.rank(), start

    def advance(self) -> tuple[int, int]:
        self.count += 1
        return self.rank, self.count


@pytest.mark.timeout(180)
def test_execute_and_execute_single_call_the_executables_start_made(cluster):
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_hosts=2, num_workers_per_host=1)
    executor.start(executable_cls=Counter, executable_args=[10])
    try:
        assert executor.execute(Counter.advance) == [(0, 11), (1, 11)]
        assert executor.execute_single(Counter.advance) == (0, 12)
        refs = executor.run_remote(lambda: os.getpid())
        assert len(set(ray.get(refs))) == 2
    finally:
        executor.shutdown()


def train_steps(x: np.ndarray, y: np.ndarray, steps: int) -> list[np.ndarray]:
    """Linear regression with SGD on this rank's half of the batch, through DistributedOptimizer."""
    import torch

    import gradsync
    import gradsync.torch as gt

    gradsync.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(x.shape[1], 1).double()
    opt = gt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    gt.broadcast_parameters(model.state_dict(), root_rank=0)
    half = len(x) // gradsync.size()
    mine = slice(gradsync.rank() * half, (gradsync.rank() + 1) * half)
    xs, ys = torch.from_numpy(x[mine]), torch.from_numpy(y[mine])
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


@pytest.mark.torch
@pytest.mark.timeout(180)
def test_training_on_two_ranks_equals_one_process_on_the_doubled_batch(cluster):
    import torch

    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((64, 5)), rng.standard_normal((64, 1))
    executor = start()
    try:
        ranks = executor.run(train_steps, args=[x, y, 5])
    finally:
        executor.shutdown()
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
    for params in ranks:
        for got, want in zip(params, model.parameters()):
            np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-10, atol=1e-12)


# ---- faults --------------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_more_workers_than_the_cluster_can_place_fail_within_the_timeout(cluster):
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=3),
                           num_workers=3)
    began = time.monotonic()
    with pytest.raises(GradsyncError, match=r"could not place 3 workers .* within placement_group_timeout_s=3"):
        executor.start()
    assert time.monotonic() - began < 15
    assert ray.util.placement_group_table() == {} or all(
        group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())


@pytest.mark.timeout(120)
def test_a_launcher_that_fails_is_quoted_and_nothing_is_left(cluster, tmp_path, monkeypatch):
    launcher = tmp_path / "mpiexec"
    launcher.write_text("#!/bin/sh\necho \"no such host: $*\" >&2\nexit 3\n")
    launcher.chmod(0o755)
    monkeypatch.setattr(gradsync.ray.job, "find_mpiexec", lambda explicit: str(launcher))
    directories = set(Path(tempfile.gettempdir()).glob("gradsync-ray-*"))
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
    with pytest.raises(GradsyncError, match=r"(?s)launcher exited with 3 .*no such host: "):
        executor.start()
    assert executor.workers == [] and executor._group is None
    left = set(Path(tempfile.gettempdir()).glob("gradsync-ray-*")) - directories
    assert not left, f"the job's directories are left: {left}"


def fail_on_rank_one() -> int:
    import gradsync

    gradsync.init()
    if gradsync.rank() == 1:
        raise ValueError("rank one's data is bad")
    return gradsync.rank()


@pytest.mark.timeout(180)
def test_a_raising_worker_is_named_with_its_traceback_and_the_executor_shuts_down(cluster):
    executor = start()
    try:
        with pytest.raises(WorkerError) as raised:
            executor.run(fail_on_rank_one)
        marks = job_processes(executor)
        pids = executor.run(os.getpid)
    finally:
        executor.shutdown()
    message = str(raised.value)
    assert "rank 1" in message and "rank 0 " not in message
    assert "ValueError: rank one's data is bad" in message
    assert "in fail_on_rank_one" in message  # the traceback
    assert set(raised.value.failures) == {1}
    assert_nothing_left(marks, pids)


def allreduce_forever() -> None:
    import gradsync

    gradsync.init()
    while True:
        gradsync.allreduce(np.ones(10), name="forever")


def assert_survivors_failed(error: WorkerError, survivors: list[int]) -> None:
    """Under MPICH each survivor raised gradsync's RankFailureError; under Open MPI its runtime
    ends the survivors' processes itself when a rank of the job is lost (PMIx's job abort)."""
    if MPI_FLAVOUR == "openmpi":
        assert all(isinstance(error.failures[number], ray.exceptions.RayActorError)
                   for number in survivors), str(error)
    else:
        assert all("RankFailureError" in str(error.failures[number]) for number in survivors), str(error)


def lose_a_rank(executor: RayExecutor, lose) -> tuple[WorkerError, float, tuple[str, str], list[int]]:
    """Run allreduces on every rank until ``lose()``, called from a timer a second in, takes a rank
    away. Returns run()'s error, the seconds from ``lose()`` to it, and the job's processes."""
    pids = executor.run(os.getpid)
    marks = job_processes(executor)
    lost_at: list[float] = []
    timer = threading.Timer(1.0, lambda: (lost_at.append(time.monotonic()), lose()))
    timer.start()
    with pytest.raises(WorkerError) as raised:
        executor.run(allreduce_forever)
    timer.join()
    return raised.value, time.monotonic() - lost_at[0], marks, pids


@pytest.mark.timeout(180)
def test_a_killed_worker_makes_every_surviving_rank_fail_within_the_liveness_bound(cluster, monkeypatch):
    monkeypatch.setenv("GRADSYNC_RANK_FAILURE_TIMEOUT_SECONDS", str(FAILURE_TIMEOUT_S))
    executor = start(env={"GRADSYNC_RANK_FAILURE_TIMEOUT_SECONDS": str(FAILURE_TIMEOUT_S)})
    try:
        victim = executor.run(os.getpid)[1]
        error, took, marks, pids = lose_a_rank(executor, lambda: os.kill(victim, signal.SIGKILL))
    finally:
        executor.shutdown()
    assert set(error.failures) == {0, 1}, str(error)
    assert "rank 1" in str(error) and "worker process died" in str(error)
    assert_survivors_failed(error, [0])
    assert took < FAILURE_TIMEOUT_S + 5, f"the survivor failed after {took:.1f} s"
    assert_nothing_left(marks, pids)


@pytest.mark.timeout(180)
def test_a_removed_node_makes_every_surviving_rank_fail_within_the_liveness_bound(cluster, monkeypatch):
    monkeypatch.setenv("GRADSYNC_RANK_FAILURE_TIMEOUT_SECONDS", str(FAILURE_TIMEOUT_S))
    doomed = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_hosts=3, num_workers_per_host=1)
    try:
        executor.start(extra_env_vars={"OMP_NUM_THREADS": "1",
                                       "GRADSYNC_RANK_FAILURE_TIMEOUT_SECONDS": str(FAILURE_TIMEOUT_S)})
        lost = executor.nodes.index(doomed.node_id)
        error, took, marks, pids = lose_a_rank(executor, lambda: cluster.remove_node(doomed))
    finally:
        executor.shutdown()
    assert set(error.failures) == {0, 1, 2}, str(error)
    assert f"rank {lost}" in str(error) and "worker process died" in str(error)
    assert_survivors_failed(error, [number for number in range(3) if number != lost])
    assert took < FAILURE_TIMEOUT_S + 5, f"the survivors failed after {took:.1f} s"
    assert_nothing_left(marks, pids)


# ---- the example ---------------------------------------------------------------------------------

def run_example(cluster, *args: str) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLE), "--address", cluster.address, *args],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def final_accuracy(output: str) -> float:
    last = output.strip().splitlines()[-1]
    assert last.startswith("test_accuracy="), output
    return float(last.split("=")[1])


@pytest.mark.torch
@pytest.mark.timeout(300)
def test_the_example_trains_to_the_promised_accuracy_under_ray_executor(cluster):
    assert final_accuracy(run_example(cluster)) >= 0.95


@pytest.mark.full
@pytest.mark.torch
@pytest.mark.timeout(300)
def test_the_example_trains_to_the_promised_accuracy_under_ray_train(cluster):
    output = run_example(cluster, "--ray-train")
    assert "checkpoint: " in output, output
    assert final_accuracy(output) >= 0.95


# ---- Ray Train -----------------------------------------------------------------------------------

def train_loop(config: dict) -> None:
    import ray.train

    import gradsync

    gradsync.init()
    values = np.asarray(config["values"])
    total = gradsync.allreduce(values[gradsync.rank()], op=gradsync.Sum, name="values")
    checkpoint = None
    if gradsync.rank() == 0:
        directory = tempfile.mkdtemp()
        np.save(os.path.join(directory, "total.npy"), total)
        checkpoint = ray.train.Checkpoint.from_directory(directory)
    ray.train.report({"rank": gradsync.rank(), "size": gradsync.size(),
                      "world_rank": ray.train.get_context().get_world_rank(),
                      "node": ray.get_runtime_context().get_node_id()}, checkpoint=checkpoint)


@pytest.mark.timeout(240)
def test_data_parallel_trainer_with_gradsyncs_backend_reports_and_checkpoints(cluster, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    values = np.random.default_rng(2).standard_normal((2, 100))
    trainer = DataParallelTrainer(train_loop, train_loop_config={"values": values.tolist()},
                                  backend_config=GradsyncConfig(timeout_s=60),
                                  scaling_config=ScalingConfig(num_workers=2),
                                  run_config=RunConfig(storage_path=str(tmp_path), name="gradsync"))
    result = trainer.fit()
    assert result.error is None
    assert result.metrics["rank"] == result.metrics["world_rank"] == 0
    assert result.metrics["size"] == 2
    with result.checkpoint.as_directory() as directory:
        np.testing.assert_allclose(np.load(os.path.join(directory, "total.npy")), values.sum(axis=0),
                                   rtol=1e-12)
