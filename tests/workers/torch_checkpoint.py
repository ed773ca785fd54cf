"""torch.distributed.checkpoint (DCP) at one rank count, reloaded at another, on backend gradsync.

    torch_checkpoint.py save|load DIRECTORY

``save``: an FSDP2 ``fully_shard`` model and a DDP model, each with Adam, train 2 steps; their
model and optimizer state (``get_state_dict``: sharded DTensors for FSDP2) goes to DIRECTORY with
``dcp.save``. ``load``: fresh models with other values, sharded over this job's ranks, take the
checkpoint (``dcp.load``, ``set_state_dict``). Either way every rank then compares the full state
(``full_state_dict=True``: gathered through gradsync) with one process's, computed here alone:
the same model and Adam on the same batch. Every rank trains on that batch, so averaging over 2
ranks (or 1) is exact and the values must be equal, not close. Each rank reports the keys it
compared and those that differ (tests/workers/report.py).
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from report import report
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import gradsync.torch  # noqa: F401 - registers the backend

MODE, DIRECTORY = sys.argv[1], sys.argv[2]
STEPS = 2


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()


def train(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(5, 3, generator=g, dtype=torch.float64)
    for _ in range(STEPS):
        torch.nn.functional.mse_loss(module(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def flat(model_state: dict, optim_state: dict) -> dict[str, torch.Tensor]:
    """``model.<name>`` and ``optim.<name>.<exp_avg|exp_avg_sq|step>`` -> a full tensor."""
    values = {f"model.{k}": v for k, v in model_state.items()}
    for name, state in optim_state["state"].items():
        values.update({f"optim.{name}.{k}": torch.as_tensor(v) for k, v in state.items()})
    return values


def alone() -> dict[str, torch.Tensor]:
    """One process's state: no torch.distributed at all."""
    module = model(1)
    optimizer = torch.optim.Adam(module.parameters(), lr=0.01)
    train(module, optimizer)
    names = {p: n for n, p in module.named_parameters()}
    return flat(module.state_dict(), {"state": {names[p]: s for p, s in optimizer.state.items()}})


def distributed(kind: str, mesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The FSDP2 or DDP model with its Adam: the saved values when saving, others when loading."""
    module = model(1 if MODE == "save" else 2)
    if kind == "fsdp2":
        for layer in (module[0], module[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)
    else:
        module = DistributedDataParallel(module)
    optimizer = torch.optim.Adam(module.parameters(), lr=0.01)
    if MODE == "save":
        train(module, optimizer)
    return module, optimizer


torch.set_num_threads(1)
dist.init_process_group(backend="gradsync", init_method="gradsync://")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
models = {kind: distributed(kind, mesh) for kind in ("fsdp2", "ddp")}
state = {}
for kind, (module, optimizer) in models.items():
    state[f"{kind}.model"], state[f"{kind}.optim"] = get_state_dict(module, optimizer)
if MODE == "save":
    dcp.save(state, checkpoint_id=DIRECTORY)
else:
    dcp.load(state, checkpoint_id=DIRECTORY)
    for kind, (module, optimizer) in models.items():
        set_state_dict(module, optimizer, model_state_dict=state[f"{kind}.model"],
                       optim_state_dict=state[f"{kind}.optim"])
want = alone()
compared, differ = [], []
for kind, (module, optimizer) in models.items():
    got = flat(*get_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True)))
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for key, value in got.items():
        compared.append(f"{kind}.{key}")
        if not torch.equal(value.reshape(want[key].shape).to(want[key].dtype), want[key]):
            differ.append(f"{kind}.{key}: max |difference| {(value - want[key]).abs().max().item():.3g}")
report(rank=dist.get_rank(), size=dist.get_world_size(), mode=MODE, compared=compared, differ=differ)
dist.destroy_process_group()
