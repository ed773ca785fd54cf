"""DistributedOptimizer's arguments pick one reduction strategy, once, at construction
(gradsync.torch.reducer.factory.pick_strategy): which one each combination gets, and that Adasum's
registers no gradient hook. Pins an internal (``_gs_strategy``): the behaviour of each strategy is
specified by test_optimizer.py, test_small_gradient_buckets.py, test_comm_hooks.py and
test_adasum.py."""

from __future__ import annotations

import dataclasses

import pytest

import gradsync

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
torch.set_num_threads(1)

RANKS = (1, 2)


def wrapped(**kwargs):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    optimizer = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                              named_parameters=model.named_parameters(), **kwargs)
    return model, optimizer


@pytest.mark.parametrize("kwargs, kind", [
    ({}, "SmallGradientBuckets"),
    ({"groups": 2}, "PerGradient"),
    ({"num_groups": 1}, "PerGradient"),
    ({"compression": gradsync.Compression.fp16}, "PerGradient"),
    ({"gradient_as_bucket_view": False}, "PerGradient"),
    ({"gradient_as_bucket_view": True}, "BucketViews"),
    ({"comm_hook": gradsync.allreduce_hook}, "BucketViews"),
    ({"comm_hook": gradsync.allreduce_hook, "gradient_as_bucket_view": False}, "Buckets"),
    ({"groups": 1, "gradient_as_bucket_view": True}, "BucketViews"),
])
def test_the_arguments_pick_one_strategy(kwargs, kind):
    _, optimizer = wrapped(**kwargs)
    assert type(optimizer._gs_strategy).__name__ == kind


def test_without_small_gradient_buckets_every_gradient_goes_alone(monkeypatch):
    state = gradsync.process.runtime.get()
    monkeypatch.setattr(state, "config", dataclasses.replace(state.config, small_gradient_bytes=0))
    _, optimizer = wrapped()
    assert type(optimizer._gs_strategy).__name__ == "PerGradient"


def test_adasum_combines_updates_on_several_ranks_and_is_average_on_one():
    model, optimizer = wrapped(op=gradsync.Adasum)
    kind = type(optimizer._gs_strategy).__name__
    assert kind == ("AdasumDeltas" if gradsync.size() > 1 else "SmallGradientBuckets")
    assert optimizer._gs_strategy.reduction.op == (gradsync.Adasum if gradsync.size() > 1
                                                  else gradsync.Average)
    hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    assert hooks == (0 if gradsync.size() > 1 else 2)  # Adasum's gradients stay local


def test_zero_redundancy_shards_with_its_own_strategy():
    model = torch.nn.Linear(3, 2)
    optimizer = gradsync.ZeroRedundancyOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                 named_parameters=model.named_parameters())
    assert type(optimizer._gs_strategy).__name__ == "ShardReducer"
    plan = optimizer.shard_plan
    owned = {param for rank in range(plan.size) for param in plan.pieces(rank)}
    assert owned == set(model.parameters())
