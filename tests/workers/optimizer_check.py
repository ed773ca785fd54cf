"""Behaviour of DistributedOptimizer and the broadcast helpers, checked on every rank.

Each case is a function; a failing case prints its traceback and aborts the whole job so that no
rank waits for it.
"""

import copy

import torch
from harness import run_checks

import gradsync

torch.set_num_threads(1)
gradsync.init()
rank, size = gradsync.rank(), gradsync.size()


def model_and_optimizer(seed=0, lr=0.1, **kwargs):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return model, gradsync.DistributedOptimizer(optimizer, model.named_parameters(), **kwargs)


def local_batch(seed=7):
    g = torch.Generator().manual_seed(seed + rank)
    return torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)


def raises(exc_type, *fragments):
    """Context manager: the block raises exc_type with every fragment in its message."""
    class Expect:
        def __enter__(self):
            return self

        def __exit__(self, kind, value, tb):
            assert kind is not None, f"expected {exc_type.__name__}, nothing was raised"
            assert issubclass(kind, exc_type), f"expected {exc_type.__name__}, got {kind.__name__}: {value}"
            for fragment in fragments:
                assert fragment in str(value), f"{fragment!r} not in message: {value}"
            return True
    return Expect()


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def case_zero_grad_between_backward_and_step_discards_the_averaged_gradients():
    # Gradients are averaged when backward() returns, so zero_grad() there races with nothing:
    # as in one process it discards them, and step() changes no parameter.
    for in_backward in (True, False):  # False: zero_grad() first finishes the round in flight
        model, opt = model_and_optimizer(synchronize_in_backward=in_backward)
        before = [p.detach().clone() for p in model.parameters()]
        loss_of(model, *local_batch()).backward()
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        opt.step()
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def case_gradients_are_averaged_across_ranks():
    model, opt = model_and_optimizer()
    loss_of(model, *local_batch()).backward()
    opt.synchronize()
    expected = None
    for r in range(size):  # recompute every rank's local gradient here
        twin = copy.deepcopy(model)
        for p, q in zip(twin.parameters(), model.parameters()):
            p.data.copy_(q.data)
            p.grad = None
        g = torch.Generator().manual_seed(7 + r)
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
        loss_of(twin, x, y).backward()
        grads = [p.grad / size for p in twin.parameters()]
        expected = grads if expected is None else [a + b for a, b in zip(expected, grads)]
    for p, e in zip(model.parameters(), expected):
        assert torch.allclose(p.grad, e, atol=1e-6), (p.grad, e)
    with opt.skip_synchronize():
        opt.step()


def case_duplicate_and_missing_names_raise():
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dup = [("w", model.weight), ("w", model.bias)]
    with raises(ValueError, "duplicate names", "'w'"):
        gradsync.DistributedOptimizer(opt, named_parameters=dup)
    with raises(ValueError, "no name in named_parameters", "[1]"):
        gradsync.DistributedOptimizer(opt, named_parameters=[("weight", model.weight)])


def case_wrapping_twice_raises():
    _, opt = model_and_optimizer()
    with raises(ValueError, "already a DistributedOptimizer"):
        gradsync.DistributedOptimizer(opt)


def case_scheduler_created_before_wrapping_raises():
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    with raises(ValueError, "before creating LR schedulers"):
        gradsync.DistributedOptimizer(opt, model.named_parameters())
    # The supported order: wrap first, then the scheduler steps the distributed optimizer.
    opt = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        model.named_parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    scheduler.step()
    assert opt.param_groups[0]["lr"] == 0.05


def case_tied_parameters_are_reduced_once():
    torch.manual_seed(0)
    shared = torch.nn.Linear(3, 3)
    model = torch.nn.Sequential(shared, torch.nn.Tanh(), shared)  # the same weights twice
    opt = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        model.named_parameters())
    assert len(opt._gs_names) == 2  # weight and bias, once each
    x = torch.full((2, 3), float(rank + 1))
    model(x).sum().backward()
    opt.synchronize()
    expected = None
    for r in range(size):  # the average of every rank's local gradient
        twin = copy.deepcopy(model)
        twin(torch.full((2, 3), float(r + 1))).sum().backward()
        g = twin[0].weight.grad / size
        expected = g if expected is None else expected + g
    assert torch.allclose(shared.weight.grad, expected, atol=1e-6)
    with opt.skip_synchronize():
        opt.step()


