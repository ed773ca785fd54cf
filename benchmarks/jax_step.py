"""JAX training-step time: one process vs gradsync.jax on N ranks, on the model of
examples/train_digits_jax.py (Linear(64, 128) + ReLU + Linear(128, 10), SGD with momentum).

Run one configuration per launch (the driver below interleaves them):

    python benchmarks/jax_step.py --mode single [--update jit|host]
    python benchmarks/jax_step.py --mode callback        # one process, an identity io_callback
    mpiexec -n 2 python benchmarks/jax_step.py --mode gradsync [--update jit|host]

or all of them, interleaved, with a table at the end (and its numbers in a CSV file):

    python benchmarks/jax_step.py --compare --ranks 2 --repeats 3 [--batch 32] [--csv PATH]

A step is the example's: gradients, the optimizer's update and the parameter update, ending with
``jax.block_until_ready`` on the parameters. ``--update jit`` runs all of it in one ``jax.jit``
(gradsync's allreduce then runs in an ordered io_callback); ``--update host`` jits the gradients and
the parameter update and calls the optimizer's update between them, outside jit (the update itself
compiled, as DistributedOptimizer compiles the update it wraps). ``single`` uses plain optax; ``callback`` adds to the jitted step an ordered ``io_callback`` that returns the
gradients unchanged, which is the cost of leaving the compiled program once per step, whatever the
callback does. Batch ``--batch`` per rank (default 32, the example's), random inputs. Prints the
median step time in microseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))


def identity_callback_tx(tx):
    """``tx`` whose update first sends the gradients through an identity ordered io_callback."""
    import jax
    import numpy as np
    import optax
    from jax.experimental import io_callback

    def update(grads, state, params=None):
        leaves, tree = jax.tree_util.tree_flatten(grads)
        shapes = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]
        leaves = io_callback(lambda *a: [np.asarray(v) for v in a], shapes, *leaves, ordered=True)
        return tx.update(jax.tree_util.tree_unflatten(tree, leaves), state, params)

    return optax.GradientTransformation(tx.init, update)


def measure(mode: str, update: str, steps: int, warmup: int, batch: int) -> None:
    import jax
    import numpy as np
    import optax
    import train_digits_jax as example

    tx = optax.sgd(0.05, momentum=0.9)
    tx = optax.GradientTransformation(tx.init, jax.jit(tx.update))  # as DistributedOptimizer runs it
    rank = 0
    if mode == "gradsync":
        import gradsync
        import gradsync.jax

        gradsync.init()
        rank = gradsync.rank()
        tx = gradsync.jax.DistributedOptimizer(tx)
    elif mode == "callback":
        tx = identity_callback_tx(tx)
    params = example.init_params(jax.random.key(0))
    state = tx.init(params)
    step = example.make_train_step(tx, update)
    rng = np.random.default_rng(rank)
    x = rng.random((batch, 64), dtype=np.float32)
    y = rng.integers(0, example.CLASSES, batch).astype(np.int32)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        params, state, loss, _ = step(params, state, x, y)
        jax.block_until_ready(params)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    if rank == 0:
        print(f"median_step_us={statistics.median(times) * 1e6:.1f}", flush=True)


CONFIGS = [  # (label, mode, update, parallel)
    ("single, update in jit", "single", "jit", False),
    ("single + identity io_callback", "callback", "jit", False),
    ("gradsync, update in jit", "gradsync", "jit", True),
    ("single, update on host", "single", "host", False),
    ("gradsync, update on host", "gradsync", "host", True),
]
BASELINE = {"jit": "single, update in jit", "host": "single, update on host"}


def compare(ranks: int, repeats: int, steps: int, batch: int, csv_path: str | None) -> None:
    """Launch every configuration ``repeats`` times, interleaved, and print a table of medians."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    results: dict[str, list[float]] = {label: [] for label, *_ in CONFIGS}
    for _ in range(repeats):
        for label, mode, update, parallel in CONFIGS:
            cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--update", update,
                   "--steps", str(steps), "--batch", str(batch)]
            if parallel:
                cmd = [mpiexec, "-n", str(ranks), *cmd]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
            line = [x for x in out.stdout.splitlines() if x.startswith("median_step_us=")]
            if not line:
                raise SystemExit(f"{label} failed:\n{out.stdout}\n{out.stderr}")
            results[label].append(float(line[0].split("=")[1]))
    print(f"\nexamples/train_digits_jax.py model, batch {batch} per rank, {ranks} ranks for gradsync, "
          f"median of {repeats} launches x {steps} steps")
    print(f"{'configuration':32s} {'step us':>9s} {'vs single':>9s}   each launch, us")
    rows = []
    for label, mode, update, _ in CONFIGS:
        median = statistics.median(results[label])
        ratio = median / statistics.median(results[BASELINE[update]])
        launches = " ".join(f"{v:.1f}" for v in results[label])
        print(f"{label:32s} {median:9.1f} {ratio:9.2f}   {launches}")
        rows.append({"configuration": label, "ranks": ranks if mode == "gradsync" else 1,
                     "batch": batch, "step_us": round(median, 1), "vs_single": round(ratio, 3),
                     "launches": launches})
    if csv_path:
        import benchenv

        benchenv.write_csv(csv_path, rows, benchenv.environment(ranks, env))
        print(f"# wrote {csv_path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["single", "callback", "gradsync"], default="gradsync")
    parser.add_argument("--update", choices=["jit", "host"], default="jit")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--compare", action="store_true", help="run every configuration")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--csv", type=str, default=None, help="--compare: also write the table here")
    args = parser.parse_args()
    if args.compare:
        compare(args.ranks, args.repeats, args.steps, args.batch, args.csv)
    else:
        measure(args.mode, args.update, args.steps, args.warmup, args.batch)


if __name__ == "__main__":
    main()
