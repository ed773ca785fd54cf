"""N-rank training with DistributedOptimizer equals one process training on the concatenated batch.

Every rank also trains the single-process reference itself (same seed, whole global batch), then
checks (1) its parameters match the reference within --tolerance and (2) every rank holds exactly the
same parameters (an allgather compared bit for bit). With --num-groups N it also checks that every
step's gradients moved in exactly N grouped responses (one per reduction group).
"""

import argparse

import numpy as np
import torch

import gradsync

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
parser.add_argument("--passes", type=int, default=1, help="backward_passes_per_step")
parser.add_argument("--batch", type=int, default=8, help="samples per rank per backward pass")
parser.add_argument("--tolerance", type=float, default=1e-5)
parser.add_argument("--num-groups", type=int, default=0, help="DistributedOptimizer num_groups")
args = parser.parse_args()

torch.set_num_threads(1)
gradsync.init()
rank, size = gradsync.rank(), gradsync.size()


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.LayerNorm(32),
        torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    model[0].bias.requires_grad_(False)  # a frozen parameter must be skipped consistently
    return model


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if args.optimizer == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)


model, reference = make_model(0), make_model(0)
# Start ranks from different weights: broadcast_parameters must make them equal to rank 0's.
with torch.no_grad():
    for p in model.parameters():
        p.add_(rank * 0.5)
gradsync.broadcast_parameters(model.state_dict(), root_rank=0)
named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
optimizer = gradsync.DistributedOptimizer(make_optimizer(model), named_parameters=named,
                                          backward_passes_per_step=args.passes,
                                          num_groups=args.num_groups)
gradsync.broadcast_optimizer_state(optimizer, root_rank=0)
reference_optimizer = make_optimizer(reference)

executed: list[tuple[str, ...]] = []  # the names of every response the coordinator executes
coordinator = gradsync.runtime.get().coordinator
execute = coordinator._execute
coordinator._execute = lambda responses, replied_ns: (
    executed.extend(response.names for response in responses), execute(responses, replied_ns))

data = torch.Generator().manual_seed(1234)
loss_fn = torch.nn.CrossEntropyLoss()
per_pass = args.batch
for step in range(args.steps):
    # One global batch per step: `passes` micro-batches of `size * batch` samples.
    xs = torch.randn(args.passes, size * per_pass, 12, generator=data)
    ys = torch.randint(0, 3, (args.passes, size * per_pass), generator=data)
    optimizer.zero_grad()
    for micro in range(args.passes):
        mine = slice(rank * per_pass, (rank + 1) * per_pass)
        loss = loss_fn(model(xs[micro, mine]), ys[micro, mine]) / args.passes
        loss.backward()
    optimizer.step()
    if args.num_groups:
        grads = [names for names in executed if names[0].startswith("grad.")]
        assert len(grads) == args.num_groups and all(
            name.startswith("grad.group.") for names in grads for name in names), grads
        assert sum(len(names) for names in grads) == len(named), grads
    executed.clear()

    reference_optimizer.zero_grad()
    for micro in range(args.passes):
        (loss_fn(reference(xs[micro]), ys[micro]) / args.passes).backward()
    reference_optimizer.step()

worst = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
everyone = gradsync.allgather(flat.reshape(1, -1))
identical = all(torch.equal(everyone[0], everyone[r]) for r in range(size))
print(f"rank {rank}: max |param - single-process param| = {worst:.3g}; identical on all ranks: "
      f"{identical}", flush=True)
assert worst <= args.tolerance, f"rank {rank}: parameters differ from single-process by {worst}"
assert identical, f"rank {rank}: ranks hold different parameters"
assert np.isfinite(worst)
gradsync.shutdown()
print(f"rank {rank}: EQUIVALENT", flush=True)
