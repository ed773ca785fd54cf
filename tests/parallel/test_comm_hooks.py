"""Communication hooks and gradient buckets as views (DistributedOptimizer(comm_hook=...,
gradient_as_bucket_view=...)).

References are independent of the code under test: DistributedOptimizer without a hook (each
gradient allreduced on its own), fp16/bf16 sums written out in torch, and PowerSGD written again
here in numpy (float64) from the algorithm's description (docs/comm-hooks.md). Every rank builds
every rank's gradients from a seeded generator, so it computes the references itself. Collectives
come before assertions, and every test takes the same path on every rank.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import gradsync

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch
RANKS = (1, 2, 4)
TIMEOUT = 400


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batch(r, step):
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)


def train(steps=4, set_to_none=True, replace_grad=False, passes=1, **options):
    """Parameters (flat) after ``steps`` SGD steps of the small model, and the optimizer."""
    model = make_model()
    optimizer = gradsync.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model.named_parameters(),
        backward_passes_per_step=passes, **options)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=set_to_none)
        if replace_grad:  # what an optimizer or user that replaces .grad does
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        for k in range(passes):
            x, y = batch(gradsync.rank(), passes * step + k)
            torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return flat(model.parameters()), optimizer


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def same_on_every_rank(tensor, name):
    everyone = gradsync.allgather(tensor.reshape(1, -1), name=name)
    return all(torch.equal(everyone[0], row) for row in everyone)


# --- The default hook, and buckets as views -----------------------------------------------------

BUCKETED = {
    "allreduce_hook_views": {"comm_hook": gradsync.allreduce_hook},
    "allreduce_hook_copies": {"comm_hook": gradsync.allreduce_hook, "gradient_as_bucket_view": False},
    "views_without_hook": {"gradient_as_bucket_view": True},
    "views_in_groups": {"gradient_as_bucket_view": True, "num_groups": 2},
    "views_set_to_zero": {"gradient_as_bucket_view": True, "set_to_none": False},
    "views_replaced_grad": {"gradient_as_bucket_view": True, "replace_grad": True},
    "views_two_passes": {"gradient_as_bucket_view": True, "passes": 2},
}


@pytest.mark.parametrize("options", list(BUCKETED.values()), ids=list(BUCKETED))
def test_buckets_equal_one_allreduce_per_gradient_bit_for_bit(options):
    extra = {k: options[k] for k in ("set_to_none", "replace_grad", "passes") if k in options}
    expected, _ = train(**extra)
    got, _ = train(**options)
    assert same_on_every_rank(got, "hooks.same")
    assert torch.equal(got, expected)


def test_gradients_are_views_into_one_bucket_buffer():
    _, optimizer = train(steps=2, comm_hook=gradsync.allreduce_hook)
    grads = [p.grad for p in optimizer.param_groups[0]["params"]]
    storages = {g.untyped_storage().data_ptr() for g in grads}
    assert len(storages) == 1, "the four small gradients share one bucket (fusion threshold 1 MiB)"
    starts = sorted((g.data_ptr(), g.numel() * g.element_size()) for g in grads)
    assert all(a + n == b for (a, n), (b, _) in zip(starts, starts[1:])), "laid out back to back"


def test_set_to_none_re_points_the_gradients_at_the_views():
    _, optimizer = train(steps=1, comm_hook=gradsync.allreduce_hook)
    params = optimizer.param_groups[0]["params"]
    before = [p.grad.data_ptr() for p in params]
    optimizer.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in params)
    model_loss = sum((p * (i + 1)).sum() for i, p in enumerate(params))
    model_loss.backward()
    assert [p.grad.data_ptr() for p in params] == before
    assert all(torch.equal(p.grad, torch.full_like(p, i + 1.0)) for i, p in enumerate(params))


def test_zero_grad_keeps_the_views_and_zeroes_them():
    _, optimizer = train(steps=1, comm_hook=gradsync.allreduce_hook)
    params = optimizer.param_groups[0]["params"]
    before = [p.grad.data_ptr() for p in params]
    optimizer.zero_grad(set_to_none=False)
    assert [p.grad.data_ptr() for p in params] == before
    assert all(not p.grad.any() for p in params)


def test_sparse_gradients_are_allgathered_beside_the_buckets():
    def run(**options):
        torch.manual_seed(1)
        embedding, head = torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2)
        params = list(embedding.parameters()) + list(head.parameters())
        named = [("embedding.weight", params[0])] + [(f"head.{n}", p) for n, p in head.named_parameters()]
        optimizer = gradsync.DistributedOptimizer(torch.optim.SGD(params, lr=0.5), named, **options)
        for step in range(3):
            optimizer.zero_grad()
            rows = torch.tensor([(gradsync.rank() + step) % 10, 3])
            head(embedding(rows)).square().sum().backward()
            optimizer.step()
        return flat(params)

    expected = run()
    got = run(comm_hook=gradsync.allreduce_hook)
    assert same_on_every_rank(got, "hooks.sparse")
    assert torch.equal(got, expected)


def test_a_gradient_changed_while_its_bucket_is_in_flight_raises():
    model = make_model()
    optimizer = gradsync.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
        comm_hook=gradsync.allreduce_hook, synchronize_in_backward=False)
    x, y = batch(gradsync.rank(), 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    model[0].bias.grad.mul_(2.0)
    with pytest.raises(RuntimeError, match="changed in place"):
        optimizer.synchronize()


def test_a_hook_that_returns_the_wrong_shape_is_named():
    def short(bucket):
        handle = gradsync.allreduce_async_(bucket.buffer, name=bucket.name)
        return gradsync.torch.comm_hooks.Then(handle, lambda reduced: reduced[1:])

    model = make_model()
    optimizer = gradsync.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), comm_hook=short)
    x, y = batch(gradsync.rank(), 0)
    with pytest.raises(TypeError, match="comm_hook .* returned a torch.float32 tensor of shape"):
        torch.nn.functional.mse_loss(model(x), y).backward()
    del optimizer


def test_comm_hook_refuses_compression():
    model = make_model()
    with pytest.raises(ValueError, match="drop compression"):
        gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      model.named_parameters(), comm_hook=gradsync.allreduce_hook,
                                      compression=gradsync.Compression.fp16)


# --- fp16 and bf16 -------------------------------------------------------------------------------

@pytest.mark.parametrize("hook, dtype", [(gradsync.fp16_compress_hook, torch.float16),
                                         (gradsync.bf16_compress_hook, torch.bfloat16)],
                         ids=["fp16", "bf16"])
def test_cast_hooks_equal_the_sum_of_the_rounded_gradients(hook, dtype):
    """One SGD step (lr 1) with gradient G_r on rank r: p = -(sum_r round(G_r)) / size, summed in
    float32 (exact here: a few 16-bit values) and rounded to ``dtype`` once."""
    size = gradsync.size()
    weight = torch.nn.Parameter(torch.zeros(3, 7))
    optimizer = gradsync.DistributedOptimizer(torch.optim.SGD([weight], lr=1.0),
                                              [("weight", weight)], comm_hook=hook)
    gradients = [torch.randn(3, 7, generator=torch.Generator().manual_seed(r)) for r in range(size)]
    (weight * gradients[gradsync.rank()]).sum().backward()
    optimizer.step()
    total = sum(g.to(dtype).float() for g in gradients)
    expected = -(total * (1.0 / size)).to(dtype).float()
    assert same_on_every_rank(weight.detach(), "hooks.cast")
    assert torch.equal(weight.detach(), expected)


# --- PowerSGD against a numpy reference ----------------------------------------------------------

SHAPES = [(8, 12), (8,), (2, 2), (4, 2, 3)]  # W: compressed at rank 1 and 2; C: at rank 1 only


def gradient(r, step, k):
    rng = np.random.default_rng((r, step, k))
    return rng.standard_normal(SHAPES[k])


def gram_schmidt(p, epsilon):
    p = p.copy()
    for i in range(p.shape[1]):
        p[:, i] /= np.linalg.norm(p[:, i]) + epsilon
        for j in range(i + 1, p.shape[1]):
            p[:, j] -= (p[:, i] @ p[:, j]) * p[:, i]
    return p


def powersgd_reference(steps, size, buckets, rank, start_iter, rate=2.0, seed=0, epsilon=1e-8):
    """The averaged update of every parameter at every step: Vogels et al.'s rank-``rank``
    power iteration with error feedback (the error of each rank against the averaged
    approximation) and warm start; the first Q of slot s of bucket b drawn by
    ``default_rng((seed, b, s)).standard_normal((m, r))``."""
    errors, qs, updates = {}, {}, []
    for step in range(steps):
        grads = [[gradient(r, step, k) for k in range(len(SHAPES))] for r in range(size)]
        update = [np.mean([grads[r][k] for r in range(size)], axis=0) for k in range(len(SHAPES))]
        for b, members in enumerate(buckets):
            for slot, k in enumerate(members):
                shape = SHAPES[k]
                n = shape[0]
                m = math.prod(shape) // n
                rr = min(rank, n, m)
                if step < start_iter or len(shape) < 2 or n * m < rate * (n + m) * rr:
                    continue
                ms = [grads[r][k].reshape(n, m) + errors.get((r, k), 0.0) for r in range(size)]
                q = qs[k] if k in qs else np.random.default_rng((seed, b, slot)).standard_normal((m, rr))
                p = gram_schmidt(np.mean([mr @ q for mr in ms], axis=0), epsilon)
                q = np.mean([mr.T @ p for mr in ms], axis=0)
                approximation = p @ q.T
                for r in range(size):
                    errors[(r, k)] = ms[r] - approximation
                qs[k] = q
                update[k] = approximation.reshape(shape)
        updates.append(update)
    return updates


@pytest.mark.parametrize("rank", [1, 2])
@pytest.mark.parametrize("num_groups, buckets", [(0, [[3, 2, 1, 0]]), (2, [[1, 0], [3, 2]])],
                         ids=["one_bucket", "two_buckets"])
def test_powersgd_equals_a_numpy_reference(rank, num_groups, buckets):
    steps, start_iter = 6, 2
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    hook = gradsync.PowerSGD(rank=rank, start_iter=start_iter)
    optimizer = gradsync.DistributedOptimizer(
        torch.optim.SGD(params, lr=1.0), [(f"p{k}", p) for k, p in enumerate(params)],
        comm_hook=hook, num_groups=num_groups)
    updates = powersgd_reference(steps, gradsync.size(), buckets, rank, start_iter)
    expected = [np.zeros(shape) for shape in SHAPES]
    worst = 0.0
    for step in range(steps):
        optimizer.zero_grad()
        sum((p * torch.from_numpy(gradient(gradsync.rank(), step, k)).float()).sum()
            for k, p in enumerate(params)).backward()
        optimizer.step()
        for k, p in enumerate(params):
            expected[k] -= updates[step][k]
            worst = max(worst, np.abs(p.detach().double().numpy() - expected[k]).max())
    assert same_on_every_rank(flat(params), "hooks.powersgd")
    assert worst < 1e-4, f"PowerSGD differs from the numpy reference by {worst}"


def test_powersgd_resumes_from_its_state_dict():
    def step(params, optimizer, s):
        optimizer.zero_grad()
        sum((p * torch.from_numpy(gradient(gradsync.rank(), s, k)).float()).sum()
            for k, p in enumerate(params)).backward()
        optimizer.step()

    def build(state=None):
        params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
        hook = gradsync.PowerSGD(rank=1, start_iter=1)
        optimizer = gradsync.DistributedOptimizer(
            torch.optim.SGD(params, lr=1.0), [(f"p{k}", p) for k, p in enumerate(params)],
            comm_hook=hook)
        if state is not None:
            with torch.no_grad():
                for p, saved in zip(params, state["params"]):
                    p.copy_(saved)
            hook.load_state_dict(state["hook"])
        return params, optimizer, hook

    params, optimizer, hook = build()
    for s in range(5):
        step(params, optimizer, s)
        if s == 2:
            state = {"params": [p.detach().clone() for p in params], "hook": hook.state_dict()}
    resumed, optimizer2, _ = build(state)
    for s in range(3, 5):
        step(resumed, optimizer2, s)
    assert torch.equal(flat(resumed), flat(params))


def test_powersgd_sends_over_ten_times_fewer_bytes_on_the_benchmark_mlp():
    """benchmarks/train_step.py's MLP (24 x Linear(768, 768) + Linear(768, 10)) at rank 2: each
    768 x 768 weight sends P and Q ((768 + 768) x 2 numbers), the last weight (10 x 768) too,
    the biases as they are."""
    torch.manual_seed(0)
    layers = []
    for _ in range(24):
        layers += [torch.nn.Linear(768, 768), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(768, 10))
    hook = gradsync.PowerSGD(rank=2, start_iter=0)
    optimizer = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                              model.named_parameters(), comm_hook=hook)
    x = torch.randn(4, 768, generator=torch.Generator().manual_seed(gradsync.rank()))
    model(x).square().sum().backward()
    optimizer.step()
    numbers = 24 * (768 + 768) * 2 + (10 + 768) * 2 + 24 * 768 + 10
    dense = sum(p.numel() for p in model.parameters())
    assert (hook.traffic.sent, hook.traffic.dense) == (4 * numbers, 4 * dense)
    assert hook.traffic.dense >= 10 * hook.traffic.sent
