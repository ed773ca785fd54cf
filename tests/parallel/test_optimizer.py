"""DistributedOptimizer and the broadcast helpers: gradients against every rank's local gradients
recomputed on each rank (torch alone), misuse errors, the broadcasts against the root's values,
training with join() and on a process set against one process, gradient compression, and the
first step's check that the ranks hold the same parameters.

The join test runs again with ``GRADSYNC_JOIN_DIVISOR=contributors`` and without the response
cache: see ``VARIANTS``.
"""

from __future__ import annotations

import copy
import gc
import logging
import os
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest
from reference import raises

import gradsync

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
torch.set_num_threads(1)

RANKS = (1, 2, 3)
VARIANTS = {
    "join-by-contributors": {"env": {"GRADSYNC_JOIN_DIVISOR": "contributors"}, "ranks": (1, 2, 3),
                             "k": "join"},
    "join-no-cache": {"env": {"GRADSYNC_CACHE_CAPACITY": "0"}, "ranks": (3,), "k": "join"},
}


def model_and_optimizer(seed=0, lr=0.1, **kwargs):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return model, gradsync.DistributedOptimizer(optimizer, model.named_parameters(), **kwargs)


def batch_of(r: int, seed: int = 7):
    """Rank ``r``'s local batch: any rank can build any rank's."""
    g = torch.Generator().manual_seed(seed + r)
    return torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def averaged_local_gradients(model, size: int) -> list:
    """The average over every rank of the gradient its batch gives ``model``'s parameters."""
    total = None
    for r in range(size):
        twin = copy.deepcopy(model)
        for p in twin.parameters():
            p.grad = None
        loss_of(twin, *batch_of(r)).backward()
        grads = [p.grad / size for p in twin.parameters()]
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return total


def test_gradients_are_averaged_across_ranks_by_synchronize(rank, size):
    model, opt = model_and_optimizer()
    loss_of(model, *batch_of(rank)).backward()
    opt.synchronize()
    for p, want in zip(model.parameters(), averaged_local_gradients(model, size)):
        assert torch.allclose(p.grad, want, atol=1e-6), (p.grad, want)
    with opt.skip_synchronize():
        opt.step()


@pytest.mark.parametrize("in_backward", [True, False], ids=["synchronize-in-backward", "deferred"])
def test_zero_grad_between_backward_and_step_discards_the_averaged_gradients(rank, in_backward):
    # Gradients are averaged when backward() returns (deferred: zero_grad() first finishes the
    # round in flight), so zero_grad() races with nothing: as in one process it discards them,
    # and step() changes no parameter.
    model, opt = model_and_optimizer(synchronize_in_backward=in_backward)
    before = [p.detach().clone() for p in model.parameters()]
    loss_of(model, *batch_of(rank)).backward()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_duplicate_and_missing_parameter_names_are_a_value_error():
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with raises(ValueError, "duplicate names", "'w'"):
        gradsync.DistributedOptimizer(opt, named_parameters=[("w", model.weight), ("w", model.bias)])
    with raises(ValueError, "no name in named_parameters", "[1]"):
        gradsync.DistributedOptimizer(opt, named_parameters=[("weight", model.weight)])


def test_wrapping_a_distributed_optimizer_again_is_a_value_error():
    _, opt = model_and_optimizer()
    with raises(ValueError, "already a DistributedOptimizer"):
        gradsync.DistributedOptimizer(opt)


def test_a_scheduler_created_before_wrapping_is_a_value_error():
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    with raises(ValueError, "before creating LR schedulers"):
        gradsync.DistributedOptimizer(opt, model.named_parameters())


def test_a_scheduler_created_after_wrapping_steps_the_distributed_optimizer():
    model = torch.nn.Linear(3, 3)
    opt = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        model.named_parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    scheduler.step()
    assert opt.param_groups[0]["lr"] == 0.05


