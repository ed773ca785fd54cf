"""gradsync.jax on every rank: each collective on jax arrays against numpy, outside and inside
jax.jit, and DistributedOptimizer training against single-process training on the concatenated
batch."""

import os

import numpy as np
import pytest

import gradsync

# Two CPU devices per rank (before jax is imported), to check where results land and that pmap and
# arrays sharded over several devices are refused; cpu:0 stays the default device.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
pytestmark = pytest.mark.jax
jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = jax.numpy
gj = pytest.importorskip("gradsync.jax")
ml_dtypes = pytest.importorskip("ml_dtypes")

BF16 = np.dtype(ml_dtypes.bfloat16)


def size():
    return gradsync.size()


def rank_data(rank, shape, dtype, seed=0):
    """This test's input on ``rank``: every rank can compute every rank's, for the references."""
    rng = np.random.default_rng(1000 * seed + rank)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        return rng.integers(-5 if dtype.kind == "i" else 0, 6, shape).astype(dtype)
    return rng.uniform(0.5, 2.0, shape).astype(np.float32).astype(dtype)


def every_rank(shape, dtype, seed=0):
    return [rank_data(r, shape, dtype, seed) for r in range(size())]


def reference(arrays, op):
    """The reduction by numpy, in the core's accumulator dtypes (docs/architecture.md#dtype-rules)."""
    dtype = arrays[0].dtype
    if dtype == np.bool_:
        return (np.logical_or.reduce if op in ("Sum", "Max") else np.logical_and.reduce)(arrays)
    wide = np.float32 if dtype in (np.float16, BF16) else (np.int64 if dtype.kind in "iu" else dtype)
    stack = np.stack(arrays).astype(wide)
    if op == "Average":
        out = stack.sum(0) // len(arrays) if dtype.kind in "iu" else stack.sum(0) / len(arrays)
    else:
        out = {"Sum": np.sum, "Min": np.min, "Max": np.max, "Product": np.prod}[op](stack, axis=0)
    return out.astype(dtype)


def close(result, expected):
    """A jax result against numpy: float32 to rounding of the reduction order, 16-bit floats to one
    rounding, everything else exactly."""
    assert isinstance(result, jax.Array), type(result)
    assert result.dtype == expected.dtype and result.shape == expected.shape
    got = np.asarray(result)
    if expected.dtype.kind in "biu":
        np.testing.assert_array_equal(got, expected)
    else:
        rtol = 1e-2 if expected.dtype.itemsize == 2 else 1e-6
        np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), rtol=rtol)


def on_host_or_in_jit(where, op, *args):
    """``op(*args)`` called as it is, or from inside a jitted function."""
    return op(*args) if where == "eager" else jax.jit(op)(*args)


WHERE = ["eager", "jit"]
CASES = [("float32", "Sum"), ("float32", "Average"), ("float32", "Min"), ("float32", "Max"),
         ("float32", "Product"), ("bfloat16", "Sum"), ("float16", "Average"), ("int32", "Average"),
         ("int32", "Sum"), ("uint8", "Max"), ("bool", "Sum"), ("bool", "Min")]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize(("dtype", "op"), CASES)
def test_allreduce_of_a_jax_array_matches_numpy(where, dtype, op):
    dtype = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    mine = jnp.asarray(rank_data(gradsync.rank(), (3, 5), dtype))
    result = on_host_or_in_jit(where, lambda x: gj.allreduce(x, op=getattr(gradsync, op)), mine)
    close(result, reference(every_rank((3, 5), dtype), op))


@pytest.mark.parametrize("where", WHERE)
def test_allreduce_of_a_pytree_keeps_its_structure(where):
    tree = {"a": jnp.asarray(rank_data(gradsync.rank(), (4,), np.float32)),
            "b": (jnp.asarray(rank_data(gradsync.rank(), (2, 2), np.int32, 1)), None),
            "c": [jnp.asarray(rank_data(gradsync.rank(), (), np.float32, 2))]}
    result = on_host_or_in_jit(where, lambda t: gj.allreduce(t, name=f"tree.{where}",
                                                             op=gradsync.Sum), tree)
    assert jax.tree_util.tree_structure(result) == jax.tree_util.tree_structure(tree)
    close(result["a"], reference(every_rank((4,), np.float32), "Sum"))
    close(result["b"][0], reference(every_rank((2, 2), np.int32, 1), "Sum"))
    close(result["c"][0], reference(every_rank((), np.float32, 2), "Sum"))


