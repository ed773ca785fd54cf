"""The first step() warns when the ranks hold different parameters (no broadcast_parameters).

Three optimizers, in turn: (1) models seeded by rank, not broadcast: rank 0 warns once, naming
the parameters, and no other rank warns; (2) the same after broadcast_parameters: no warning;
(3) one parameter differs on the last rank only: the warning names that parameter alone. Every
rank prints ``parameter_check rank R: ok`` at the end.
"""

import gc
import logging

import torch

import gradsync

torch.set_num_threads(1)
gradsync.init()
rank, size = gradsync.rank(), gradsync.size()


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "different parameters" in record.getMessage():
            self.messages.append(record.getMessage())


capture = Capture()
logging.getLogger("gradsync").addHandler(capture)


def train(model: torch.nn.Module, steps: int = 2) -> None:
    optimizer = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                              model.named_parameters())
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    del optimizer
    gc.collect()  # its hooks go with it, so the next optimizer may take the same parameters


def warnings() -> list[str]:
    found, capture.messages = capture.messages, []
    return found


torch.manual_seed(rank)
model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
train(model)
found = warnings()
if rank == 0 and size > 1:
    assert len(found) == 1, found  # once: at the first step only
    assert "4 of 4 differ, e.g. '0.weight', '0.bias', '2.weight'" in found[0], found
    assert "gradsync.broadcast_parameters(model.state_dict(), root_rank=0)" in found[0], found
else:
    assert found == [], found

gradsync.broadcast_parameters(model.state_dict(), root_rank=0)
train(model)
assert warnings() == []

gradsync.broadcast_parameters(model.state_dict(), root_rank=0)
if rank == size - 1:
    with torch.no_grad():
        model[2].bias.add_(1e-6)
train(model)
found = warnings()
if rank == 0 and size > 1:
    assert len(found) == 1 and "1 of 4 differ, e.g. '2.bias'." in found[0], found
else:
    assert found == [], found
print(f"parameter_check rank {rank}: ok", flush=True)