def test_tied_parameters_are_reduced_once_and_averaged(rank, size):
    """Pins an internal: ``_gs_names``, the names the optimizer reduces (an average reduced
    twice would still be the average)."""
    torch.manual_seed(0)
    shared = torch.nn.Linear(3, 3)
    model = torch.nn.Sequential(shared, torch.nn.Tanh(), shared)  # the same weights twice
    opt = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        model.named_parameters())
    assert len(opt._gs_names) == 2  # weight and bias, once each
    model(torch.full((2, 3), float(rank + 1))).sum().backward()
    opt.synchronize()
    want = None
    for r in range(size):  # the average of every rank's local gradient
        twin = copy.deepcopy(model)
        twin(torch.full((2, 3), float(r + 1))).sum().backward()
        g = twin[0].weight.grad / size
        want = g if want is None else want + g
    assert torch.allclose(shared.weight.grad, want, atol=1e-6)
    with opt.skip_synchronize():
        opt.step()


def test_two_optimizers_without_names_reduced_in_one_backward_train_as_one_process(rank, size):
    """A GAN's generator and discriminator, each wrapped without named_parameters, both reached by
    one backward pass: their gradients are in flight together, so their names must differ."""
    def models():
        torch.manual_seed(3)
        return (torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4)),
                torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Tanh(), torch.nn.Linear(2, 1)))

    def step(generator, discriminator, optimizers, z):
        discriminator(generator(z)).pow(2).mean().backward()
        for optimizer in optimizers:
            optimizer.step()

    generator, discriminator = models()
    optimizers = [gradsync.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))
                  for m in (generator, discriminator)]
    names = [set(o._parameter_names.values()) for o in optimizers]
    assert not names[0] & names[1], names
    noise = [torch.randn(5, 3, generator=torch.Generator().manual_seed(r)) for r in range(size)]
    step(generator, discriminator, optimizers, noise[rank])
    expected = models()
    step(*expected, [torch.optim.SGD(m.parameters(), lr=0.1) for m in expected], torch.cat(noise))
    for got, want in zip([*generator.parameters(), *discriminator.parameters()],
                         [p for m in expected for p in m.parameters()]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_second_optimizer_over_the_same_parameters_is_a_value_error_until_the_first_is_gone():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    first = gradsync.DistributedOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1),
                                          model[0].named_parameters(prefix="0"))
    with raises(ValueError, "'0.weight' is already reduced by another DistributedOptimizer"):
        gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      model.named_parameters())
    # Disjoint parameters are fine, and so is re-wrapping once the first optimizer is gone.
    gradsync.DistributedOptimizer(torch.optim.SGD(model[1].parameters(), lr=0.1),
                                  model[1].named_parameters(prefix="1"))
    del first
    gc.collect()  # the caught error's traceback holds it in a reference cycle
    again = gradsync.DistributedOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1),
                                          model[0].named_parameters(prefix="0"))
    model(torch.ones(1, 3)).sum().backward()
    again.step()  # the dropped optimizer's hooks are gone: no second allreduce of the same grads


def test_a_second_backward_through_a_wrapped_module_before_step_is_a_runtime_error():
    torch.manual_seed(0)
    generator, discriminator = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    d_opt = gradsync.DistributedOptimizer(torch.optim.SGD(discriminator.parameters(), lr=0.1),
                                          discriminator.named_parameters(prefix="D"))
    discriminator(torch.randn(4, 2)).mean().backward()  # D's own loss
    with raises(RuntimeError, "parameter 'D.", "GAN", "requires_grad_(False)"):
        discriminator(generator(torch.randn(4, 2))).mean().backward()  # G's loss through D
    d_opt.step()