@pytest.mark.parametrize("where", WHERE)
def test_grouped_allreduce_of_a_mixed_dtype_pytree_matches_numpy(where):
    specs = {"w": ((8, 3), np.float32), "b": ((3,), np.float32), "h": ((5,), BF16),
             "n": ((2,), np.int32)}
    tree = {k: jnp.asarray(rank_data(gradsync.rank(), s, d, i)) for i, (k, (s, d)) in enumerate(specs.items())}
    result = on_host_or_in_jit(where, lambda t: gj.grouped_allreduce(t, name=f"group.{where}"), tree)
    for i, (key, (shape, dtype)) in enumerate(specs.items()):
        close(result[key], reference(every_rank(shape, dtype, i), "Average"))


@pytest.mark.parametrize("op", ["Average", "Sum"])
def test_inside_jit_the_in_place_custom_call_gives_the_same_bits_as_outside(op):
    """Inside jit the leaves are reduced in XLA's own buffers (gradsync/jax/xla_ffi.py); outside,
    from host views into new buffers: the same fused reduction, so the same bits."""
    seeds = {"w": ((300, 7), np.float32, 3), "b": ((7,), np.float32, 4), "h": ((5,), np.float16, 5)}
    tree = {key: jnp.asarray(rank_data(gradsync.rank(), *spec)) for key, spec in seeds.items()}
    reduce = lambda t, where: gj.grouped_allreduce(t, name=f"bits.{op}.{where}",  # noqa: E731
                                                   op=getattr(gradsync, op))
    inside = jax.jit(lambda t: reduce(jax.tree_util.tree_map(lambda a: a * 1, t), "jit"))(tree)
    outside = reduce(tree, "eager")
    for key, spec in seeds.items():
        np.testing.assert_array_equal(np.asarray(inside[key]), np.asarray(outside[key]))
        close(inside[key], reference(every_rank(*spec), op))


def test_inside_jit_an_average_by_three_ranks_gives_the_same_bits_as_outside():
    """Inside jit the program divides a float32 Average (the core sums, the call returns
    1/divisor): 1/3 is where a rounding other than the core's would show."""
    if size() < 3:
        pytest.skip("needs three ranks for a divisor of 3")
    trio = gradsync.add_process_set([0, 1, 2])
    try:
        if gradsync.rank() < 3:
            shapes = {"w": (300, 7), "b": (7,)}
            tree = {k: jnp.asarray(rank_data(gradsync.rank(), s, np.float32, i))
                    for i, (k, s) in enumerate(shapes.items())}
            reduce = lambda t, where: gj.allreduce(t, name=f"third.{where}",  # noqa: E731
                                                   process_set=trio)
            inside = jax.jit(lambda t: reduce(jax.tree_util.tree_map(lambda a: a * 1, t), "jit"))(tree)
            outside = reduce(tree, "eager")
            for i, (key, shape) in enumerate(shapes.items()):
                np.testing.assert_array_equal(np.asarray(inside[key]), np.asarray(outside[key]))
                close(inside[key], reference(every_rank(shape, np.float32, i)[:3], "Average"))
    finally:
        gradsync.remove_process_set(trio)


@pytest.mark.parametrize("where", WHERE)
def test_allreduce_with_scale_factors(where):
    mine = jnp.asarray(rank_data(gradsync.rank(), (6,), np.float32))
    result = on_host_or_in_jit(where, lambda x: gj.allreduce(x, op=gradsync.Sum, prescale_factor=0.5,
                                                             postscale_factor=3.0), mine)
    close(result, reference(every_rank((6,), np.float32), "Sum") * np.float32(1.5))


@pytest.fixture(scope="module")
def alone():
    """A process set of this rank alone: at one rank the global set, else one set per rank, each
    registered on every rank in the same order."""
    if size() == 1:
        yield gradsync.global_process_set
        return
    sets = [gradsync.add_process_set([r]) for r in range(size())]
    yield sets[gradsync.rank()]
    for one in sets:
        gradsync.remove_process_set(one)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize(("dtype", "op"), CASES)
