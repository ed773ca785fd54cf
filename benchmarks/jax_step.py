"""JAX training-step time: one process, the floor of N at once, gradsync.jax, mpi4jax and jax's own
multi-process collectives (jax.distributed with gloo), on the same jitted MLP step.

Models (``--model``): ``digits``, the MLP of examples/train_digits_jax.py (64-128-10, 9.5 k
parameters, default batch 32 per rank), and ``wide``, 784-1024-1024-10 (1.86 M parameters, 7.4 MB of
float32 gradients, default batch 256 per rank). A step computes the gradients, averages them across
ranks, runs SGD with momentum and applies the update, ending with ``jax.block_until_ready``. Every
process runs XLA on one thread (``XLA_FLAGS`` below), one process per core.

All configurations, interleaved, with a table of medians at the end (and a CSV file):

    python benchmarks/jax_step.py --compare --model wide --ranks 2 --repeats 2 [--csv PATH]

One configuration per launch:

    python benchmarks/jax_step.py --mode single --model wide
    mpiexec -n 2 python benchmarks/jax_step.py --mode gradsync --update jit|host --model wide
    mpiexec -n 2 python benchmarks/jax_step.py --mode mpi4jax --model wide     # if installed
    mpiexec -n 2 python benchmarks/jax_step.py --mode gloo --model wide        # jax.distributed

``--update jit`` compiles the whole step (gradsync's allreduce then runs as an in-place XLA custom
call); ``--update host`` compiles the gradients and the parameter update and calls the optimizer's
update between them, outside jit. ``mpi4jax`` calls ``mpi4jax.allreduce`` (Sum) on each gradient
leaf inside the jitted step and divides by the number of ranks; ``gloo`` runs the step in
``jax.shard_map`` over one CPU device per process with ``lax.pmean`` of the gradients
(``jax_cpu_collectives_implementation=gloo``). The floor is ``--ranks`` single processes started at
the same time: the cores share memory bandwidth, so that, not one process alone, is the best an
N-rank step can do on one machine. The row "MPI_Allreduce only" is gradsync with its shared-memory
allreduce off (``GRADSYNC_SHARED_MEMORY_BYTES=0``, docs/configuration.md#shared-memory-allreduce).
``--baseline-src DIR`` adds the in-jit gradsync rows again with the gradsync package of ``DIR``
(another version's ``src``) first on ``PYTHONPATH``: before and after, interleaved in one run. Each
gradsync launch also prints where its step's time goes (benchmarks/breakdown.py), summed up in a
second table.
Prints the median step time in microseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# The same gradsync row with the shared-memory allreduce off (GRADSYNC_SHARED_MEMORY_BYTES=0).
MPI_ONLY = "MPI_Allreduce only"
XLA_ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
MODELS = {"digits": ((64, 128, 10), 32), "wide": ((784, 1024, 1024, 10), 256)}  # sizes, batch


def init_params(sizes, key):
    """One {"w", "b"} per layer, initialised as torch.nn.Linear does."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    layers = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        key, k_w, k_b = jax.random.split(key, 3)
        bound = 1.0 / np.sqrt(fan_in)
        layers.append({"w": jax.random.uniform(k_w, (fan_in, fan_out), jnp.float32, -bound, bound),
                       "b": jax.random.uniform(k_b, (fan_out,), jnp.float32, -bound, bound)})
    return layers


def loss_fn(params, x, y):
    """Mean cross-entropy of the ReLU MLP ``params`` on the batch."""
    import jax
    import optax

    h = x
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    logits = h @ params[-1]["w"] + params[-1]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def mpi4jax_tx(tx):
    """``tx`` whose update first averages the gradients with ``mpi4jax.allreduce`` (inside jit)."""
    import jax
    import mpi4jax
    import optax
    from mpi4py import MPI

    size = MPI.COMM_WORLD.Get_size()

    def average(g):
        out = mpi4jax.allreduce(g, op=MPI.SUM, comm=MPI.COMM_WORLD)
        return (out[0] if isinstance(out, tuple) else out) / size  # mpi4jax < 0.5 returns a token too

    def update(grads, state, params=None):
        return tx.update(jax.tree_util.tree_map(average, grads), state, params)

    return optax.GradientTransformation(tx.init, update)


def make_step(tx, update: str):
    """``step(params, state, x, y) -> (params, state)``; see the module docstring."""
    import jax
    import optax

    def whole(params, state, x, y):
        updates, state = tx.update(jax.grad(loss_fn)(params, x, y), state, params)
        return optax.apply_updates(params, updates), state

    if update == "jit":
        return jax.jit(whole)
    grad, apply = jax.jit(jax.grad(loss_fn)), jax.jit(optax.apply_updates)

    def host(params, state, x, y):
        updates, state = tx.update(grad(params, x, y), state, params)
        return apply(params, updates), state

    return host


