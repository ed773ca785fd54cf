"""A ``new_group([0, 1])`` that rank 1 never calls, with a 2 s timeout: rank 0 raises torch's
DistBackendError naming rank 1 after about 2 s instead of waiting forever in the communicator's
set-up; the default group still works afterwards on both ranks. Lines: ``rank R: ERROR <type>
<seconds> | <message>`` and ``rank R: AFTER <sum>``."""

import time
from datetime import timedelta

import torch
import torch.distributed as dist

import gradsync.torch  # noqa: F401 - registers the backend

torch.set_num_threads(1)
dist.init_process_group(backend="gradsync", init_method="gradsync://", timeout=timedelta(seconds=60))
rank = dist.get_rank()
if rank == 0:
    start = time.monotonic()
    try:
        dist.new_group([0, 1], timeout=timedelta(seconds=2))
    except Exception as exc:  # noqa: BLE001 - the test reads its type and message
        print(f"rank 0: ERROR {type(exc).__name__} {time.monotonic() - start:.2f} | {exc}", flush=True)
    else:
        print("rank 0: ERROR none 0 | new_group returned", flush=True)
tensor = torch.ones(2)
dist.all_reduce(tensor)
print(f"rank {rank}: AFTER {tensor.tolist()}", flush=True)
dist.destroy_process_group()
