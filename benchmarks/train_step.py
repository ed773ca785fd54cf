"""Training-step time: gradsync vs PyTorch DDP (gloo) vs a single process, on the same model.

Run one configuration per launch (the driver below interleaves them):

    mpiexec -n 2 python benchmarks/train_step.py --mode gradsync [--fusion-threshold BYTES] [--model cnn]
    mpiexec -n 2 python benchmarks/train_step.py --mode ddp
    python benchmarks/train_step.py --mode single
    mpiexec -n 2 python benchmarks/train_step.py --mode lockstep

``lockstep`` is one process's training on every rank, the ranks meeting at an ``MPI_Barrier``
after each backward: what any synchronous data-parallel step costs before it moves a byte (the
ranks wait for the slowest one every step, and their backward passes contend for memory at the
same moments). ``--compare`` prints each configuration's ratio to it (``vs lockstep``) beside
the ratio to N single processes run at the same time (``vs floor``, which pays neither).

or all of them, interleaved, with a table at the end (and its numbers in a CSV file):

    python benchmarks/train_step.py --compare --ranks 2 --repeats 3 [--model cnn] [--csv PATH]

Two versions of gradsync side by side (before/after a change), each gradsync configuration once per
source tree (its ``src/`` on PYTHONPATH), optionally with extra flags for that tree's launches:

    python benchmarks/train_step.py --compare --thresholds 1048576 \
        --src before=/path/to/main/src --src after=src --src after-at-step=src:--synchronize-at-step

Communication hooks and gradient buckets (docs/comm-hooks.md), side by side the same way:

    python benchmarks/train_step.py --compare --thresholds 1048576 --src per-gradient=src \
        --src "views=src:--bucket-view on" --src "copies=src:--comm-hook allreduce --bucket-view off"
    mpiexec -n 2 python benchmarks/train_step.py --comm-hook powersgd --powersgd-rank 2  # + bytes

ZeroRedundancyOptimizer (sharded optimizer state, docs/sharding.md) beside DistributedOptimizer,
interleaved, with Adam (``--optimizer``, default sgd, applies to every configuration):

    python benchmarks/train_step.py --compare --thresholds 1048576 --optimizer adam \
        --src distributed=src --src zero=src:--zero

On a GPU (``--device cuda``; each rank takes the GPU of its local rank modulo the GPUs present, so
several ranks may share one with GRADSYNC_GPU_OPERATIONS=MPI), every step ends with
``torch.cuda.synchronize()`` so that the time covers the GPU's work; DDP then uses NCCL:

    python benchmarks/train_step.py --mode single --device cuda --batch 256
    mpiexec -n 1 python benchmarks/train_step.py --mode gradsync --device cuda --batch 256
    mpiexec -n 1 python benchmarks/train_step.py --mode ddp --ddp-backend gradsync --device cuda --batch 256

Models (--model), batch 32 per rank, SGD with momentum (or --optimizer adam), torch.set_num_threads(1):
  mlp (default): 24 x (Linear(768, 768) + ReLU) + Linear(768, 10) (50 tensors, 14.2 M parameters);
  cnn: 3 x (Conv2d 3x3 + ReLU + MaxPool2d(2)) with 32/64/128 channels on 3x32x32 inputs, then
       Linear(2048, 256) + ReLU + Linear(256, 10) (10 tensors, 0.62 M parameters): far less to
       reduce per unit of compute than the MLP.
  transformer: a small encoder, Embedding(1000, 64) + 24 x TransformerEncoderLayer(64, 4 heads,
       feed-forward 256, no dropout) + mean over the 16 tokens + Linear(64, 10) (291 tensors,
       1.27 M parameters): many small gradients, where the fixed cost per tensor shows.
  tensors: 145 x Linear(4, 4) + Linear(4, 10) (292 tensors, 2.5 K parameters): almost no compute,
       so a step's CPU time is mostly what the training loop and gradsync spend per tensor.
Prints the median step time in milliseconds, and rank 0's CPU milliseconds per step by thread
(``process``; ``training``, the thread that runs the loop and backward's hooks; ``coordinator``,
gradsync's background thread; ``other``, the rest: gloo's or MPI's own threads). On a machine
whose cores are shared with other work, CPU time is the steadier figure: with 2 ranks on 2 cores a
step's time follows the CPU each rank spends on it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

MODEL_LAYERS, WIDTH, BATCH = 24, 768, 32
# CPU milliseconds per step of rank 0, by thread (cpu_ms_per_step): columns of the --compare table.
CPU_COLUMNS = ("process", "training", "coordinator", "other")
VOCAB, TOKENS, D_MODEL = 1000, 16, 64  # the transformer's vocabulary, sequence length and width
# The --compare row of N ranks each training alone but meeting at an MPI_Barrier after every
# backward: what any synchronous data-parallel step costs before moving a byte.
LOCKSTEP = "{ranks} ranks in lockstep"
SAMPLE_SHAPES = {"cnn": (3, 32, 32), "transformer": (TOKENS,), "tensors": (4,), "mlp": (WIDTH,)}


def build_model(kind: str):
    """The model of ``kind`` (its input sample's shape: ``SAMPLE_SHAPES[kind]``)."""
    import torch

    nn = torch.nn
    if kind == "cnn":
        layers = []
        for channels_in, channels_out in ((3, 32), (32, 64), (64, 128)):
            layers += [nn.Conv2d(channels_in, channels_out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        layers += [nn.Flatten(), nn.Linear(128 * 4 * 4, 256), nn.ReLU(), nn.Linear(256, 10)]
        return nn.Sequential(*layers)
    if kind == "transformer":
        return _Transformer()
    if kind == "tensors":  # as many tensors as the transformer, almost no compute
        return nn.Sequential(*[nn.Linear(4, 4) for _ in range(145)], nn.Linear(4, 10))
    layers = []
    for _ in range(MODEL_LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    layers.append(nn.Linear(WIDTH, 10))
    return nn.Sequential(*layers)


def hook_options(comm_hook: str, bucket_view: str, powersgd_rank: int) -> dict:
    """DistributedOptimizer keyword arguments for --comm-hook and --bucket-view."""
    import gradsync

    hooks = {"allreduce": gradsync.allreduce_hook, "fp16": gradsync.fp16_compress_hook,
             "bf16": gradsync.bf16_compress_hook}
    options = {}
    if comm_hook == "powersgd":
        options["comm_hook"] = gradsync.PowerSGD(rank=powersgd_rank, start_iter=0)
    elif comm_hook != "none":
        options["comm_hook"] = hooks[comm_hook]
    if bucket_view != "auto":
        options["gradient_as_bucket_view"] = bucket_view == "on"
    return options


def _Transformer():
    """The small transformer encoder of the module docstring (token ids in, 10 logits out)."""
    import torch

    nn = torch.nn

    class Transformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, D_MODEL)
            layer = nn.TransformerEncoderLayer(D_MODEL, 4, 4 * D_MODEL, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, MODEL_LAYERS, enable_nested_tensor=False)
            self.head = nn.Linear(D_MODEL, 10)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(self.embed(tokens)).mean(dim=1))

    return Transformer()


def sample_batch(kind: str, batch: int = BATCH, generator=None):
    """One batch for ``build_model(kind)`` drawn from ``generator`` (a ``torch.Generator``; None:
    torch's global random state): (inputs, labels), token ids for the transformer, else standard
    normal floats; labels in [0, 10)."""
    import torch

    shape = SAMPLE_SHAPES[kind]
    x = (torch.randint(0, VOCAB, (batch, *shape), generator=generator) if kind == "transformer"
         else torch.randn(batch, *shape, generator=generator))
    return x, torch.randint(0, 10, (batch,), generator=generator)


def make_optimizer(kind: str, model):
    import torch

    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def measure(mode: str, model_kind: str, steps: int, warmup: int, fusion_threshold: int | None,
            device: str = "cpu", batch: int = BATCH, synchronize_at_step: bool = False,
            hooks: tuple[str, str, int] = ("none", "auto", 2), set_to_none: bool = True,
            optimizer_kind: str = "sgd", zero: bool = False, ddp_backend: str | None = None) -> None:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(model_kind)
    rank = 0
    cuda = device == "cuda"
    if mode == "gradsync":
        import gradsync

        settings = {} if fusion_threshold is None else {"fusion_threshold": fusion_threshold}
        gradsync.init(**settings)
        rank = gradsync.rank()
        if cuda:
            torch.cuda.set_device(gradsync.local_rank() % torch.cuda.device_count())
            model = model.cuda()
        options = {"synchronize_in_backward": False} if synchronize_at_step else {}
        if zero:  # ZeroRedundancyOptimizer takes no communication hook
            optimizer = gradsync.ZeroRedundancyOptimizer(make_optimizer(optimizer_kind, model),
                                                         named_parameters=model.named_parameters(),
                                                         **options)
        else:
            options.update(hook_options(*hooks))
            optimizer = gradsync.DistributedOptimizer(make_optimizer(optimizer_kind, model),
                                                      named_parameters=model.named_parameters(),
                                                      **options)
        gradsync.broadcast_parameters(model.state_dict(), root_rank=0)
    elif mode == "ddp":
        import torch.distributed as dist
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        rank = world.Get_rank()
        if cuda:
            torch.cuda.set_device(rank % torch.cuda.device_count())
            model = model.cuda()
        if ddp_backend == "gradsync":  # torch.distributed on gradsync's engine (docs/torch-distributed.md)
            import gradsync.torch  # noqa: F401 - registers the backend

            dist.init_process_group("gradsync", init_method="gradsync://")
        else:
            port = world.bcast(29500 + os.getpid() % 1000, root=0)
            dist.init_process_group(ddp_backend or ("nccl" if cuda else "gloo"),
                                    init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world.Get_size())
        model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = make_optimizer(optimizer_kind, model)
    else:
        model = model.cuda() if cuda else model
        optimizer = make_optimizer(optimizer_kind, model)
    barrier = None
    if mode == "lockstep":  # one process's training, with the ranks meeting once per step
        # As gradsync does at import (mpi_environment.py): Open MPI's waits yield the core.
        os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
        from mpi4py import MPI

        rank, barrier = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Barrier
    x, y = sample_batch(model_kind, batch)
    if cuda:
        x, y = x.cuda(), y.cuda()
    loss_fn = torch.nn.CrossEntropyLoss()
    times = []
    clocks = None
    for step in range(warmup + steps):
        if step == warmup:
            clocks = cpu_clocks()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=set_to_none)
        loss_fn(model(x), y).backward()
        if barrier is not None:
            barrier()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    if mode == "ddp":
        import torch.distributed as dist

        dist.destroy_process_group()
    cpu = cpu_ms_per_step(clocks, cpu_clocks(), steps)
    if rank == 0:
        print(f"median_step_ms={statistics.median(times) * 1e3:.2f}", flush=True)
        print("cpu_ms_per_step " + " ".join(f"{k}={v:.2f}" for k, v in cpu.items()), flush=True)
        traffic = getattr(options.get("comm_hook") if mode == "gradsync" else None, "traffic", None)
        if traffic is not None:
            print(f"bytes_sent_per_step={traffic.sent} uncompressed={traffic.dense} "
                  f"ratio={traffic.dense / traffic.sent:.1f}", flush=True)


def cpu_clocks() -> dict[str, float]:
    """CPU seconds used so far: by the process, by this (the training) thread, and by each other
    Python thread by name (gradsync's coordinator is "gradsync-coordinator"); threads that Python
    does not know (gloo's, MPI's) count only in the process's figure."""
    clocks = {"process": time.process_time(), "training": time.thread_time()}
    for thread in threading.enumerate():
        if thread is threading.current_thread() or thread.ident is None:
            continue
        try:
            used = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, ProcessLookupError):
            continue  # the thread ended meanwhile
        clocks[thread.name] = clocks.get(thread.name, 0.0) + used
    return clocks


