"""Lightning's view of a gradsync job: ranks, sizes and devices come from gradsync, not Lightning.

Under ``mpiexec``/``srun`` the processes exist before Lightning runs; gradsync.init() has read the
launch (rank, size, local and cross topology). :class:`GradsyncEnvironment` hands these to
Lightning as its ``ClusterEnvironment``, so Lightning's own detection (SLURM, MPI, TorchElastic
variables) is never consulted, and :func:`check_launch` refuses a ``devices`` / ``num_nodes``
setting that disagrees with the launch.
"""

from __future__ import annotations

import os

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment

import gradsync


class GradsyncEnvironment(ClusterEnvironment):
    """A ``ClusterEnvironment`` whose ranks are gradsync's: ``global_rank`` is ``gradsync.rank()``,
    ``world_size`` ``gradsync.size()``, ``local_rank`` ``gradsync.local_rank()``, ``node_rank``
    ``gradsync.cross_rank()`` (the host's index). Creating one calls ``gradsync.init()`` unless it
    was called already (it is collective: every rank creates its strategy)."""

    def __init__(self) -> None:
        if not gradsync.is_initialized():
            gradsync.init()

    @property
    def creates_processes_externally(self) -> bool:
        """True: the MPI launcher (or srun) started every process; Lightning starts none."""
        return True

    @property
    def main_address(self) -> str:
        """Unused by gradsync (no torch.distributed rendezvous); ``MASTER_ADDR`` or localhost."""
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        """Unused by gradsync (no torch.distributed rendezvous); ``MASTER_PORT`` or 0."""
        return int(os.environ.get("MASTER_PORT", "0"))

    @staticmethod
    def detect() -> bool:
        """True once gradsync is initialised; Lightning never picks this environment by itself
        (the gradsync strategies set it)."""
        return gradsync.is_initialized()

    def world_size(self) -> int:
        return gradsync.size()

    def set_world_size(self, size: int) -> None:
        """Refuse a world size other than gradsync's (the launch decides it).

        Raises:
            ValueError: ``size`` differs from ``gradsync.size()``.
        """
        if size != gradsync.size():
            raise ValueError(f"gradsync: rank {gradsync.rank()}: Lightning asked for world size {size}, "
                             f"but the job was launched with {gradsync.size()} processes")

    def global_rank(self) -> int:
        return gradsync.rank()

    def set_global_rank(self, rank: int) -> None:
        """Nothing to set: the rank is the launcher's (``gradsync.rank()``)."""

    def local_rank(self) -> int:
        return gradsync.local_rank()

    def node_rank(self) -> int:
        return gradsync.cross_rank()


def check_launch(devices: int, num_nodes: int) -> None:
    """Refuse a Lightning ``devices`` / ``num_nodes`` setting that disagrees with the launch.

    ``devices`` agrees when it is the number of processes on this host (``gradsync.local_size()``:
    one device each) or 1 (each process sees one device: the CPU, Lightning's default
    ``devices="auto"`` there, or the one GPU its launcher made visible). ``num_nodes`` agrees when
    it is the number of hosts, ``gradsync.cross_size()``.

    Raises:
        ValueError: naming the Trainer's (Fabric's) value, the launch's, and this rank.
    """
    rank, local, hosts = gradsync.rank(), gradsync.local_size(), gradsync.cross_size()
    if devices not in (1, local):
        raise ValueError(
            f"gradsync: rank {rank}: devices={devices} disagrees with the launch, which started {local} "
            f"process(es) on this host ({gradsync.size()} in all): pass devices={local} (one device per "
            "process) or leave devices at its default")
    if num_nodes != hosts:
        raise ValueError(
            f"gradsync: rank {rank}: num_nodes={num_nodes} disagrees with the launch, which runs on "
            f"{hosts} host(s): pass num_nodes={hosts}")


def root_device(parallel_devices: list[torch.device] | None) -> torch.device:
    """This process's device: the CPU, or for GPUs the ``gradsync.local_rank()``-th of the host's
    devices (or the only one, when the launcher made one GPU visible per process)."""
    if not parallel_devices:
        return torch.device("cpu")
    if parallel_devices[0].type == "cpu" or len(parallel_devices) == 1:
        return parallel_devices[0]
    return parallel_devices[gradsync.local_rank()]
