"""The launcher's side: one MPI job whose ranks are Ray actors (docs/ray.md, "How the ranks start").

:class:`MpiJob` runs the ``mpiexec`` of the MPI wheel beside this Python (the same one
``gradsyncrun`` uses: :func:`gradsync.run.launcher.find_mpiexec`) with one host per Ray node, named
by :func:`host_names`, and ranks placed on them in blocks, as the elastic driver does. Its remote
shell is :mod:`gradsync.ray.rsh`: the launcher's proxy for a node (Hydra's ``hydra_pmi_proxy``,
Open MPI's ``prted``) is started through Ray inside an actor on that node, and the proxy starts
:mod:`gradsync.ray.stub` for each rank there, which hands its launch identity to the actor prepared
as that rank (:mod:`gradsync.ray.rank`). The actors then initialise MPI: the job's
``MPI_COMM_WORLD`` is the actors, in rank order, and MPI carries the data between them.

The actors are reached through ``call(index, function, *args) -> ObjectRef``, which runs a
function of :mod:`gradsync.ray.rank` in the actor ``index``: RayExecutor's workers and Ray Train's
(``WorkerGroup.execute_single_async``) alike.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from ..errors import GradsyncError
from ..run.hosts import place
from ..run.launcher import find_mpiexec, flavour
from . import channel, rank

log = logging.getLogger("gradsync")

Call = Callable[..., "ray.ObjectRef"]
#: How often the relay asks an actor whether the launcher proxy it started has ended, in seconds.
PROXY_POLL_S = 0.5
#: How long finalize() and close() wait for the ranks to finalise MPI and for the launcher to end, in seconds.
STOP_GRACE_S = 10.0


def host_names(nodes: Sequence[str], hostnames: Sequence[str], kind: str) -> tuple[dict[str, str], bool]:
    """The host name the launcher is given for each Ray node (node id -> name), from the node and
    the host name of each worker and the launcher's ``kind`` (:func:`gradsync.run.launcher.flavour`),
    and whether those names are made up.

    Made up, ``ray-`` and the node id's first 16 hex digits, for Hydra (``"mpich"``), which starts
    every host's proxy through the remote shell, so in its actor, only when no host is its own;
    and wherever several Ray nodes share a host name (Ray nodes on one machine). Otherwise (Open
    MPI on machines of distinct names) each node's own host name: PRRTE's daemons report theirs.
    """
    names = dict(zip(nodes, hostnames))
    if kind == "openmpi" and len(set(names.values())) == len(names):
        return names, False
    return {node: f"ray-{node[:16]}" for node in names}, True


def block_ranks(nodes: Sequence[str], names: dict[str, str]) -> tuple[list[int], dict[str, int]]:
    """The rank of each worker, given the Ray node of each (``nodes[i]``), and the launcher's
    hosts (host name -> ranks on it, in rank order); ``names`` maps nodes to host names.

    The launcher places ranks in blocks (the first host's slots first: :func:`gradsync.run.hosts.place`);
    hosts come in the order their first worker appears, and the workers of one node take its ranks in
    their order. Workers listed node by node (as Ray Train lists them) keep their index as rank.
    """
    by_node: dict[str, list[int]] = {}
    for index, node in enumerate(nodes):
        by_node.setdefault(node, []).append(index)
    ranks = [0] * len(nodes)
    for number, index in enumerate(i for members in by_node.values() for i in members):
        ranks[index] = number
    slots = {names[node]: len(members) for node, members in by_node.items()}
    return ranks, place(slots, len(nodes))


def _may_unshare(hosts: dict[str, int]) -> bool:
    """Whether Open MPI's proxies can run in UTS namespaces of their own here (root and
    ``unshare``); raises the reason when they cannot. Open MPI's daemons must report distinct
    host names (PRRTE tells nodes apart by them), which Ray nodes on one machine do not."""
    if os.geteuid() == 0 and shutil.which("unshare"):
        return True
    raise GradsyncError(f"gradsync.ray: the Ray nodes of this job share a host name, and Open MPI "
                        f"needs a distinct one per node ({len(hosts)} nodes); run as root with "
                        "`unshare` on PATH (each node's proxy then gets a UTS namespace of its own, "
                        "named after its node), or use MPICH (pip install gradsync[mpi])")


class MpiJob:
    """One MPI job over Ray actors, from :meth:`start` to :meth:`finalize` and :meth:`close`.

    ``call`` reaches the actors (see the module doc); ``nodes[i]`` is the Ray node id of actor i
    and ``hostnames[i]`` the host name of its machine.
    After :meth:`start`, ``ranks[i]`` is the MPI rank of actor i.
    """

    def __init__(self, call: Call, nodes: Sequence[str], hostnames: Sequence[str]) -> None:
        self.call = call
        self.nodes = list(nodes)
        self.mpiexec = find_mpiexec(None)
        self.kind = flavour(self.mpiexec)
        names, self.made_up_names = host_names(self.nodes, hostnames, self.kind)
        self.ranks, self.hosts = block_ranks(self.nodes, names)
        # The launcher starts the ranks of its own host itself, without the remote shell (PRRTE
        # does, under a real host name): no proxy is awaited there; its stubs find their actors.
        self.remote_hosts = [host for host in self.hosts
                             if self.made_up_names or host != socket.gethostname()]
        self.token = secrets.token_hex(8)
        self.authkey = secrets.token_bytes(32)
        self.workdir = channel.private_dir("gradsync-ray-launcher-")
        self.launcher: subprocess.Popen | None = None
        self.proxies_started = 0
        self._lock = threading.Condition()
        self._stopping = False
        self._relay = channel.listen(str(self.workdir / "relay"), self.authkey)
        self._first_on_host = {names[node]: self.nodes.index(node) for node in self.nodes}
        self._own_uts = False  # start each proxy in a UTS namespace named after its host

    # ---- starting ------------------------------------------------------------------------------

    def start(self, timeout: float) -> None:
        """Launch the job and make every actor its rank, within ``timeout`` seconds.

        Raises:
            GradsyncError: the launcher failed or did not start every rank in time (the message
                quotes the launcher's output); the job is stopped before raising.
        """
        deadline = time.monotonic() + timeout
        try:
            ray.get([self.call(i, rank.prepare, self.token, self.ranks[i], self.authkey)
                     for i in range(len(self.nodes))], timeout=timeout)
            threading.Thread(target=self._serve, name="gradsync-ray-relay", daemon=True).start()
            self.launcher = self._launch()
            self._await_proxies(deadline)
            left = max(deadline - time.monotonic(), 1.0)
            joined = ray.get([self.call(i, rank.join, left) for i in range(len(self.nodes))],
                             timeout=left + 5)
        except Exception as error:
            failure = error if isinstance(error, GradsyncError) else GradsyncError(
                f"gradsync.ray: starting the MPI job of {len(self.nodes)} ranks failed: {error}"
                f"{self._launcher_output()}")
            self.close(wait=0)  # which removes the launcher's output: quoted above
            if failure is error:
                raise
            raise failure from error
        log.debug("gradsync.ray: job %s started: %s", self.token, joined)

    def _launch(self) -> subprocess.Popen:
        mpiexec = self.mpiexec
        rsh = self.workdir / "rsh"
        rsh.write_text(f"#!/bin/sh\nexec '{sys.executable}' -m gradsync.ray.rsh \"$@\"\n")
        rsh.chmod(0o700)
        hosts = ",".join(f"{host}:{slots}" for host, slots in self.hosts.items())
        rank_command = [sys.executable, "-m", "gradsync.ray.stub", self.token]
        size = str(len(self.nodes))
        env = dict(os.environ, **{channel.RELAY_ENV: str(self.workdir / "relay"),
                                  channel.AUTHKEY_ENV: self.authkey.hex()})
        if self.kind == "openmpi":
            self._own_uts = self.made_up_names and _may_unshare(self.hosts)
            forwarded = [arg for name in env if name.startswith(("GRADSYNC_", "HOROVOD_"))
                         for arg in ("-x", name)]
            argv = [mpiexec, "-n", size, "--host", hosts, "--prtemca", "plm_ssh_agent", str(rsh),
                    *forwarded, *rank_command]
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        else:
            argv = [mpiexec, "-launcher", "ssh", "-launcher-exec", str(rsh), "-hosts", hosts,
                    "-n", size, *rank_command]
        log.debug("gradsync.ray: launching %s", " ".join(argv))
        with open(self.workdir / "launcher.log", "wb") as output:
            return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=output,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def _await_proxies(self, deadline: float) -> None:
        with self._lock:
            while self.proxies_started < len(self.remote_hosts):
                if self.launcher.poll() is not None:
                    raise GradsyncError(f"gradsync.ray: the MPI launcher exited with "
                                        f"{self.launcher.returncode} before starting every rank"
                                        f"{self._launcher_output()}")
                if time.monotonic() > deadline:
                    raise GradsyncError(f"gradsync.ray: the MPI launcher started {self.proxies_started} "
                                        f"of {len(self.remote_hosts)} node proxies in time"
                                        f"{self._launcher_output()}")
                self._lock.wait(0.2)

    def _launcher_output(self) -> str:
        try:
            text = (self.workdir / "launcher.log").read_text(errors="replace").strip()
        except OSError:
            return ""
        return f"; the launcher's output:\n{text[-3000:]}" if text else ""

    # ---- the relay: the launcher's remote shell, carried out through Ray -------------------------

    def _serve(self) -> None:
        while not self._stopping:
            try:
                conn = self._relay.accept()
            except Exception:  # noqa: BLE001 - a client that failed authentication, or closing
                continue
            if self._stopping:
                conn.close()
                return
            threading.Thread(target=self._carry_out, args=(conn,), daemon=True,
                             name="gradsync-ray-rsh").start()

    def _carry_out(self, conn: Any) -> None:
        code = 255
        try:
            host, command = conn.recv()
            index = self._first_on_host[host]
            pid = ray.get(self.call(index, rank.start_proxy, command, host if self._own_uts else None))
            with self._lock:
                self.proxies_started += 1
                self._lock.notify_all()
            while not conn.poll(PROXY_POLL_S):  # until the remote shell ends (the launcher gave up)
                status = ray.get(self.call(index, rank.proxy_status, pid))
                if status is not None:
                    code = status
                    break
            else:
                ray.get(self.call(index, rank.stop_proxies))
                return
        except Exception as error:  # noqa: BLE001 - the actor died, or a bad request: ssh's 255
            log.debug("gradsync.ray: relay: %r", error)
        try:
            conn.send(code)
        except OSError:
            pass
        conn.close()

    # ---- stopping ------------------------------------------------------------------------------

    def finalize(self, timeout: float = STOP_GRACE_S) -> list[int]:
        """Finalise MPI on every rank that still answers within ``timeout`` seconds; returns the
        ranks that did not (dead, or stuck in a collective)."""
        refs = [self.call(i, rank.finish) for i in range(len(self.nodes))]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        failed = []
        for i, ref in enumerate(refs):
            try:
                if ref not in done:
                    raise TimeoutError
                ray.get(ref)
            except Exception:  # noqa: BLE001 - a dead actor, or MPI that cannot finalise
                failed.append(self.ranks[i])
        return failed

    def stop_proxies(self, timeout: float = STOP_GRACE_S) -> None:
        """Kill the launcher's proxies in the actors that still answer within ``timeout`` seconds."""
        refs = [self.call(i, rank.stop_proxies) for i in range(len(self.nodes))]
        ray.wait(refs, num_returns=len(refs), timeout=timeout)

    def close(self, wait: float = STOP_GRACE_S, background: bool = False) -> None:
        """Stop the relay and give the launcher ``wait`` seconds to end (it ends when the actors'
        processes have ended) before killing it; in a daemon thread when ``background``, for a
        caller whose actors end after it returns. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        try:  # wake the relay's accept()
            channel.connect(str(self.workdir / "relay"), self.authkey).close()
        except OSError:
            pass
        self._relay.close()
        if background:
            threading.Thread(target=self._reap, args=(wait,), daemon=True, name="gradsync-ray-reap").start()
        else:
            self._reap(wait)

    def _reap(self, wait: float) -> None:
        launcher = self.launcher
        if launcher is not None:
            try:
                launcher.wait(wait)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(launcher.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                launcher.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)
