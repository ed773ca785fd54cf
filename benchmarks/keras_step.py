"""Keras 3 training-step time on each backend: one process, the floor of N at once, gradsync.keras,
and for the TensorFlow backend tf.distribute.MultiWorkerMirroredStrategy, on the same model.

The model is an MLP, 784-1024-1024-10 with ReLU (1.86 M parameters, 7.4 MB of float32 gradients,
6 tensors), SGD with momentum, mean-squared error on random data, batch 64 per rank (``--batch``):
on one thread a single-process step takes well over 5 ms on every backend. A step is one
``model.train_on_batch`` (the backend's compiled train step: ``tf.function``, ``jax.jit``, eager
torch), which returns the loss as a host number, so its time covers the whole update. Every process
computes on one thread: ``OMP_NUM_THREADS=1``, XLA's ``XLA_FLAGS`` below, ``torch.set_num_threads(1)``,
TensorFlow's intra- and inter-op pools of 1.

All configurations of every backend, interleaved, with a table of medians at the end (and a CSV file):

    python benchmarks/keras_step.py --compare --ranks 2 --repeats 2 [--backends jax,torch,tensorflow] [--csv PATH]

One configuration per launch (``KERAS_BACKEND`` chooses the backend):

    KERAS_BACKEND=jax python benchmarks/keras_step.py --mode single
    KERAS_BACKEND=jax mpiexec -n 2 python benchmarks/keras_step.py --mode gradsync
    KERAS_BACKEND=tensorflow mpiexec -n 2 python benchmarks/keras_step.py --mode mwms

``gradsync`` wraps the optimizer in ``gradsync.keras.DistributedOptimizer`` (and broadcasts the
initial variables); ``lockstep`` trains as one process alone, under ``mpiexec``, with an
``MPI_Barrier`` after every step (mpi4py, no gradsync): it moves no data, so it is the floor of any
synchronous step, the ranks waiting for the slower one each step; ``mwms`` builds and compiles the model in
``tf.distribute.MultiWorkerMirroredStrategy`` with one worker per process on localhost
(``TF_CONFIG`` made from the launcher's rank, ports from ``--port``), its CPU collectives on the
ring (gRPC) implementation; each worker trains on its own batch of ``--batch``. The floor is
``--ranks`` single processes started at the same time: they share the cores' memory bandwidth, so
that, not one process alone, is the best an N-rank step can do on one machine. ``--baseline-src
DIR`` adds each gradsync row again with the gradsync package of ``DIR`` (another version's
``src``) first on ``PYTHONPATH``: a before/after comparison interleaved in one run. Each gradsync
launch also prints where its step's time goes (benchmarks/breakdown.py), summed up in a second
table. Prints the median
step time and its CPU time (all threads of the process) in microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import benchenv  # noqa: E402
import breakdown  # noqa: E402
from jax_step import XLA_ONE_THREAD, launcher_rank  # noqa: E402

SIZES = (784, 1024, 1024, 10)
BACKENDS = ("tensorflow", "jax", "torch")


def one_thread(backend: str) -> None:
    """Hold this process's computation to one thread (call before the first op)."""
    if backend == "torch":
        import torch

        torch.set_num_threads(1)
    elif backend == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)


def mwms_strategy(port: int):
    """MultiWorkerMirroredStrategy over this launch's ranks, one worker each on localhost."""
    import tensorflow as tf

    rank, size = launcher_rank()
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"localhost:{port + r}" for r in range(size)]},
        "task": {"type": "worker", "index": rank}})
    # Configure TensorFlow's coordination service as the strategy would, but with a 10-minute
    # heartbeat timeout: on a loaded machine the default fails the job (UNAVAILABLE: heartbeat timeout).
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.eager import context

    context.context().configure_coordination_service(
        service_type="standalone", service_leader="/job:worker/replica:0/task:0",
        heartbeat_timeout_in_ms=600_000,
        coordinated_jobs=[coordination_config_pb2.CoordinatedJob(name="worker", num_tasks=size)])
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options), rank


