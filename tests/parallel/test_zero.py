"""ZeroRedundancyOptimizer: sharded optimizer state that trains like one process on the whole batch.

Every rank builds every rank's batch from a seeded generator, so each rank computes its reference
itself: the same model and optimizer in one process on the concatenated batch. Collectives (the
allgather comparing the ranks' parameters) come before the assertions, so that an assertion
failing on one rank cannot leave the others waiting.
"""

from __future__ import annotations

import copy
import io

import pytest

import gradsync

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch
RANKS = (1, 2, 4)
TIMEOUT = 400

F = torch.nn.functional
TOLERANCE = 1e-5


def batch(r, step):
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def concatenated(step, ranks=None):
    ranks = range(gradsync.size()) if ranks is None else ranks
    xs, ys = zip(*(batch(r, step) for r in ranks))
    return torch.cat(xs), torch.cat(ys)


def make_model():
    """Small layers (packed into one allgather after the step) and a 64 KiB weight (broadcast)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 128), torch.nn.Tanh(), torch.nn.Linear(128, 128),
                               torch.nn.Tanh(), torch.nn.Linear(128, 3))


def adam(model, lr=0.01):
    return torch.optim.Adam(model.parameters(), lr=lr)


def zero(model, optimizer=None, **kwargs):
    return gradsync.ZeroRedundancyOptimizer(optimizer or adam(model), model.named_parameters(),
                                            bucket_bytes=4096, **kwargs)


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def assert_trained_alike(model, reference, name="zero.parameters", process_set=None):
    """Every rank holds the same parameters, bit for bit, and they equal the reference's."""
    mine = flat(model.parameters())
    options = {} if process_set is None else {"process_set": process_set}
    everyone = gradsync.allgather(mine.reshape(1, -1), name=name, **options)
    assert all(torch.equal(everyone[0], row) for row in everyone), "the ranks' parameters differ"
    worst = (mine - flat(reference.parameters())).abs().max().item()
    assert worst <= TOLERANCE, f"parameters differ from one process's by {worst}"


def train(model, optimizer, steps, first=0, rank=None):
    rank = gradsync.rank() if rank is None else rank
    for step in range(first, first + steps):
        optimizer.zero_grad()
        x, y = batch(rank, step)
        F.mse_loss(model(x), y).backward()
        optimizer.step()


def train_reference(model, optimizer, steps, first=0, ranks=None):
    for step in range(first, first + steps):
        optimizer.zero_grad()
        x, y = concatenated(step, ranks)
        F.mse_loss(model(x), y).backward()
        optimizer.step()


def state_bytes(optimizer):
    """Bytes of the optimizer's state tensors shaped like what it steps (not Adam's scalar step)."""
    return sum(v.nbytes for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


# --- training equals one process ---------------------------------------------------------------

def test_adam_equals_one_process_on_the_concatenated_batch():
    model, reference = make_model(), make_model()
    train(model, zero(model), 6)
    train_reference(reference, adam(reference), 6)
    assert_trained_alike(model, reference)


def ownership(optimizer, model):
    """1 where this rank owns the element of the flattened parameters, else 0 (int64)."""
    pieces = optimizer.shard_plan.pieces(gradsync.rank())
    masks = []
    for p in model.parameters():
        mask = torch.zeros(p.numel(), dtype=torch.int64)
        if p in pieces:
            mask[pieces[p].start:pieces[p].start + pieces[p].numel] = 1
        masks.append(mask)
    return torch.cat(masks)


def test_each_rank_keeps_state_for_its_shard_only():
    model = make_model()
    optimizer = zero(model)
    train(model, optimizer, 1)
    owners = gradsync.allgather(ownership(optimizer, model).reshape(1, -1), name="zero.owners")
    assert owners.sum(0).tolist() == [1] * owners.shape[1]  # every element owned once
    shards = [p for group in optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in optimizer.state} == {id(p) for p in shards}
    assert sum(p.numel() for p in shards) == int(owners[gradsync.rank()].sum())


def test_a_scheduler_changes_the_learning_rate_of_the_shard():
    model, reference = make_model(), make_model()
    optimizer, plain = zero(model), adam(reference)
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.1) for o in (optimizer, plain)]
    for step in range(5):
        train(model, optimizer, 1, first=step)
        train_reference(reference, plain, 1, first=step)
        for schedule in schedules:
            schedule.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(plain.param_groups[0]["lr"])
    assert_trained_alike(model, reference)


