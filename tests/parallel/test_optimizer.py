"""DistributedOptimizer and the broadcast helpers: gradients against every rank's local gradients
recomputed on each rank (torch alone), misuse errors, the broadcasts against the root's values,
and training with join() against one process.

The join test runs again with ``GRADSYNC_JOIN_DIVISOR=contributors`` and without the response
cache: see ``VARIANTS``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os

import pytest

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


@contextlib.contextmanager
def raises(error: type[BaseException], *fragments: str):
    """The block raises ``error`` whose message holds every fragment."""
    with pytest.raises(error) as caught:
        yield
    for fragment in fragments:
        assert fragment in str(caught.value), f"{fragment!r} not in {str(caught.value)!r}"


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


def test_zero_grad_between_backward_and_step_is_a_runtime_error(rank):
    model, opt = model_and_optimizer()
    loss_of(model, *batch_of(rank)).backward()
    with raises(RuntimeError, "zero_grad() was called after backward()", "step()", f"rank {rank}"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()  # fine after step


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
    assert embedding.weight.grad.is_sparse != as_dense
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


def test_a_step_without_a_new_backward_does_not_reduce_again(rank):
    model, opt = model_and_optimizer()
    loss_of(model, *batch_of(rank)).backward()
    opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.grad.fill_(float(rank))
    opt.step()  # no new backward: gradients stay local (a reduction would average the ranks)
    assert all(torch.all(p.grad == rank) for p in model.parameters())


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


def test_load_state_dict_waits_for_the_reductions_in_flight_and_forgets_them(rank):
    model, opt = model_and_optimizer()
    saved = opt.state_dict()
    loss_of(model, *batch_of(rank)).backward()
    opt.load_state_dict(saved)
    opt.zero_grad()  # allowed now
    loss_of(model, *batch_of(rank)).backward()
    opt.step()


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