def cpu_ms_per_step(before: dict[str, float], after: dict[str, float], steps: int) -> dict[str, float]:
    """CPU milliseconds per step per thread between two :func:`cpu_clocks`: ``process``,
    ``training``, ``coordinator`` (gradsync's background thread, 0 without it), and ``other``
    (the rest of the process: other Python threads and threads Python does not know)."""
    used = {k: (after[k] - before.get(k, 0.0)) * 1e3 / steps for k in after}
    result = {"process": used.pop("process"), "training": used.pop("training"),
              "coordinator": used.pop("gradsync-coordinator", 0.0)}
    result["other"] = result["process"] - result["training"] - result["coordinator"]
    return result


def source_trees(specs: list[str]) -> list[tuple[str, str | None, list[str]]]:
    """(label, src path or None, extra flags) per ``--src LABEL=PATH[:FLAGS]``; [("", None, [])]
    (the gradsync this Python imports) without any."""
    trees = []
    for spec in specs:
        label, _, rest = spec.partition("=")
        path, _, flags = rest.partition(":")
        trees.append((label, os.path.abspath(path), flags.split()))
    return trees or [("", None, [])]


def compare(ranks: int, repeats: int, steps: int, thresholds: list[int], model: str,
            csv_path: str | None, trees: list[tuple[str, str | None, list[str]]],
            optimizer_kind: str = "sgd") -> None:
    """Launch every configuration `repeats` times, interleaved (in an order rotated by one per
    repeat), and print a table of medians."""
    here = os.path.abspath(__file__)
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    floor, lockstep_row = f"{ranks} singles at once", LOCKSTEP.format(ranks=ranks)
    configs = [("single", ["--mode", "single"], False, env), (floor, ["--mode", "single"], ranks, env),
               (lockstep_row, ["--mode", "lockstep"], True, env),
               ("ddp (gloo)", ["--mode", "ddp"], True, env)]
    for label, path, flags in trees:
        tree_env = env if path is None else dict(env, PYTHONPATH=os.pathsep.join(
            filter(None, [path, env.get("PYTHONPATH")])))
        configs += [(f"gradsync{' ' + label if label else ''}, fusion {t >> 10} KiB",
                     ["--mode", "gradsync", "--fusion-threshold", str(t), *flags], True, tree_env)
                    for t in thresholds]
    results: dict[str, list[float]] = {name: [] for name, *_ in configs}
    cpu: dict[str, list[dict[str, float]]] = {name: [] for name, *_ in configs}
    for repeat in range(repeats):
        # Each repeat starts one configuration later: a configuration that always ran right after
        # another ran ~7 ms slower per transformer step here, whichever version it was (order bias).
        shift = repeat % len(configs)
        for name, args, parallel, config_env in configs[shift:] + configs[:shift]:
            cmd = [sys.executable, here, *args, "--model", model, "--steps", str(steps),
                   "--optimizer", optimizer_kind]
            if parallel is True:
                cmd = [mpiexec, "-n", str(ranks), *cmd]
            step_ms, cpu_ms = _launch(name, cmd, config_env, copies=parallel or 1)
            results[name].append(step_ms)
            cpu[name].append(cpu_ms)
    single = statistics.median(results["single"])
    floor_ms = statistics.median(results[floor])
    ddp = statistics.median(results["ddp (gloo)"])
    lockstep = statistics.median(results[lockstep_row])
    print(f"\n{model}, {ranks} ranks, batch {BATCH} per rank, {optimizer_kind}, median of {repeats} "
          f"launches x {steps} steps; floor: {floor} (each one's median step, averaged); "
          f"lockstep: {lockstep_row}, a barrier after each backward")
    width = max(28, *map(len, results))
    print(f"{'configuration':{width}s} {'step ms':>8s} {'vs DDP':>7s} {'efficiency':>10s} {'vs floor':>8s}"
          f" {'vs lockstep':>11s}" + "".join(f" {k + ' CPU':>15s}" for k in CPU_COLUMNS))
    rows = []
    for name, values in results.items():
        median = statistics.median(values)
        cpu_ms = {k: statistics.median(c[k] for c in cpu[name]) for k in CPU_COLUMNS}
        print(f"{name:{width}s} {median:8.1f} {median / ddp:7.2f} {single / median:10.2f} "
              f"{floor_ms / median:8.2f} {lockstep / median:11.2f}" + "".join(f" {cpu_ms[k]:15.2f}" for k in CPU_COLUMNS))
        rows.append({"model": model, "ranks": ranks, "configuration": name, "step_ms": round(median, 3),
                     "vs_ddp": round(median / ddp, 4), "efficiency": round(single / median, 4),
                     "vs_floor": round(floor_ms / median, 4), "vs_lockstep": round(lockstep / median, 4),
                     **{f"{k}_cpu_ms": round(v, 3) for k, v in cpu_ms.items()},
                     "launches": " ".join(f"{v:.2f}" for v in values)})
    if csv_path:
        import benchenv

        benchenv.write_csv(csv_path, rows, benchenv.environment(ranks, env))
        print(f"# wrote {csv_path}")


