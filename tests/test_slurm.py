"""gradsync under a real single-node SLURM: srun with the right and a wrong --mpi plugin, and sbatch.

The plugin follows the MPI that mpi4py loads here: ``--mpi=pmix`` for Open MPI, ``--mpi=pmi2`` for
MPICH (CI runs this module under both). As root, the module starts SLURM when it is not up
(scripts/slurm_up.sh, which installs it with apt when missing) and stops the daemons it started.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from cluster import cancel, job_name, right_plugin, sbatch, srun, start_slurm, stop_slurm, wrong_plugins
from mpi_launch import REPO, WORKERS, assert_trained_like_one_process, flavour, reports, run_job, verdicts

pytestmark = [pytest.mark.mpi, pytest.mark.full]  # the full suite only: tests/conftest.py
DOCS = REPO / "docs" / "launching.md"


@pytest.fixture(scope="module", autouse=True)
def slurm():
    started = start_slurm()
    yield
    if started:
        stop_slurm()


def topology(output: str) -> dict[int, dict[str, str]]:
    """rank -> the fields of its ``topology ...`` line (tests/workers/topology_check.py)."""
    rows = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in output.splitlines()
            if line.startswith("topology ")]
    return {int(row["rank"]): row for row in rows}


def test_srun_ranks_and_local_ranks_are_slurms_task_ids():
    out = srun(right_plugin(), 2, "topology_check.py").stdout
    rows = topology(out)
    assert sorted(rows) == [0, 1], out
    for rank, row in rows.items():
        assert row["size"] == "2" and row["launcher"] == f"srun_--mpi={right_plugin()}", out
        assert row["slurm_procid"] == str(rank) and row["local"] == f"{row['slurm_localid']}/2", out
        assert row["cross"] == "0/1", out


@pytest.mark.torch
def test_srun_training_equals_single_process_training():
    assert_trained_like_one_process(srun(right_plugin(), 2, "train_equivalence.py", timeout=180).stdout, 2)


@pytest.mark.torch
def test_srun_runs_torch_ddp_on_the_gradsync_backend_like_one_process():
    """An unchanged DDP script whose only gradsync line is init_method="gradsync://": ranks from
    SLURM through gradsync.init(), torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE exported as SLURM's
    local task ids (from import gradsync.torch on, for a script that reads them before
    init_process_group), training equal to one process on the whole batch."""
    out = srun(right_plugin(), 2, "train_equivalence.py", "--ddp", timeout=180).stdout
    assert_trained_like_one_process(out, 2)
    for rank, values in reports(out, 2).items():
        assert values["env_local_rank"] == str(values["local_rank"]), (rank, values)
        assert values["env_local_world_size"] == "2" and values["local_size"] == 2, (rank, values)
        assert values["env_before_init"] == [str(rank), "2", str(values["local_rank"]), "2"], (rank, values)


@pytest.mark.parametrize("plugin", ["pmi2", "pmix", "none"])
def test_a_wrong_plugin_stops_init_with_the_mismatch_and_the_fix(plugin):
    if plugin not in wrong_plugins():
        pytest.skip(f"--mpi={plugin} is the right plugin for {flavour()}")
    result = srun(plugin, 2, "init_only.py", check=False)
    errors = [r["error"] for r in reports(result.stdout, 2).values()]
    assert result.returncode != 0 and all(errors), result.stdout
    launcher = f"srun --mpi={plugin}" if plugin != "none" else "srun without a PMI plugin (--mpi=none)"
    assert f"{launcher} started 2 processes" in errors[0], errors[0]
    # A plugin of the wrong interface is found before MPI_Init; without one, from the world size.
    found = "cannot join them" if plugin != "none" else "sees a world of 1 in each: every process would train alone"
    assert found in errors[0], errors[0]
    assert f"Start it with `srun --mpi={right_plugin()}`" in errors[0]
    assert "Runtime environment uses unsupported PMI version" not in result.stdout, result.stdout


def test_the_self_check_passes_under_srun():
    out = srun(right_plugin(), 2, "-m", "gradsync.check", timeout=120).stdout
    assert f"launcher       srun --mpi={right_plugin()}, started 2 processes; MPI world size 2" in out
    assert "ranks 0-1, local_rank 0-1 of 2, cross_rank 0" in out
    assert verdicts(out) == ["PASS"], out


@pytest.mark.parametrize("plugin", ["pmi2", "pmix", "none"])
def test_the_self_check_fails_under_a_wrong_plugin_and_says_why(plugin):
    if plugin not in wrong_plugins():
        pytest.skip(f"--mpi={plugin} is the right plugin for {flavour()}")
    result = srun(plugin, 2, "-m", "gradsync.check", check=False)
    fails = [line for line in result.stdout.splitlines() if line.startswith("FAIL: ")]
    # Only the launcher's rank 0 (SLURM_PROCID=0) prints, as rank 0 of a working job would.
    assert result.returncode != 0 and len(fails) == 1, result.stdout
    assert f"Start it with `srun --mpi={right_plugin()}`" in fails[0]
    assert "PASS" not in result.stdout


def docs_sbatch_template() -> str:
    text = DOCS.read_text()
    block = text.split("<!-- sbatch-template -->\n")[1].split("<!-- /sbatch-template -->")[0]
    return block.split("```sh\n")[1].split("```")[0]


@pytest.mark.torch
def test_the_sbatch_script_from_the_docs_trains_like_a_single_process(tmp_path: Path):
    template = docs_sbatch_template()
    program = "srun --mpi=pmix .venv/bin/python train.py"
    assert program in template, "docs/launching.md's sbatch template changed: update this test"
    script = tmp_path / "train.sbatch"
    script.write_text(template.replace(
        program, f"srun --mpi={right_plugin()} {sys.executable} {WORKERS / 'train_equivalence.py'}"))
    # One node of this machine instead of the template's two; everything else as written.
    job_id, record = sbatch(script, "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1",
                            "--time=5", timeout=240)
    output = tmp_path / f"train-{job_id}.out"  # the template's --output=%x-%j.out
    text = output.read_text() if output.exists() else f"(no {output.name})"
    assert record.get("JobState") == "COMPLETED" and record.get("ExitCode") == "0:0", \
        f"{record}\n{text}"
    assert_trained_like_one_process(text, 2)


@pytest.mark.torch
def test_the_elastic_driver_relaunches_a_killed_worker_as_a_new_srun_step(tmp_path: Path):
    """gradsyncrun inside an allocation (salloc) starts each launch as an srun job step on the
    allocation's node (discovered as docs/elastic.md's SLURM recipe does); rank 1 SIGKILLs itself
    at step 5, the step ends, and the driver's next step resumes from the commit after step 4."""
    pytest.importorskip("torch")
    discover = tmp_path / "hosts.sh"
    discover.write_text('for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do echo "$node:3"; done\n')
    log, name = tmp_path / "log", job_name()
    worker = [sys.executable, str(WORKERS / "elastic_train.py"), "--log", str(log), "--epochs", "1",
              "--kill", "1:5", "--slots-file", str(tmp_path / "unused"), "--kill-slots", "unused:3",
              "--commit-copy", str(tmp_path / "commit.pt")]
    driver = [sys.executable, "-m", "gradsync.run", "--launcher", "srun", "--mpi", flavour(),
              "--poll-interval", "0.3", "--min-np", "2", "--max-np", "3",
              "--host-discovery-script", f"sh {discover}", "--state-dir", str(tmp_path / "state")]
    # -O: three tasks on a node of fewer CPUs (this machine has 2).
    cmd = ["salloc", "-n", "3", "-O", f"--job-name={name}", "--time=5", *driver, *worker]
    output = run_job(cmd, timeout=300, cleanup=cancel(name)).stdout
    # srun names the node of the killed task (the failure counts against it; one is not a blacklist).
    assert re.search(r"gradsyncrun: restart 1: the job exited with status \d+ \(the launcher reports a "
                     r"failed worker on (\S+)\); launching 3 ranks on \1:3", output), output
    assert output.count(f"launcher: srun --mpi={right_plugin()}") == 2, output  # rank 0 of each step
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [e for e in entries if e["event"] == "step"]
    before = [i for e in steps if e["launch"] == 0 and e["step"] < 5 for i in e["indices"]]
    after = [e for e in steps if e["launch"] == 1]
    assert {e["size"] for e in after} == {3} and min(e["step"] for e in after) == 5, output
    # Every sample of the epoch trained once: before the last commit, or after the restart.
    assert sorted(before + [i for e in after for i in e["indices"]]) == list(range(48))
    kill = next(e for e in entries if e["event"] == "kill")
    print(f"srun steps: kill to first step after recovery: {min(e['time'] for e in after) - kill['time']:.2f} s")
    print(re.search(r"gradsyncrun: launch 1 timing: .*", output)[0])
