"""gradsync.torch.DistributedOptimizer and the broadcast helpers with Horovod's arguments.

References are computed in this one process from every rank's (seeded) batch: the average of the
ranks' gradients for Average, and for Adasum the numpy formula of Maleki et al. applied to the
ranks' optimizer updates (Horovod's Adasum optimizer reduces updates, not gradients).
"""

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import gradsync.torch as hvd  # noqa: E402

pytestmark = pytest.mark.torch
RANKS = (1, 2, 3, 4)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def batch(r, step=0):
    g = torch.Generator().manual_seed(100 * step + r)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def loss_of(net, r, step=0):
    x, y = batch(r, step)
    return torch.nn.functional.mse_loss(net(x), y)


def grads_of(r, step=0):
    net = model()
    loss_of(net, r, step).backward()
    return [p.grad.clone() for p in net.parameters()]


def averaged_sgd_step(lr, step=0):
    """The parameters after one SGD step on the ranks' averaged gradients."""
    per_rank = [grads_of(q, step) for q in range(hvd.size())]
    with torch.no_grad():
        return [p - lr * sum(g[i] for g in per_rank) / hvd.size()
                for i, p in enumerate(model().parameters())]


def train_one_step(opt, net):
    opt.zero_grad()
    loss_of(net, hvd.rank()).backward()
    opt.step()


def assert_parameters(net, expected):
    for p, q in zip(net.parameters(), expected):
        assert torch.allclose(p, q, atol=1e-6), (p, q)


def test_arguments_in_horovods_positional_order():
    net = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                   net.named_parameters(), hvd.Compression.none, 1, hvd.Average,
                                   1.0, 0, None, False, hvd.global_process_set)
    train_one_step(opt, net)
    assert_parameters(net, averaged_sgd_step(0.1))


@pytest.mark.parametrize("groups", [2, "lists"])
def test_groups_reduce_like_single_tensors(groups):
    net = model()
    params = list(net.parameters())
    if groups == "lists":
        groups = [[params[0], params[3]], [params[1]]]  # params[2] is reduced on its own
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                   net.named_parameters(), groups=groups)
    train_one_step(opt, net)
    assert_parameters(net, averaged_sgd_step(0.1))


def test_num_groups_is_groups_by_its_older_name():
    net = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                   net.named_parameters(), num_groups=3)
    train_one_step(opt, net)
    assert_parameters(net, averaged_sgd_step(0.1))


@pytest.mark.parametrize("groups, num_groups, message", [
    (-1, 0, "groups must be"), ("two", 0, "groups must be"), ([["x"]], 0, "list of parameters"),
    (2, 3, "not both")])
def test_bad_groups_are_refused(groups, num_groups, message):
    net = model()
    with pytest.raises(ValueError, match=message):
        hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                 groups=groups, num_groups=num_groups)


def test_a_parameter_in_two_groups_is_refused():
    net = model()
    weight = next(net.parameters())
    with pytest.raises(ValueError, match="in groups twice"):
        hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                 groups=[[weight], [weight]])


def test_step_after_synchronize_warns_as_horovod_unless_skipped():
    net = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net.named_parameters())
    for skip in (False, True):
        opt.zero_grad()
        loss_of(net, hvd.rank()).backward()
        opt.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if skip:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        texts = [str(w.message) for w in caught]
        if skip:
            assert texts == []
        else:
            assert len(texts) == 1
            assert "optimizer.step() called without optimizer.skip_synchronize()" in texts[0]


def test_parameter_names_are_unique_and_agree_across_ranks():
    net = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(
        [{"params": net[0].parameters()}, {"params": net[2].parameters()}], lr=0.1))
    names = opt._parameter_names
    assert len(set(names.values())) == len(names) == 4
    assert hvd.allgather_object(sorted(names.values())) == [sorted(names.values())] * hvd.size()


def test_set_backward_passes_per_step_accumulates_that_many():
    net = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net.named_parameters())
    opt.set_backward_passes_per_step(2)
    opt.zero_grad()
    for _ in range(2):
        loss_of(net, hvd.rank()).backward()
    opt.step()
    assert_parameters(net, averaged_sgd_step(0.2))  # two summed passes: twice the averaged step


