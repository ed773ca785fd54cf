"""What gradsync adds to a step past the last rank's backward, from the ranks' timelines.

With N ranks on N cores a step's time is mostly the slowest rank's compute and the ranks' waiting
for each other (the lockstep floor of ``train_step.py``), which moves by 25 % and more from one
launch to the next on a shared machine. The part gradsync itself puts on the critical path is
steadier: from the moment the *last* rank's last gradient hook has run (the end of its BACKWARD
span) to the moment the last rank's last collective of that round has finished. This script
launches ``train_step.py --mode gradsync`` with a timeline per rank
(``GRADSYNC_TIMELINE='.../tl.{rank}.json'``), for one or more source trees, interleaved, and prints
that time per step: median, mean, 10th and 90th percentiles, in milliseconds.

    python benchmarks/critical_path.py --model transformer --repeats 4 --steps 30 \\
        --src before=/path/to/main/src --src after=src

The round's end is the end of the last timeline event (ALLREDUCE, MEMCPY_OUT_FUSION_BUFFER, ...)
that finishes after the rank's BACKWARD span and before its next one starts; the copy of a bucket's
result back into ``p.grad`` is not in the timeline and is not counted. The first ``--skip`` steps
(warm-up, the first round's model check) and the last one (no next BACKWARD) are left out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

from train_step import source_trees

from gradsync.timeline import load

HERE = os.path.dirname(os.path.abspath(__file__))


def spans(events: list[dict]) -> tuple[list[tuple[float, float]], list[float]]:
    """(start, end) of each BACKWARD span in order, and the end of every other span, in µs."""
    backward = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                      if e.get("ph") == "X" and e["name"] == "BACKWARD")
    others = sorted(e["ts"] + e["dur"] for e in events if e.get("ph") == "X" and e["name"] != "BACKWARD")
    return backward, others


def round_ends(backward: list[tuple[float, float]], others: list[float]) -> list[float | None]:
    """Per step but the last: the end of the last span between this BACKWARD's end and the next
    BACKWARD's start (None if there is none)."""
    ends = []
    for (_, end), (next_start, _) in zip(backward, backward[1:]):
        inside = [t for t in others if end < t <= next_start]
        ends.append(max(inside) if inside else None)
    return ends


def critical_path_ms(paths: list[str], skip: int) -> list[float]:
    """Per step: last rank's round end minus last rank's backward end, in ms."""
    per_rank = [spans(load(p)) for p in paths]
    backward_ends = [[end for _, end in backward] for backward, _ in per_rank]
    ends = [round_ends(backward, others) for backward, others in per_rank]
    steps = min(len(e) for e in ends)
    result = []
    for step in range(skip, steps):
        finished = [e[step] for e in ends]
        if None in finished:
            continue
        result.append((max(finished) - max(b[step] for b in backward_ends)) / 1e3)
    return result


def launch(ranks: int, model: str, steps: int, src: str | None, flags: list[str],
           directory: str) -> list[str]:
    """One ``train_step.py --mode gradsync`` job (with ``flags``) writing a timeline per rank;
    their paths."""
    pattern = os.path.join(directory, "tl.{rank}.json")
    env = dict(os.environ, OMP_NUM_THREADS="1", GRADSYNC_TIMELINE=pattern)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    subprocess.run([mpiexec, "-n", str(ranks), sys.executable, os.path.join(HERE, "train_step.py"),
                    "--mode", "gradsync", "--model", model, "--steps", str(steps), *flags],
                   env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=600)
    return [pattern.format(rank=r) for r in range(ranks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer", choices=["mlp", "cnn", "transformer", "tensors"])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--skip", type=int, default=5, help="steps left out at the start")
    parser.add_argument("--src", action="append", default=[], metavar="LABEL=PATH[:FLAGS]",
                        help="a src/ tree to run first on PYTHONPATH (and train_step.py FLAGS), as "
                             "train_step.py's --src; repeat to compare versions")
    args = parser.parse_args()
    trees = [(label or "gradsync", src, flags) for label, src, flags in source_trees(args.src)]
    results: dict[str, list[float]] = {label: [] for label, _, _ in trees}
    for _ in range(args.repeats):
        for label, src, flags in trees:
            with tempfile.TemporaryDirectory() as directory:
                results[label] += critical_path_ms(
                    launch(args.ranks, args.model, args.steps, src, flags, directory), args.skip)
    print(f"{args.model}, {args.ranks} ranks, {args.repeats} launches x {args.steps} steps: ms from the "
          "last rank's backward end to the last rank's round end")
    print(f"{'tree':12s} {'steps':>6s} {'median':>7s} {'mean':>7s} {'p10':>7s} {'p90':>7s}")
    for label, values in results.items():
        deciles = statistics.quantiles(values, n=10, method="inclusive")
        print(f"{label:12s} {len(values):6d} {statistics.median(values):7.2f} "
              f"{statistics.mean(values):7.2f} {deciles[0]:7.2f} {deciles[-1]:7.2f}")


if __name__ == "__main__":
    main()
