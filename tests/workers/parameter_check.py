"""The first step() warns when the ranks hold different parameters (no broadcast_parameters).

Optimizers in turn: (1) models seeded by rank, not broadcast: rank 0 warns once, naming the
parameters, and no other rank warns; (2) the same after broadcast_parameters: no warning; (3) one
parameter differs on the last rank only: the warning names that parameter alone; (4) join(): the
last rank has no batch in epoch 0, so its first step() comes after a join, when the others have
run their check already: it must not check alone (that would stall); (5) with 3 ranks, an
optimizer on the set [1, 2]: world rank 1 warns, and the fix it gives names that root and set.
Every rank prints ``parameter_check rank R: ok`` at the end.
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

torch.manual_seed(0)
joiner = torch.nn.Linear(8, 1)
optimizer = gradsync.DistributedOptimizer(torch.optim.SGD(joiner.parameters(), lr=0.1),
                                          joiner.named_parameters())
for epoch in range(2):
    for _ in range(0 if rank == size - 1 and epoch == 0 else 2):
        optimizer.zero_grad()
        joiner(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    gradsync.join()
assert warnings() == []
del optimizer
gc.collect()

if size == 3:
    pair = gradsync.add_process_set([1, 2])
    if pair.included():
        torch.manual_seed(rank)
        model = torch.nn.Linear(8, 1)
        optimizer = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                  model.named_parameters(), process_set=pair)
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        found = warnings()
        if rank == 1:
            assert len(found) == 1 and "2 of 2 differ" in found[0], found
            assert ("gradsync.broadcast_parameters(model.state_dict(), root_rank=1, process_set=<this "
                    "optimizer's ProcessSet(id 1, ranks [1, 2])>)") in found[0], found
        else:
            assert found == [], found
print(f"parameter_check rank {rank}: ok", flush=True)
