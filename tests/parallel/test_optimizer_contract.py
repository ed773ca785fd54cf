"""The DistributedOptimizer contract: what a DDP user may do after backward(), and that no rank's
data changes which collectives it submits (no hang, no silently wrong training).

Every rank builds every rank's batch from a seeded generator, so each rank computes the reference
itself: the same model trained in one process (float64) on the concatenated batch, with the loss
averaged over the ranks as Average does. Each test takes the same path on every rank; collectives
(the allgather that compares the ranks' parameters) come before the assertions, so an assertion
that fails on one rank cannot leave the others waiting.
"""

from __future__ import annotations

import math

import pytest

import gradsync

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch
RANKS = (1, 2, 3)
TIMEOUT = 400

F = torch.nn.functional
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def batch(r, step, dtype=torch.float64):
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(4, 5, generator=g).to(dtype), torch.randn(4, 3, generator=g).to(dtype)


def concatenated(step, dtype=torch.float64):
    xs, ys = zip(*(batch(r, step, dtype) for r in range(gradsync.size())))
    return torch.cat(xs), torch.cat(ys)


def make_model(dtype=torch.float64):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3)).to(dtype)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def wrap(model, optimizer=None, **kwargs):
    return gradsync.DistributedOptimizer(optimizer or sgd(model), model.named_parameters(), **kwargs)


def mse(model, x, y):
    return F.mse_loss(model(x), y)


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def assert_trained_alike(model, reference, dtype=torch.float64, tolerance=None):
    """Every rank holds the same parameters, bit for bit, and they equal the reference's."""
    mine = flat(model.parameters())
    everyone = gradsync.allgather(mine.reshape(1, -1), name="contract.parameters")
    assert all(torch.equal(everyone[0], row) for row in everyone), "the ranks' parameters differ"
    worst = (mine - flat(reference.parameters())).abs().max().item()
    assert worst <= (tolerance or TOLERANCE[dtype]), f"parameters differ from one process's by {worst}"


# --- A rank without gradients (issue 11: this hung) --------------------------------------------

def idle_rank(step):
    """The rank whose loss reaches no parameter in ``step`` (steps 1 and 2), or None."""
    return step % gradsync.size() if step in (1, 2) else None


@pytest.mark.parametrize("options", [{}, {"num_groups": 2}, {"compression": "fp16"},
                                     {"synchronize_in_backward": False}],
                         ids=["plain", "num_groups", "fp16", "synchronize_at_step"])
def test_a_rank_whose_loss_reaches_no_parameter_contributes_zeros(options):
    rank, size = gradsync.rank(), gradsync.size()
    model, reference = make_model(), make_model()
    if "compression" in options:  # each rank's gradient is rounded to 16 bits on the way
        options = dict(options, compression=gradsync.Compression.fp16)
    opt, ref_opt = wrap(model, **options), sgd(reference)
    other_head = torch.nn.Linear(5, 3).double()  # not this optimizer's: that rank's batch takes it
    for step in range(4):
        opt.zero_grad()
        head = other_head if rank == idle_rank(step) else model
        mse(head, *batch(rank, step)).backward()
        opt.step()
        ref_opt.zero_grad()
        working = [r for r in range(size) if r != idle_rank(step)]
        if working:  # Average: the idle rank's share of the batch counts as zero gradient
            (sum(mse(reference, *batch(r, step)) for r in working) / size).backward()
        ref_opt.step()
    assert_trained_alike(model, reference, tolerance=2e-3 if "compression" in options else None)


