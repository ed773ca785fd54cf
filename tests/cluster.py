"""Launch gradsync jobs the way clusters do, from tests: SLURM srun/sbatch, and two hosts.

* SLURM: a single-node SLURM on this machine (scripts/slurm_up.sh installs and starts it when
  running as root; the fixtures use one that is already up, and stop only daemons they started).
* Two hosts: the network namespaces gsA and gsB of scripts/netns_up.sh, joined by a veth pair;
  scripts/nsrsh stands in for ssh. Ranks on different "hosts" talk over TCP.

Where this cannot be set up (not root, no apt-get) the tests skip with the reason, unless
``GRADSYNC_TEST_REQUIRE_CLUSTER=1`` (CI sets it): then they fail, so that CI never passes by skipping.
``GRADSYNC_TEST_CLUSTER=0`` keeps the tests from installing or starting anything on this machine
(they still use a SLURM or namespaces that are already up).
Every job runs under a timeout; on timeout its process group is killed, and its SLURM job cancelled
or the processes left in the namespaces killed, before the test fails with the output so far.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from mpi_launch import REPO, WORKERS, flavour, mpiexec, run_job

SCRIPTS = REPO / "scripts"
NSRSH = SCRIPTS / "nsrsh"
HOSTS = ("gsA", "gsB")
SUBNET = "198.51.100.0/24"
_job_numbers = itertools.count()


def unavailable(reason: str) -> None:
    """Skip the test, or fail it where CI requires the cluster tests to run."""
    if os.environ.get("GRADSYNC_TEST_REQUIRE_CLUSTER") == "1":
        pytest.fail(f"{reason} (GRADSYNC_TEST_REQUIRE_CLUSTER=1: not skipping)")
    pytest.skip(reason)


def may_set_up(what: str) -> None:
    """Stop here unless the tests may install or start ``what`` on this machine."""
    if os.environ.get("GRADSYNC_TEST_CLUSTER") == "0":
        unavailable(f"GRADSYNC_TEST_CLUSTER=0: not starting {what}")
    if os.geteuid() != 0:
        unavailable(f"{what} is not running here and only root can start it")


def run_script(script: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run an infrastructure script with its output in a file, not a pipe: the daemons it starts
    would keep a pipe open."""
    log = Path(f"/tmp/gradsync-{script.stem}-{os.getpid()}.log")
    with log.open("w") as out:
        try:
            code = subprocess.run(["bash", str(script)], stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, cwd="/", timeout=timeout,
                                  start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            code = 124
    output = log.read_text()
    log.unlink()
    return subprocess.CompletedProcess([str(script)], code, output, "")


# ---- SLURM ---------------------------------------------------------------------------------------

def right_plugin() -> str:
    """The srun --mpi plugin of the MPI that mpi4py loads here."""
    return "pmix" if flavour() == "openmpi" else "pmi2"


def wrong_plugins() -> list[str]:
    """srun --mpi plugins this MPI cannot work under: gradsync.init() stops before MPI_Init where the
    plugin's interface is one the MPI does not speak (Open MPI 5 under pmi2, MPICH under pmix, which
    would abort inside MPI_Init: "unsupported PMI version PMIx"), after it where no plugin gives the
    tasks a PMI (none: every task a world of 1)."""
    return ["pmi2", "none"] if flavour() == "openmpi" else ["pmix", "none"]


def slurm_is_up() -> bool:
    """A controller answers and the node takes jobs. (``scontrol ping`` answers at once; sinfo
    retries for ~9 s while no controller runs.)"""
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
        if "is UP" not in ping.stdout:
            return False
        states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                                timeout=30).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(state in ("idle", "mixed", "allocated") for state in states)


def start_slurm() -> bool:
    """Make sure SLURM is up; True when this call started daemons (so the caller stops them)."""
    if slurm_is_up():
        return False
    may_set_up("SLURM")
    result = run_script(SCRIPTS / "slurm_up.sh", timeout=900)
    if result.returncode != 0:
        unavailable(f"could not start SLURM (scripts/slurm_up.sh exit {result.returncode}):\n"
                    f"{result.stdout[-3000:]}")
    return "already up" not in result.stdout


def stop_slurm() -> None:
    result = run_script(SCRIPTS / "slurm_down.sh", timeout=60)
    assert result.returncode == 0, f"scripts/slurm_down.sh failed:\n{result.stdout}"


def job_name() -> str:
    return f"gradsync-test-{os.getpid()}-{next(_job_numbers)}"


def cancel(name: str) -> Callable[[], None]:
    return lambda: subprocess.run(["scancel", "--name", name], timeout=30, check=False)


