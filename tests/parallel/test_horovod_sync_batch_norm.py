"""SyncBatchNorm equals BatchNorm on the concatenation of every rank's batch.

Every rank builds every rank's batch from seeds (different sizes per rank, one of them possibly
empty), runs SyncBatchNorm on its own, and compares with torch.nn.BatchNorm on the concatenated
batch in this one process: the output rows, the running statistics, the input gradient of the sum
of every rank's loss, and the weight and bias gradients summed over the ranks.
"""

import pytest

torch = pytest.importorskip("torch")
import gradsync.torch as hvd  # noqa: E402

pytestmark = pytest.mark.torch

C = 3


def batches(sizes, trailing=(5,)):
    return [torch.randn(n, C, *trailing, generator=torch.Generator().manual_seed(q), dtype=torch.float64)
            * (q + 1) + q for q, n in enumerate(sizes)]


def loss_weights(sizes, trailing=(5,)):
    return [torch.randn(n, C, *trailing, generator=torch.Generator().manual_seed(100 + q),
                        dtype=torch.float64) for q, n in enumerate(sizes)]


def reference(bn, xs, ws):
    """BatchNorm on the concatenated batch; the loss is the sum of every rank's loss."""
    x = torch.cat(xs).requires_grad_()
    y = bn(x)
    (torch.cat(ws) * y).sum().backward()
    return y, x.grad


def modules(**options):
    sync = hvd.SyncBatchNorm(C, **options).double()
    plain = torch.nn.BatchNorm1d(C, **options).double()
    with torch.no_grad():
        if sync.weight is not None:
            for module in (sync, plain):
                module.weight.copy_(torch.tensor([0.5, 2.0, -1.0]))
                module.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    return sync, plain


def close(a, b):
    return torch.allclose(a, b, rtol=1e-10, atol=1e-10)


def run_one_step(sync, plain, sizes, trailing=(5,)):
    r = hvd.rank()
    xs, ws = batches(sizes, trailing), loss_weights(sizes, trailing)
    x = xs[r].clone().requires_grad_()
    y = sync(x)
    (ws[r] * y).sum().backward()
    expected, expected_grad = reference(plain, xs, ws)
    start = sum(sizes[:r])
    assert close(y, expected[start:start + sizes[r]])
    assert close(x.grad, expected_grad[start:start + sizes[r]])
    if sync.weight is not None:
        assert close(hvd.allreduce(sync.weight.grad, op=hvd.Sum), plain.weight.grad)
        assert close(hvd.allreduce(sync.bias.grad, op=hvd.Sum), plain.bias.grad)
    if sync.track_running_stats:
        assert close(sync.running_mean, plain.running_mean)
        assert close(sync.running_var, plain.running_var)


def test_equal_batches():
    sync, plain = modules()
    run_one_step(sync, plain, [4] * hvd.size())


def test_uneven_batches_over_two_steps():
    sync, plain = modules()
    for step in range(2):
        run_one_step(sync, plain, [2 + q + step for q in range(hvd.size())])
    assert int(sync.num_batches_tracked) == 2


def test_a_rank_with_an_empty_batch():
    sizes = [0] + [3] * (hvd.size() - 1) if hvd.size() > 1 else [3]
    sync, plain = modules()
    run_one_step(sync, plain, sizes)


def test_two_dimensional_input_without_affine_and_cumulative_average():
    sync, plain = modules(affine=False, momentum=None)
    for _ in range(2):
        run_one_step(sync, plain, [3 + q for q in range(hvd.size())], trailing=())


def test_four_dimensional_input():
    sync = hvd.SyncBatchNorm(C).double()
    plain = torch.nn.BatchNorm3d(C).double()
    run_one_step(sync, plain, [2] * hvd.size(), trailing=(2, 3, 2))


def test_eval_mode_uses_the_running_statistics():
    sync, plain = modules()
    run_one_step(sync, plain, [4] * hvd.size())
    sync.eval()
    plain.eval()
    x = batches([5])[0]
    assert close(sync(x), plain(x))


def test_without_running_statistics_eval_still_synchronises():
    sync, plain = modules(track_running_stats=False)
    sync.eval()
    plain.eval()
    run_one_step(sync, plain, [3] * hvd.size())


def test_one_value_per_channel_in_all_is_an_error_on_every_rank():
    if hvd.size() == 1:
        pytest.skip("one rank: torch's own BatchNorm check applies")
    sync = hvd.SyncBatchNorm(C)
    x = torch.randn(1 if hvd.rank() == 0 else 0, C)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        sync(x)


def test_fewer_than_two_dimensions_is_refused():
    with pytest.raises(ValueError, match="at least 2D"):
        hvd.SyncBatchNorm(C)(torch.randn(C))