def launcher_rank() -> tuple[int, int]:
    """(rank, size) from the MPI launcher's environment (MPICH/Hydra, Open MPI), without MPI."""
    for rank, size in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank in os.environ:
            return int(os.environ[rank]), int(os.environ[size])
    return 0, 1


def gloo_step(tx, sizes, batch):
    """The step in shard_map over one CPU device per process, gradients averaged with pmean; its
    inputs as global arrays. Returns (step, params, state, x, y)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rank, size = launcher_rank()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{int(os.environ.get('GLOO_PORT', '12734'))}", size, rank)
    mesh = jax.make_mesh((size,), ("d",))

    def local(params, state, x, y):
        grads = jax.lax.pmean(jax.grad(loss_fn)(params, x, y), "d")
        updates, state = tx.update(grads, state, params)
        import optax

        return optax.apply_updates(params, updates), state

    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
    params = init_params(sizes, jax.random.key(0))
    state = tx.init(params)
    as_global = lambda a, sharding: jax.make_array_from_process_local_data(sharding, np.asarray(a))  # noqa: E731
    params, state = jax.tree_util.tree_map(lambda a: as_global(a, replicated), (params, state))
    x, y = batch_for(rank, sizes, batch)
    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("d"), P("d")),
                                 out_specs=(P(), P())))
    return step, params, state, as_global(x, split), as_global(y, split)


def batch_for(rank: int, sizes, batch: int):
    import numpy as np

    rng = np.random.default_rng(rank)
    return (rng.random((batch, sizes[0]), dtype=np.float32),
            rng.integers(0, sizes[-1], batch).astype(np.int32))


def setup(mode: str, update: str, sizes, batch: int):
    """(step, params, state, x, y, rank) for one configuration."""
    import jax
    import optax

    tx = optax.sgd(0.05, momentum=0.9)
    tx = optax.GradientTransformation(tx.init, jax.jit(tx.update))  # as DistributedOptimizer runs it
    if mode == "gloo":
        return (*gloo_step(tx, sizes, batch), launcher_rank()[0])
    rank = 0
    if mode == "gradsync":
        import gradsync
        import gradsync.jax

        gradsync.init()
        rank = gradsync.rank()
        tx = gradsync.jax.DistributedOptimizer(tx)
    elif mode == "mpi4jax":
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
        tx = mpi4jax_tx(tx)
    params = init_params(sizes, jax.random.key(0))
    return (make_step(tx, update), params, tx.init(params), *batch_for(rank, sizes, batch), rank)


def measure(mode: str, update: str, model: str, steps: int, warmup: int, batch: int) -> None:
    import jax

    sys.path.insert(0, HERE)
    import benchenv
    import breakdown

    sizes = MODELS[model][0]
    if mode == "gradsync":  # before the step is traced
        breakdown.install("jax")
    step, params, state, x, y, rank = setup(mode, update, sizes, batch)

    def one_step() -> None:
        nonlocal params, state
        params, state = step(params, state, x, y)
        jax.block_until_ready(params)

    benchenv.print_step_medians(breakdown.per_step(one_step), steps, warmup, rank)
    if mode == "gradsync" and rank == 0:
        print(breakdown.line(steps), flush=True)


def configs(ranks: int, baseline: bool = False) -> list[tuple[str, str, str, int, str]]:
    """(label, mode, update, processes, what it is compared with); mpi4jax only if installed; with
    ``baseline``, the in-jit gradsync rows again with the baseline's gradsync (``--baseline-src``)."""
    rows = [("one process alone", "single", "jit", 1, ""),
            (f"{ranks} single processes at once (floor)", "single", "jit", -ranks, ""),
            ("gradsync, in jit, 1 rank", "gradsync", "jit", 1, "alone"),
            (f"gradsync, in jit, {ranks} ranks", "gradsync", "jit", ranks, "floor"),
            (f"gradsync, in jit, {ranks} ranks, {MPI_ONLY}", "gradsync", "jit", ranks, "floor"),
            ("gradsync, update on host, 1 rank", "gradsync", "host", 1, "alone"),
            (f"gradsync, update on host, {ranks} ranks", "gradsync", "host", ranks, "floor"),
            (f"jax.distributed gloo pmean, {ranks} ranks", "gloo", "jit", ranks, "floor")]
    if baseline:
        sys.path.insert(0, HERE)
        import benchenv

        rows[3:3] = [(f"gradsync, in jit, 1 rank, {benchenv.BASELINE}", "gradsync", "jit", 1, "alone"),
                     (f"gradsync, in jit, {ranks} ranks, {benchenv.BASELINE}", "gradsync", "jit", ranks,
                      "floor")]
    try:
        import mpi4jax  # noqa: F401
    except ImportError:
        print("# mpi4jax is not installed: its row is left out", flush=True)
    else:
        rows.append((f"mpi4jax allreduce in jit, {ranks} ranks", "mpi4jax", "jit", ranks, "floor"))
    return rows