@pytest.mark.parametrize("as_dense", [False, True], ids=["allgathered", "densified"])
def test_sparse_gradients_are_averaged_allgathered_or_densified(rank, size, as_dense):
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    opt = gradsync.DistributedOptimizer(torch.optim.SGD(embedding.parameters(), lr=0.1),
                                        embedding.named_parameters(prefix=f"emb{as_dense}"),
                                        sparse_as_dense=as_dense)
    embedding(torch.tensor([rank % 10, (rank + 3) % 10, 7])).sum().backward()  # rows overlap
    opt.synchronize()
    want = torch.zeros(10, 3)
    for r in range(size):
        for row in (r % 10, (r + 3) % 10, 7):
            want[row] += 1.0 / size
    assert torch.allclose(embedding.weight.grad.to_dense(), want, atol=1e-6)
    assert embedding.weight.grad.is_sparse  # densified for the allreduce only (Horovod's)
    with opt.skip_synchronize():
        opt.step()


def test_frozen_parameters_get_no_gradient(rank):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    model[0].weight.requires_grad_(False)
    opt = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        model.named_parameters())
    loss_of(model, *batch_of(rank)).backward()
    opt.step()
    assert model[0].weight.grad is None
    assert model[0].bias.grad is not None


def test_clipping_between_synchronize_and_step_matches_one_process_on_the_whole_batch(rank, size):
    model, opt = model_and_optimizer()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    loss_of(model, *batch_of(rank)).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    with opt.skip_synchronize():
        opt.step()
    batches = [batch_of(r) for r in range(size)]
    loss_of(reference, torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=1e-6), (p - q).abs().max()


def test_more_backward_passes_than_backward_passes_per_step_is_a_runtime_error(rank):
    model, opt = model_and_optimizer(backward_passes_per_step=2)
    x, y = batch_of(rank)
    loss_of(model, x, y).backward()
    loss_of(model, x, y).backward()
    with raises(RuntimeError, "backward_passes_per_step=2", "raise backward_passes_per_step"):
        loss_of(model, x, y).backward()
    opt.step()


def test_a_parameter_unused_on_some_ranks_is_averaged_with_zeros_from_them(rank, size):
    torch.manual_seed(0)
    trunk, branch = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    params = list(trunk.named_parameters(prefix="trunk")) + list(branch.named_parameters(prefix="branch"))
    opt = gradsync.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1), params)
    x, _ = batch_of(rank)
    (trunk(x) + (branch(x) if rank == 0 else 0)).sum().backward()  # the branch is unused on ranks > 0
    opt.step()  # must not hang
    x0, _ = batch_of(0)
    want = x0.sum(0).expand(2, 4) / size  # d(sum(branch(x0)))/dW, averaged with zeros
    assert torch.allclose(branch.weight.grad, want, atol=1e-6), (branch.weight.grad, want)


def test_a_step_without_a_new_backward_reduces_the_current_gradients(rank, size):
    # Whether a backward ran on this rank is this rank's data: every step() reduces every
    # parameter once (as Horovod's), so a rank without a backward never leaves the others waiting.
    model, opt = model_and_optimizer()
    loss_of(model, *batch_of(rank)).backward()
    opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.grad.fill_(float(rank))
    opt.step()
    mean = (size - 1) / 2
    assert all(torch.all(p.grad == mean) for p in model.parameters())


def test_a_parameter_group_added_after_wrapping_is_reduced(rank, size):
    model, opt = model_and_optimizer()
    extra = torch.nn.Parameter(torch.zeros(3))
    opt.add_param_group({"params": [extra]})
    (loss_of(model, *batch_of(rank)) + (extra * (rank + 1)).sum()).backward()
    opt.step()
    mean = sum(r + 1 for r in range(size)) / size
    assert torch.allclose(extra.grad, torch.full((3,), mean)), extra.grad


def test_broadcast_parameters_gives_every_rank_the_roots_parameters_and_buffers(rank, size):
    torch.manual_seed(rank)  # different weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    model[1].running_mean.fill_(rank)
    root = size - 1
    gradsync.broadcast_parameters(model.state_dict(), root_rank=root)
    torch.manual_seed(root)
    want = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    for (name, a), (_, b) in zip(model.named_parameters(), want.named_parameters()):
        assert torch.equal(a, b), name
    assert torch.all(model[1].running_mean == root)