def _launch(name: str, cmd: list[str], env: dict, copies: int = 1) -> tuple[float, dict[str, float]]:
    """Run ``cmd`` (``copies`` processes at the same time, each on its own) and return the
    median step time it printed, in ms, and its CPU ms per step per thread (rank 0's); for several
    copies, the means of theirs: the floor a synchronous N-rank step can reach on a machine whose
    cores share memory bandwidth."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(copies)]
    medians, cpus = [], []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        line = [x for x in out.splitlines() if x.startswith("median_step_ms=")]
        if not line:
            raise SystemExit(f"{name} failed:\n{out}\n{err}")
        medians.append(float(line[0].split("=")[1]))
        cpu = [x for x in out.splitlines() if x.startswith("cpu_ms_per_step ")]
        cpus.append(dict((k, float(v)) for k, v in (kv.split("=") for kv in cpu[0].split()[1:])))
    return statistics.mean(medians), {k: statistics.mean(c[k] for c in cpus) for k in cpus[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["single", "lockstep", "gradsync", "ddp"], default="gradsync")
    parser.add_argument("--model", choices=["mlp", "cnn", "transformer", "tensors"], default="mlp")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--fusion-threshold", type=int, default=None, help="bytes")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--batch", type=int, default=BATCH, help="samples per rank per step")
    parser.add_argument("--compare", action="store_true", help="run every configuration")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--thresholds", type=str, default="262144,1048576,4194304,16777216,67108864",
                        help="fusion thresholds (bytes, comma separated) for --compare")
    parser.add_argument("--csv", type=str, default=None, help="--compare: also write the table here")
    parser.add_argument("--src", action="append", default=[], metavar="LABEL=PATH[:FLAGS]",
                        help="--compare: run the gradsync configurations with this src/ tree "
                             "first on PYTHONPATH (and FLAGS); repeat to compare versions")
    parser.add_argument("--synchronize-at-step", action="store_true",
                        help="gradsync: DistributedOptimizer(synchronize_in_backward=False)")
    parser.add_argument("--comm-hook", choices=["none", "allreduce", "fp16", "bf16", "powersgd"],
                        default="none", help="gradsync: DistributedOptimizer(comm_hook=...)")
    parser.add_argument("--bucket-view", choices=["auto", "on", "off"], default="auto",
                        help="gradsync: gradient_as_bucket_view (auto: on with a hook)")
    parser.add_argument("--powersgd-rank", type=int, default=2)
    parser.add_argument("--keep-grads", action="store_true",
                        help="zero_grad(set_to_none=False) (gradients stay bucket views)")
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    parser.add_argument("--ddp-backend", choices=["gloo", "nccl", "gradsync"], default=None,
                        help="--mode ddp: the torch.distributed backend (default: nccl on cuda, else gloo)")
    parser.add_argument("--zero", action="store_true",
                        help="gradsync: ZeroRedundancyOptimizer instead of DistributedOptimizer")
    args = parser.parse_args()
    if args.compare:
        compare(args.ranks, args.repeats, args.steps, [int(t) for t in args.thresholds.split(",")],
                args.model, args.csv, source_trees(args.src), args.optimizer)
    else:
        measure(args.mode, args.model, args.steps, args.warmup, args.fusion_threshold, args.device,
                args.batch, args.synchronize_at_step,
                (args.comm_hook, args.bucket_view, args.powersgd_rank), not args.keep_grads,
                args.optimizer, args.zero, args.ddp_backend)


if __name__ == "__main__":
    main()
