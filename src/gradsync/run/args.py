"""The elastic driver's command line: ``horovodrun``'s flags where they fit, then the command."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from .hosts import HostsError, parse_hosts


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``gradsyncrun`` / ``python -m gradsync.run``."""
    p = argparse.ArgumentParser(
        prog="gradsyncrun", description="Run a gradsync job elastically: relaunch it through mpiexec or "
        "srun on the hosts available when a worker fails or hosts change; the workers resume from the last "
        "commit (docs/elastic.md).")
    p.add_argument("-np", "--num-proc", dest="np", type=int, help="ranks of the first launch "
                   "(default: all usable slots up to --max-np)")
    p.add_argument("--min-np", type=int, help="fewest ranks to run on (default: -np, else 1)")
    p.add_argument("--max-np", type=int, help="most ranks to run on (default: -np without a discovery "
                   "script, else unlimited)")
    p.add_argument("-H", "--hosts", help="host1:slots,host2:slots (default: localhost with -np slots)")
    p.add_argument("--hostfile", type=Path, help="one 'host slots=N' or 'host:N' per line")
    p.add_argument("--host-discovery-script", help="prints the hosts available now, 'host[:slots]' per line")
    p.add_argument("--slots-per-host", "--slots", type=int, default=1,
                   help="slots of a host listed without them (default 1)")
    p.add_argument("--max-restarts", "--reset-limit", type=int, default=3,
                   help="failed launches to restart after before giving up (default 3)")
    p.add_argument("--start-timeout", type=float, default=30.0,
                   help="seconds to wait for --min-np usable slots before giving up (default 30)")
    p.add_argument("--blacklist-after", type=int, default=2,
                   help="failed launches in a row after which a host is left out (default 2)")
    p.add_argument("--mpi", choices=("auto", "mpich", "openmpi"), default="auto",
                   help="the MPI whose launcher syntax to use (default: ask mpiexec --version)")
    p.add_argument("--launcher", choices=("auto", "srun", "mpiexec"), default="auto",
                   help="start each launch as an srun job step or through mpiexec (default: srun "
                   "inside a SLURM allocation whose srun has the MPI's plugin, else mpiexec)")
    p.add_argument("--mpiexec", help="the launcher (default: the mpiexec beside this Python, else on PATH)")
    p.add_argument("--state-dir", help="where committed state lives, shared by the hosts' rank 0 "
                   "(default: a temporary directory, removed at the end)")
    p.add_argument("--poll-interval", type=float, default=1.0,
                   help="seconds between looks at the job and at discovery (default 1)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the training command")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and complete ``argv``: min/max np, the static host list; errors exit with status 2."""
    p = parser()
    args = p.parse_args(argv)
    if not args.command:
        p.error("no command to run")
    if not args.host_discovery_script and not (args.np or args.hosts or args.hostfile):
        p.error("give -np, -H/--hosts, --hostfile or --host-discovery-script")
    try:
        args.static_hosts = _static_hosts(args)
    except (HostsError, OSError) as error:
        p.error(str(error))
    args.min_np = args.min_np or args.np or 1
    default_max = math.inf if args.host_discovery_script else (args.np or sum(args.static_hosts.values()))
    args.max_np = args.max_np or default_max
    if args.min_np > args.max_np:
        p.error(f"--min-np {args.min_np} is above --max-np {args.max_np}")
    return args


def _static_hosts(args: argparse.Namespace) -> dict[str, int]:
    if args.hosts:
        return parse_hosts(args.hosts, args.slots_per_host, separator=",")
    if args.hostfile:
        return parse_hosts(args.hostfile.read_text(), args.slots_per_host)
    return {"localhost": args.np or 1}