def local_logs_under_mwms() -> None:
    """Keras 3's TensorFlow train step fails in multi-worker MWMS: it averages the scalar loss with
    ``strategy.reduce("MEAN", loss, axis=0)`` (ValueError: invalid reduction dimension 0). Have it
    return each worker's own loss instead (``reduction="first"``), as gradsync's train step does;
    the gradients are still averaged by the strategy."""
    from keras.src.backend.tensorflow import trainer

    reduce = trainer.reduce_per_replica
    trainer.reduce_per_replica = lambda values, strategy, reduction: reduce(
        values, strategy, "first" if reduction == "auto" else reduction)


def build(mode: str):
    """(model compiled for ``mode``, rank)."""
    import contextlib

    import keras

    rank, scope = 0, contextlib.nullcontext
    if mode == "mwms":  # before any variable exists: it configures the collectives at startup
        strategy, rank = mwms_strategy(int(os.environ.get("KERAS_STEP_PORT", "23456")))
        scope = strategy.scope
        local_logs_under_mwms()
    with scope():
        optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    if mode == "gradsync":
        import gradsync.keras as hvd

        hvd.init()
        rank = hvd.rank()
        optimizer = hvd.DistributedOptimizer(optimizer)
    with scope():
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Dense(n, activation="relu") for n in SIZES[1:-1]]
        model = keras.Sequential([keras.Input((SIZES[0],)), *layers, keras.layers.Dense(SIZES[-1])])
        model.compile(optimizer=optimizer, loss="mse")
    return model, rank


def measure(mode: str, steps: int, warmup: int, batch: int) -> None:
    """Time ``warmup + steps`` train_on_batch calls; rank 0 prints the medians (us)."""
    import numpy as np

    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    one_thread(backend)
    if mode == "gradsync":  # before the train step is traced
        breakdown.install(backend)
    model, rank = build(mode)
    if mode == "lockstep":
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
    rng = np.random.default_rng(rank)
    x = rng.random((batch, SIZES[0]), dtype=np.float32)
    y = rng.random((batch, SIZES[-1]), dtype=np.float32)
    if mode == "gradsync":
        import gradsync.keras as hvd

        model.train_on_batch(x, y)  # builds the optimizer's variables, then everyone starts from rank 0's
        hvd.broadcast_variables(model.variables + model.optimizer.variables, root_rank=0)
    step = lambda: model.train_on_batch(x, y)  # noqa: E731
    if mode == "lockstep":
        step = lambda: (model.train_on_batch(x, y), MPI.COMM_WORLD.Barrier())  # noqa: E731
    benchenv.print_step_medians(breakdown.per_step(step), steps, warmup, rank)
    if mode == "gradsync" and rank == 0:
        print(breakdown.line(steps), flush=True)


def configs(backends: list[str], ranks: int, baseline: bool = False) -> list[tuple[str, str, str, int, str]]:
    """(label, backend, mode, processes, what it is compared with) for every backend; with
    ``baseline``, the gradsync row again with the baseline's gradsync (``--baseline-src``)."""
    rows = []
    for backend in backends:
        rows += [(f"{backend}: one process alone", backend, "single", 1, ""),
                 (f"{backend}: {ranks} single processes (floor)", backend, "single", -ranks, "alone"),
                 (f"{backend}: lockstep, {ranks} ranks, no data", backend, "lockstep", ranks, "floor"),
                 (f"{backend}: gradsync, {ranks} ranks", backend, "gradsync", ranks, "floor")]
        if baseline:
            rows.append((f"{backend}: gradsync, {ranks} ranks, {benchenv.BASELINE}", backend, "gradsync",
                         ranks, "floor"))
        if backend == "tensorflow":
            rows.append((f"{backend}: MultiWorkerMirrored, {ranks} workers", backend, "mwms", ranks, "floor"))
    return rows