def test_sparse_as_dense_gives_sparse_adam_a_sparse_gradient():
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    torch.nn.init.constant_(embedding.weight, 1.0)
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(embedding.parameters()), lr=0.1),
                                   sparse_as_dense=True)
    rows = torch.tensor([[hvd.rank() % 10, 9]])
    embedding(rows).sum().backward()
    opt.synchronize()
    grad = embedding.weight.grad
    assert grad.is_sparse
    expected = torch.zeros(10, 3)
    for q in range(hvd.size()):
        expected[q % 10] += 1.0 / hvd.size()
    expected[9] += 1.0
    assert torch.allclose(grad.to_dense(), expected)
    with opt.skip_synchronize():
        opt.step()


def adasum_reference(deltas):
    """Adasum of one flattened update per rank (numpy, float64): the pairwise formula by levels."""
    current = [d.double().reshape(-1).numpy() for d in deltas]
    distance = 1
    while distance < len(current):
        nxt = []
        for r in range(len(current)):
            a, b = current[min(r, r ^ distance)], current[max(r, r ^ distance)]
            dot, aa, bb = a @ b, a @ a, b @ b  # a zero vector keeps its coefficient at 1
            ca = 1 - dot / (2 * aa) if aa > 1e-150 else 1.0
            cb = 1 - dot / (2 * bb) if bb > 1e-150 else 1.0
            nxt.append(ca * a + cb * b)
        current, distance = nxt, distance * 2
    return torch.from_numpy(current[0])


@pytest.mark.parametrize("make", [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                  lambda p: torch.optim.Adam(p, lr=0.01)], ids=["sgd", "adam"])
def test_adasum_combines_the_optimizers_updates(make):
    n = hvd.size()
    if n & (n - 1):
        with pytest.raises(NotImplementedError, match="power-of-two"):
            hvd.DistributedOptimizer(make(model().parameters()), op=hvd.Adasum)
        return
    net = model()
    opt = hvd.DistributedOptimizer(make(net.parameters()), net.named_parameters(), op=hvd.Adasum)
    train_one_step(opt, net)

    start = [p.detach().clone() for p in model().parameters()]
    updates = []
    for q in range(n):  # every rank's own optimizer step, from the same start
        local = model()
        local_opt = make(local.parameters())
        loss_of(local, q).backward()
        local_opt.step()
        updates.append([p.detach() - s for p, s in zip(local.parameters(), start)])
    for i, (p, s) in enumerate(zip(net.parameters(), start)):
        combined = adasum_reference([u[i] for u in updates]).reshape(s.shape).float()
        assert torch.allclose(p, s + combined, atol=1e-6), (p, s + combined)


def test_adasum_refuses_skip_synchronize():
    if hvd.size() & (hvd.size() - 1) or hvd.size() == 1:
        pytest.skip("Adasum optimizer needs a power of two above 1")
    net = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), op=hvd.Adasum)
    with pytest.raises(AssertionError, match="skip_synchronize"):
        with opt.skip_synchronize():
            pass


def test_broadcast_optimizer_state_gives_missing_gradients_zeros_and_keeps_the_state_fresh():
    class NoGrad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.index = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32),
                                            requires_grad=False)
            self.values = torch.nn.Parameter(torch.arange(4.0))

    net = NoGrad()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9,
                                                   weight_decay=0.5), net.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert net.index.grad is None
    assert torch.equal(net.values.grad, torch.zeros(4))  # Horovod's test broadcasts this gradient
    assert torch.equal(net.values.detach(), torch.arange(4.0)) and not opt.state
    net.values.sum().backward()
    opt.step()  # the first step of a fresh SGD: no momentum yet, decay on the parameters
    expected = torch.arange(4.0) - 0.1 * (1.0 + 0.5 * torch.arange(4.0))
    assert torch.allclose(net.values.detach(), expected)


def test_broadcast_parameters_takes_a_list_of_tensors_and_refuses_other_things():
    tensors = [torch.full((2,), float(hvd.rank())), torch.full((1,), 10.0 + hvd.rank())]
    hvd.broadcast_parameters(tensors, root_rank=0)
    assert tensors[0].tolist() == [0.0, 0.0] and tensors[1].tolist() == [10.0]
    for bad in (3, "weights", [1, 2]):
        with pytest.raises(ValueError):
            hvd.broadcast_parameters(bad, root_rank=0)
        with pytest.raises(TypeError):
            hvd.broadcast_parameters(bad, root_rank=0)


def test_adasum_reference_is_exact_for_orthogonal_updates():
    """The numpy reference itself, on vectors whose result is known: orthogonal ones add."""
    basis = [torch.eye(4)[q] for q in range(4)]
    assert np.allclose(adasum_reference(basis).numpy(), np.ones(4))
