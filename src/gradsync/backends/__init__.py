"""Data movers: each backend runs the agreed collectives on buffers of one kind of memory.

:mod:`.mpi` reduces host buffers with MPI over the coordinator's own communicators, through
:mod:`.shared` (a /dev/shm file all ranks of one host map) for large allreduces when every rank is on
one host. Device buffers go through :mod:`.nccl` on the coordinator's CUDA stream, or through
:mod:`.staging` (pinned host memory and MPI). :mod:`.nccl_api` is the cffi binding of libnccl.so.2
(declarations in ``nccl_api.h``), :mod:`.nccl_loader` finds and loads the library.
"""