def test_a_rank_without_gradients_while_another_has_joined():
    """The last rank has data for 2 steps, the others for 4; in step 2 rank 0's loss reaches no
    parameter as well (with 2 ranks nobody has a gradient in that step)."""
    rank, size = gradsync.rank(), gradsync.size()
    steps_of = [2 if r == size - 1 else 4 for r in range(size)]
    idle = {2: 0} if size > 1 else {}
    model, reference = make_model(), make_model()
    opt, ref_opt = wrap(model), sgd(reference)
    other_head = torch.nn.Linear(5, 3).double()
    for step in range(steps_of[rank]):
        opt.zero_grad()
        mse(other_head if idle.get(step) == rank else model, *batch(rank, step)).backward()
        opt.step()
    last = gradsync.join()
    assert last in (range(size - 1) if size > 1 else [0]), last  # one with 4 steps joined last
    gradsync.broadcast_parameters(model.state_dict(), root_rank=last)  # the joined rank missed steps
    for step in range(max(steps_of)):
        ref_opt.zero_grad()
        working = [r for r in range(size) if step < steps_of[r] and idle.get(step) != r]
        if working:  # joined ranks count as zero gradients (Average divides by the world size)
            (sum(mse(reference, *batch(r, step)) for r in working) / size).backward()
        ref_opt.step()
    assert_trained_alike(model, reference)


def test_a_parameter_no_rank_has_a_gradient_for_keeps_none_as_in_one_process():
    model, reference = make_model(), make_model()
    opt, ref_opt = wrap(model), sgd(reference)
    for step in range(3):
        for m, o, (x, y) in ((model, opt, batch(gradsync.rank(), step)),
                             (reference, ref_opt, concatenated(step))):
            o.zero_grad()
            F.mse_loss(m[1](m[0](x))[:, :3], y).backward()  # the last layer is unused everywhere
            o.step()
    assert model[2].weight.grad is None and model[2].bias.grad is None
    assert_trained_alike(model, reference)  # momentum never moved the unused layer


def test_a_backward_pass_without_gradients_among_accumulated_ones():
    rank, size = gradsync.rank(), gradsync.size()
    model, reference = make_model(), make_model()
    opt, ref_opt = wrap(model, backward_passes_per_step=2), sgd(reference)
    other_head = torch.nn.Linear(5, 3).double()
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro in range(2):
            idle = size - 1 if micro == 0 and size > 1 else None  # this pass reaches nothing there
            x, y = batch(rank, 10 * step + micro)
            (mse(other_head if rank == idle else model, x, y) / 2).backward()
            working = [r for r in range(size) if r != idle]
            (sum(mse(reference, *batch(r, 10 * step + micro)) for r in working) / size / 2).backward()
        opt.step()
        ref_opt.step()
    assert_trained_alike(model, reference)


def test_a_rank_without_a_sparse_gradient_contributes_no_rows():
    rank, size = gradsync.rank(), gradsync.size()
    idle = size - 1 if size > 1 else None  # this rank looks up no row
    for num_groups in (0, 2):
        torch.manual_seed(0)
        embedding = torch.nn.Embedding(10, 3, sparse=True).double()
        head = torch.nn.Linear(3, 1).double()
        named = list(embedding.named_parameters(prefix="emb")) + list(head.named_parameters(prefix="head"))
        opt = gradsync.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1), named,
                                            num_groups=num_groups)
        rows = [] if rank == idle else [rank, rank + 3, 7]
        out = head(embedding(torch.tensor(rows, dtype=torch.long))).sum() if rows else 0.0
        (out + head(torch.ones(1, 3, dtype=torch.float64)).sum()).backward()
        grad = embedding.weight.grad
        assert grad is not None and grad.is_sparse, grad
        expected = torch.zeros(10, 3, dtype=torch.float64)
        for r in range(size):
            for row in ([] if r == idle else [r, r + 3, 7]):
                expected[row] += head.weight.detach()[0] / size
        assert torch.allclose(grad.to_dense(), expected, atol=1e-12), (num_groups, grad, expected)
        opt.step()
        del opt


# --- What you can do after backward() (issue 17) -----------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_clipping_after_backward_equals_single_process(dtype):
    model, reference = make_model(dtype), make_model(dtype)
    opt, ref_opt = wrap(model), sgd(reference)
    clipped = []
    for step in range(4):
        opt.zero_grad()
        mse(model, *batch(gradsync.rank(), step, dtype)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # no synchronize(): the contract
        opt.step()
        ref_opt.zero_grad()
        mse(reference, *concatenated(step, dtype)).backward()
        clipped.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05).item() > 0.05)
        ref_opt.step()
    assert all(clipped), "the test must clip"
    assert_trained_alike(model, reference, dtype)


