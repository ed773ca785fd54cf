"""gradsync's torch.distributed backend started by torchrun instead of an MPI launcher: every
process is an MPI job of one rank, so each one refuses the group with an error that says how to
launch, instead of an IndexError or a wait."""

import sys

import pytest

from mpi_launch import WORKERS, reports, run_job

pytestmark = pytest.mark.torch

# Variables of an MPI launcher that the test's own process may have: none may reach torchrun's.
LAUNCHER_VARIABLES = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_PORT", "HYDI_CONTROL_FD", "MPI_LOCALRANKID",
                      "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK",
                      "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_STEP_ID")


def test_under_torchrun_every_process_says_to_start_the_script_with_mpiexec():
    pytest.importorskip("torch.distributed.run")
    result = run_job([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                      str(WORKERS / "torchrun_init.py")], timeout=120, unset=LAUNCHER_VARIABLES)
    for rank, values in reports(result.stdout, 2).items():
        assert values["error"] is not None, values
        assert values["error"].startswith("ValueError: gradsync: rank 0: torch says rank "
                                          f"{rank} of 2 in the default group"), values
        assert "start the script with `mpiexec -n N` or `srun`" in values["error"], values
