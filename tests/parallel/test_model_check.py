"""Ranks whose models differ get one clear error naming the parameters, not an internal collective's.

Every rank builds a model, wraps its optimizer and runs backward; where the models differ, the
first round's model check raises CollectiveError on every rank, with a message that says how many
parameters each rank has and which ones differ (as DDP's construction check does).
"""

from __future__ import annotations

import pytest
import torch

import gradsync
import gradsync.torch as gst

pytestmark = pytest.mark.torch
RANKS = (2, 4)


def _train_one_backward(model: torch.nn.Module, optimizer_factory=gst.DistributedOptimizer) -> None:
    torch.manual_seed(0)
    opt = optimizer_factory(torch.optim.SGD(model.parameters(), lr=0.1),
                            named_parameters=model.named_parameters())
    model(torch.randn(3, 2)).sum().backward()
    opt.step()


def _error_of(model: torch.nn.Module, **kwargs) -> str:
    with pytest.raises(gradsync.CollectiveError) as caught:
        _train_one_backward(model, **kwargs)
    gradsync.barrier()  # nothing of the failed round is left in flight
    return str(caught.value)


def test_an_extra_parameter_on_the_last_rank_is_named_with_every_ranks_count(rank, size):
    torch.set_num_threads(1)
    layers = [torch.nn.Linear(2, 4), torch.nn.Linear(4, 1)]
    if rank == size - 1:
        layers.append(torch.nn.Linear(1, 1))
    message = _error_of(torch.nn.Sequential(*layers))
    counts = ", ".join(f"rank {r}: {6 if r == size - 1 else 4}" for r in range(size))
    assert message.startswith(f"gradsync: rank {rank}: the ranks' models differ: parameters per rank: "
                              f"{counts}. Present on some ranks only: '2.weight' (1, 1) only on "
                              f"rank(s) [{size - 1}]; '2.bias' (1,) only on rank(s) [{size - 1}].")
    assert "Every rank must build the same model" in message


def test_a_parameter_of_another_shape_is_named_with_each_ranks_shape(rank, size):
    torch.set_num_threads(1)
    hidden = 5 if rank == 1 else 4
    message = _error_of(torch.nn.Sequential(torch.nn.Linear(2, hidden), torch.nn.Linear(hidden, 1)))
    shapes = ", ".join(f"rank {r}: ({5 if r == 1 else 4}, 2) float32" for r in range(size))
    assert f"First parameter that differs: '0.weight': {shapes}." in message
    assert f"parameters per rank: {', '.join(f'rank {r}: 4' for r in range(size))}." in message


def test_zero_redundancy_optimizer_runs_the_same_check(rank, size):
    torch.set_num_threads(1)
    layers = [torch.nn.Linear(2, 4), torch.nn.Linear(4, 1)]
    if rank == 0:
        layers.insert(0, torch.nn.Linear(2, 2))
    message = _error_of(torch.nn.Sequential(*layers), optimizer_factory=gst.ZeroRedundancyOptimizer)
    assert f"parameters per rank: rank 0: 6, {', '.join(f'rank {r}: 4' for r in range(1, size))}." in message


def test_the_same_model_on_every_rank_trains_without_error(rank, size):
    torch.set_num_threads(1)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Linear(4, 1))
    gst.broadcast_parameters(model.state_dict(), root_rank=0)
    _train_one_backward(model)
    weights = gst.allgather(model[0].weight.detach().reshape(1, -1))
    assert all(torch.equal(weights[0], w) for w in weights)


def test_adasum_checks_before_combining_updates(rank, size):
    torch.set_num_threads(1)
    layers = [torch.nn.Linear(2, 4), torch.nn.Linear(4, 1)]
    if rank == size - 1:
        layers.append(torch.nn.Linear(1, 1))

    def adasum(optimizer, named_parameters):
        return gst.DistributedOptimizer(optimizer, named_parameters=named_parameters, op=gst.Adasum)

    message = _error_of(torch.nn.Sequential(*layers), optimizer_factory=adasum)
    assert f"'2.weight' (1, 1) only on rank(s) [{size - 1}]" in message