def test_backward_returns_averaged_gradients_for_logging():
    model, reference = make_model(), make_model()
    opt = wrap(model)  # noqa: F841 - its hooks live as long as it does
    mse(model, *batch(gradsync.rank(), 0)).backward()
    norm = torch.linalg.vector_norm(flat(p.grad for p in model.parameters()))
    norms = gradsync.allgather(norm.reshape(1), name="contract.norm")
    mse(reference, *concatenated(0)).backward()
    expected = torch.linalg.vector_norm(flat(p.grad for p in reference.parameters()))
    assert torch.unique(norms).numel() == 1, norms
    assert abs(norm.item() - expected.item()) <= 1e-12, (norm, expected)


def test_synchronize_and_step_after_backward_reduce_nothing_again(monkeypatch):
    model = make_model()
    opt = wrap(model)
    mse(model, *batch(gradsync.rank(), 0)).backward()
    opt.step()  # the first step also compares the ranks' parameters
    opt.zero_grad()
    mse(model, *batch(gradsync.rank(), 1)).backward()
    started = []
    monkeypatch.setattr(gradsync.ops, "allreduce_async_", lambda *a, **k: started.append(a))
    monkeypatch.setattr(gradsync.ops, "allreduce_async", lambda *a, **k: started.append(a))
    opt.synchronize()
    with pytest.warns(UserWarning, match="skip_synchronize"):  # Horovod's warning, nothing reduced
        opt.step()
    assert started == []


@pytest.mark.parametrize("zero_grad_of", ["optimizer", "model"])
def test_grad_scaler_unscales_averaged_gradients_and_skips_alike(zero_grad_of):
    """unscale_ after backward sees the averages; in step 1 the last rank's loss is inf, so every
    rank's averaged gradients are inf and every rank skips that step (as one process does on the
    whole batch); zero_grad() (or the model's) then starts the next step."""
    rank, size = gradsync.rank(), gradsync.size()
    model, reference = make_model(), make_model()
    opt, ref_opt = wrap(model), sgd(reference)
    scaler, ref_scaler = (torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in range(2))
    for step in range(4):
        (opt if zero_grad_of == "optimizer" else model).zero_grad()
        poison = math.inf if step == 1 and rank == size - 1 else 1.0
        scaler.scale(mse(model, *batch(rank, step)) * poison).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        scaler.step(opt)
        scaler.update()
        ref_opt.zero_grad()
        losses = [mse(reference, *batch(r, step)) * (math.inf if step == 1 and r == size - 1 else 1.0)
                  for r in range(size)]
        ref_scaler.scale(sum(losses) / size).backward()
        ref_scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
    scales = gradsync.allgather(torch.tensor([scaler.get_scale()]), name="contract.scale")
    assert scales.tolist() == [ref_scaler.get_scale()] * size == [1024.0 / 2] * size, scales
    assert_trained_alike(model, reference)


def test_dropping_averaged_gradients_with_the_models_zero_grad_starts_a_new_step():
    model, reference = make_model(), make_model()
    opt, ref_opt = wrap(model), sgd(reference)
    mse(model, *batch(gradsync.rank(), 0)).backward()  # averaged, then dropped without a step
    model.zero_grad()
    mse(model, *batch(gradsync.rank(), 1)).backward()
    opt.step()
    mse(reference, *concatenated(1)).backward()
    ref_opt.step()
    assert_trained_alike(model, reference)