def test_optimizer_state_per_rank_is_a_share_of_distributed_optimizers():
    """The MLP of benchmarks/train_step.py: per rank at most 1/N + 5 % of the full Adam state
    (DistributedOptimizer keeps the whole state on every rank: that of one process)."""
    torch.manual_seed(0)
    layers = []
    for _ in range(24):
        layers += [torch.nn.Linear(768, 768), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(768, 10))
    full = torch.optim.Adam(copy.deepcopy(model).parameters())
    for p in full.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    full.step()
    optimizer = gradsync.ZeroRedundancyOptimizer(torch.optim.Adam(model.parameters()),
                                                 model.named_parameters())
    model(torch.randn(2, 768)).sum().backward()
    optimizer.step()
    bytes_per_rank = gradsync.allgather(torch.tensor([state_bytes(optimizer)]), name="zero.bytes")
    assert int(bytes_per_rank.sum()) == state_bytes(full)
    assert int(bytes_per_rank.max()) <= (1 / gradsync.size() + 0.05) * state_bytes(full)


# --- gradients ---------------------------------------------------------------------------------

def test_backward_returns_the_averaged_gradients_of_the_shard_and_zeros_elsewhere():
    model, reference = make_model(), make_model()
    optimizer = zero(model)
    x, y = batch(gradsync.rank(), 0)
    F.mse_loss(model(x), y).backward()
    x, y = concatenated(0)
    F.mse_loss(reference(x), y).backward()
    pieces = optimizer.shard_plan.pieces(gradsync.rank())
    for p, q in zip(model.parameters(), reference.parameters()):
        assert (p.grad is not None) == (p in pieces)
        if p in pieces:
            mine = slice(pieces[p].start, pieces[p].start + pieces[p].numel)
            expected = torch.zeros(p.numel())
            expected[mine] = q.grad.reshape(-1)[mine]
            assert torch.allclose(p.grad.reshape(-1), expected, atol=1e-6)
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_clip_grad_norm_uses_the_norm_over_every_shard():
    model, reference = make_model(), make_model()
    optimizer, plain = zero(model), adam(reference)
    for step in range(3):
        optimizer.zero_grad()
        x, y = batch(gradsync.rank(), step)
        F.mse_loss(model(x), y).backward()
        norm = optimizer.clip_grad_norm_(0.05)
        optimizer.step()
        plain.zero_grad()
        x, y = concatenated(step)
        F.mse_loss(reference(x), y).backward()
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        plain.step()
        assert norm.item() == pytest.approx(expected.item(), rel=1e-5)
    assert_trained_alike(model, reference)


def test_synchronize_then_skip_synchronize():
    model, reference = make_model(), make_model()
    optimizer = zero(model, synchronize_in_backward=False)
    for step in range(3):
        optimizer.zero_grad()
        x, y = batch(gradsync.rank(), step)
        F.mse_loss(model(x), y).backward()
        optimizer.synchronize()
        with optimizer.skip_synchronize():
            optimizer.step()
    train_reference(reference, adam(reference), 3)
    assert_trained_alike(model, reference)


def test_backward_passes_per_step_accumulates_locally():
    """In float64: in float32, Adam turns the rounding of two accumulated passes into differences
    of 1.7e-4 at 4 ranks, the same when the ranks' gradients are averaged by hand."""
    model, reference = make_model().double(), make_model().double()
    optimizer = zero(model, backward_passes_per_step=2)
    plain = adam(reference)
    for step in range(3):
        optimizer.zero_grad()
        plain.zero_grad()
        for micro in range(2):
            x, y = batch(gradsync.rank(), 10 * step + micro)
            F.mse_loss(model(x.double()), y.double()).backward()
            x, y = concatenated(10 * step + micro)
            F.mse_loss(reference(x.double()), y.double()).backward()
        optimizer.step()
        plain.step()
    assert_trained_alike(model, reference)


