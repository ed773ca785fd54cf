"""Start-up cost: ``import gradsync`` and ``gradsync.init()`` in fresh single-process interpreters.

    python benchmarks/startup.py [--runs 7] [--src DIR ...]

Each run starts a new interpreter that times, with ``time.perf_counter``, ``import gradsync`` and then
``gradsync.init()`` (which imports and initialises MPI, checks the launch, and starts the
coordinator) followed by ``gradsync.shutdown()``. With several ``--src`` checkouts (their ``src/``
directories, default this checkout's), runs alternate between them, and the table gives the
median milliseconds of each and the ratio to the first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PROBE = """
import json, time
t0 = time.perf_counter()
import gradsync
t1 = time.perf_counter()
gradsync.init()
gradsync.shutdown()
t2 = time.perf_counter()
print(json.dumps({"import_ms": (t1 - t0) * 1e3, "init_ms": (t2 - t1) * 1e3}))
"""


def one_run(src: Path) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "OMPI_", "SLURM_"))}
    env.update(PYTHONPATH=str(src), GRADSYNC_LOG_LEVEL="error")
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--src", action="append", type=Path, default=None,
                        help="a checkout's src/ directory (repeat to compare; default: this one)")
    args = parser.parse_args()
    sources = args.src or [Path(__file__).resolve().parent.parent / "src"]
    results: dict[Path, list[dict[str, float]]] = {src: [] for src in sources}
    one_run(sources[0])  # warm the file cache
    for _ in range(args.runs):
        for src in sources:
            results[src].append(one_run(src))
    first = None
    print(f"{'src':50s} {'import ms':>10s} {'init ms':>10s} {'import x':>9s} {'init x':>7s}")
    for src, runs in results.items():
        medians = [statistics.median(r[key] for r in runs) for key in ("import_ms", "init_ms")]
        first = first or medians
        print(f"{str(src):50s} {medians[0]:10.1f} {medians[1]:10.1f} {medians[0] / first[0]:9.2f} "
              f"{medians[1] / first[1]:7.2f}")
    print(f"medians of {args.runs} fresh interpreters each, runs interleaved")


if __name__ == "__main__":
    main()