def test_reentrant_checkpointing_averages_once_when_backward_returns(monkeypatch):
    """Each checkpointed layer's gradients come from a backward pass nested in the outer one; the
    wait belongs to the outer pass: one round per step (counted by its layout allreduce, an
    internal name), and clipping after backward() equals one process."""
    from torch.utils.checkpoint import checkpoint

    rounds, allreduce_async = [], gradsync.ops.allreduce_async

    def counting(tensor, name=None, *args, **kwargs):
        rounds.extend([name] if str(name).startswith("gradsync.gradient_layouts.") else [])
        return allreduce_async(tensor, name, *args, **kwargs)

    monkeypatch.setattr(gradsync.ops, "allreduce_async", counting)

    def forward(model, x):
        for layer in model:
            x = checkpoint(layer, x, use_reentrant=True)
        return x

    model, reference = make_model(), make_model()
    opt, ref_opt = wrap(model), sgd(reference)
    for step in range(3):
        opt.zero_grad()
        x, y = batch(gradsync.rank(), step)
        F.mse_loss(forward(model, x.requires_grad_()), y).backward()
        assert len(rounds) == step + 1, rounds
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        ref_opt.zero_grad()
        mse(reference, *concatenated(step)).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        ref_opt.step()
    assert_trained_alike(model, reference)


# --- What raises -------------------------------------------------------------------------------

def test_a_backward_after_the_gradients_were_averaged_raises():
    model = make_model()
    opt = wrap(model)
    mse(model, *batch(gradsync.rank(), 0)).backward()
    with pytest.raises(RuntimeError, match=r"parameter '2\.(weight|bias)' received a gradient after this "
                                           r"step's gradients were averaged.*Call optimizer\.step\(\) "
                                           r"or optimizer\.zero_grad\(\) first"):
        mse(model, *batch(gradsync.rank(), 1)).backward()
    opt.zero_grad()  # the fix: a new step
    mse(model, *batch(gradsync.rank(), 1)).backward()
    opt.step()


def test_changing_a_gradient_in_flight_raises_naming_the_parameter():
    model = make_model()
    opt = wrap(model, synchronize_in_backward=False)  # Horovod's timing: step() waits
    mse(model, *batch(gradsync.rank(), 0)).backward()
    model[2].bias.grad.mul_(2.0)  # races with the background allreduce writing it
    with pytest.raises(RuntimeError, match=r"changed in place \('2\.bias'\) while its allreduce was "
                                           r"in flight.*after backward\(\) returns"):
        opt.step()


def test_replacing_a_gradient_in_flight_raises_naming_the_parameter():
    model = make_model()
    opt = wrap(model, synchronize_in_backward=False)
    mse(model, *batch(gradsync.rank(), 0)).backward()
    model[0].weight.grad = model[0].weight.grad * 2.0  # the allreduce writes the old tensor
    with pytest.raises(RuntimeError, match=r"replaced by another tensor, p\.grad = \.\.\. "
                                           r"\('0\.weight'\)"):
        opt.synchronize()


def test_a_gradient_hook_that_changes_the_gradient_raises_in_backward():
    model = make_model()
    opt = wrap(model)  # noqa: F841 - its hooks live as long as it does

    def halve(param):  # registered after gradsync's hook, so it runs while the allreduce is in flight
        param.grad.mul_(0.5)

    model[2].weight.register_post_accumulate_grad_hook(halve)
    with pytest.raises(RuntimeError, match=r"changed in place \('2\.weight'\).*never in a gradient "
                                           r"hook"):
        mse(model, *batch(gradsync.rank(), 0)).backward()


def test_step_with_a_closure_or_skipped_synchronize_while_gradients_are_in_flight_raises():
    model = make_model()
    opt = wrap(model, synchronize_in_backward=False)
    mse(model, *batch(gradsync.rank(), 0)).backward()
    with pytest.raises(RuntimeError, match=r"step\(closure\) was called while the gradients of 4 "
                                           r"parameter\(s\).*Call optimizer\.synchronize\(\) first"):
        opt.step(lambda: mse(model, *batch(gradsync.rank(), 0)))
    with pytest.raises(RuntimeError, match=r"inside skip_synchronize\(\) while"):
        with opt.skip_synchronize():
            opt.step()
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()


# --- Closures (issue 11 item 6) ----------------------------------------------------------------

def closure_of(model, optimizer, x, y, calls):
    def closure():
        calls.append(1)
        optimizer.zero_grad()
        loss = mse(model, x, y)
        loss.backward()
        return loss
    return closure