def test_an_allreduce_over_one_rank_is_its_input_bit_for_bit(alone, where, dtype, op):
    """Every op of one rank is the identity: inside jit the program holds no call at all, outside
    it the result is a new array of the same values."""
    dtype = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    mine = jnp.asarray(rank_data(gradsync.rank(), (3, 5), dtype))
    reduce = lambda x: gj.allreduce(x, op=getattr(gradsync, op), process_set=alone)  # noqa: E731
    result = on_host_or_in_jit(where, reduce, mine)
    close(result, rank_data(gradsync.rank(), (3, 5), dtype))
    np.testing.assert_array_equal(np.asarray(result).view(np.uint8), np.asarray(mine).view(np.uint8))
    if where == "jit":
        hlo = jax.jit(reduce).lower(mine).as_text()
        assert "gradsync_inplace" not in hlo and "callback" not in hlo
    else:
        assert result.unsafe_buffer_pointer() != mine.unsafe_buffer_pointer()


@pytest.mark.parametrize("where", WHERE)
def test_scale_factors_still_apply_over_one_rank(alone, where):
    mine = jnp.asarray(rank_data(gradsync.rank(), (6,), np.float32))
    result = on_host_or_in_jit(where, lambda t: gj.grouped_allreduce(
        t, name=f"alone.scaled.{where}", prescale_factor=0.5, postscale_factor=3.0,
        process_set=alone), {"x": mine})
    expected = rank_data(gradsync.rank(), (6,), np.float32) * np.float32(0.5) * np.float32(3.0)
    np.testing.assert_array_equal(np.asarray(result["x"]), expected)


def test_vmap_and_grad_are_refused_over_one_rank_too(alone):
    with pytest.raises(TypeError, match="cannot run under jax.vmap"):
        jax.vmap(lambda x: gj.allreduce(x, process_set=alone))(jnp.ones((2, 3)))
    with pytest.raises(TypeError, match="not differentiable"):
        jax.grad(lambda x: gj.allreduce(x, process_set=alone).sum())(jnp.ones(3))


class Twins:
    """A pytree node whose two children have the same key: a custom node may name them so."""

    def __init__(self, first, second):
        self.first, self.second = first, second


jax.tree_util.register_pytree_with_keys(
    Twins, lambda t: (((jax.tree_util.GetAttrKey("w"), t.first), (jax.tree_util.GetAttrKey("w"), t.second)), None),
    lambda _, children: Twins(*children))


@pytest.mark.parametrize("where", WHERE)
def test_leaves_whose_key_paths_repeat_are_reduced_each_on_its_own(where):
    tree = Twins(jnp.asarray(rank_data(gradsync.rank(), (3,), np.float32, seed=1)),
                 jnp.asarray(rank_data(gradsync.rank(), (3,), np.float32, seed=2)))
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert paths == [".w", ".w"]  # both leaves would be named "twins.<where>.w"
    result = on_host_or_in_jit(where, lambda t: gj.allreduce(t, name=f"twins.{where}", op=gradsync.Sum), tree)
    close(result.first, reference(every_rank((3,), np.float32, seed=1), "Sum"))
    close(result.second, reference(every_rank((3,), np.float32, seed=2), "Sum"))


@pytest.mark.parametrize("where", WHERE)
def test_broadcast_gives_every_rank_the_roots_pytree(where):
    root = size() - 1
    tree = {"x": jnp.asarray(rank_data(gradsync.rank(), (3, 2), np.float32)),
            "i": jnp.asarray(rank_data(gradsync.rank(), (4,), np.int8))}
    result = on_host_or_in_jit(where, lambda t: gj.broadcast(t, root, name=f"bcast.{where}"), tree)
    close(result["x"], rank_data(root, (3, 2), np.float32))
    close(result["i"], rank_data(root, (4,), np.int8))


def test_allgather_outside_jit_takes_uneven_first_dimensions():
    mine = jnp.asarray(rank_data(gradsync.rank(), (gradsync.rank() + 1, 3), np.float32))
    result = gj.allgather(mine)
    close(result, np.concatenate([rank_data(r, (r + 1, 3), np.float32) for r in range(size())]))


