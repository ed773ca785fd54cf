"""Data-parallel training of a small MLP on scikit-learn's digits data set with gradsync on Ray.

The Ray twin of examples/train_digits.py: the same data, model, batch size and optimizer, run as a
function on the ranks of one gradsync job placed by Ray, in one of two ways:

* ``RayExecutor`` (the default; horovod.ray's API): ``executor.run(train, ...)`` on N workers;
* ``--ray-train``: Ray Train's ``DataParallelTrainer`` with ``backend_config=GradsyncConfig()``,
  reporting each epoch's metrics and a checkpoint of rank 0's model through ``ray.train.report``.

    python examples/train_digits_ray.py                   # starts a local Ray, 2 workers
    python examples/train_digits_ray.py --ray-train       # the same under Ray Train
    python examples/train_digits_ray.py --address auto    # on a running Ray cluster

The last line printed is ``test_accuracy=<float>``. Lines marked ``# gradsync:`` are the ones that
make the function data-parallel; docs/ray.md explains how the ranks start.
"""

from __future__ import annotations

import os
import tempfile

import digits
import numpy as np
import ray

from gradsync.ray import GradsyncConfig, RayExecutor


def parse_args():
    parser = digits.training_arguments(__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2, help="ranks (one Ray worker each)")
    parser.add_argument("--address", default=None,
                        help="the Ray cluster to join (ray.init's address, e.g. auto); "
                             "default: start a local one")
    parser.add_argument("--ray-train", action="store_true",
                        help="run under Ray Train's DataParallelTrainer instead of RayExecutor")
    return parser.parse_args()


def train(config: dict) -> float:
    """Train on this rank's shards for ``config["epochs"]`` epochs; the test accuracy over all ranks.

    Runs on every rank. Under Ray Train (``config["report"]``) it reports each epoch's metrics, and
    rank 0's model as a checkpoint with the last.
    """
    import torch
    from torch import nn

    import gradsync
    import gradsync.torch
    from gradsync.metrics import Metric

    torch.set_num_threads(1)  # one rank per core
    gradsync.init()  # gradsync: the ranks of the job Ray placed
    rank, size = gradsync.rank(), gradsync.size()
    x_train, y_train, x_test, y_test = (torch.tensor(a) for a in config["data"])
    torch.manual_seed(config["seed"])
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    # gradsync: N ranks take the steps of one process with an N-times larger batch and learning rate.
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"] * size, momentum=0.9)
    opt = gradsync.torch.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    gradsync.torch.broadcast_parameters(model.state_dict(), root_rank=0)

    def test_accuracy() -> float:
        with torch.no_grad():
            x, y = x_test[rank::size], y_test[rank::size]
            metric = Metric("test_accuracy")  # gradsync: averaged over the ranks' shards
            metric.update((model(x).argmax(1) == y).double().mean().item(), weight=len(y))
            return metric.compute()

    for epoch in range(config["epochs"]):
        loss_metric = Metric("train_loss")
        batches = digits.epoch_batches(len(y_train), epoch, config["seed"], rank, size, config["batch_size"])
        for batch in torch.from_numpy(batches):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
            loss.backward()
            opt.step()
            loss_metric.update(loss.item(), weight=len(batch))
        metrics = {"epoch": epoch + 1, "train_loss": loss_metric.compute(), "test_accuracy": test_accuracy()}
        if config.get("report"):
            report(metrics, model if rank == 0 and epoch + 1 == config["epochs"] else None)
    return metrics["test_accuracy"]


def report(metrics: dict, model=None) -> None:
    """``ray.train.report`` of ``metrics``, with ``model`` saved as the checkpoint when given."""
    import torch
    from ray import train as ray_train

    if model is None:
        ray_train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as directory:
        torch.save(model.state_dict(), os.path.join(directory, "model.pt"))
        ray_train.report(metrics, checkpoint=ray_train.Checkpoint.from_directory(directory))


def main() -> None:
    args = parse_args()
    ray.init(address=args.address or "local", num_cpus=None if args.address else args.num_workers,
             include_dashboard=False, logging_level="warning")
    ray.cloudpickle.register_pickle_by_value(digits)  # the workers cannot import it from here
    config = {"data": digits.load_split(np.int64), "epochs": args.epochs, "batch_size": args.batch_size,
              "lr": args.lr, "seed": args.seed}
    if args.ray_train:
        from ray.train import RunConfig, ScalingConfig
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

        trainer = DataParallelTrainer(train, train_loop_config={**config, "report": True},
                                      backend_config=GradsyncConfig(timeout_s=120),  # gradsync
                                      scaling_config=ScalingConfig(num_workers=args.num_workers),
                                      run_config=RunConfig(storage_path=tempfile.mkdtemp()))
        result = trainer.fit()
        print(f"checkpoint: {result.checkpoint.path}")
        accuracy = result.metrics["test_accuracy"]
    else:
        # gradsync: one Ray worker per rank, the ranks of one MPI job.
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=args.num_workers)
        executor.start(extra_env_vars={"OMP_NUM_THREADS": "1"})
        try:
            accuracy = executor.run(train, args=[config])[0]
        finally:
            executor.shutdown()
    print(f"test_accuracy={accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
