"""Training-step time of lockstep, DDP and gradsync trained alternately in one launch.

    mpiexec -n 2 python benchmarks/interleaved_step.py --model transformer [--blocks 20]
        [--block-steps 5] [--configs lockstep,ddp,gradsync] [--csv PATH]

``train_step.py --compare`` launches each configuration on its own, one after another; on a shared
VM the machine's speed drifts by 10-30 % between launches, more than the differences it measures.
Here every rank builds one model per configuration (the same weights, the same batch), and trains
them in turn, a block of ``--block-steps`` steps each, the order reversed every other block, so
that a drift falls on every configuration alike. Per configuration it prints rank 0's median step
time, its 25th percentile, the median of backward (the wait for the averaged gradients included),
and CPU milliseconds per step of the whole process; then each configuration's ratio to the first
one, as the median over blocks of the ratio of the two block medians (a paired ratio).

The configurations (``train_step.py``'s models and optimizer, SGD with momentum, batch 32 per rank):

* ``lockstep``: one process's training with an ``MPI_Barrier`` after each backward (no data moved:
  the least a synchronous data-parallel step can take, ``train_step.py --mode lockstep``);
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over gloo;
* ``ddp-gradsync``: the same DDP over gradsync's ``torch.distributed`` backend (docs/torch-distributed.md):
  the default group when ``ddp`` is not run, else a ``new_group(backend="gradsync")`` of every rank;
* ``ddp-nocomm``: DDP with a comm hook that moves no data (each bucket comes back as it went in)
  and an ``MPI_Barrier`` after backward, as ``lockstep``: what DDP's reducer costs of itself (its
  copies into the buckets and out, its autograd hooks), whichever backend it would run on;
* ``gradsync``: ``gradsync.DistributedOptimizer`` with its defaults (fusion threshold
  ``--fusion-threshold``, default 1 MiB as ``train_step.py --compare``);
* ``floor``: one process's training on every rank at once, no barrier (``train_step.py``'s N
  singles at once: what the cores give when nothing waits).

All share one process: gradsync's coordinator thread idles (its heartbeat) while the others train,
and gloo's threads idle during gradsync's blocks. Under Open MPI, ``import gradsync`` sets
``OMPI_MCA_mpi_yield_when_idle=1`` before MPI starts, for the lockstep barrier too, as
``train_step.py --mode lockstep`` does.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import benchenv  # noqa: E402
import train_step  # noqa: E402

CONFIGS = ("lockstep", "ddp", "ddp-gradsync", "ddp-nocomm", "gradsync", "floor")
DDP = ("ddp", "ddp-gradsync", "ddp-nocomm")


class Config:
    """One configuration's model, optimizer, and per-step figures (ms)."""

    def __init__(self, name: str, model, optimizer, barrier) -> None:
        self.name, self.model, self.optimizer, self.barrier = name, model, optimizer, barrier
        self.step_ms: list[float] = []
        self.backward_ms: list[float] = []
        self.cpu_ms: list[float] = []
        self.faults: list[int] = []
        self.block_medians: list[float] = []


def build(name: str, kind: str, comm, gradsync, groups: dict):
    """The configuration ``name``: its own model with the seed-0 weights, and its optimizer.
    ``groups``: the torch process group of ``ddp`` and ``ddp-gradsync`` (None: the default group)."""
    import torch

    torch.manual_seed(0)
    model = train_step.build_model(kind)
    barrier = None
    if name in DDP:
        model = torch.nn.parallel.DistributedDataParallel(model, process_group=groups[name])
        optimizer = train_step.make_optimizer("sgd", model)
        if name == "ddp-nocomm":
            model.register_comm_hook(None, _no_communication)
            barrier = comm.Barrier
    elif name == "gradsync":
        optimizer = gradsync.DistributedOptimizer(train_step.make_optimizer("sgd", model),
                                                  named_parameters=model.named_parameters())
    else:
        optimizer = train_step.make_optimizer("sgd", model)
        barrier = comm.Barrier if name == "lockstep" else None
    return Config(name, model, optimizer, barrier)


def _no_communication(state, bucket):
    """A DDP comm hook that moves no data: the bucket's future, completed with the bucket."""
    import torch

    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def start_torch_distributed(names: list[str], comm) -> dict:
    """Start torch.distributed for the DDP configurations in ``names``: gloo as the default group
    for ``ddp`` (a TCP rendezvous on 127.0.0.1), gradsync's backend for ``ddp-gradsync`` (the
    default group, or a group of every rank beside gloo); ``ddp-nocomm`` uses the default group
    (only to build DDP: its hook moves nothing). Returns {configuration: group}."""
    if not set(DDP) & set(names):
        return {}
    import torch.distributed as dist

    import gradsync.torch  # noqa: F401  (registers backend "gradsync" and gradsync://)

    if "ddp" not in names:
        dist.init_process_group(backend="gradsync", init_method="gradsync://")
        return {"ddp-gradsync": None, "ddp-nocomm": None}
    port = comm.bcast(29500 + os.getpid() % 1000, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.Get_rank(),
                            world_size=comm.Get_size())
    gradsync_group = dist.new_group(backend="gradsync") if "ddp-gradsync" in names else None
    return {"ddp": None, "ddp-gradsync": gradsync_group, "ddp-nocomm": None}