def test_broadcast_parameters_takes_named_parameters_too(rank):
    torch.manual_seed(rank)
    model = torch.nn.Linear(3, 3)
    gradsync.broadcast_parameters(model.named_parameters(), root_rank=0)
    torch.manual_seed(0)
    assert torch.equal(model.weight, torch.nn.Linear(3, 3).weight)


def test_broadcast_parameters_of_two_modules_whose_names_repeat_gives_the_roots_values(rank):
    def modules(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(3, 2)), torch.nn.Sequential(torch.nn.Linear(2, 4))

    first, second = modules(seed=rank)
    pairs = [*first.named_parameters(), *second.named_parameters()]
    assert [n for n, _ in pairs] == ["0.weight", "0.bias", "0.weight", "0.bias"]
    gradsync.broadcast_parameters(pairs, root_rank=0)
    roots = modules(seed=0)
    for (_, got), want in zip(pairs, [p for m in roots for p in m.parameters()]):
        assert torch.equal(got, want)


def test_broadcast_parameters_from_a_root_outside_the_world_is_a_value_error(size):
    model = torch.nn.Linear(3, 3)
    with raises(ValueError, "root_rank"):
        gradsync.broadcast_parameters(model.state_dict(), root_rank=size)


def test_broadcast_optimizer_state_gives_every_rank_the_roots_lazy_state_and_options(rank, size):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    adam = torch.optim.Adam(model.parameters(), lr=0.001 * (rank + 1), betas=(0.8, 0.9))
    if rank == 0:  # only the root has stepped: its state exists, the others' is still empty
        model(torch.ones(1, 3)).sum().backward()
        adam.step()
    gradsync.broadcast_optimizer_state(adam, root_rank=0)
    state = adam.state[model.weight]
    gathered = gradsync.allgather(state["exp_avg"].reshape(1, -1).clone())
    group = adam.param_groups[0]
    assert group["lr"] == 0.001 and isinstance(group["lr"], float), group["lr"]
    assert group["betas"] == (0.8, 0.9) and isinstance(group["betas"], tuple)
    assert int(state["step"]) == 1 and state["exp_avg"].abs().sum() > 0
    assert all(torch.equal(gathered[0], gathered[r]) for r in range(size)), "the root's moments exactly"


def test_load_state_dict_waits_for_the_reductions_in_flight_and_forgets_them(rank, size):
    model, opt = model_and_optimizer()
    initial = copy.deepcopy(model)
    saved = opt.state_dict()
    loss_of(model, *batch_of(rank)).backward()
    opt.load_state_dict(saved)
    opt.zero_grad()  # allowed now
    loss_of(model, *batch_of(rank)).backward()
    opt.step()
    # One SGD step (lr 0.1) with the second backward's average alone: the first round left nothing.
    for p, p0, g in zip(model.parameters(), initial.parameters(), averaged_local_gradients(initial, size)):
        assert torch.allclose(p, p0 - 0.1 * g, atol=1e-6), (p, p0 - 0.1 * g)


