"""The lines a rank-loss worker prints (rank_dies.py, torch_rank_dies.py), which
tests/test_failures.py parses: ``rank R: DIED <time>`` on the victim, ``rank R: ERROR <type>
<time> | <first line>`` on a survivor whose call failed, ``rank R: AGAIN <type> | <first line>``
for its next call (times are time.time(), in seconds)."""

import os
import signal
import sys
import time


class FaultLines:
    """Rank ``rank``'s lines; ``mode`` is how :meth:`die` dies: ``kill`` (SIGKILL to itself),
    ``exit0`` (os._exit(0)) or anything else (os._exit(3))."""

    def __init__(self, rank: int, mode: str) -> None:
        self.rank = rank
        self.mode = mode

    def say(self, line: str) -> None:
        """Print ``rank R: line`` in one write: lines of different ranks do not interleave."""
        sys.stdout.write(f"rank {self.rank}: {line}\n")
        sys.stdout.flush()

    def die(self) -> None:
        """Say DIED with the time, then die by the mode."""
        self.say(f"DIED {time.time():.3f}")
        if self.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(0 if self.mode == "exit0" else 3)

    def error(self, exc: BaseException) -> None:
        """The ERROR line of the call that failed with ``exc``."""
        self.say(f"ERROR {type(exc).__name__} {time.time():.3f} | {str(exc).splitlines()[0]}")

    def again(self, exc: BaseException) -> None:
        """The AGAIN line of the next call, which failed with ``exc``."""
        self.say(f"AGAIN {type(exc).__name__} | {str(exc).splitlines()[0]}")

    def train(self, model, optimizer, victim: int, steps: int = 50) -> None:
        """Train the torch ``model`` (16 inputs) with ``optimizer`` for ``steps`` steps of random
        batches; rank ``victim`` dies (:meth:`die`) at step 3."""
        import torch

        for step in range(steps):
            if self.rank == victim and step == 3:
                self.die()
            optimizer.zero_grad()
            model(torch.randn(8, 16)).sum().backward()
            optimizer.step()
