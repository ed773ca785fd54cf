"""DistributedOptimizer with process sets and gradient compression, against references every rank
computes alone from the members' known batches."""

import ml_dtypes
import numpy as np
import torch
from harness import run_checks

import gradsync

torch.set_num_threads(1)
gradsync.init()
rank, size = gradsync.rank(), gradsync.size()
evens = gradsync.add_process_set(range(0, size, 2)) if size > 1 else gradsync.global_process_set
odds = gradsync.add_process_set(range(1, size, 2)) if size > 1 else None
mine = evens if rank % 2 == 0 else odds


def batch(r, step):
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(8, 5, generator=g), torch.randn(8, 2, generator=g)


def model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def grads_of(net, r, step):
    net.zero_grad()
    x, y = batch(r, step)
    torch.nn.functional.mse_loss(net(x), y).backward()
    return [p.grad.detach().clone() for p in net.parameters()]


def check_training_on_a_process_set_equals_one_process():
    net, reference = model(), model()
    opt = gradsync.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.2),
                                        net.named_parameters(), process_set=mine)
    for step in range(4):
        opt.zero_grad()
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        per_rank = [grads_of(reference, r, step) for r in mine.ranks]
        with torch.no_grad():
            for i, p in enumerate(reference.parameters()):
                p -= 0.2 * sum(g[i] for g in per_rank) / len(per_rank)
    for p, q in zip(net.parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=1e-6), (p, q)


def check_a_non_member_steps_on_its_own_gradients():
    """As Horovod's: a rank outside the optimizer's process set reduces nothing."""
    if size == 1 or rank % 2 == 0:
        return
    net, reference = model(), model()
    opt = gradsync.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), process_set=evens)
    opt.zero_grad()
    x, y = batch(rank, 0)
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()
    own = grads_of(reference, rank, 0)
    with torch.no_grad():
        for p, q, g in zip(net.parameters(), reference.parameters(), own):
            assert torch.allclose(p, q - 0.1 * g, atol=1e-6), (p, q - 0.1 * g)


def compressed_average(compression, cast, step):
    """The gradients DistributedOptimizer gives with ``compression``, and the numpy reference:
    each rank's gradient cast to 16 bits, summed in float32, scaled by 1/size, rounded once."""
    net = model()
    opt = gradsync.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                        net.named_parameters(), compression=compression)
    x, y = batch(rank, step)
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.synchronize()
    got = [p.grad.clone() for p in net.parameters()]
    per_rank = [grads_of(model(), r, step) for r in range(size)]
    expected = []
    for i in range(len(got)):
        total = sum(cast(g[i].numpy()).astype(np.float32) for g in per_rank)
        expected.append(cast(total * np.float32(1 / size)).astype(np.float32))
    del opt
    return got, expected


def check_fp16_and_bf16_compression():
    for compression, dtype, tolerance in ((gradsync.Compression.fp16, np.float16, 1e-3),
                                          (gradsync.Compression.bf16, ml_dtypes.bfloat16, 8e-3)):
        got, expected = compressed_average(compression, lambda a, d=dtype: a.astype(d), 1)
        for g, e in zip(got, expected):
            g = g.numpy()
            assert g.dtype == np.float32, g.dtype  # decompressed to the parameter's dtype
            assert np.array_equal(g.astype(dtype).astype(np.float32), g), "not rounded to 16 bits"
            assert np.allclose(g, e, rtol=tolerance, atol=1e-6), (compression, g, e)


class Scaling:
    """A user compressor: multiplies by 4 before the allreduce and divides after; counts calls."""

    def __init__(self):
        self.calls = [0, 0]

    def compress(self, tensor):
        self.calls[0] += 1
        return tensor * 4, 4.0

    def decompress(self, tensor, context):
        self.calls[1] += 1
        return tensor / context


def check_user_compressor_plug_in():
    compressor = Scaling()
    net = model()
    opt = gradsync.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                        net.named_parameters(), compression=compressor)
    x, y = batch(rank, 2)
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.synchronize()
    params = len(list(net.parameters()))
    assert compressor.calls == [params, params], compressor.calls
    per_rank = [grads_of(model(), r, 2) for r in range(size)]
    for i, p in enumerate(net.parameters()):
        assert torch.allclose(p.grad, sum(g[i] for g in per_rank) / size, atol=1e-6), i
    try:
        gradsync.DistributedOptimizer(torch.optim.SGD(model().parameters(), lr=0.1),
                                      compression="fp16")
    except TypeError as exc:
        assert "compress() and decompress()" in str(exc), exc
    else:
        raise AssertionError("a compression without methods was accepted")


count = run_checks(globals())
print(f"toolkit_optimizer_check rank {rank}: {count} checks passed", flush=True)
