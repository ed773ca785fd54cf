"""torch.distributed.checkpoint on backend gradsync, saved at one rank count and loaded at another:
two MPI jobs of tests/workers/torch_checkpoint.py (an FSDP2 model and a DDP model, each with
Adam), every rank comparing the full state with one process's, exactly."""

import pytest

from mpi_launch import reports, run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.torch]

SAVED_AT = 2
PARAMETERS = 4  # two Linear layers: weight and bias each
KEYS = 2 * (PARAMETERS + 3 * PARAMETERS)  # FSDP2 and DDP: each parameter, its step, exp_avg, exp_avg_sq


def check(output: str, ranks: int, mode: str) -> None:
    for rank, values in reports(output, ranks).items():
        assert (values["size"], values["mode"]) == (ranks, mode), values
        assert len(values["compared"]) == KEYS, values
        assert values["differ"] == [], f"rank {rank}: {values['differ']}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A checkpoint saved by a job of SAVED_AT ranks, whose state was one process's there too."""
    directory = str(tmp_path_factory.mktemp("dcp") / "checkpoint")
    check(run_mpi("torch_checkpoint.py", SAVED_AT, "save", directory, timeout=120).stdout, SAVED_AT, "save")
    return directory


@pytest.mark.parametrize("ranks", [1, pytest.param(3, marks=pytest.mark.full)])
def test_a_checkpoint_saved_at_2_ranks_loads_exactly_at_another_rank_count(checkpoint, ranks):
    """Resharded: FSDP2's shards of 2 ranks into one process's whole tensors, or into 3 uneven
    shards; the DDP model and every optimizer state too."""
    check(run_mpi("torch_checkpoint.py", ranks, "load", checkpoint, timeout=120).stdout, ranks, "load")
