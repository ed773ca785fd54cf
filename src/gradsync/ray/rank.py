"""The rank's side, run inside each Ray actor (RayExecutor's workers, Ray Train's workers).

The process that runs the MPI launcher (:mod:`gradsync.ray.job`) calls these functions in the
actors through Ray, in this order: :func:`prepare` (listen for the hand-over), :func:`start_proxy`
(the launcher's proxy on this node, asked for by its remote shell), :func:`join` (take the launch
identity the stub handed over and initialise MPI: this actor is now rank r of the launcher's
``MPI_COMM_WORLD``), and at the end :func:`finish`. After :func:`join`, ``gradsync.init()`` and
every adapter find MPI initialised and use ``MPI_COMM_WORLD``, as under mpiexec.

The functions are module-level because Ray Train runs plain functions in its own actors; their
state is the one :class:`Agent` of this process (:data:`_agent`), as a process has one MPI.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shlex
import signal
import socket
import subprocess
import threading
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any

from ..errors import GradsyncError
from ..process import launch
from . import channel, stub

log = logging.getLogger("gradsync")
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # in the child, before exec: the proxy ends when its actor does
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Agent:
    """One actor's part in one job: the rank it will be, the hand-over, its launcher proxies."""

    def __init__(self, session: str, rank: int, authkey: bytes) -> None:
        self.rank = rank
        self.session = channel.session_dir(session)
        path = channel.rank_socket(self.session, rank)
        if os.path.exists(path):
            os.unlink(path)
        self.listener = channel.listen(path, authkey)
        self.handed: dict[str, Any] = {}
        self.arrived = threading.Event()
        self.stub: Connection | None = None
        self.held_fd: int | None = None
        self.proxies: dict[int, subprocess.Popen] = {}
        threading.Thread(target=self._accept, name="gradsync-ray-handover", daemon=True).start()

    def _accept(self) -> None:
        try:
            conn = self.listener.accept()
            launch_env, settings, has_fd = conn.recv()
            fd = recv_handle(conn) if has_fd else None
        except (OSError, EOFError) as error:  # the listener closed (shutdown) or a bad client
            self.handed = {"error": repr(error)}
        else:
            self.stub = conn
            self.handed = {"launch": launch_env, "settings": settings, "fd": fd}
        finally:
            self.release()
            self.arrived.set()

    def release(self) -> None:
        """Stop listening: the socket file goes, and the session directory with the last one."""
        self.listener.close()  # which removes the socket file; again is harmless
        try:
            self.session.rmdir()
        except OSError:  # another rank's socket is still there: that rank removes it
            pass

    def adopt(self) -> None:
        """Make the handed-over launch identity this process's, before ``MPI_Init``."""
        os.environ.update(self.handed["launch"])
        for name, value in self.handed["settings"].items():
            os.environ.setdefault(name, value)
        if self.handed["fd"] is not None:
            os.environ["PMI_FD"] = str(self.handed["fd"])
        # A copy of the stub's socket that only the kernel closes, at the very end of this process:
        # the stub stays (and the launcher keeps the rank) until after MPI's exit handlers ran.
        self.held_fd = os.dup(self.stub.fileno())


_agent: Agent | None = None


def _current() -> Agent:
    if _agent is None:
        raise GradsyncError("gradsync.ray: this actor was not prepared for a job (prepare() first)")
    return _agent


def prepare(session: str, rank: int, authkey: bytes) -> dict[str, Any]:
    """Listen for the launch identity of ``rank`` in the job ``session``; returns where this actor
    runs: ``{"node_id", "hostname", "pid"}``.

    Raises:
        GradsyncError: this process is already a rank of a job (MPI starts once per process).
    """
    global _agent
    if _agent is not None:
        raise GradsyncError("gradsync.ray: this actor is already a rank of a job; MPI can be "
                            "initialised only once per process: start a new actor")
    import ray

    _agent = Agent(session, rank, authkey)
    return {"node_id": ray.get_runtime_context().get_node_id(), "hostname": socket.gethostname(),
            "pid": os.getpid()}


def start_proxy(command: str, own_uts: str | None = None) -> int:
    """Start the launcher's ``command`` (a shell command line, as ssh runs it) on this node; the
    process is killed when this actor's process ends. Returns its pid. With ``own_uts``, in a UTS
    namespace of its own whose host name is ``own_uts`` (root only: Open MPI's proxies of Ray
    nodes that share a machine, :func:`gradsync.ray.job._may_unshare`)."""
    argv = ["/bin/sh", "-c", command]
    if own_uts:
        argv = ["unshare", "--uts", "/bin/sh", "-c", f"hostname {shlex.quote(own_uts)} && {command}"]
    proxy = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                             start_new_session=True, preexec_fn=_die_with_parent)
    _current().proxies[proxy.pid] = proxy
    return proxy.pid


def proxy_status(pid: int) -> int | None:
    """The exit status of the proxy ``pid``, None while it runs (255 for a signal, as ssh)."""
    code = _current().proxies[pid].poll()
    return None if code is None else (code if code >= 0 else 255)


def stop_proxies() -> None:
    """Kill the launcher proxies this actor started (and what they started), if still running."""
    for proxy in _current().proxies.values():
        if proxy.poll() is None:
            try:
                os.killpg(proxy.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proxy.wait()


def join(timeout: float) -> dict[str, int]:
    """Become the rank this actor was prepared as: wait up to ``timeout`` seconds for the stub's
    hand-over, take its launch identity and initialise MPI (collective: every rank of the job must
    join). Returns ``{"rank", "size"}`` as MPI numbers this process.

    Raises:
        GradsyncError: no hand-over within ``timeout`` (the launcher did not start this rank), or
            MPI numbers this process differently from the rank it was prepared as.
        LaunchError: the launcher and this process's MPI library cannot work together (as under
            mpiexec: :func:`gradsync.process.launch.start_mpi`).
    """
    agent = _current()
    if not agent.arrived.wait(timeout) or "error" in agent.handed:
        agent.release()
        why = agent.handed.get("error", "no hand-over")
        raise GradsyncError(f"gradsync.ray: rank {agent.rank}: the MPI launcher did not start this "
                            f"rank's process within {timeout:.0f} s ({why})")
    agent.adopt()
    MPI = launch.start_mpi()
    world = MPI.COMM_WORLD
    if world.Get_rank() != agent.rank:
        raise GradsyncError(f"gradsync.ray: prepared as rank {agent.rank} but MPI numbers this "
                            f"process {world.Get_rank()} of {world.Get_size()}")
    return {"rank": world.Get_rank(), "size": world.Get_size()}


def finish() -> None:
    """End this rank: ``gradsync.shutdown()``, ``MPI_Finalize``, and tell the stub (which then
    exits 0 when this process ends). Collective, as MPI_Finalize is."""
    import gradsync

    agent = _current()
    agent.release()  # a job that never started leaves no socket behind
    if gradsync.is_initialized():
        gradsync.shutdown()
    MPI = launch.import_mpi()
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
    if agent.stub is not None:
        agent.stub.send(stub.FINALIZED)
