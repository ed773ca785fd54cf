"""Hosts and slots for the elastic driver: parsing, discovery, blacklisting, picking the job's size.

Host lists follow ``horovodrun``: ``-H host1:2,host2:4`` (a host without ``:slots`` gets
``--slots-per-host``), a hostfile with one ``host slots=N`` or ``host:N`` per line (``#`` starts a
comment), or a discovery script whose standard output lists the hosts available now, one
``host`` or ``host:slots`` per line, as Horovod's ``--host-discovery-script``.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess

_HOSTFILE_LINE = re.compile(r"^(?P<host>[^\s:]+)(?::(?P<colon>\d+))?(?:\s+slots\s*=\s*(?P<slots>\d+))?\s*$")


class HostsError(ValueError):
    """A host list, hostfile line or discovery output that cannot be read."""


def parse_host(entry: str, slots_per_host: int) -> tuple[str, int]:
    """``"host"`` or ``"host:slots"`` -> ``(host, slots)``; ``HostsError`` naming ``entry`` otherwise."""
    match = _HOSTFILE_LINE.match(entry.strip())
    if not match or not match["host"]:
        raise HostsError(f"cannot read host entry {entry!r}: expected 'host', 'host:slots' or "
                         "'host slots=N'")
    slots = match["colon"] or match["slots"]
    count = int(slots) if slots else slots_per_host
    if count < 1:
        raise HostsError(f"host entry {entry!r} has {count} slots; a host needs at least 1")
    return match["host"], count


def parse_hosts(text: str, slots_per_host: int, separator: str | None = None) -> dict[str, int]:
    """Hosts of ``text`` (comma-separated with ``separator=","``, else one per line) -> slots.

    Blank lines and ``#`` comments are skipped; a host listed twice gets the slots of both entries.
    """
    entries = text.split(separator) if separator else text.splitlines()
    hosts: dict[str, int] = {}
    for entry in entries:
        entry = entry.split("#", 1)[0].strip()
        if entry:
            host, slots = parse_host(entry, slots_per_host)
            hosts[host] = hosts.get(host, 0) + slots
    return hosts


def discover(script: str, slots_per_host: int, timeout: float = 30.0) -> dict[str, int]:
    """Run the discovery ``script`` (through the shell) and read the hosts it prints.

    Raises:
        HostsError: the script exited non-zero or ran past ``timeout`` seconds (its stderr is
            quoted), or printed a line that is not a host entry.
    """
    try:
        done = subprocess.run(script, shell=True, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as error:
        raise HostsError(f"host discovery script {script!r} ran past {timeout:.0f} s") from error
    if done.returncode != 0:
        raise HostsError(f"host discovery script {script!r} exited with {done.returncode}: "
                         f"{done.stderr.strip()[-500:]}")
    return parse_hosts(done.stdout, slots_per_host)


@dataclasses.dataclass
class Blacklist:
    """Hosts that failed ``limit`` launches in a row are left out of every later launch (Horovod's
    blacklist, without its cool-down). A launch that ends without naming a host counts for none."""

    limit: int
    failures: dict[str, int] = dataclasses.field(default_factory=dict)
    banned: set[str] = dataclasses.field(default_factory=set)

    def record(self, failed_hosts: set[str], used_hosts: set[str]) -> list[str]:
        """Count a failed launch on ``used_hosts`` whose failing workers ran on ``failed_hosts``.

        Returns the hosts newly blacklisted by it. A used host that did not fail starts over at 0.
        """
        newly = []
        for host in used_hosts:
            self.failures[host] = self.failures.get(host, 0) + 1 if host in failed_hosts else 0
            if self.failures[host] >= self.limit and host not in self.banned:
                self.banned.add(host)
                newly.append(host)
        return newly

    def usable(self, hosts: dict[str, int]) -> dict[str, int]:
        """``hosts`` minus the blacklisted ones."""
        return {host: slots for host, slots in hosts.items() if host not in self.banned}


def place(hosts: dict[str, int], max_np: int) -> dict[str, int]:
    """Slots to use on each host for a job of ``min(total slots, max_np)`` ranks, filling hosts in
    order (the first hosts full, as mpiexec's block placement does)."""
    placed: dict[str, int] = {}
    left = max_np
    for host, slots in hosts.items():
        if left <= 0:
            break
        placed[host] = min(slots, left)
        left -= placed[host]
    return placed
