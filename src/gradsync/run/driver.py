"""The elastic driver's loop: launch, watch, relaunch on the hosts available.

Each launch starts the workers through the MPI launcher (:mod:`gradsync.run.launcher`) on
``min(usable slots, --max-np)`` ranks and watches the job:

* exit 0: done.
* exit ``EXIT_HOSTS_UPDATED``: the workers stopped at a commit because the driver had signalled
  added hosts; relaunch at the new size (not a failure).
* a host in use disappears from the discovery script's output: end the job (SIGTERM to its process
  group, SIGKILL after ``KILL_GRACE`` s) and relaunch (not a failure).
* any other exit status: a failure; relaunch, at most ``--max-restarts`` times, counting each
  failure against the hosts whose workers recorded one (``--blacklist-after`` in a row blacklists
  the host). The workers restart from the last commit in the state directory.

Before each launch, with fewer than ``--min-np`` usable slots the driver polls discovery for up to
``--start-timeout`` seconds, then stops with an error naming the slots it had. Every restart is one
log line on stderr: ``gradsyncrun: restart N: <cause>; launching <n> ranks on <hosts>``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import hosts as hostlib
from . import launcher, store
from .args import parse_args
from .output import LauncherOutput

KILL_GRACE = 10.0


class DriverError(RuntimeError):
    """The driver stopped without finishing the job; the message says why."""


def log(message: str) -> None:
    """One line of the driver's log, on stderr."""
    print(f"gradsyncrun: {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Outcome:
    """How one launch ended: ``status`` (the launcher's exit status), ``cause`` (a sentence for the
    log), ``failed`` (counts against --max-restarts) and the hosts a recorded failure names."""

    status: int
    cause: str
    failed: bool
    failed_hosts: set[str] = dataclasses.field(default_factory=set)


class Driver:
    """One elastic job: the parsed arguments, the state directory, the blacklist and the counters."""

    def __init__(self, args, state_dir: Path):
        self.args = args
        self.state_dir = state_dir
        self.blacklist = hostlib.Blacklist(args.blacklist_after)
        self.mpiexec = launcher.find_mpiexec(args.mpiexec)
        self.kind = launcher.flavour(self.mpiexec) if args.mpi == "auto" else args.mpi
        self.launcher = launcher.choose(args.launcher, self.kind)
        self.launches = 0
        self.failures = 0
        self.job: subprocess.Popen | None = None
        self.step_name: str | None = None
        self.output: LauncherOutput | None = None

    def known_hosts(self) -> dict[str, int]:
        """Hosts -> slots now: the discovery script's output, or the static -H/--hostfile list."""
        if self.args.host_discovery_script:
            return hostlib.discover(self.args.host_discovery_script, self.args.slots_per_host)
        return self.args.static_hosts

    def wait_for_hosts(self) -> dict[str, int]:
        """Usable hosts with at least --min-np slots, polling for up to --start-timeout seconds.

        Raises:
            DriverError: still fewer than --min-np usable slots after --start-timeout seconds.
        """
        deadline = time.monotonic() + self.args.start_timeout
        while True:
            usable = self.blacklist.usable(self.known_hosts())
            if sum(usable.values()) >= self.args.min_np:
                return usable
            if time.monotonic() >= deadline:
                raise DriverError(
                    f"only {sum(usable.values())} usable slots ({_describe(usable) or 'no hosts'}; "
                    f"blacklisted: {sorted(self.blacklist.banned) or 'none'}) after waiting "
                    f"--start-timeout {self.args.start_timeout:g} s for --min-np {self.args.min_np}")
            time.sleep(self.args.poll_interval)

    def size_for(self, usable: dict[str, int]) -> int:
        """Ranks of the next launch: -np on the first, else all usable slots, capped by --max-np."""
        total = sum(usable.values())
        wanted = self.args.np if self.launches == 0 and self.args.np else total
        return min(wanted, total, self.args.max_np)

    def launch(self, placed: dict[str, int]) -> subprocess.Popen:
        """Start the workers on ``placed`` in a new process group."""
        store.clear_launch_files(self.state_dir)
        if self.launcher == "srun":
            step = f"gradsync-elastic-{os.getpid()}-{self.launches}"
            how = launcher.srun_launch(self.kind, placed, self.args.command, self.state_dir, step)
        else:
            how = launcher.mpiexec_launch(self.mpiexec, self.kind, placed, self.args.command)
        env = dict(os.environ, **how.env, **{store.STATE_DIR_ENV: str(self.state_dir),
                                             store.RESTART_ENV: str(self.launches)})
        store.record_time(self.state_dir, "launched", self.launches)
        self.launches += 1
        self.step_name = how.step_name
        self.job = subprocess.Popen(how.argv, env=env, start_new_session=True, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE)
        self.output = LauncherOutput(self.job)
        return self.job

    def watch(self, job: subprocess.Popen, placed: dict[str, int]) -> Outcome:
        """Wait for ``job``, signalling added hosts and ending it when a host in use is removed."""
        signalled = False
        while True:
            try:
                status = job.wait(timeout=self.args.poll_interval)
                store.record_time(self.state_dir, "ended", self.launches - 1)
                return self.outcome(status, placed)
            except subprocess.TimeoutExpired:
                pass
            if not self.args.host_discovery_script:
                continue
            try:
                usable = self.blacklist.usable(self.known_hosts())
            except hostlib.HostsError as error:  # the job keeps its hosts; the next look may work
                log(f"host discovery failed while the job runs, keeping its hosts: {error}")
                continue
            removed = {h for h, n in placed.items() if usable.get(h, 0) < n}
            if removed:
                _end(job, self.step_name)
                status = job.wait()
                self.output.finish()
                store.record_time(self.state_dir, "ended", self.launches - 1)
                return Outcome(status, f"hosts removed: {sorted(removed)}", failed=False)
            grown = min(sum(usable.values()), self.args.max_np) > sum(placed.values())
            if grown and not signalled:
                log(f"hosts added ({_describe(usable)}): the workers stop at their next commit")
                (self.state_dir / store.HOSTS_UPDATED).write_text(_describe(usable) + "\n")
                signalled = True

    def outcome(self, status: int, placed: dict[str, int]) -> Outcome:
        """What the launcher's exit ``status`` means, with the failures the workers recorded or,
        where none did (a worker killed by a signal), the hosts the launcher's report names."""
        reported = self.output.finish()
        if status == store.EXIT_HOSTS_UPDATED:
            return Outcome(status, "hosts added; the workers stopped at a commit", failed=False)
        records = store.read_failures(self.state_dir)
        cause = f"the job exited with status {status}"
        if records:
            cause += ": " + "; ".join(records)
            return Outcome(status, cause, failed=status != 0, failed_hosts=_hosts_named(records, placed))
        failed_hosts = _placed_among(reported, placed) if status != 0 else set()
        if failed_hosts:
            cause += f" (the launcher reports a failed worker on {', '.join(sorted(reported))})"
        return Outcome(status, cause, failed=status != 0, failed_hosts=failed_hosts)

    def run(self) -> int:
        """Launch until the job finishes (0) or the driver gives up (``DriverError``)."""
        outcome = None
        while True:
            usable = self.wait_for_hosts()
            placed = hostlib.place(usable, self.size_for(usable))
            if outcome is not None:
                log(f"restart {self.launches}: {outcome.cause}; launching {sum(placed.values())} "
                    f"ranks on {_describe(placed)}")
            outcome = self.watch(self.launch(placed), placed)
            if outcome.status == 0:
                self.log_recoveries()
                log(f"the job finished after {self.launches} launch(es)")
                return 0
            if outcome.failed:
                self.count_failure(outcome, placed)

    def log_recoveries(self) -> None:
        """One log line per relaunch: the seconds of each phase from the end of the previous launch
        to the first commit, with rank 0's CPU seconds in its phases
        (:func:`gradsync.run.store.recovery_phases`)."""
        for launch in range(1, self.launches):
            phases = store.recovery_phases(self.state_dir, launch)
            cpu = store.recovery_phases(self.state_dir, launch, clock="cpu")
            parts = [f"{name} {seconds:.2f} s" + (f" (cpu {cpu[name]:.2f} s)" if name in cpu else "")
                     for name, seconds in phases.items()]
            if parts:
                log(f"launch {launch} timing: " + ", ".join(parts))

    def count_failure(self, outcome: Outcome, placed: dict[str, int]) -> None:
        """Count a failed launch; ``DriverError`` naming it once --max-restarts is spent."""
        self.failures += 1
        if self.failures > self.args.max_restarts:
            raise DriverError(f"stopping after --max-restarts {self.args.max_restarts} restarts; "
                              f"last failure: {outcome.cause}")
        for host in self.blacklist.record(outcome.failed_hosts, set(placed)):
            log(f"blacklisting host {host}: its workers failed {self.blacklist.limit} launches in a row")


def _describe(hosts: dict[str, int]) -> str:
    return ",".join(f"{host}:{slots}" for host, slots in hosts.items())


def _hosts_named(records: list[str], placed: dict[str, int]) -> set[str]:
    """The hosts of ``placed`` that failure records name (``rank r on HOST: ...``)."""
    return _placed_among({record.split(" on ", 1)[1].split(":", 1)[0] for record in records
                          if " on " in record}, placed)


def _placed_among(named: set[str], placed: dict[str, int]) -> set[str]:
    """The hosts of ``placed`` among the host names ``named``; a name of this machine counts for
    ``localhost`` when that is what the launch used."""
    node = os.uname().nodename
    local = {node, node.split(".")[0], "localhost", "127.0.0.1"}
    return {host for host in placed if host in named or (host in local and named & local)}


def _end(job: subprocess.Popen, step_name: str | None) -> None:
    """SIGTERM the job's process group; SIGKILL it if it is still there after KILL_GRACE s. An srun
    step (``step_name``) is then cancelled too, in case its srun died before ending it."""
    try:
        os.killpg(job.pid, signal.SIGTERM)
        job.wait(timeout=KILL_GRACE)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if step_name is not None:
        launcher.cancel_step(step_name)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # through main's finally, which ends the running job


def main(argv: list[str] | None = None) -> int:
    """``gradsyncrun`` / ``python -m gradsync.run``: returns the exit status (0, or 1 with a reason)."""
    args = parse_args(argv)
    state_dir = Path(args.state_dir or tempfile.mkdtemp(prefix="gradsync-elastic-"))
    state_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    driver = None
    try:
        driver = Driver(args, state_dir)
        return driver.run()
    except (DriverError, hostlib.HostsError, launcher.LauncherError) as error:
        log(f"error: {error}")
        return 1
    finally:
        if driver is not None and driver.job is not None and driver.job.poll() is None:
            _end(driver.job, driver.step_name)
        if args.state_dir is None:
            shutil.rmtree(state_dir, ignore_errors=True)