def launch(mode: str, update: str, processes: int, args, env: dict,
           parts: dict[str, float] | None = None) -> tuple[float, float]:
    """The median step and its CPU time (us, rank 0's process, all its threads) of one
    configuration; ``processes < 0``: that many single processes at once, their means. ``parts``
    receives gradsync's per-step breakdown (benchmarks/breakdown.py)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--update", update, "--model",
           args.model, "--steps", str(args.steps), "--batch", str(args.batch)]
    sys.path.insert(0, HERE)
    import benchenv

    return benchenv.launch_measured(cmd, processes, env, parts)


def compare(args) -> None:
    """Launch every configuration ``args.repeats`` times, interleaved; print a table of medians."""
    env = dict(os.environ, OMP_NUM_THREADS="1", XLA_FLAGS=XLA_ONE_THREAD)
    rows = configs(args.ranks, bool(args.baseline_src))
    sys.path.insert(0, HERE)
    import benchenv
    results: dict[str, list[float]] = {label: [] for label, *_ in rows}
    cpu: dict[str, list[float]] = {label: [] for label, *_ in rows}
    parts: dict[str, list[dict[str, float]]] = {label: [] for label, *_ in rows}
    for repeat in range(args.repeats):
        for label, mode, update, processes, _ in rows:
            env["GLOO_PORT"] = str(12734 + repeat)
            launch_env = dict(env, GRADSYNC_SHARED_MEMORY_BYTES="0") if MPI_ONLY in label else env
            launch_env = benchenv.with_baseline(launch_env, label, args.baseline_src)
            launch_parts: dict[str, float] = {}
            step, step_cpu = launch(mode, update, processes, args, launch_env, launch_parts)
            results[label].append(step)
            cpu[label].append(step_cpu)
            if launch_parts:
                parts[label].append(launch_parts)
    print(f"\n{args.model} MLP, batch {args.batch} per rank, XLA on one thread per process, median of "
          f"{args.repeats} launches x {args.steps} steps; load average {os.getloadavg()[0]:.1f}")
    print(f"{'configuration':48s} {'step ms':>8s} {'ratio':>12s} {'CPU ms':>7s} {'ratio':>12s}   "
          "each launch, ms")
    table = []
    for label, *_, against in rows:
        row = {"configuration": label, "model": args.model, "batch": args.batch}
        for what, values in (("step", results), ("cpu", cpu)):
            median = {key: statistics.median(v) for key, v in values.items()}
            base = {"alone": median[rows[0][0]], "floor": median[rows[1][0]]}
            row[f"{what}_ms"] = round(median[label] / 1e3, 2)
            row[f"{what}_ratio"] = f"{median[label] / base[against]:.2f}x {against}" if against else ""
        row["launches"] = " ".join(f"{v / 1e3:.2f}" for v in results[label])
        print(f"{label:48s} {row['step_ms']:8.2f} {row['step_ratio']:>12s} {row['cpu_ms']:7.2f} "
              f"{row['cpu_ratio']:>12s}   {row['launches']}")
        table.append(row)
    base = {"alone": rows[0][0], "floor": rows[1][0]}
    sys.path.insert(0, HERE)
    import breakdown

    breakdown.table([(label, results[label], results[base[against]], parts[label])
                     for label, mode, *_, against in rows if mode == "gradsync"])
    if args.csv:
        sys.path.insert(0, HERE)
        import benchenv

        benchenv.write_csv(args.csv, table, benchenv.environment(args.ranks, env))
        print(f"# wrote {args.csv}")


def benchenv_help() -> str:
    sys.path.insert(0, HERE)
    import benchenv

    return benchenv.BASELINE_HELP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["single", "gradsync", "mpi4jax", "gloo"], default="gradsync")
    parser.add_argument("--update", choices=["jit", "host"], default="jit")
    parser.add_argument("--model", choices=sorted(MODELS), default="wide")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (digits 2000, wide 100)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch", type=int, default=None, help="samples per rank per step")
    parser.add_argument("--compare", action="store_true", help="run every configuration")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--csv", type=str, default=None, help="--compare: also write the table here")
    parser.add_argument("--baseline-src", type=str, default=None, help=benchenv_help())
    args = parser.parse_args()
    args.batch = args.batch or MODELS[args.model][1]
    args.steps = args.steps or (2000 if args.model == "digits" else 100)
    if args.compare:
        compare(args)
    else:
        os.environ.setdefault("XLA_FLAGS", XLA_ONE_THREAD)  # before jax is imported
        measure(args.mode, args.update, args.model, args.steps, args.warmup, args.batch)


if __name__ == "__main__":
    main()
