"""The elastic driver: ``python -m gradsync.run`` (console script ``gradsyncrun``).

It launches the workers through the MPI launcher the user already has (``mpiexec`` with a host list,
or an ``srun`` job step inside a SLURM allocation), watches the job, and relaunches it on the hosts
available when a worker fails or hosts are added or removed; the workers resume from the state their
last ``commit()`` wrote to the state directory (:mod:`gradsync.torch.elastic`). It decides hosts and
restarts only: no controller or transport of its own.
Usage and semantics: docs/elastic.md.

Modules: ``args`` (command line), ``hosts`` (host lists, discovery, blacklist), ``launcher`` (the
mpiexec or srun command), ``output`` (the launcher's output passed on, and the hosts of failed
workers it names), ``store`` (the state directory shared with the workers, and the timing of each
launch), ``driver`` (the loop). The workers' side is :mod:`gradsync.elastic`.
"""

from .driver import main

__all__ = ["main"]
