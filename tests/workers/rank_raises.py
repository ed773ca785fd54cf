"""One rank raises in user code mid-training; the other must not hang.

Rank 1 raises before its second backward. Rank 0 then submits gradients rank 1 will never send;
rank 1's interpreter exit runs gradsync.shutdown(), which must make rank 0 fail with ShutdownError
naming rank 1: in optimizer.step() (its pending handles) or, when the news arrives while rank 0 is
still in backward(), at the next submission from a gradient hook. Both are correct; which one happens
depends on timing.
"""

import time

import torch

import gradsync
from gradsync import ShutdownError

torch.set_num_threads(1)
gradsync.init()
rank = gradsync.rank()
model = torch.nn.Linear(8, 2)
optimizer = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          model.named_parameters())
for step in range(2):
    if rank == 1 and step == 1:
        raise ValueError("user code failed on rank 1")
    start = time.monotonic()
    try:
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    except ShutdownError as exc:
        print(f"rank {rank}: step {step} failed after {time.monotonic() - start:.2f} s: {exc}",
              flush=True)
        raise SystemExit(3) from None
