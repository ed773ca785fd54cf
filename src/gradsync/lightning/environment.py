"""Lightning's view of a gradsync job: ranks, sizes and devices come from gradsync, not Lightning.

Under ``mpiexec``/``srun`` the processes exist before Lightning runs; gradsync.init() has read the
launch (rank, size, local and cross topology). :class:`GradsyncEnvironment` hands these to
Lightning as its ``ClusterEnvironment``, so Lightning's own detection (SLURM, MPI, TorchElastic
variables) is never consulted, and :func:`check_launch` refuses a ``devices`` / ``num_nodes``
setting that disagrees with the launch.

The same environment serves Lightning's own ``DDPStrategy(process_group_backend="gradsync",
cluster_environment=GradsyncEnvironment())``, which starts ``torch.distributed`` through its
``env://`` rendezvous: :attr:`GradsyncEnvironment.main_address` and
:attr:`GradsyncEnvironment.main_port` then name rank 0's host and a port free there, agreed on by
every rank, for the TCPStore that rendezvous opens (docs/torch-distributed.md).
"""

from __future__ import annotations

import os
import socket

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
        self._main: tuple[str, int] | None = None

    @property
    def creates_processes_externally(self) -> bool:
        """True: the MPI launcher (or srun) started every process; Lightning starts none."""
        return True

    @property
    def main_address(self) -> str:
        """Rank 0's address for torch.distributed's ``env://`` rendezvous (Lightning's
        ``DDPStrategy`` sets it as ``MASTER_ADDR``): rank 0's ``MASTER_ADDR`` when set there, else
        the loopback address when every rank is on one host, else rank 0's host name. The first
        read of this or :attr:`main_port` is collective (see :attr:`main_port`); gradsync's own
        strategies read neither."""
        return self._rendezvous()[0]

    @property
    def main_port(self) -> int:
        """A port free on rank 0's host when first read (``MASTER_PORT``), the same on every rank.
        The first read of this or :attr:`main_address` broadcasts both from rank 0 (gradsync's
        ``broadcast_object``), so every rank must read them: Lightning's ``DDPStrategy`` does, in
        ``setup_distributed``. Later reads return the same values."""
        return self._rendezvous()[1]

    def _rendezvous(self) -> tuple[str, int]:
        if self._main is None:
            mine = None
            if gradsync.rank() == 0:
                one_host = gradsync.cross_size() == 1
                address = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if one_host else socket.gethostname())
                mine = (address, _free_port())
            self._main = tuple(gradsync.broadcast_object(mine, root_rank=0,
                                                         name="lightning.environment.main"))
        return self._main

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
                             f"but the job was launched with {gradsync.size()} processes (Lightning's "
                             f"DDPStrategy: pass devices={gradsync.local_size()}, the processes on this "
                             f"host, and num_nodes={gradsync.cross_size()})")

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


def _free_port() -> int:
    """A TCP port that no process of this host listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]