def srun(plugin: str, n: int, *program: str, timeout: float = 120,
         env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """``srun --mpi=PLUGIN -n N python PROGRAM...``; a PROGRAM starting with a file name in
    tests/workers/ runs that worker, anything else is passed to python as it is (``-m ...``)."""
    args = list(program)
    if args and (WORKERS / args[0]).is_file():
        args[0] = str(WORKERS / args[0])
    name = job_name()
    cmd = ["srun", f"--mpi={plugin}", "-n", str(n), f"--job-name={name}",
           f"--time={max(1, int(timeout // 60) + 1)}", sys.executable, *args]
    return run_job(cmd, timeout, env=env, check=check, cleanup=cancel(name))


def scontrol_job(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                         timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def sbatch(script: Path, *options: str, timeout: float = 180) -> tuple[str, dict[str, str]]:
    """Submit ``script`` with ``options``, wait (bounded) until the job ends: (job id, job record)."""
    submitted = run_job(["sbatch", "--parsable", *options, str(script)], timeout=60,
                        cwd=script.parent)
    job_id = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = scontrol_job(job_id)
        if record.get("JobState") not in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            return job_id, record
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], timeout=30, check=False)
    pytest.fail(f"batch job {job_id} did not finish within {timeout} s: {scontrol_job(job_id)}")


# ---- two hosts -----------------------------------------------------------------------------------

def namespaces_exist() -> bool:
    try:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    names = {line.split()[0] for line in listed.splitlines() if line.strip()}
    return set(HOSTS) <= names


def start_namespaces() -> bool:
    """Make sure gsA and gsB exist; True when this call created them (so the caller removes them)."""
    if namespaces_exist():
        return False
    may_set_up("the network namespaces gsA and gsB (two-host tests)")
    result = run_script(SCRIPTS / "netns_up.sh", timeout=60)
    if result.returncode != 0:
        run_script(SCRIPTS / "netns_down.sh", timeout=60)
        unavailable(f"could not create the network namespaces (scripts/netns_up.sh exit "
                    f"{result.returncode}):\n{result.stdout[-3000:]}")
    return True


def stop_namespaces() -> None:
    run_script(SCRIPTS / "netns_down.sh", timeout=60)


def kill_namespace_processes() -> None:
    """Kill what a timed-out job left in the namespaces (remote daemons, ranks), by pid."""
    for host in HOSTS:
        pids = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True,
                              timeout=30).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


def veth_bytes() -> int:
    """Bytes gsA has sent over the veth link to gsB so far."""
    out = subprocess.run(["ip", "netns", "exec", "gsA", "cat",
                          "/sys/class/net/vgsA/statistics/tx_bytes"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return int(out)


def two_host_mpiexec(per_host: int, *program: str) -> str:
    """The mpiexec command line (run inside gsA) for ``per_host`` ranks on each of gsA and gsB."""
    hosts, n = ",".join(f"{h}:{per_host}" for h in HOSTS), 2 * per_host
    python = shlex.join([sys.executable, *program])
    if flavour() == "openmpi":
        return (f"{mpiexec()} --host {hosts} -n {n} --prtemca plm_ssh_agent {NSRSH} "
                f"--prtemca oob_tcp_if_include {SUBNET} --mca btl_tcp_if_include {SUBNET} {python}")
    return f"{mpiexec()} -launcher ssh -launcher-exec {NSRSH} -iface vgsA -hosts {hosts} -n {n} {python}"


def run_two_hosts(per_host: int, *program: str, timeout: float = 180,
                  env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python PROGRAM...`` with ``per_host`` ranks on each of the hosts gsA and gsB; a
    PROGRAM starting with a file name in tests/workers/ runs that worker."""
    args = list(program)
    if args and (WORKERS / args[0]).is_file():
        args[0] = str(WORKERS / args[0])
    # The two "hosts" share one kernel: UCX (MPICH's network layer) would otherwise find a
    # shared-memory path between them. On real hosts there is none, so force TCP, as there.
    job_env = {"UCX_TLS": "tcp,self", **(env or {})}
    # Open MPI's oversubscribe mapping policy (mpi_launch sets it for one host) would pack every
    # rank onto gsA; here each host has the slots it needs.
    return run_job([str(NSRSH), "gsA", two_host_mpiexec(per_host, *args)], timeout, env=job_env,
                   check=check, cleanup=kill_namespace_processes,
                   unset=("PRTE_MCA_rmaps_default_mapping_policy", "OMPI_MCA_rmaps_base_oversubscribe"))