@pytest.mark.parametrize("bad", [-1, True, "2", 1.5], ids=["-1", "True", "'2'", "1.5"])
def test_num_groups_that_is_not_a_non_negative_int_is_a_value_error(rank, bad):
    with raises(ValueError, "num_groups", repr(bad), f"rank {rank}"):
        model_and_optimizer(num_groups=bad)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_num_groups_with_mixed_dtypes_an_unused_parameter_and_a_sparse_gradient(rank, size, groups):
    """One group holding float32 and float64 parameters (one grouped allreduce per dtype), a
    parameter unused on ranks > 0 (reduced with zeros) and a sparse gradient (allgathered)."""
    w32 = torch.nn.Parameter(torch.zeros(3))
    w64 = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    unused = torch.nn.Parameter(torch.zeros(4))
    embedding = torch.nn.Embedding(5, 2, sparse=True)
    named = [("w32", w32), ("w64", w64), ("unused", unused), ("emb", embedding.weight)]
    opt = gradsync.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1),
                                        [(f"g{groups}.{n}", p) for n, p in named], num_groups=groups)
    loss = (w32 * (rank + 1)).sum() + (w64 * (rank + 1)).sum() + embedding(torch.tensor([1])).sum()
    if rank == 0:
        loss = loss + (unused * 2).sum()
    loss.backward()
    opt.synchronize()
    mean = (size + 1) / 2  # the average of 1 .. size
    assert torch.allclose(w32.grad, torch.full((3,), mean)), w32.grad
    assert w64.grad.dtype == torch.float64
    assert torch.allclose(w64.grad, torch.full((2,), mean, dtype=torch.float64))
    assert torch.allclose(unused.grad, torch.full((4,), 2.0 / size)), unused.grad
    assert embedding.weight.grad.is_sparse
    assert torch.allclose(embedding.weight.grad.to_dense()[1], torch.ones(2)), embedding.weight.grad
    with opt.skip_synchronize():
        opt.step()


def _uneven_batches(r: int):
    """Rank ``r`` has 2 + r batches."""
    g = torch.Generator().manual_seed(100 + r)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(2 + r)]


def _reference_training(size: int, by_contributors: bool) -> torch.nn.Module:
    """One process: at each step, the sum of the gradients of the ranks that still had a batch
    over the world size (joined ranks count as zeros, as in Horovod and DDP), or over those
    ranks with ``GRADSYNC_JOIN_DIVISOR=contributors``."""
    torch.manual_seed(0)
    reference = torch.nn.Linear(3, 1)
    every = [_uneven_batches(r) for r in range(size)]
    for step in range(2 + size - 1):
        active = [r for r in range(size) if step < len(every[r])]
        grads = []
        for r in active:
            reference.zero_grad()
            torch.nn.functional.mse_loss(reference(every[r][step][0]), every[r][step][1]).backward()
            grads.append([p.grad.clone() for p in reference.parameters()])
        with torch.no_grad():
            for i, p in enumerate(reference.parameters()):
                p -= 0.1 * sum(g[i] for g in grads) / (len(active) if by_contributors else size)
    return reference


def test_ranks_that_run_out_of_batches_join_and_the_last_rank_trains_like_one_process(rank, size):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        model.named_parameters())
    for x, y in _uneven_batches(rank):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    last = gradsync.join()
    assert last == size - 1, "the rank with the most batches joins last"
    if rank == size - 1:  # it stepped through every batch: it must match exactly
        by_contributors = os.environ.get("GRADSYNC_JOIN_DIVISOR") == "contributors"
        reference = _reference_training(size, by_contributors)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(p, q, atol=1e-6), (p, q)


# ---- process sets and compression ----------------------------------------------------------------

@dataclass(frozen=True)
class Sets:
    evens: gradsync.ProcessSet  # world ranks 0, 2, ... (the global set at one rank)
    odds: gradsync.ProcessSet | None  # 1, 3, ... (None at one rank)
    mine: gradsync.ProcessSet


@pytest.fixture(scope="module")
def sets():
    """Two disjoint process sets, registered for this file's tests and removed after them."""
    rank, size = gradsync.rank(), gradsync.size()
    if size == 1:
        yield Sets(gradsync.global_process_set, None, gradsync.global_process_set)
        return
    evens, odds = gradsync.add_process_set(range(0, size, 2)), gradsync.add_process_set(range(1, size, 2))
    yield Sets(evens, odds, evens if rank % 2 == 0 else odds)
    gradsync.remove_process_set(odds)
    gradsync.remove_process_set(evens)


