"""Elastic training of the digits MLP: Horovod's ``pytorch_mnist_elastic.py`` with gradsync.

The script is written against Horovod's elastic API (``import gradsync.torch as hvd``): the model,
optimizer, sampler and counters live in a ``TorchState`` committed every ``--batches-per-commit``
steps. Under the elastic driver a lost worker or an added host restarts the job from the last
commit on the hosts available (docs/elastic.md); the reset callback rescales the learning rate to
the new number of ranks.

    gradsyncrun -np 2 python examples/train_digits_elastic.py
    gradsyncrun --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh \\
        python examples/train_digits_elastic.py
    mpiexec -n 2 python examples/train_digits_elastic.py   # a fixed number of ranks, no recovery

Rank 0 prints one line per epoch; the last line it prints is ``test_accuracy=<float>``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

import gradsync.torch as hvd

sys.path.insert(0, str(Path(__file__).parent))
from train_digits import evaluate, load_data  # noqa: E402  (the same data and test metric)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batches-per-commit", type=int, default=5,
                        help="steps between commits: what a failure loses at most")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step on each rank")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="learning rate of one process; multiplied by the number of ranks "
                             "(again after each restart, by the reset callback)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_data()
    dataset = torch.utils.data.TensorDataset(x_train, y_train)
    # hvd: each rank draws its share of the epoch's samples not yet processed, at any number of ranks.
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=args.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    loss_fn = nn.CrossEntropyLoss()

    def on_state_reset():  # hvd: after a restart at another size, the learning rate follows it
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, batch=0)
    state.register_reset_callbacks([on_state_reset])

    @hvd.elastic.run  # hvd: starts from the last commit after a restart
    def train(state):
        while state.epoch < args.epochs:
            for batch_idx, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                loss_fn(model(x), y).backward()
                optimizer.step()
                state.sampler.record_batch(batch_idx, args.batch_size)
                state.batch += 1
                if state.batch % args.batches_per_commit == 0:
                    state.commit()
            state.epoch, state.batch = state.epoch + 1, 0
            state.sampler.set_epoch(state.epoch)
            state.commit()
            if hvd.rank() == 0:
                print(f"epoch {state.epoch}/{args.epochs} on {hvd.size()} ranks", flush=True)

    train(state)
    final = evaluate(model, x_test, y_test)
    if hvd.rank() == 0:
        print(f"test_accuracy={final:.4f}", flush=True)


if __name__ == "__main__":
    main()