def test_a_parameter_without_gradient_anywhere_is_not_updated():
    model, reference = make_model(), make_model()
    for m in (model, reference):
        m.register_parameter("unused", torch.nn.Parameter(torch.ones(2)))
    optimizer, plain = zero(model, adam(model)), adam(reference)
    train(model, optimizer, 3)
    train_reference(reference, plain, 3)
    assert_trained_alike(model, reference)


# --- checkpoints -------------------------------------------------------------------------------

def roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def test_resume_from_a_consolidated_checkpoint_equals_uninterrupted_training():
    model, uninterrupted = make_model(), make_model()
    optimizer = zero(model)
    train(model, optimizer, 3)
    optimizer.consolidate_state_dict(to=0)
    state = roundtrip(optimizer.state_dict()) if gradsync.rank() == 0 else None
    state = gradsync.broadcast_object(state, root_rank=0, name="zero.checkpoint")
    weights = copy.deepcopy(model.state_dict())

    resumed = make_model()
    resumed.load_state_dict(weights)
    optimizer2 = zero(resumed)
    optimizer2.load_state_dict(state)
    train(resumed, optimizer2, 3, first=3)

    train(uninterrupted, zero(uninterrupted), 6)
    assert_trained_alike(resumed, uninterrupted)


def test_the_consolidated_state_loads_into_the_plain_optimizer():
    model, reference = make_model(), make_model()
    optimizer = zero(model)
    train(model, optimizer, 3)
    optimizer.consolidate_state_dict(to=0)
    state = optimizer.state_dict() if gradsync.rank() == 0 else None
    state = gradsync.broadcast_object(state, root_rank=0, name="zero.checkpoint.plain")
    plain = adam(reference)
    train_reference(reference, plain, 3)
    expected = plain.state_dict()
    assert state["state"].keys() == expected["state"].keys()
    for key, value in expected["state"].items():
        assert torch.allclose(state["state"][key]["exp_avg"], value["exp_avg"], atol=1e-6)
    resumed = make_model()
    resumed.load_state_dict(model.state_dict())
    restored = adam(resumed)
    restored.load_state_dict(state)
    train_reference(resumed, restored, 2, first=3)
    train_reference(reference, plain, 2, first=3)
    assert_trained_alike(resumed, reference, name="zero.parameters.plain")


def test_state_dict_without_consolidation_is_refused():
    optimizer = zero(make_model())
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        optimizer.state_dict()


# --- uneven data, process sets ------------------------------------------------------------------

def test_join_lets_a_rank_run_out_of_data():
    """Rank r trains r + 1 steps: the others keep stepping, with zeros from the joined ranks
    (Average divides by the number of ranks)."""
    rank, size = gradsync.rank(), gradsync.size()
    model, reference = make_model(), make_model()
    optimizer = zero(model)
    train(model, optimizer, rank + 1)
    optimizer.join()
    plain = adam(reference)
    for step in range(size):
        plain.zero_grad()
        active = range(step, size)
        x, y = concatenated(step, active)
        (F.mse_loss(reference(x), y) * len(active) / size).backward()
        plain.step()
    assert_trained_alike(model, reference)


def test_a_process_set_shards_among_its_members():
    size = gradsync.size()
    if size < 2:
        pytest.skip("needs 2 ranks")
    evens = gradsync.add_process_set(range(0, size, 2))
    odds = gradsync.add_process_set(range(1, size, 2))
    try:
        mine = evens if gradsync.rank() % 2 == 0 else odds
        model, reference = make_model(), make_model()
        train(model, zero(model, process_set=mine), 3)
        train_reference(reference, adam(reference), 3, ranks=mine.ranks)
        assert_trained_alike(model, reference, process_set=mine)
    finally:
        gradsync.remove_process_set(odds)
        gradsync.remove_process_set(evens)


# --- the plan ----------------------------------------------------------------------------------

