"""The process layer: this process's place in the job.

:mod:`.runtime` holds the one runtime object that ``gradsync.init()`` creates and ``shutdown()`` tears
down (MPI, rank, size, local and cross topology, the coordinators). :mod:`.launch` tells which
launcher started the process and which MPI library mpi4py loaded, and refuses a mismatch before MPI
starts; :mod:`.mpi_environment` sets what MPI reads from the environment at start-up;
:mod:`.libraries` lists the shared libraries already loaded.
"""
