"""What gradsync costs per tensor in the training thread: its gradient hooks and its end of backward.

    python benchmarks/hook_cost.py --model transformer [--blocks 20] [--block-steps 5] [--csv PATH]

One process, one rank (``mpiexec -n 1`` or none): there is no other rank to wait for, so what
``backward()`` takes beyond plain torch is what gradsync spends in the thread that runs backward,
per step. Three configurations, each with its own copy of one of ``train_step.py``'s models (the
same seed-0 weights, the same batch, SGD with momentum), trained in turn, ``--block-steps`` steps
each, the order reversed every other block (as ``interleaved_step.py``):

* ``plain``: torch alone;
* ``empty hook``: one empty Python ``register_post_accumulate_grad_hook`` per parameter: what
  calling a Python hook from the autograd engine costs at all;
* ``gradsync``: ``gradsync.DistributedOptimizer`` with its defaults (fusion threshold
  ``--fusion-threshold``, 1 MiB as ``train_step.py --compare``). Its time inside its gradient hook
  (the optimizer's ``_gs_hook``: the hand-over, the copy into a bucket) and inside its
  end-of-backward callback (``_gs_end_of_backward``: the round's layout exchange, the buckets'
  allreduce, the copy back into ``p.grad``) is measured by wrapping those two methods of the
  optimizer instance with ``time.perf_counter`` (about 0.1 µs a call more).

Prints the median ``backward()`` time per configuration and its paired ratio to ``plain`` (median
over blocks of the ratio of the block medians), then gradsync's hook and end-of-backward time per
step, and per parameter in microseconds. At 1 rank every collective completes at once, so the
reduction's own time is small here; ``critical_path.py`` and ``interleaved_step.py`` measure the
ranks together.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import benchenv  # noqa: E402
import train_step  # noqa: E402
from interleaved_step import alternate, paired_ratio  # noqa: E402

CONFIGS = ("plain", "empty hook", "gradsync")


class Config:
    """One configuration's model and optimizer, and its figures per step (ms)."""

    def __init__(self, name: str, model, optimizer) -> None:
        self.name, self.model, self.optimizer = name, model, optimizer
        self.backward_ms: list[float] = []
        self.block_medians: list[float] = []
        self.hooks_ms: list[float] = []  # gradsync only: inside its gradient hooks
        self.end_ms: list[float] = []  # gradsync only: inside its end-of-backward callback
        self.clock = [0.0, 0.0]  # seconds in the hooks and in the end of backward, this step


def _timed(method, clock: list[float], index: int):
    """``method`` wrapped: its wall time is added to ``clock[index]``."""
    def timed(*args):
        start = time.perf_counter()
        try:
            return method(*args)
        finally:
            clock[index] += time.perf_counter() - start
    return timed


def build(name: str, kind: str, gradsync) -> Config:
    """The configuration ``name``: its own model with the seed-0 weights, and its optimizer."""
    import torch

    torch.manual_seed(0)
    model = train_step.build_model(kind)
    optimizer = train_step.make_optimizer("sgd", model)
    if name == "empty hook":
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(lambda param: None)
    config = Config(name, model, optimizer)
    if name == "gradsync":
        optimizer = config.optimizer = gradsync.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters())
        # The hooks call optimizer._gs_hook, and the callback is optimizer._gs_end_of_backward, both
        # looked up on the instance when called: instance attributes take their place.
        optimizer._gs_hook = _timed(optimizer._gs_hook, config.clock, 0)
        optimizer._gs_end_of_backward = _timed(optimizer._gs_end_of_backward, config.clock, 1)
    return config


def run_step(config: Config, x, y, loss_fn) -> float:
    """One step; returns backward's time in seconds (and notes gradsync's hook and callback time)."""
    config.clock[:] = [0.0, 0.0]
    config.optimizer.zero_grad()
    loss = loss_fn(config.model(x), y)
    start = time.perf_counter()
    loss.backward()
    backward = time.perf_counter() - start
    config.optimizer.step()
    return backward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["mlp", "cnn", "transformer", "tensors"],
                        default="transformer")
    parser.add_argument("--blocks", type=int, default=20, help="blocks of steps per configuration")
    parser.add_argument("--block-steps", type=int, default=5, help="steps per block")
    parser.add_argument("--warmup", type=int, default=5, help="steps per configuration first")
    parser.add_argument("--fusion-threshold", type=int, default=1 << 20, help="bytes")
    parser.add_argument("--csv", default=None, help="also write the table here")
    args = parser.parse_args()
    environ = dict(os.environ)

    import torch

    import gradsync

    torch.set_num_threads(1)
    gradsync.init(fusion_threshold=args.fusion_threshold)
    if gradsync.size() != 1:
        raise SystemExit(f"hook_cost.py runs at 1 rank, got {gradsync.size()}: "
                         "use interleaved_step.py for several")
    configs = [build(name, args.model, gradsync) for name in CONFIGS]
    parameters = sum(1 for _ in configs[0].model.parameters())
    torch.manual_seed(1)
    x, y = train_step.sample_batch(args.model)
    loss_fn = torch.nn.CrossEntropyLoss()
    for config in alternate(configs, args.blocks, args.warmup, lambda c: run_step(c, x, y, loss_fn)):
        steps = []
        for _ in range(args.block_steps):
            steps.append(run_step(config, x, y, loss_fn) * 1e3)
            if config.name == "gradsync":
                config.hooks_ms.append(config.clock[0] * 1e3)
                config.end_ms.append(config.clock[1] * 1e3)
        config.backward_ms += steps
        config.block_medians.append(statistics.median(steps))
    plain = configs[0]
    print(f"{args.model} ({parameters} parameter tensors), 1 rank, batch {train_step.BATCH}, "
          f"{args.blocks} blocks x {args.block_steps} steps per configuration, interleaved")
    print(f"{'configuration':<14}{'backward ms':>14}{'p25 ms':>14}{'vs plain':>14}{'extra ms':>14}")
    rows = []
    base = statistics.median(plain.backward_ms)
    for config in configs:
        median = statistics.median(config.backward_ms)
        row = {"configuration": config.name, "backward_ms": median,
               "p25_ms": statistics.quantiles(config.backward_ms, n=4)[0],
               "vs_plain": paired_ratio(config, plain), "extra_ms": median - base,
               "hooks_ms": statistics.median(config.hooks_ms) if config.hooks_ms else "",
               "end_of_backward_ms": statistics.median(config.end_ms) if config.end_ms else ""}
        rows.append(row)
        print(f"{config.name:<14}{median:>14.3f}{row['p25_ms']:>14.3f}{row['vs_plain']:>14.3f}"
              f"{row['extra_ms']:>14.3f}")
    hooks, end = rows[-1]["hooks_ms"], rows[-1]["end_of_backward_ms"]
    print(f"gradsync's gradient hooks: {hooks:.3f} ms a step, {hooks * 1e3 / parameters:.2f} µs a "
          f"parameter; its end of backward: {end:.3f} ms a step")
    if args.csv:
        benchenv.write_csv(args.csv, rows, benchenv.environment(1, environ))
        print(f"# wrote {args.csv}")


if __name__ == "__main__":
    main()