def _toolkit_batch(r: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(8, 5, generator=g), torch.randn(8, 2, generator=g)


def _toolkit_model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _local_gradients(net, r: int, step: int) -> list:
    net.zero_grad()
    torch.nn.functional.mse_loss(net(_toolkit_batch(r, step)[0]), _toolkit_batch(r, step)[1]).backward()
    return [p.grad.detach().clone() for p in net.parameters()]


def test_training_on_a_process_set_equals_one_process_on_the_members_batches(sets, rank):
    net, reference = _toolkit_model(), _toolkit_model()
    opt = gradsync.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.2),
                                        net.named_parameters(), process_set=sets.mine)
    for step in range(4):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(_toolkit_batch(rank, step)[0]), _toolkit_batch(rank, step)[1]).backward()
        opt.step()
        per_rank = [_local_gradients(reference, r, step) for r in sets.mine.ranks]
        with torch.no_grad():
            for i, p in enumerate(reference.parameters()):
                p -= 0.2 * sum(g[i] for g in per_rank) / len(per_rank)
    for p, q in zip(net.parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=1e-6), (p, q)


def test_a_rank_outside_the_optimizers_process_set_steps_on_its_own_gradients(sets, rank, size):
    """As Horovod's: a rank outside the optimizer's process set reduces nothing."""
    if size == 1:
        pytest.skip("at one rank the only set is the global one")
    if rank % 2 == 0:
        return  # the odd ranks wrap an optimizer for the even set
    net, reference = _toolkit_model(), _toolkit_model()
    opt = gradsync.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                        process_set=sets.evens)
    opt.zero_grad()
    x, y = _toolkit_batch(rank, 0)
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.step()
    own = _local_gradients(reference, rank, 0)
    with torch.no_grad():
        for p, q, g in zip(net.parameters(), reference.parameters(), own):
            assert torch.allclose(p, q - 0.1 * g, atol=1e-6), (p, q - 0.1 * g)


@pytest.mark.parametrize(("compression", "dtype", "tolerance"), [
    pytest.param(gradsync.Compression.fp16, np.float16, 1e-3, id="fp16"),
    pytest.param(gradsync.Compression.bf16, ml_dtypes.bfloat16, 8e-3, id="bf16")])
def test_16_bit_compression_averages_the_gradients_rounded_to_16_bits(rank, size, compression, dtype,
                                                                      tolerance):
    """The reference: each rank's gradient cast to 16 bits, summed in float32, scaled by 1/size,
    rounded once; decompressed to the parameter's dtype."""
    net = _toolkit_model()
    opt = gradsync.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                        net.named_parameters(), compression=compression)
    torch.nn.functional.mse_loss(net(_toolkit_batch(rank, 1)[0]), _toolkit_batch(rank, 1)[1]).backward()
    opt.synchronize()
    per_rank = [_local_gradients(_toolkit_model(), r, 1) for r in range(size)]
    for i, p in enumerate(net.parameters()):
        total = sum(g[i].numpy().astype(dtype).astype(np.float32) for g in per_rank)
        want = (total * np.float32(1 / size)).astype(dtype).astype(np.float32)
        got = p.grad.numpy()
        assert got.dtype == np.float32, got.dtype
        assert np.array_equal(got.astype(dtype).astype(np.float32), got), "not rounded to 16 bits"
        assert np.allclose(got, want, rtol=tolerance, atol=1e-6), (got, want)


class _Scaling:
    """A user compressor: multiplies by 4 before the allreduce and divides after; counts calls."""

    def __init__(self) -> None:
        self.calls = [0, 0]

    def compress(self, tensor):
        self.calls[0] += 1
        return tensor * 4, 4.0

    def decompress(self, tensor, context):
        self.calls[1] += 1
        return tensor / context


