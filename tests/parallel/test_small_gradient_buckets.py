"""DistributedOptimizer's default buckets for small gradients (GRADSYNC_SMALL_GRADIENT_BYTES):
gradients below the size share one allreduce per bucket, larger ones are allreduced alone, and
the averaged gradients equal the average of every rank's local gradients (torch alone, on each
rank) either way."""

from __future__ import annotations

import copy
import dataclasses

import pytest

import gradsync

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
torch.set_num_threads(1)


def build():
    """Linear(300, 300): a 360,000-byte weight (above the default 256 KiB) and a small bias;
    Linear(300, 4): both small."""
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.ReLU(), torch.nn.Linear(300, 4))


def batch_of(r: int):
    g = torch.Generator().manual_seed(11 + r)
    return torch.randn(6, 300, generator=g), torch.randn(6, 4, generator=g)


def loss_of(model, r: int):
    x, y = batch_of(r)
    return torch.nn.functional.mse_loss(model(x), y)


def reference(model) -> dict[str, torch.Tensor]:
    """The average over every rank of the gradients its batch gives ``model``."""
    total: dict[str, torch.Tensor] = {}
    for r in range(gradsync.size()):
        twin = copy.deepcopy(model)
        loss_of(twin, r).backward()
        for name, p in twin.named_parameters():
            total[name] = total.get(name, 0) + p.grad
    return {name: g / gradsync.size() for name, g in total.items()}


@pytest.fixture
def submitted(monkeypatch):
    """The names of the collectives this rank submits, in order."""
    queue = gradsync.process.runtime.get().coordinator.queue
    names: list[str] = []
    push_all = queue.push_all

    def recorded(entries, wake=True):
        names.extend(entry.request.name for entry in entries)
        return push_all(entries, wake)

    monkeypatch.setattr(queue, "push_all", recorded)
    return names


def grad_names(names: list[str]) -> list[str]:
    return [n for n in names if n.startswith("grad.")]


def train_one_backward(model, **kwargs):
    optimizer = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                              named_parameters=model.named_parameters(), **kwargs)
    expected = reference(model)
    loss_of(model, gradsync.rank()).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-6, atol=1e-7, msg=name)
    optimizer.step()


def test_small_gradients_share_a_bucket_and_a_large_one_goes_alone(submitted):
    model = build()
    train_one_backward(model)
    grads = grad_names(submitted)
    assert "grad.0.weight" in grads, grads
    assert not {"grad.0.bias", "grad.2.weight", "grad.2.bias"} & set(grads), grads
    assert len([n for n in grads if n.startswith("grad.bucket.")]) == 1, grads


def test_with_the_size_0_every_gradient_goes_alone(submitted, monkeypatch):
    state = gradsync.process.runtime.get()
    monkeypatch.setattr(state, "config", dataclasses.replace(state.config, small_gradient_bytes=0))
    train_one_backward(build())
    grads = grad_names(submitted)
    assert {"grad.0.weight", "grad.0.bias", "grad.2.weight", "grad.2.bias"} <= set(grads), grads
    assert not [n for n in grads if n.startswith("grad.bucket.")], grads


def test_a_compression_reduces_every_gradient_alone(submitted):
    model = build()
    optimizer = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                              named_parameters=model.named_parameters(),
                                              compression=gradsync.Compression.fp16)
    loss_of(model, gradsync.rank()).backward()
    optimizer.step()
    grads = grad_names(submitted)
    assert {"grad.0.bias", "grad.2.weight", "grad.2.bias"} <= set(grads), grads
    assert not [n for n in grads if n.startswith("grad.bucket.")], grads


class Deep(torch.nn.Module):
    """21 Linear(8, 8) layers (42 small gradients: several of the batches a bucket's gradients
    are copied in by, and a remainder), and one layer no rank uses. Odd ranks skip layers 3 and
    17, so their gradients come from even ranks only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(21))
        self.unused = torch.nn.Linear(8, 8)

    def forward(self, x, r: int):
        for i, layer in enumerate(self.layers):
            if not (r % 2 and i in (3, 17)):
                x = torch.tanh(layer(x))
        return x


def deep_grads(model: Deep, r: int) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(40 + r)
    x, y = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    torch.nn.functional.mse_loss(model(x, r), y).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_bucket_of_many_gradients_some_missing_on_some_ranks_averages_them(set_to_none):
    """Every step's gradients equal the average of the ranks' own (zeros where a rank has none;
    None where no rank has one), round after round, in one bucket of 42 gradients."""
    model = Deep()
    optimizer = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                              named_parameters=model.named_parameters())
    for _ in range(3):
        optimizer.zero_grad(set_to_none=set_to_none)
        expected: dict[str, torch.Tensor] = {}
        for r in range(gradsync.size()):
            for name, grad in deep_grads(copy.deepcopy(model), r).items():
                if grad is not None:
                    expected[name] = expected.get(name, 0) + grad / gradsync.size()
        deep_grads(model, gradsync.rank())
        for name, p in model.named_parameters():
            if name.startswith("unused."):
                assert p.grad is None or not set_to_none and not p.grad.any(), name
            else:
                torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)
        optimizer.step()