@pytest.mark.parametrize("line_search_fn", [None, "strong_wolfe"])
def test_lbfgs_with_a_closure_equals_single_process(line_search_fn):
    model, reference = make_model(), make_model()
    lbfgs = {"lr": 0.5, "max_iter": 6, "history_size": 4, "line_search_fn": line_search_fn}
    opt = wrap(model, torch.optim.LBFGS(model.parameters(), **lbfgs))
    ref_opt = torch.optim.LBFGS(reference.parameters(), **lbfgs)
    calls, ref_calls, losses, ref_losses = [], [], [], []
    for step in range(3):
        losses.append(opt.step(closure_of(model, opt, *batch(gradsync.rank(), step), calls)).item())
        ref_losses.append(ref_opt.step(closure_of(reference, ref_opt, *concatenated(step),
                                                  ref_calls)).item())
    counts = gradsync.allgather(torch.tensor([len(calls)]), name="contract.calls")
    assert counts.tolist() == [len(ref_calls)] * gradsync.size(), (counts, len(ref_calls))
    assert len(ref_calls) > 3 * 2, "LBFGS must evaluate the closure several times per step"
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-12, (losses, ref_losses)
    assert_trained_alike(model, reference)


def test_adam_with_a_closure_returns_the_averaged_loss_and_equals_single_process():
    model, reference = make_model(), make_model()
    opt = wrap(model, torch.optim.Adam(model.parameters(), lr=0.01))
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    for step in range(3):
        loss = opt.step(closure_of(model, opt, *batch(gradsync.rank(), step), []))
        ref_loss = ref_opt.step(closure_of(reference, ref_opt, *concatenated(step), []))
        assert isinstance(loss, torch.Tensor) and loss.dtype == torch.float64
        assert abs(loss.item() - ref_loss.item()) <= 1e-12, (loss, ref_loss)
    assert_trained_alike(model, reference)


def test_ranks_holding_different_parameters_still_submit_the_same_collectives():
    """The optimizer's own collectives are named after parameter names, never their values: a
    forgotten broadcast_parameters trains apart (and warns), but nothing stalls."""
    torch.manual_seed(gradsync.rank())
    model = torch.nn.Linear(5, 3).double()
    opt = wrap(model, torch.optim.LBFGS(model.parameters(), max_iter=3))
    x, y = batch(gradsync.rank(), 0)
    loss = opt.step(closure_of(model, opt, x, y, []))
    losses = gradsync.allgather(loss.reshape(1), name="contract.losses")
    assert torch.unique(losses).numel() == 1, losses


# --- broadcast_optimizer_state (issue 16 item 9) -----------------------------------------------

class OnAnotherDevice(torch.Tensor):
    """A host tensor that reports cuda:0, standing in for the root's GPU state on this CPU-only
    machine; ``cpu()`` gives a plain host tensor, as for a real CUDA tensor."""

    @property
    def device(self):
        return torch.device("cuda", 0)

    def cpu(self, *args, **kwargs):
        return self.as_subclass(torch.Tensor).clone()


def test_broadcast_optimizer_state_sends_host_tensors_only():
    rank = gradsync.rank()
    model = make_model()
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    mse(model, *batch(0, 0)).backward()
    adam.step()  # the same state on every rank; the root's moments must arrive as host tensors
    expected = {key: value.clone() for key, value in adam.state[model[0].weight].items()}
    for state in adam.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = state[key].as_subclass(OnAnotherDevice) if rank == 0 else state[key] + 1
    gradsync.broadcast_optimizer_state(adam, root_rank=0)
    state = adam.state[model[0].weight]
    for key in ("exp_avg", "exp_avg_sq"):
        if rank == 0:
            assert type(state[key]) is OnAnotherDevice  # the root keeps its own state
        else:
            assert type(state[key]) is torch.Tensor and state[key].device.type == "cpu", type(state[key])
        assert torch.equal(state[key].as_subclass(torch.Tensor), expected[key]), key