def launch(backend: str, mode: str, processes: int, args, env: dict,
           parts: dict[str, float] | None = None) -> tuple[float, float]:
    """The median step and its CPU time (us) of one configuration (rank 0's; with
    ``processes < 0``, that many single processes at once, their mean); ``parts`` receives
    gradsync's per-step breakdown (benchmarks/breakdown.py)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--batch", str(args.batch)]
    return benchenv.launch_measured(cmd, processes, dict(env, KERAS_BACKEND=backend), parts)


def compare(args) -> None:
    """Launch every configuration ``args.repeats`` times, interleaved; print a table of medians."""
    env = dict(os.environ, OMP_NUM_THREADS="1", XLA_FLAGS=XLA_ONE_THREAD, TF_CPP_MIN_LOG_LEVEL="3")
    rows = configs(args.backends.split(","), args.ranks, bool(args.baseline_src))
    results: dict[str, list[float]] = {label: [] for label, *_ in rows}
    cpu: dict[str, list[float]] = {label: [] for label, *_ in rows}
    parts: dict[str, list[dict[str, float]]] = {label: [] for label, *_ in rows}
    for repeat in range(args.repeats):
        for label, backend, mode, processes, _ in rows:
            env["KERAS_STEP_PORT"] = str(args.port + 10 * repeat)
            launch_parts: dict[str, float] = {}
            launch_env = benchenv.with_baseline(env, label, args.baseline_src)
            step, step_cpu = launch(backend, mode, processes, args, launch_env, launch_parts)
            results[label].append(step)
            cpu[label].append(step_cpu)
            if launch_parts:
                parts[label].append(launch_parts)
    print(f"\nKeras MLP {'-'.join(map(str, SIZES))}, batch {args.batch} per rank, one thread per process, "
          f"median of {args.repeats} launches x {args.steps} steps; load average {os.getloadavg()[0]:.1f}")
    print(f"{'configuration':42s} {'step ms':>8s} {'ratio':>12s} {'CPU ms':>7s} {'ratio':>12s}   each launch, ms")
    table = [row(label, backend, against, rows, results, cpu, args) for label, backend, *_, against in rows]
    floors = {backend: label for label, backend, mode, processes, _ in rows if processes < 0}
    breakdown.table([(label, results[label], results[floors[backend]], parts[label])
                     for label, backend, mode, *_ in rows if mode == "gradsync"])
    if args.csv:
        benchenv.write_csv(args.csv, table, benchenv.environment(args.ranks, env))
        print(f"# wrote {args.csv}")


def row(label: str, backend: str, against: str, rows, results, cpu, args) -> dict:
    """One line of the table (printed) and of the CSV file; ratios against the same backend's rows."""
    first = next(i for i, r in enumerate(rows) if r[1] == backend)
    out = {"configuration": label, "backend": backend, "batch": args.batch}
    for what, values in (("step", results), ("cpu", cpu)):
        median = {key: statistics.median(v) for key, v in values.items()}
        base = {"alone": median[rows[first][0]], "floor": median[rows[first + 1][0]]}
        out[f"{what}_ms"] = round(median[label] / 1e3, 2)
        out[f"{what}_ratio"] = f"{median[label] / base[against]:.2f}x {against}" if against else ""
    out["launches"] = " ".join(f"{v / 1e3:.2f}" for v in results[label])
    print(f"{label:42s} {out['step_ms']:8.2f} {out['step_ratio']:>12s} {out['cpu_ms']:7.2f} "
          f"{out['cpu_ratio']:>12s}   {out['launches']}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["single", "lockstep", "gradsync", "mwms"], default="gradsync")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per launch")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--compare", action="store_true", help="run every configuration")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="--compare: comma-separated")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--port", type=int, default=23456, help="mwms: the first worker's port")
    parser.add_argument("--csv", type=str, default=None, help="--compare: also write the table here")
    parser.add_argument("--baseline-src", type=str, default=None, help=benchenv.BASELINE_HELP)
    args = parser.parse_args()
    if args.compare:
        compare(args)
    else:
        os.environ.setdefault("XLA_FLAGS", XLA_ONE_THREAD)  # before jax is imported
        measure(args.mode, args.steps, args.warmup, args.batch)


if __name__ == "__main__":
    main()