def run_step(config: Config, x, y, loss_fn) -> tuple[float, float, float, int]:
    """One step: (step, backward, process CPU) in seconds, and the process's minor page faults."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cpu = time.process_time()
    start = time.perf_counter()
    config.optimizer.zero_grad()
    loss = loss_fn(config.model(x), y)
    backward_start = time.perf_counter()
    loss.backward()
    if config.barrier is not None:
        config.barrier()
    backward_end = time.perf_counter()
    config.optimizer.step()
    end = time.perf_counter()
    return (end - start, backward_end - backward_start, time.process_time() - cpu,
            resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)


def alternate(configs: list, blocks: int, warmup: int, run: Callable) -> Iterator:
    """Call ``run(config)`` ``warmup`` times for each configuration, then yield each configuration
    once per block: in order in even blocks, reversed in odd ones (a drift falls on all alike)."""
    for config in configs:
        for _ in range(warmup):
            run(config)
    for block in range(blocks):
        yield from (configs if block % 2 == 0 else configs[::-1])


def paired_ratio(config: Config, reference: Config) -> float:
    """Median over blocks of (this configuration's block median / the reference's)."""
    return statistics.median(a / b for a, b in zip(config.block_medians, reference.block_medians))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["mlp", "cnn", "transformer", "tensors"], default="mlp")
    parser.add_argument("--blocks", type=int, default=20, help="blocks of steps per configuration")
    parser.add_argument("--block-steps", type=int, default=5, help="steps per block")
    parser.add_argument("--warmup", type=int, default=3, help="steps per configuration first")
    parser.add_argument("--configs", default="lockstep,ddp,gradsync",
                        help=f"comma separated, from {', '.join(CONFIGS)}; ratios are to the first")
    parser.add_argument("--fusion-threshold", type=int, default=1 << 20, help="bytes")
    parser.add_argument("--csv", default=None, help="also write the table here")
    args = parser.parse_args()
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or len(set(names)) != len(names):
        parser.error(f"--configs: each of {', '.join(CONFIGS)} at most once, got {args.configs!r}")
    environ = dict(os.environ)  # as launched: init() adds OMPI_MCA_mpi_yield_when_idle

    import torch

    import gradsync

    torch.set_num_threads(1)
    gradsync.init(fusion_threshold=args.fusion_threshold)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    groups = start_torch_distributed(names, comm)
    configs = [build(name, args.model, comm, gradsync, groups) for name in names]
    torch.manual_seed(1 + rank)
    x, y = train_step.sample_batch(args.model)
    loss_fn = torch.nn.CrossEntropyLoss()
    for config in alternate(configs, args.blocks, args.warmup, lambda c: run_step(c, x, y, loss_fn)):
        comm.Barrier()
        steps = []
        for _ in range(args.block_steps):
            step, backward, cpu, faults = run_step(config, x, y, loss_fn)
            config.faults.append(faults)
            steps.append(step * 1e3)
            config.backward_ms.append(backward * 1e3)
            config.cpu_ms.append(cpu * 1e3)
        config.step_ms += steps
        config.block_medians.append(statistics.median(steps))
    if groups:
        torch.distributed.destroy_process_group()
    if rank != 0:
        return
    first = configs[0]
    print(f"{args.model}, {size} ranks, batch {train_step.BATCH} per rank, {args.blocks} blocks x "
          f"{args.block_steps} steps per configuration, interleaved in one launch; "
          f"{benchenv.mpi_library()}")
    header = ["configuration", "step ms", "p25 ms", "backward ms", "process CPU", "page faults",
              f"vs {first.name}"]
    print(f"{header[0]:<14}" + "".join(f"{h:>14}" for h in header[1:]))
    rows = []
    for config in configs:
        row = {"configuration": config.name,
               "step_ms": statistics.median(config.step_ms),
               "p25_ms": statistics.quantiles(config.step_ms, n=4)[0],
               "backward_ms": statistics.median(config.backward_ms),
               "process_cpu_ms": statistics.median(config.cpu_ms),
               "page_faults": statistics.median(config.faults),
               f"vs_{first.name}": paired_ratio(config, first)}
        rows.append(row)
        values = list(row.values())
        print(f"{values[0]:<14}" + "".join(f"{v:>14.2f}" for v in values[1:5])
              + f"{values[5]:>14.0f}" + f"{values[6]:>14.3f}")
    by_name = {config.name: config for config in configs}
    for a, b in (("gradsync", "ddp"), ("ddp-gradsync", "ddp"), ("gradsync", "ddp-gradsync"),
                 ("lockstep", "ddp"), ("gradsync", "lockstep"), ("ddp-gradsync", "lockstep"),
                 ("ddp-nocomm", "lockstep"), ("ddp-nocomm", "ddp")):
        if a in by_name and b in by_name and b != first.name:
            print(f"{a} / {b} (paired): {paired_ratio(by_name[a], by_name[b]):.3f}")
    if args.csv:
        benchenv.write_csv(args.csv, rows, benchenv.environment(size, environ))
        print(f"# wrote {args.csv}")


if __name__ == "__main__":
    main()