def test_allgather_inside_jit_matches_numpy():
    mine = jnp.asarray(rank_data(gradsync.rank(), (2, 3), np.int32))
    result = jax.jit(lambda x: gj.allgather(x, name="gather.jit"))(mine)
    close(result, np.concatenate(every_rank((2, 3), np.int32)))


@pytest.mark.parametrize("where", WHERE)
def test_reducescatter_gives_each_rank_its_rows(where):
    rows = 2 * size() + 1
    mine = jnp.asarray(rank_data(gradsync.rank(), (rows, 2), np.float32))
    result = on_host_or_in_jit(where, lambda x: gj.reducescatter(x, op=gradsync.Sum), mine)
    counts = [rows // size() + (r < rows % size()) for r in range(size())]
    start = sum(counts[:gradsync.rank()])
    full = reference(every_rank((rows, 2), np.float32), "Sum")
    close(result, full[start:start + counts[gradsync.rank()]])


def test_alltoall_sends_each_rank_its_rows():
    me, n = gradsync.rank(), size()
    splits = [(me + r) % 3 for r in range(n)]
    mine = jnp.asarray(np.arange(sum(splits) * 2, dtype=np.float32).reshape(-1, 2) + 100 * me)
    output, received = gj.alltoall(mine, splits=splits)
    expected = []
    for sender in range(n):
        their = [(sender + r) % 3 for r in range(n)]
        rows = np.arange(sum(their) * 2, dtype=np.float32).reshape(-1, 2) + 100 * sender
        expected.append(rows[sum(their[:me]):sum(their[:me + 1])])
    close(output, np.concatenate(expected))
    np.testing.assert_array_equal(np.asarray(received), [(s + me) % 3 for s in range(n)])


def test_async_allreduce_returns_a_handle_that_synchronize_completes():
    mine = {"v": jnp.full((3,), float(gradsync.rank()), jnp.float32)}
    handle = gj.allreduce_async(mine, name="async")
    assert isinstance(handle, gj.JaxHandle)
    result = gradsync.synchronize(handle)
    assert gradsync.poll(handle)
    close(result["v"], np.full(3, (size() - 1) / 2, np.float32))


def test_unnamed_ops_inside_jit_and_on_the_host_thread_do_not_shift_each_others_names():
    """A jitted step runs its callback while the Python thread issues unnamed ops of its own."""
    step = jax.jit(lambda x: gj.allreduce(x * 2, op=gradsync.Sum))
    x = jnp.full((4,), float(gradsync.rank() + 1), jnp.float32)
    total = sum(r + 1 for r in range(size()))
    for _ in range(5):
        pending = step(x)  # dispatched asynchronously: its callback may run during the next line
        eager = gj.allreduce(x, op=gradsync.Sum)
        close(pending, np.full(4, 2 * total, np.float32))
        close(eager, np.full(4, total, np.float32))


def test_a_retraced_function_keeps_working_with_new_shapes():
    reduce = jax.jit(lambda x: gj.allreduce(x, name="retrace", op=gradsync.Max))
    for length in (3, 7, 3):
        mine = jnp.asarray(rank_data(gradsync.rank(), (length,), np.float32, length))
        close(reduce(mine), reference(every_rank((length,), np.float32, length), "Max"))


def test_allreduce_inside_lax_scan_runs_once_per_iteration():
    def body(carry, _):
        return gj.allreduce(carry, name="scan", op=gradsync.Sum), None

    start = jnp.ones((2,), jnp.float32)
    result, _ = jax.jit(lambda c: jax.lax.scan(body, c, None, length=3))(start)
    close(result, np.full(2, size() ** 3, np.float32))


def test_ranks_that_disagree_inside_jit_fail_with_the_collectives_error():
    if size() == 1:
        pytest.skip("needs two ranks to disagree")
    mine = jnp.zeros((gradsync.rank() + 1,), jnp.float32)
    with pytest.raises(Exception, match="disagree on shape"):
        jax.block_until_ready(jax.jit(lambda x: gj.allreduce(x, name="mismatch.jit"))(mine))


def test_in_place_ops_are_refused_with_the_fix():
    x = jnp.ones(3)
    with pytest.raises(ValueError, match=r"read-only.*gradsync\.jax\.allreduce"):
        gradsync.allreduce_(x)
    with pytest.raises(AttributeError, match=r"immutable.*gradsync\.jax\.allreduce\b"):
        gj.allreduce_  # noqa: B018


def test_core_ops_on_a_jax_array_return_numpy():
    result = gradsync.allreduce(jnp.full((2,), float(gradsync.rank())), op=gradsync.Sum)
    assert isinstance(result, np.ndarray)
    np.testing.assert_array_equal(result, np.full(2, sum(range(size())), np.float32))


def test_a_core_op_on_a_traced_value_names_gradsync_jax():
    with pytest.raises(TypeError, match=r"traced jax value.*gradsync\.jax\.allreduce"):
        jax.jit(lambda x: gradsync.allreduce(x))(jnp.ones(2))


def test_async_ops_are_refused_inside_jit():
    with pytest.raises(TypeError, match="traced jax value"):
        jax.jit(lambda x: gj.allreduce_async(x))(jnp.ones(2))


def test_vmap_and_grad_are_refused_clearly():
    with pytest.raises(TypeError, match="cannot run under jax.vmap"):
        jax.vmap(gj.allreduce)(jnp.ones((2, 3)))
    with pytest.raises(TypeError, match="not differentiable"):
        jax.grad(lambda x: gj.allreduce(x).sum())(jnp.ones(3))


def test_results_come_back_on_their_inputs_device():
    other = jax.devices()[1]
    tree = {"a": jax.device_put(jnp.full((3,), float(gradsync.rank())), other), "b": jnp.ones(2)}
    result = gj.allreduce(tree, name="device")
    assert result["a"].devices() == {other} and result["b"].devices() == {jax.devices()[0]}
    close(result["a"], np.full(3, (size() - 1) / 2, np.float32))


def test_inside_jit_on_another_device_the_results_stay_there():
    other = jax.devices()[1]
    mine = jax.device_put(jnp.full((3,), float(gradsync.rank())), other)
    result = jax.jit(lambda x: gj.allreduce(x, name="device.jit"))(mine)
    assert result.devices() == {other}
    close(result, np.full(3, (size() - 1) / 2, np.float32))


def test_an_array_sharded_over_two_devices_is_refused():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    sharded = jax.device_put(jnp.arange(4.0), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
    with pytest.raises(TypeError, match="sharded over 2 devices.*one process per device"):
        gj.allreduce(sharded)


def test_pmap_and_shard_map_are_refused_clearly():
    with pytest.raises(TypeError, match="cannot run inside jax.pmap or shard_map"):
        jax.pmap(gj.allreduce)(jnp.ones((2, 3)))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    spec = jax.sharding.PartitionSpec("d")
    with pytest.raises(TypeError, match="cannot run inside jax.pmap or shard_map"):
        jax.shard_map(gj.allreduce, mesh=mesh, in_specs=spec, out_specs=spec)(jnp.ones(4))


def test_average_metrics_gives_python_floats_of_the_mean():
    values = {"loss": jnp.float32(gradsync.rank()), "accuracy": jnp.asarray(1.0)}
    assert gj.average_metrics(values) == {"accuracy": 1.0, "loss": (size() - 1) / 2}


# ---- training -------------------------------------------------------------------------------

BATCH, FEATURES, CLASSES, STEPS = 4, 6, 3, 6


def init_params(key):
    k1, k2 = jax.random.split(key)
    return {"hidden": {"w": jax.random.normal(k1, (FEATURES, 8)) * 0.5, "b": jnp.zeros(8)},
            "out": {"w": jax.random.normal(k2, (8, CLASSES)) * 0.5, "b": jnp.zeros(CLASSES)}}


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["hidden"]["w"] + params["hidden"]["b"])
    logits = h @ params["out"]["w"] + params["out"]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def global_batches(n_ranks):
    """Every step's batch over all ranks, the same on every rank: rank r's share is rows
    ``r * BATCH`` to ``(r + 1) * BATCH``."""
    rng = np.random.default_rng(7)
    return [(rng.normal(size=(n_ranks * BATCH, FEATURES)).astype(np.float32),
             rng.integers(0, CLASSES, n_ranks * BATCH)) for _ in range(STEPS)]


def make_tx():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.05))


