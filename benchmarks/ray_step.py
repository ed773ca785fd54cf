"""Training-step time under gradsync's RayExecutor beside the same job under mpiexec (docs/ray.md).

The same function trains a model of benchmarks/train_step.py (``--model``, default mlp: 24 x
Linear(768, 768), 14.2 M parameters; batch 32 per rank, SGD with momentum, torch.set_num_threads(1))
with gradsync.DistributedOptimizer for ``--warmup`` + ``--steps`` steps and returns its median step
time. Each repeat runs it once under ``mpiexec -n N`` and once through ``RayExecutor.run`` on N
Ray workers (an executor started for the repeat), alternating, so that the machine's drift falls on
both alike; both start fresh processes, so both warm up alike. Prints each repeat's medians (rank 0's), the
median over repeats, and the ratio RayExecutor / mpiexec.

    python benchmarks/ray_step.py [--ranks 2] [--repeats 5] [--steps 30] [--model mlp]

Ray runs on this machine as one node (``ray.init(address="local")``): the ranks share memory as
under mpiexec, so the two jobs move the same bytes the same way. Its workers get the launcher's
priority too (``RAY_worker_niceness=0``; Ray's default, 15, would lower theirs: ``--ray-niceness``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import train_step

#: The environment of every rank, under mpiexec and on Ray alike (Ray sets OMP_NUM_THREADS itself).
RANK_ENV = {"OMP_NUM_THREADS": "1"}


def median_step_ms(model_kind: str, warmup: int, steps: int) -> tuple[float, float, int]:
    """Train ``build_model(model_kind)`` on this rank for ``warmup + steps`` steps; the median of
    the last ``steps`` step times and this process's CPU time per step over them (every thread:
    Ray's own included), in milliseconds, and the process's nice value."""
    import time

    import torch

    import gradsync

    torch.set_num_threads(1)
    torch.manual_seed(0)
    gradsync.init()
    model = train_step.build_model(model_kind)
    optimizer = gradsync.DistributedOptimizer(train_step.make_optimizer("sgd", model),
                                              named_parameters=model.named_parameters())
    gradsync.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = train_step.sample_batch(model_kind)
    times = []
    for step in range(warmup + steps):
        if step == warmup:
            cpu = time.process_time()
        start = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:]) * 1e3, (time.process_time() - cpu) / steps * 1e3, os.nice(0)


def on_ray(ranks: int, model: str, warmup: int, steps: int) -> tuple[float, float, int]:
    """One repeat through a RayExecutor started for it (fresh processes, as mpiexec's)."""
    from gradsync.ray import RayExecutor

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=ranks)
    executor.start(extra_env_vars=RANK_ENV)
    try:
        return tuple(executor.run(median_step_ms, args=[model, warmup, steps])[0])
    finally:
        executor.shutdown()


def under_mpiexec(ranks: int, model: str, warmup: int, steps: int) -> tuple[float, float, int]:
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    done = subprocess.run([mpiexec, "-n", str(ranks), sys.executable, __file__, "--worker",
                           json.dumps([model, warmup, steps])], capture_output=True, text=True,
                          timeout=600, check=True, env=dict(os.environ, **RANK_ENV))
    return tuple(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--model", choices=sorted(train_step.SAMPLE_SHAPES), default="mlp")
    parser.add_argument("--ray-niceness", type=int, default=0,
                        help="Ray's worker_niceness (Ray's default is 15: lower priority than mpiexec's ranks)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one mpiexec rank: JSON arguments
    args = parser.parse_args()
    if args.worker:
        result = median_step_ms(*json.loads(args.worker))
        import gradsync

        if gradsync.rank() == 0:
            print(json.dumps(result), flush=True)
        return

    import ray

    # Ray runs its workers 15 nice levels below the raylet (RAY_worker_niceness) unless told
    # otherwise; mpiexec's ranks keep the launcher's. The same priority for both, unless --ray-niceness.
    os.environ.setdefault("RAY_worker_niceness", str(args.ray_niceness))
    ray.init(address="local", num_cpus=args.ranks, include_dashboard=False, logging_level="warning")
    ray.cloudpickle.register_pickle_by_value(train_step)
    results: dict[str, list[tuple[float, float, int]]] = {"mpiexec": [], "RayExecutor": []}
    try:
        for repeat in range(args.repeats):
            results["mpiexec"].append(under_mpiexec(args.ranks, args.model, args.warmup, args.steps))
            results["RayExecutor"].append(on_ray(args.ranks, args.model, args.warmup, args.steps))
            print(f"repeat {repeat + 1}: step ms (CPU ms) mpiexec {results['mpiexec'][-1][0]:.1f} "
                  f"({results['mpiexec'][-1][1]:.1f}), RayExecutor {results['RayExecutor'][-1][0]:.1f} "
                  f"({results['RayExecutor'][-1][1]:.1f})", flush=True)
    finally:
        ray.shutdown()
    report(args, results)


def report(args: argparse.Namespace, results: dict[str, list[tuple[float, float, int]]]) -> None:
    """Medians over the repeats, their ratio, and the median of each repeat's ratio (paired: the
    two runs of a repeat are next to each other in time)."""
    print(f"\n{args.model}, {args.ranks} ranks, batch {train_step.BATCH} per rank, {args.repeats} "
          f"repeats x {args.steps} steps after {args.warmup}, 1 torch thread per rank, nice "
          f"{results['mpiexec'][0][2]} under mpiexec and {results['RayExecutor'][0][2]} on Ray")
    for column, what in ((0, "step ms"), (1, "CPU ms per step, rank 0")):
        mpi, on_ray = (statistics.median(r[column] for r in results[name])
                       for name in ("mpiexec", "RayExecutor"))
        paired = statistics.median(r[column] / m[column]
                                   for r, m in zip(results["RayExecutor"], results["mpiexec"]))
        print(f"{what}: mpiexec median {mpi:.1f}, RayExecutor median {on_ray:.1f}, ratio "
              f"{on_ray / mpi:.3f}, median of paired ratios {paired:.3f}")


if __name__ == "__main__":
    main()
