"""Launcher detection and the launcher/MPI mismatch error, from the environments real launchers set.

The environments below are what each launcher was observed to set (Slurm 22.05, Open MPI 5.0 and
MPICH 5.0 wheels); tests/test_slurm.py runs the same cases for real under srun.
"""

import sys

import pytest

from gradsync.runtime import Launcher, detect_launcher, launcher_mismatch

OPEN_MPI = ("Open MPI", (5, 0, 11))
MPICH = ("MPICH", (5, 0, 2))
SRUN_STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2",
             "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}


@pytest.mark.parametrize("environ, name, size, kind", [
    ({}, "none", None, "none"),
    ({"OMPI_COMM_WORLD_SIZE": "4", "PMIX_RANK": "0"}, "Open MPI mpirun/mpiexec", 4, "mpiexec"),
    ({"PMI_SIZE": "3", "PMI_RANK": "0", "MPI_LOCALNRANKS": "3"},
     "Hydra mpiexec (MPICH, Intel MPI)", 3, "mpiexec"),
    ({**SRUN_STEP, "PMI_SIZE": "2", "PMI_RANK": "0", "PMI_FD": "11"}, "srun --mpi=pmi2", 2, "srun"),
    ({**SRUN_STEP, "PMIX_RANK": "0", "PMIX_NAMESPACE": "slurm.pmix.8.0"}, "srun --mpi=pmix", 2, "srun"),
    (SRUN_STEP, "srun without a PMI plugin (--mpi=none)", 2, "srun"),
    # Hydra inside a SLURM allocation starts its proxies with srun (one task per node): its own
    # PMI_SIZE counts the ranks, SLURM_STEP_NUM_TASKS the nodes.
    ({**SRUN_STEP, "SLURM_STEP_NUM_TASKS": "1", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "4"},
     "Hydra mpiexec (MPICH, Intel MPI)", 4, "mpiexec"),
    # Open MPI's mpirun in a job step likewise.
    ({**SRUN_STEP, "SLURM_STEP_NUM_TASKS": "1", "OMPI_COMM_WORLD_SIZE": "4"},
     "Open MPI mpirun/mpiexec", 4, "mpiexec"),
    # The batch script of an sbatch job is no job step: only srun starts the tasks.
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}, "none", None, "none"),
    ({"PMI_SIZE": "not a number", "MPI_LOCALNRANKS": "1"}, "Hydra mpiexec (MPICH, Intel MPI)", None,
     "mpiexec"),
])
def test_each_launcher_is_recognised_from_its_environment(environ, name, size, kind):
    assert detect_launcher(environ) == Launcher(name, size, kind)


@pytest.mark.parametrize("environ, vendor, fix", [
    ({**SRUN_STEP, "PMI_SIZE": "2"}, OPEN_MPI, "Start it with `srun --mpi=pmix`, the plugin for Open MPI"),
    (SRUN_STEP, OPEN_MPI, "Start it with `srun --mpi=pmix`, the plugin for Open MPI"),
    (SRUN_STEP, MPICH, "Start it with `srun --mpi=pmi2`, the plugin for MPICH"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, MPICH, "launch with the mpiexec of MPICH"),
    ({"PMI_SIZE": "2", "MPI_LOCALNRANKS": "2"}, OPEN_MPI, "launch with the mpiexec of Open MPI"),
])
def test_a_world_of_one_under_a_launcher_of_two_names_the_mismatch_and_the_fix(environ, vendor, fix):
    launcher = detect_launcher(environ)
    message = launcher_mismatch(launcher, 1, vendor)
    assert message is not None
    assert f"{launcher.name} started 2 processes" in message
    assert f"MPI ({vendor[0]} {'.'.join(map(str, vendor[1]))}) sees a world of 1" in message
    assert fix in message
    if "mpiexec of" in fix:  # the example command is this Python, not whichever is first on PATH
        assert f" -n 2 {sys.executable} ...`" in message, message


@pytest.mark.parametrize("launcher, world_size", [
    (Launcher("none", None), 1),
    (Launcher("srun --mpi=pmix", 2, "srun"), 2),
    (Launcher("srun --mpi=none", 1, "srun"), 1),  # one task: nothing to mismatch
    (Launcher("Open MPI mpirun/mpiexec", 4, "mpiexec"), 2),  # not the world-of-1 trap
])
def test_no_error_when_the_world_is_what_the_launcher_started_or_not_a_world_of_one(launcher,
                                                                                     world_size):
    assert launcher_mismatch(launcher, world_size, MPICH) is None