def train(tx, batches, shard, where):
    """STEPS steps from the same initial parameters; ``shard`` picks this process's rows."""
    params = init_params(jax.random.key(0))
    state = tx.init(params)

    def step(params, state, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    grad = jax.jit(jax.grad(loss_fn))
    jitted = jax.jit(step)
    for x, y in batches:
        x, y = jnp.asarray(x[shard]), jnp.asarray(y[shard])
        if where == "jit":
            params, state = jitted(params, state, x, y)
        else:  # gradients in jit, the optimizer's update (and its allreduce) outside it
            updates, state = tx.update(grad(params, x, y), state, params)
            params = optax.apply_updates(params, updates)
    return params


def flat(params):
    return np.concatenate([np.asarray(leaf).ravel() for leaf in jax.tree_util.tree_leaves(params)])


@pytest.mark.parametrize("where", WHERE)
def test_training_equals_one_process_on_the_concatenated_batch(where):
    batches = global_batches(size())
    me = slice(gradsync.rank() * BATCH, (gradsync.rank() + 1) * BATCH)
    distributed = train(gj.DistributedOptimizer(make_tx(), name=f"grads.{where}"), batches, me, where)
    single = train(make_tx(), batches, slice(None), where)  # the reference, computed on this rank
    np.testing.assert_allclose(flat(distributed), flat(single), rtol=0, atol=1e-5)


@pytest.mark.parametrize("where", WHERE)
def test_training_leaves_identical_parameters_on_every_rank(where):
    batches = global_batches(size())
    me = slice(gradsync.rank() * BATCH, (gradsync.rank() + 1) * BATCH)
    params = flat(train(gj.DistributedOptimizer(make_tx(), name=f"same.{where}"), batches, me, where))
    every = gradsync.allgather(params.view(np.int32)[None])
    assert (every == every[0]).all(), "the ranks' parameters differ bit for bit"


@pytest.mark.parametrize("where", WHERE)
def test_training_over_one_rank_equals_one_process_bit_for_bit(alone, where):
    """A set of one rank: DistributedOptimizer's update is the wrapped one's, to the last bit."""
    batches = global_batches(1)
    alone_params = train(gj.DistributedOptimizer(make_tx(), name=f"alone.{where}", process_set=alone),
                         batches, slice(None), where)
    tx = make_tx()  # the update compiled, as DistributedOptimizer runs it outside jit
    single = train(optax.GradientTransformation(tx.init, jax.jit(tx.update)), batches, slice(None), where)
    np.testing.assert_array_equal(flat(alone_params), flat(single))


def test_broadcast_parameters_gives_every_rank_the_roots_parameters():
    mine = init_params(jax.random.key(gradsync.rank()))
    params = gj.broadcast_parameters(mine, root_rank=0)
    np.testing.assert_array_equal(flat(params), flat(init_params(jax.random.key(0))))


def test_broadcast_parameters_results_can_be_donated_to_a_jitted_step():
    params = gj.broadcast_parameters(init_params(jax.random.key(0)), name="donated")
    step = jax.jit(lambda p: jax.tree_util.tree_map(lambda a: a + 1, p), donate_argnums=0)
    expected = flat(params) + 1
    np.testing.assert_array_equal(flat(step(params)), expected)


def test_gradient_accumulation_with_optax_multisteps_equals_the_big_batch():
    """MultiSteps calls the wrapped update (and so the allreduce) only every k-th micro-step."""
    batches = global_batches(size())
    me = slice(gradsync.rank() * BATCH, (gradsync.rank() + 1) * BATCH)
    accumulated = optax.MultiSteps(gj.DistributedOptimizer(optax.sgd(0.1), name="multi"),
                                   every_k_schedule=2)
    params = train(accumulated, batches, me, "jit")
    reference = train(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2), batches, slice(None), "jit")
    np.testing.assert_allclose(flat(params), flat(reference), rtol=0, atol=1e-5)
