"""The elastic driver's pieces without MPI: host lists, blacklist, placement, command line, the
launcher command and the state directory's atomic write. References are written out by hand."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from gradsync.run import args as cli
from gradsync.run import hosts, launcher, output, store
from gradsync.run.driver import Driver, _hosts_named, _placed_among


def test_host_lists_read_horovods_forms():
    assert hosts.parse_hosts("a:2,b,c:1", slots_per_host=4, separator=",") == {"a": 2, "b": 4, "c": 1}
    text = "# cluster\na slots=3\nb:2  # spare\n\nb\n"
    assert hosts.parse_hosts(text, slots_per_host=1) == {"a": 3, "b": 3}
    with pytest.raises(hosts.HostsError, match="'a:x'"):
        hosts.parse_hosts("a:x", slots_per_host=1)
    with pytest.raises(hosts.HostsError, match="has 0 slots"):
        hosts.parse_host("a:0", slots_per_host=1)


def test_discovery_reads_the_scripts_output_and_names_its_failure():
    assert hosts.discover("printf 'a:2\\nb\\n'", slots_per_host=2) == {"a": 2, "b": 2}
    with pytest.raises(hosts.HostsError, match="exited with 3: no hosts file"):
        hosts.discover("echo no hosts file >&2; exit 3", slots_per_host=1)


def test_a_host_is_blacklisted_after_failing_launches_in_a_row():
    blacklist = hosts.Blacklist(limit=2)
    assert blacklist.record({"a"}, {"a", "b"}) == []
    assert blacklist.record(set(), {"a", "b"}) == []  # a's count starts over
    assert blacklist.record({"a"}, {"a", "b"}) == []
    assert blacklist.record({"a", "b"}, {"a", "b"}) == ["a"]
    assert blacklist.usable({"a": 2, "b": 1, "c": 4}) == {"b": 1, "c": 4}


def test_placement_fills_hosts_in_order_up_to_max_np():
    assert hosts.place({"a": 2, "b": 2, "c": 2}, 3) == {"a": 2, "b": 1}
    assert hosts.place({"a": 2}, math.inf) == {"a": 2}


def test_command_line_defaults_follow_horovodrun():
    fixed = cli.parse_args(["-np", "3", "python", "train.py", "--lr", "1"])
    assert (fixed.min_np, fixed.max_np, fixed.static_hosts) == (3, 3, {"localhost": 3})
    assert fixed.command == ["python", "train.py", "--lr", "1"]
    elastic = cli.parse_args(["--min-np", "2", "--host-discovery-script", "d.sh", "--reset-limit", "5",
                              "python", "t.py"])
    assert (elastic.min_np, elastic.max_np, elastic.max_restarts) == (2, math.inf, 5)
    listed = cli.parse_args(["-H", "a:2,b:2", "--max-np", "3", "python", "t.py"])
    assert (listed.static_hosts, listed.min_np, listed.max_np) == ({"a": 2, "b": 2}, 1, 3)


@pytest.mark.parametrize("argv", [["-np", "2"], ["python", "t.py"],
                                  ["--min-np", "4", "--max-np", "2", "-np", "2", "python"]])
def test_command_line_errors_exit_with_status_2(argv):
    with pytest.raises(SystemExit) as caught:
        cli.parse_args(argv)
    assert caught.value.code == 2


def test_launcher_command_per_mpi():
    placed = {"a": 2, "b": 1}
    assert launcher.mpiexec_launch("mpiexec", "mpich", placed, ["python", "t.py"]).argv == [
        "mpiexec", "-n", "3", "-hosts", "a:2,b:1", "python", "t.py"]
    assert launcher.mpiexec_launch("mpirun", "openmpi", placed, ["python", "t.py"]).argv == [
        "mpirun", "-n", "3", "--host", "a:2,b:1", "-x", store.STATE_DIR_ENV, "-x", store.RESTART_ENV,
        "python", "t.py"]


def test_an_srun_step_places_each_task_on_its_node(tmp_path):
    launch = launcher.srun_launch("openmpi", {"a": 2, "b": 1}, ["python", "t.py"], tmp_path, "s1")
    assert launch.argv == ["srun", "--mpi=pmix", "--ntasks=3", "--nodes=2", "--kill-on-bad-exit=1",
                           "--job-name=s1", "--distribution=arbitrary", "python", "t.py"]
    assert launch.step_name == "s1" and launch.env == {"SLURM_HOSTFILE": str(tmp_path / "srun_hosts")}
    assert (tmp_path / "srun_hosts").read_text() == "a\na\nb\n"  # one line per rank, in rank order
    even = launcher.srun_launch("mpich", {"a": 2, "b": 2}, ["p"], tmp_path, "s2")
    assert even.argv == ["srun", "--mpi=pmi2", "--ntasks=4", "--nodes=2", "--kill-on-bad-exit=1",
                         "--job-name=s2", "--nodelist=a,b", "--ntasks-per-node=2", "p"]
    assert even.env == {}


def test_auto_uses_srun_only_inside_an_allocation(monkeypatch):
    monkeypatch.setattr(launcher, "srun_plugins", lambda: frozenset({"pmi2", "none"}))
    monkeypatch.setattr(launcher.shutil, "which", lambda name, **kw: f"/usr/bin/{name}")
    inside = {"SLURM_JOB_ID": "7"}
    assert launcher.choose("auto", "mpich", inside) == "srun"
    assert launcher.choose("auto", "mpich", {}) == "mpiexec"
    assert launcher.choose("auto", "openmpi", inside) == "mpiexec"  # this srun has no pmix
    assert launcher.choose("mpiexec", "mpich", inside) == "mpiexec"
    with pytest.raises(launcher.LauncherError, match="does not offer pmix"):
        launcher.choose("srun", "openmpi", inside)
    with pytest.raises(launcher.LauncherError, match="not inside a SLURM allocation"):
        launcher.choose("srun", "mpich", {})


def test_size_of_a_launch(tmp_path):
    args = cli.parse_args(["-np", "2", "--max-np", "3", "-H", "a:4", "--mpiexec", "true", "python"])
    driver = Driver(args, tmp_path)
    assert driver.size_for({"a": 4}) == 2  # -np on the first launch
    driver.launches = 1
    assert driver.size_for({"a": 4}) == 3  # then every usable slot, up to --max-np


def test_atomic_write_keeps_the_last_whole_file(tmp_path):
    path = tmp_path / store.COMMITTED
    store.write_atomically(path, lambda p: p.write_text("commit 1"))

    def broken(p):
        p.write_text("part of commit 2")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        store.write_atomically(path, broken)
    assert path.read_text() == "commit 1" and [p.name for p in tmp_path.iterdir()] == [store.COMMITTED]


def test_failure_records_name_the_failed_hosts(tmp_path):
    store.record_failure(tmp_path, 1, RuntimeError("boom\nmore"))
    (records,) = store.read_failures(tmp_path)
    assert records.startswith("rank 1 on ") and records.endswith(": RuntimeError: boom")
    assert _hosts_named([records], {"localhost": 2}) == {"localhost"}
    assert _hosts_named(["rank 3 on b: ValueError: x"], {"a": 2, "b": 2}) == {"b"}
    store.clear_launch_files(tmp_path)
    assert store.read_failures(tmp_path) == []


def test_recovery_phases_are_the_gaps_between_the_recorded_events(tmp_path):
    events = [("ended", 0, 100.0, None), ("launched", 1, 100.5, None), ("process_start", 1, 101.0, 0.0),
              ("init_start", 1, 104.0, 2.0), ("init_end", 1, 105.5, 2.5), ("resume_start", 1, 106.0, 3.0),
              ("resume_end", 1, 106.25, 3.25), ("first_commit", 1, 107.0, 3.5), ("first_commit", 0, 50.0, 9.0)]
    for event, launch, when, cpu in events:
        store.record_time(tmp_path, event, launch, when, cpu)
    assert store.recovery_phases(tmp_path, 1) == {
        "relaunch": 0.5, "launcher": 0.5, "imports": 3.0, "init": 1.5, "setup": 0.5, "restore": 0.25,
        "first_step": 0.75, "total": 7.0}
    assert store.recovery_phases(tmp_path, 1, clock="cpu") == {
        "imports": 2.0, "init": 0.5, "setup": 0.5, "restore": 0.25, "first_step": 0.25, "total": 3.5}
    assert store.recovery_phases(tmp_path, 2) == {}


def test_the_process_start_time_is_the_start_of_the_interpreter():
    import subprocess
    import sys

    code = ("import time; t = time.time()\nfrom gradsync.run import store\n"
            "print(t - store.process_start_time())")
    src = str(Path(__file__).resolve().parent.parent / "src")  # this checkout's, as conftest.py
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          check=True, env=dict(os.environ, PYTHONPATH=src))
    assert 0 <= float(done.stdout) < 60, done.stdout  # the interpreter's own start-up, 10 ms steps


def test_the_launchers_reports_name_the_host_of_a_killed_worker():
    assert output.failed_hosts("=   PID 595 RUNNING AT node7") == {"node7"}  # MPICH's Hydra
    assert output.failed_hosts("srun: error: node7: task 1: Killed") == {"node7"}
    assert output.failed_hosts("srun: error: n2: tasks 0-1,3: Segmentation fault") == {"n2"}
    assert output.failed_hosts("srun: error: node8: tasks 0,2: Terminated") == set()  # srun ended them
    assert output.failed_hosts("prterun noticed that process rank 1 with PID 0 on node n3 exited on "
                               "signal 9 (Killed).") == {"n3"}  # Open MPI
    assert output.failed_hosts("epoch 1/10 on 2 ranks") == set()
    assert _placed_among({os.uname().nodename}, {"localhost": 2, "b": 1}) == {"localhost"}


def test_the_launcher_output_is_passed_on_and_its_wrapped_reports_read(capfd):
    """Open MPI wraps its report over two lines; the copy keeps every byte, even without a newline."""
    import subprocess
    import sys

    text = ("epoch 1\nprterun noticed that process rank 1 with PID 26264 on node vm exited on\n"
            "signal 9 (Killed).\nprogress 50%\r")
    job = subprocess.Popen([sys.executable, "-c", f"import sys; sys.stderr.write({text!r}); print('out')"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    copied = output.LauncherOutput(job)
    job.wait()
    assert copied.finish() == {"vm"}
    captured = capfd.readouterr()
    assert captured.err == text and captured.out == "out\n"