def test_a_user_compressor_is_called_once_per_gradient_each_way(rank, size):
    compressor = _Scaling()
    net = _toolkit_model()
    opt = gradsync.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                        net.named_parameters(), compression=compressor)
    torch.nn.functional.mse_loss(net(_toolkit_batch(rank, 2)[0]), _toolkit_batch(rank, 2)[1]).backward()
    opt.synchronize()
    params = len(list(net.parameters()))
    assert compressor.calls == [params, params]
    per_rank = [_local_gradients(_toolkit_model(), r, 2) for r in range(size)]
    for i, p in enumerate(net.parameters()):
        assert torch.allclose(p.grad, sum(g[i] for g in per_rank) / size, atol=1e-6), i


def test_a_compression_without_compress_and_decompress_is_a_type_error():
    with raises(TypeError, "compress() and decompress()"):
        gradsync.DistributedOptimizer(torch.optim.SGD(_toolkit_model().parameters(), lr=0.1),
                                      compression="fp16")


# ---- the first step's check that every rank holds the same parameters ----------------------------

class _Capture(logging.Handler):
    """The "different parameters" warnings of the gradsync logger."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "different parameters" in record.getMessage():
            self.messages.append(record.getMessage())


@pytest.fixture
def warnings():
    """The messages of the warnings about different parameters logged during the test."""
    capture = _Capture()
    logging.getLogger("gradsync").addHandler(capture)
    yield capture.messages
    logging.getLogger("gradsync").removeHandler(capture)


def _train(model: torch.nn.Module, steps: int = 2, **kwargs) -> None:
    optimizer = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                              model.named_parameters(), **kwargs)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


def test_the_first_step_warns_once_on_rank_0_when_the_ranks_hold_different_parameters(rank, size, warnings):
    _train(_mlp(seed=rank))  # seeded by rank, not broadcast
    if rank == 0 and size > 1:
        assert len(warnings) == 1, warnings  # once: at the first step only
        assert "4 of 4 differ, e.g. '0.weight', '0.bias', '2.weight'" in warnings[0]
        assert "gradsync.broadcast_parameters(model.state_dict(), root_rank=0)" in warnings[0]
    else:
        assert warnings == []


def test_the_first_step_does_not_warn_after_broadcast_parameters(rank, warnings):
    model = _mlp(seed=rank)
    gradsync.broadcast_parameters(model.state_dict(), root_rank=0)
    _train(model)
    assert warnings == []


def test_the_warning_names_the_one_parameter_that_differs(rank, size, warnings):
    model = _mlp(seed=0)
    if rank == size - 1:
        with torch.no_grad():
            model[2].bias.add_(1e-6)
    _train(model)
    if rank == 0 and size > 1:
        assert len(warnings) == 1 and "1 of 4 differ, e.g. '2.bias'." in warnings[0], warnings
    else:
        assert warnings == []


def test_a_rank_whose_first_step_comes_after_a_join_does_not_check_alone(rank, size, warnings):
    """The last rank has no batch in epoch 0: the others have run their check already, so a
    check of its own would stall."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                              model.named_parameters())
    for epoch in range(2):
        for _ in range(0 if rank == size - 1 and epoch == 0 else 2):
            optimizer.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
        gradsync.join()
    assert warnings == []


def test_on_a_process_set_its_first_rank_warns_and_the_fix_names_the_set(rank, size, warnings):
    if size < 3:
        pytest.skip("needs a set of two ranks that does not start at rank 0")
    pair = gradsync.add_process_set([1, 2])
    pair_id = pair.process_set_id
    try:
        if pair.included():
            _train(_mlp(seed=rank), steps=1, process_set=pair)
    finally:
        gradsync.remove_process_set(pair)
    if rank == 1:
        assert len(warnings) == 1 and "4 of 4 differ" in warnings[0], warnings
        assert (f"gradsync.broadcast_parameters(model.state_dict(), root_rank=1, process_set=<this "
                f"optimizer's ProcessSet(id {pair_id}, ranks [1, 2])>)") in warnings[0], warnings
    else:
        assert warnings == []
