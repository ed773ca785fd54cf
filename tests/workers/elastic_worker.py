"""What the elastic test workers (elastic_train.py, elastic_train_jax.py) share: their common
command line, their JSON log and the SIGKILL of one rank at one step of the first launch."""

import argparse
import json
import os
import shutil
import signal
import time
from pathlib import Path

import gradsync
from gradsync.run import store


def parser() -> argparse.ArgumentParser:
    """--log, --out, --epochs, and --kill RANK:STEP with --kill-slots, --commit-copy, --slots-file."""
    p = argparse.ArgumentParser()
    p.add_argument("--log", type=Path, required=True)
    p.add_argument("--out", type=Path)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--kill")
    p.add_argument("--kill-slots", default="localhost:2")
    p.add_argument("--commit-copy", type=Path)
    p.add_argument("--slots-file", type=Path)
    return p


def log(path: Path, **entry) -> None:
    """Append ``entry`` with this launch, rank, size and the time to the JSON-lines file ``path``."""
    entry.update(launch=store.restart_count(), rank=gradsync.rank(), size=gradsync.size(), time=time.time())
    with open(path, "a") as out:
        out.write(json.dumps(entry) + "\n")


def kill_if_due(args: argparse.Namespace, step: int) -> None:
    """On the first launch, at ``--kill RANK:STEP``: write ``--kill-slots`` to ``--slots-file``, copy
    the last commit to ``--commit-copy``, log the time and SIGKILL this process."""
    if store.restart_count() != 0 or not args.kill:
        return
    if [gradsync.rank(), step] == [int(x) for x in args.kill.split(":")]:
        args.slots_file.write_text(args.kill_slots + "\n")
        shutil.copy(store.state_dir() / store.COMMITTED, args.commit_copy)
        log(args.log, event="kill", step=step)
        os.kill(os.getpid(), signal.SIGKILL)
