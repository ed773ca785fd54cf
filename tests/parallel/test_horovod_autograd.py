"""gradsync.torch's collectives are differentiable, with Horovod's gradients.

Each test builds every rank's input and loss weights from seeds (so each rank knows all of them),
runs the collective across the ranks and backpropagates this rank's loss ``(w_r * y_r).sum()``,
then repeats the same computation in this one process with plain torch ops and compares this
rank's gradient. Horovod's rules, as the reference says: allreduce, alltoall and (times the set's
size) reducescatter give the gradient of the *sum* of every rank's loss; allgather and broadcast
that of their *average*.
"""

import pytest

torch = pytest.importorskip("torch")
import gradsync.torch as hvd  # noqa: E402

pytestmark = pytest.mark.torch


def seeded(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def every_rank(seed, shape_of):
    """The tensor of every rank r: seeded by ``seed + r``, shaped ``shape_of(r)``."""
    return [seeded(seed + r, *shape_of(r)) for r in range(hvd.size())]


def leaves(tensors):
    return [t.clone().requires_grad_() for t in tensors]


def backward_of_this_rank(y, weights):
    (weights[hvd.rank()] * y).sum().backward()


def assert_close(actual, expected):
    assert actual.shape == expected.shape
    assert torch.allclose(actual, expected, rtol=1e-12, atol=1e-12), (actual, expected)


@pytest.mark.parametrize("op, prescale, postscale", [
    (hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 1.0), (hvd.Sum, 0.5, 3.0), (hvd.Average, 2.0, 0.25)])
def test_allreduce_gradient_is_the_allreduce_of_the_output_gradient(op, prescale, postscale):
    n, r = hvd.size(), hvd.rank()
    xs, ws = every_rank(0, lambda _: (3, 4)), every_rank(100, lambda _: (3, 4))
    x = xs[r].clone().requires_grad_()
    y = hvd.allreduce(x, op=op, prescale_factor=prescale, postscale_factor=postscale)
    backward_of_this_rank(y, ws)

    ref = leaves(xs)
    total = sum(prescale * t for t in ref) * postscale / (n if op == hvd.Average else 1)
    sum((w * total).sum() for w in ws).backward()
    assert_close(y.detach(), total.detach())
    assert_close(x.grad, ref[r].grad)


def test_allreduce_with_average_false_is_a_differentiable_sum():
    x = torch.ones(5, dtype=torch.float64, requires_grad=True)
    with pytest.warns(DeprecationWarning):
        hvd.allreduce(x, average=False).sum().backward()
    assert_close(x.grad, torch.full((5,), float(hvd.size()), dtype=torch.float64))


def test_grouped_allreduce_gradient_is_each_members_allreduce():
    r = hvd.rank()
    shapes = [(2,), (3, 2), (1, 1, 4)]
    xs = [every_rank(10 * i, lambda _, s=s: s) for i, s in enumerate(shapes)]
    ws = [every_rank(500 + 10 * i, lambda _, s=s: s) for i, s in enumerate(shapes)]
    mine = [member[r].clone().requires_grad_() for member in xs]
    ys = hvd.grouped_allreduce(mine, op=hvd.Sum)
    sum((w[r] * y).sum() for w, y in zip(ws, ys)).backward()

    for member, weights, x in zip(xs, ws, mine):
        ref = leaves(member)
        total = sum(ref)
        sum((w * total).sum() for w in weights).backward()
        assert_close(x.grad, ref[r].grad)


def test_allgather_gradient_is_this_ranks_rows_of_the_averaged_gradient():
    n, r = hvd.size(), hvd.rank()
    xs = every_rank(0, lambda q: (q + 1, 3))  # uneven first dimensions
    ws = [seeded(200 + q, n * (n + 1) // 2, 3) for q in range(n)]
    x = xs[r].clone().requires_grad_()
    y = hvd.allgather(x)
    backward_of_this_rank(y, ws)

    ref = leaves(xs)
    gathered = torch.cat(ref)
    (sum((w * gathered).sum() for w in ws) / n).backward()
    assert_close(y.detach(), gathered.detach())
    assert_close(x.grad, ref[r].grad)


def test_grouped_allgather_gradient_is_each_members_rows():
    n, r = hvd.size(), hvd.rank()
    xs = [every_rank(0, lambda q: (q + 1, 2)), every_rank(50, lambda q: (2 * q + 1,))]
    rows = [n * (n + 1) // 2, n * n]
    ws = [[seeded(300 + q, rows[0], 2) for q in range(n)], [seeded(400 + q, rows[1]) for q in range(n)]]
    mine = [member[r].clone().requires_grad_() for member in xs]
    ys = hvd.grouped_allgather(mine)
    sum((w[r] * y).sum() for w, y in zip(ws, ys)).backward()

    for member, weights, x in zip(xs, ws, mine):
        ref = leaves(member)
        gathered = torch.cat(ref)
        (sum((w * gathered).sum() for w in weights) / n).backward()
        assert_close(x.grad, ref[r].grad)


def test_broadcast_gradient_is_the_averaged_gradient_on_the_root_only():
    n, r = hvd.size(), hvd.rank()
    root = n - 1
    xs, ws = every_rank(0, lambda _: (4,)), every_rank(100, lambda _: (4,))
    x = xs[r].clone().requires_grad_()
    y = hvd.broadcast(x, root)
    backward_of_this_rank(y, ws)

    ref = leaves(xs)
    (sum((w * ref[root]).sum() for w in ws) / n).backward()
    expected = ref[r].grad if ref[r].grad is not None else torch.zeros_like(x)
    assert_close(y.detach(), xs[root])
    assert_close(x.grad, expected)


@pytest.mark.parametrize("even", [False, True])
def test_alltoall_gradient_goes_back_along_the_received_splits(even):
    n, r = hvd.size(), hvd.rank()
    # rank q sends (q + d + 1) rows to rank d, or 2 rows to every rank with the even split
    splits_of = [[2] * n if even else [q + d + 1 for d in range(n)] for q in range(n)]
    xs = every_rank(0, lambda q: (sum(splits_of[q]), 2))
    received = [sum(splits_of[q][d] for q in range(n)) for d in range(n)]
    ws = [seeded(100 + d, received[d], 2) for d in range(n)]
    x = xs[r].clone().requires_grad_()
    if even:
        y = hvd.alltoall(x)
    else:
        y, got = hvd.alltoall(x, torch.tensor(splits_of[r], dtype=torch.int32))
        assert got.tolist() == [splits_of[q][r] for q in range(n)] and got.dtype == torch.int32
    backward_of_this_rank(y, ws)

    ref = leaves(xs)
    pieces = [torch.split(t, splits_of[q]) for q, t in enumerate(ref)]
    outputs = [torch.cat([pieces[q][d] for q in range(n)]) for d in range(n)]
    sum((w * out).sum() for w, out in zip(ws, outputs)).backward()
    assert_close(y.detach(), outputs[r].detach())
    assert_close(x.grad, ref[r].grad)


@pytest.mark.parametrize("op, prescale, postscale", [
    (hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 1.0), (hvd.Sum, 0.5, 4.0)])
def test_reducescatter_gradient_is_the_allgathered_gradient_scaled_as_horovod(op, prescale, postscale):
    n, r = hvd.size(), hvd.rank()
    rows = 2 * n + 1  # uneven blocks: the first rank gets one row more
    xs = every_rank(0, lambda _: (rows, 3))
    blocks = [rows // n + (q < rows % n) for q in range(n)]
    ws = [seeded(100 + q, blocks[q], 3) for q in range(n)]
    x = xs[r].clone().requires_grad_()
    y = hvd.reducescatter(x, op=op, prescale_factor=prescale, postscale_factor=postscale)
    backward_of_this_rank(y, ws)

    ref = leaves(xs)
    total = sum(prescale * t for t in ref) * postscale / (n if op == hvd.Average else 1)
    mine = torch.split(total, blocks)
    # Horovod's reducescatter gradient: the set's size times that of the sum of the losses.
    (n * sum((w * block).sum() for w, block in zip(ws, mine))).backward()
    assert_close(y.detach(), mine[r].detach())
    assert_close(x.grad, ref[r].grad)


def test_grouped_reducescatter_gradient_is_each_members_allgathered_gradient():
    n, r = hvd.size(), hvd.rank()
    shapes = [(2 * n, 2), (n + 1,)]
    xs = [every_rank(10 * i, lambda _, s=s: s) for i, s in enumerate(shapes)]
    blocks = [[s[0] // n + (q < s[0] % n) for q in range(n)] for s in shapes]
    ws = [[seeded(700 + 10 * i + q, b[q], *s[1:]) for q in range(n)]
          for i, (s, b) in enumerate(zip(shapes, blocks))]
    mine = [member[r].clone().requires_grad_() for member in xs]
    ys = hvd.grouped_reducescatter(mine, op=hvd.Sum)
    sum((w[r] * y).sum() for w, y in zip(ws, ys)).backward()

    for member, weights, b, x in zip(xs, ws, blocks, mine):
        ref = leaves(member)
        split = torch.split(sum(ref), b)
        (n * sum((w * block).sum() for w, block in zip(weights, split))).backward()
        assert_close(x.grad, ref[r].grad)


def test_gradients_follow_a_process_set():
    n, r = hvd.size(), hvd.rank()
    if n < 2:
        pytest.skip("a process set of one rank would be every rank")
    evens = hvd.add_process_set([q for q in range(n) if q % 2 == 0])
    try:
        if r % 2 == 0:
            x = torch.ones(3, dtype=torch.float64, requires_grad=True)
            hvd.allreduce(x, op=hvd.Sum, process_set=evens).sum().backward()
            assert_close(x.grad, torch.full((3,), float(evens.size()), dtype=torch.float64))
    finally:
        hvd.remove_process_set(evens)