def case_overlapping_distributed_optimizers_raise():
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
    again = gradsync.DistributedOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1),
                                          model[0].named_parameters(prefix="0"))
    model(torch.ones(1, 3)).sum().backward()
    again.step()  # the dropped optimizer's hooks are gone: no second allreduce of the same grads


def case_second_backward_through_a_wrapped_module_raises():
    torch.manual_seed(0)
    generator, discriminator = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    d_opt = gradsync.DistributedOptimizer(torch.optim.SGD(discriminator.parameters(), lr=0.1),
                                          discriminator.named_parameters(prefix="D"))
    discriminator(torch.randn(4, 2)).mean().backward()  # D's own loss
    with raises(RuntimeError, "parameter 'D.", "GAN", "requires_grad_(False)"):
        discriminator(generator(torch.randn(4, 2))).mean().backward()  # G's loss through D
    d_opt.step()


def case_sparse_gradients_allgathered_or_densified():
    for as_dense in (False, True):
        torch.manual_seed(0)
        embedding = torch.nn.Embedding(10, 3, sparse=True)
        opt = gradsync.DistributedOptimizer(torch.optim.SGD(embedding.parameters(), lr=0.1),
                                            embedding.named_parameters(prefix=f"emb{as_dense}"),
                                            sparse_as_dense=as_dense)
        rows = torch.tensor([rank % 10, (rank + 3) % 10, 7])  # overlapping rows across ranks
        embedding(rows).sum().backward()
        opt.synchronize()
        grad = embedding.weight.grad.to_dense()
        expected = torch.zeros(10, 3)
        for r in range(size):
            for row in (r % 10, (r + 3) % 10, 7):
                expected[row] += 1.0 / size
        assert torch.allclose(grad, expected, atol=1e-6), (as_dense, grad, expected)
        assert embedding.weight.grad.is_sparse  # densified for the allreduce only (Horovod's)
        with opt.skip_synchronize():
            opt.step()


def case_frozen_parameters_are_skipped():
    torch.manual_seed(0)
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    model2[0].weight.requires_grad_(False)
    opt2 = gradsync.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1),
                                         model2.named_parameters())
    loss_of(model2, *local_batch()).backward()
    opt2.step()
    assert model2[0].weight.grad is None
    assert model2[0].bias.grad is not None


def case_skip_synchronize_for_clipping_matches_single_process():
    model, opt = model_and_optimizer()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    # Rebuild the exact local batches of every rank for the reference.
    batches = []
    for r in range(size):
        g = torch.Generator().manual_seed(7 + r)
        batches.append((torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)))
    x_all = torch.cat([b[0] for b in batches])
    y_all = torch.cat([b[1] for b in batches])
    loss_of(model, *batches[rank]).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    with opt.skip_synchronize():
        opt.step()
    loss_of(reference, x_all, y_all).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=1e-6), (p - q).abs().max()


def case_too_many_backward_passes_raises():
    model, opt = model_and_optimizer(backward_passes_per_step=2)
    x, y = local_batch()
    loss_of(model, x, y).backward()
    loss_of(model, x, y).backward()
    with raises(RuntimeError, "backward_passes_per_step=2", "raise backward_passes_per_step"):
        loss_of(model, x, y).backward()
    opt.step()


def case_unused_parameter_on_one_rank_is_reduced_with_zeros():
    torch.manual_seed(0)
    trunk, branch = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    params = list(trunk.named_parameters(prefix="trunk")) + list(branch.named_parameters(prefix="branch"))
    opt = gradsync.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1), params)
    x, _ = local_batch()
    out = trunk(x) + (branch(x) if rank == 0 else 0)  # the branch is unused on ranks > 0
    out.sum().backward()
    opt.step()  # must not hang
    g = torch.Generator().manual_seed(7)
    x0 = torch.randn(5, 4, generator=g)
    expected = x0.sum(0).expand(2, 4) / size  # d(sum(branch(x0)))/dW, averaged with zeros
    assert torch.allclose(branch.weight.grad, expected, atol=1e-6), (branch.weight.grad, expected)


def case_step_without_backward_reduces_the_current_gradients():
    # Whether a backward ran on this rank is this rank's data: every step() reduces every
    # parameter once (as Horovod's), so a rank without a backward never leaves the others waiting.
    model, opt = model_and_optimizer()
    loss_of(model, *local_batch()).backward()
    opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.grad.fill_(float(rank))
    opt.step()
    mean = (size - 1) / 2
    assert all(torch.all(p.grad == mean) for p in model.parameters())