def test_the_plan_splits_every_bucket_evenly_and_is_the_same_on_every_rank():
    from gradsync.torch.zero import shard_plan

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 7, 100, 7, 100, 7, 100, 7, 3)]
    plan = shard_plan(params, 4, bucket_bytes=800)
    assert [len(b.members) for b in plan.buckets] == [5, 4]  # reverse order, closed at 200 elements
    index = {id(p): i for i, p in enumerate(params)}
    rows = [[(index[id(piece.param)], piece.start, piece.numel) for piece in b.pieces(r)]
            for r in range(4) for b in plan.buckets]
    assert [b.width for b in plan.buckets] == [55, 54]  # ceil(217 / 4), ceil(214 / 4)
    assert rows[:4:2] == [[(8, 0, 3), (7, 0, 7), (6, 0, 45)], [(6, 45, 55)]]  # rank 0, rank 1
    assert rows[4:8:2] == [[(5, 0, 7), (4, 0, 48)], [(4, 48, 52)]]  # ranks 2 and 3, bucket 0
    encoded = torch.tensor([[x for row in rows for piece in row for x in piece]])
    everyone = gradsync.allgather(encoded, name="zero.plan")
    assert all(torch.equal(everyone[0], row) for row in everyone)
    total = sum(p.numel() for p in params)
    assert sum(plan.elements(r) for r in range(4)) == total
    assert max(plan.elements(r) for r in range(4)) <= -(-total // 4) + len(plan.buckets)


# --- a model whose largest tensor is most of it -------------------------------------------------

def make_lopsided_model():
    """3131 parameters, 2048 (65 %) in one weight: owned whole, it would keep 65 % of the state
    on one rank."""
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 256),
                               torch.nn.Tanh(), torch.nn.Linear(256, 3)).double()


def train_double(model, optimizer, steps, first=0, ranks=None):
    """Steps on this rank's batch (ranks=None) or on the concatenated batches of ``ranks``."""
    for step in range(first, first + steps):
        optimizer.zero_grad()
        x, y = batch(gradsync.rank(), step) if ranks is None else concatenated(step, ranks)
        F.mse_loss(model(x.double()), y.double()).backward()
        optimizer.step()


def test_state_per_rank_is_a_share_even_when_one_tensor_is_most_of_the_model():
    model, reference = make_lopsided_model(), make_lopsided_model()
    sizes = [p.numel() for p in model.parameters()]
    assert max(sizes) > sum(sizes) / 2
    optimizer, plain = zero(model), adam(reference)
    train_double(model, optimizer, 5)
    train_double(reference, plain, 5, ranks=range(gradsync.size()))
    per_rank = gradsync.allgather(torch.tensor([state_bytes(optimizer)]), name="zero.lopsided.bytes")
    assert int(per_rank.sum()) == state_bytes(plain)
    assert int(per_rank.max()) <= (1 / gradsync.size() + 0.05) * state_bytes(plain)
    mine = flat(model.parameters())
    everyone = gradsync.allgather(mine.reshape(1, -1), name="zero.lopsided.parameters")
    assert all(torch.equal(everyone[0], row) for row in everyone), "the ranks' parameters differ"
    assert (mine - flat(reference.parameters())).abs().max().item() <= 1e-12


def test_a_plain_optimizers_state_loads_at_any_number_of_ranks():
    """Adam's state from one process, sliced by each rank's load_state_dict, trains on as it."""
    model, reference = make_lopsided_model(), make_lopsided_model()
    everyone = range(gradsync.size())
    plain = adam(reference)
    train_double(reference, plain, 3, ranks=everyone)
    model.load_state_dict(reference.state_dict())
    optimizer = zero(model)
    optimizer.load_state_dict(copy.deepcopy(plain.state_dict()))
    train_double(model, optimizer, 3, first=3)
    train_double(reference, plain, 3, first=3, ranks=everyone)
    optimizer.consolidate_state_dict(to=0)
    if gradsync.rank() == 0:
        state, expected = optimizer.state_dict()["state"], plain.state_dict()["state"]
        assert state.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.allclose(state[key]["exp_avg_sq"], value["exp_avg_sq"], rtol=1e-10)
            assert state[key]["exp_avg_sq"].shape == value["exp_avg_sq"].shape
            assert float(state[key]["step"]) == float(value["step"]) == 6
    assert (flat(model.parameters()) - flat(reference.parameters())).abs().max().item() <= 1e-12