def case_add_param_group_after_wrapping_is_reduced():
    model, opt = model_and_optimizer()
    extra = torch.nn.Parameter(torch.zeros(3))
    opt.add_param_group({"params": [extra]})
    loss = loss_of(model, *local_batch()) + (extra * (rank + 1)).sum()
    loss.backward()
    opt.step()
    mean = sum(r + 1 for r in range(size)) / size
    assert torch.allclose(extra.grad, torch.full((3,), mean)), extra.grad


def case_broadcast_parameters_from_root():
    torch.manual_seed(rank)  # different weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    model[1].running_mean.fill_(rank)
    root = size - 1
    gradsync.broadcast_parameters(model.state_dict(), root_rank=root)
    torch.manual_seed(root)
    expected = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    for (name, a), (_, b) in zip(model.named_parameters(), expected.named_parameters()):
        assert torch.equal(a, b), name
    assert torch.all(model[1].running_mean == root)
    gradsync.broadcast_parameters(model.named_parameters(), root_rank=0)
    with raises(ValueError, "root_rank"):
        gradsync.broadcast_parameters(model.state_dict(), root_rank=size)


def case_broadcast_optimizer_state_lazy_adam_and_options():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    adam = torch.optim.Adam(model.parameters(), lr=0.001 * (rank + 1), betas=(0.8, 0.9))
    if rank == 0:  # only the root has stepped: its state exists, the others' is still empty
        model(torch.ones(1, 3)).sum().backward()
        adam.step()
    gradsync.broadcast_optimizer_state(adam, root_rank=0)
    group = adam.param_groups[0]
    assert group["lr"] == 0.001 and isinstance(group["lr"], float), group["lr"]
    assert group["betas"] == (0.8, 0.9) and isinstance(group["betas"], tuple)
    state = adam.state[model.weight]
    assert int(state["step"]) == 1 and state["exp_avg"].abs().sum() > 0
    # Every rank now holds the root's moments exactly.
    gathered = gradsync.allgather(state["exp_avg"].reshape(1, -1).clone())
    assert all(torch.equal(gathered[0], gathered[r]) for r in range(size))


def case_load_state_dict_resets_pending_state():
    model, opt = model_and_optimizer()
    saved = opt.state_dict()
    loss_of(model, *local_batch()).backward()
    opt.load_state_dict(saved)  # waits for the allreduces in flight, forgets them
    opt.zero_grad()  # allowed now
    loss_of(model, *local_batch()).backward()
    opt.step()


def case_num_groups_must_be_a_non_negative_int():
    for bad in (-1, True, "2", 1.5):
        with raises(ValueError, "num_groups", repr(bad), f"rank {rank}"):
            model_and_optimizer(num_groups=bad)


def case_num_groups_with_mixed_dtypes_an_unused_parameter_and_a_sparse_gradient():
    """One group holding float32 and float64 parameters (one grouped allreduce per dtype), a
    parameter unused on ranks > 0 (reduced with zeros) and a sparse gradient (allgathered)."""
    w32 = torch.nn.Parameter(torch.zeros(3))
    w64 = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    unused = torch.nn.Parameter(torch.zeros(4))
    embedding = torch.nn.Embedding(5, 2, sparse=True)
    named = [("w32", w32), ("w64", w64), ("unused", unused), ("emb", embedding.weight)]
    for groups in (1, 2, 4):
        opt = gradsync.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1),
                                            [(f"g{groups}.{n}", p) for n, p in named],
                                            num_groups=groups)
        loss = (w32 * (rank + 1)).sum() + (w64 * (rank + 1)).sum() + embedding(torch.tensor([1])).sum()
        if rank == 0:
            loss = loss + (unused * 2).sum()
        loss.backward()
        opt.synchronize()
        mean = (size + 1) / 2  # the average of 1 .. size
        assert torch.allclose(w32.grad, torch.full((3,), mean)), (groups, w32.grad)
        assert w64.grad.dtype == torch.float64 and torch.allclose(w64.grad, torch.full((2,), mean,
                                                                                         dtype=torch.float64))
        assert torch.allclose(unused.grad, torch.full((4,), 2.0 / size)), (groups, unused.grad)
        assert embedding.weight.grad.is_sparse
        assert torch.allclose(embedding.weight.grad.to_dense()[1], torch.ones(2)), embedding.weight.grad
        with opt.skip_synchronize():
            opt.step()
        opt.zero_grad()
        del opt


count = run_checks(globals(), prefix="case_")
print(f"rank {rank}: {count} optimizer cases passed", flush=True)
