"""gradsync.tensorflow on every rank: each collective on tf.Tensor against numpy, eagerly and inside
tf.function, Horovod's gradients against their formulas, and a custom training loop with
DistributedGradientTape in a tf.function against single-process training on the concatenated
batch."""

import os

import numpy as np
import pytest

import gradsync

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
pytestmark = pytest.mark.tensorflow
tf = pytest.importorskip("tensorflow")
hvd = pytest.importorskip("gradsync.tensorflow")

RANKS = (1, 2, 4)
TIMEOUT = 240
tf.config.threading.set_inter_op_parallelism_threads(2)
tf.config.threading.set_intra_op_parallelism_threads(1)


def rank_data(rank, shape, dtype, seed=0):
    """This test's input on ``rank``: every rank can compute every rank's, for the references."""
    rng = np.random.default_rng(1000 * seed + rank)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        return rng.integers(-5 if dtype.kind == "i" else 0, 6, shape).astype(dtype)
    return rng.uniform(0.5, 2.0, shape).astype(dtype)


def every_rank(shape, dtype, seed=0):
    return [rank_data(r, shape, dtype, seed) for r in range(hvd.size())]


def reference(arrays, op):
    """The reduction by numpy, in the core's accumulator dtypes (integer Average: the floor)."""
    dtype = arrays[0].dtype
    if dtype == np.bool_:
        return (np.logical_or.reduce if op in ("Sum", "Max") else np.logical_and.reduce)(arrays)
    wide = np.float32 if dtype == np.float16 else (np.int64 if dtype.kind in "iu" else dtype)
    stack = np.stack(arrays).astype(wide)
    if op == "Average":
        out = stack.sum(0) // len(arrays) if dtype.kind in "iu" else stack.sum(0) / len(arrays)
    else:
        out = {"Sum": np.sum, "Min": np.min, "Max": np.max, "Product": np.prod}[op](stack, axis=0)
    return out.astype(dtype)


def close(result, expected):
    assert isinstance(result, tf.Tensor), type(result)
    got = result.numpy()
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got.dtype, got.shape)
    if expected.dtype.kind in "biu":
        np.testing.assert_array_equal(got, expected)
    else:
        rtol = 1e-2 if expected.dtype.itemsize == 2 else 1e-6
        np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), rtol=rtol)


def run(where, fn, *args):
    """``fn(*args)`` eagerly, or traced into a tf.function and run there."""
    return fn(*args) if where == "eager" else tf.function(fn)(*args)


WHERE = ["eager", "function"]
CASES = [("float32", "Sum"), ("float32", "Average"), ("float32", "Min"), ("float64", "Max"),
         ("float32", "Product"), ("float16", "Average"), ("int32", "Average"), ("int64", "Sum"),
         ("uint8", "Max"), ("bool", "Min")]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize(("dtype", "op"), CASES)
def test_allreduce_of_a_tf_tensor_matches_numpy(where, dtype, op, rank):
    mine = tf.constant(rank_data(rank, (3, 5), dtype))
    result = run(where, lambda x: hvd.allreduce(x, op=getattr(hvd, op)), mine)
    close(result, reference(every_rank((3, 5), dtype), op))


@pytest.mark.parametrize("where", WHERE)
def test_allreduce_average_flag_scale_factors_and_fp16_compression(where, rank):
    mine = tf.constant(rank_data(rank, (6,), np.float32))
    summed = reference(every_rank((6,), np.float32), "Sum")
    result = run(where, lambda x: hvd.allreduce(x, average=False, prescale_factor=0.5,
                                                postscale_factor=3.0, name=f"scaled.{where}"), mine)
    close(result, summed * np.float32(1.5))
    compressed = run(where, lambda x: hvd.allreduce(x, compression=hvd.Compression.fp16), mine)
    assert compressed.dtype == tf.float32
    np.testing.assert_allclose(compressed.numpy(), summed / hvd.size(), rtol=2e-3)


@pytest.mark.parametrize("where", WHERE)
def test_grouped_allreduce_of_mixed_dtypes_matches_numpy(where, rank):
    specs = [((8, 3), np.float32), ((3,), np.float64), ((5,), np.int32), ((), np.float32)]
    mine = [tf.constant(rank_data(rank, s, d, i)) for i, (s, d) in enumerate(specs)]
    result = run(where, lambda *xs: hvd.grouped_allreduce(list(xs), op=hvd.Sum), *mine)
    for i, (shape, dtype) in enumerate(specs):
        close(result[i], reference(every_rank(shape, dtype, i), "Sum"))


@pytest.mark.parametrize("where", WHERE)
def test_allgather_takes_uneven_first_dimensions(where, rank, size):
    mine = tf.constant(rank_data(rank, (rank + 1, 3), np.float32))
    result = run(where, lambda x: hvd.allgather(x), mine)
    close(result, np.concatenate([rank_data(r, (r + 1, 3), np.float32) for r in range(size)]))


@pytest.mark.parametrize("where", WHERE)
def test_broadcast_gives_every_rank_the_roots_tensor(where, rank, size):
    mine = tf.constant(rank_data(rank, (3, 2), np.int8))
    close(run(where, lambda x: hvd.broadcast(x, size - 1), mine), rank_data(size - 1, (3, 2), np.int8))


@pytest.mark.parametrize("where", WHERE)
def test_alltoall_sends_each_rank_its_rows(where, rank, size):
    """Rank r sends j + 1 rows to rank j: rows labelled 100 * sender + destination."""
    splits = [j + 1 for j in range(size)]
    mine = np.concatenate([np.full((j + 1, 2), 100 * rank + j, np.float64) for j in range(size)])
    output, received = run(where, lambda x: hvd.alltoall(x, splits=splits), tf.constant(mine))
    close(output, np.concatenate([np.full((rank + 1, 2), 100 * r + rank, np.float64)
                                  for r in range(size)]))
    close(received, np.full(size, rank + 1, np.int32))


@pytest.mark.parametrize("where", WHERE)
def test_reducescatter_gives_each_rank_its_block(where, rank, size):
    rows = 2 * size + 1
    result = run(where, lambda x: hvd.reducescatter(x, op=hvd.Sum),
                 tf.constant(rank_data(rank, (rows, 2), np.float32)))
    total = reference(every_rank((rows, 2), np.float32), "Sum")
    counts = [rows // size + (r < rows % size) for r in range(size)]
    start = sum(counts[:rank])
    close(result, total[start:start + counts[rank]])


def gradient(where, op, x):
    """d sum(op(x) * weights) / dx, with weights = 1 + position, eagerly or in a tf.function."""
    def grad(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = op(x)
            weights = tf.reshape(tf.range(1, tf.size(y) + 1, dtype=y.dtype), tf.shape(y))
            loss = tf.reduce_sum(y * weights)
        return tape.gradient(loss, x)
    return run(where, grad, x).numpy()


@pytest.mark.parametrize("where", WHERE)
def test_gradients_of_the_collectives_are_horovods(where, rank, size):
    x = tf.constant(rank_data(rank, (size, 2), np.float64))
    weights = np.arange(1, 2 * size + 1, dtype=np.float64).reshape(size, 2)
    np.testing.assert_allclose(gradient(where, lambda t: hvd.allreduce(t, op=hvd.Sum), x), weights * size)
    gathered = np.arange(1, 2 * size * size + 1, dtype=np.float64).reshape(size * size, 2)
    np.testing.assert_allclose(gradient(where, hvd.allgather, x), gathered[size * rank:size * (rank + 1)])
    root = size - 1
    np.testing.assert_allclose(gradient(where, lambda t: hvd.broadcast(t, root), x),
                               weights * (rank == root))
    exchanged = gradient(where, hvd.alltoall, x)  # row j went to rank j as row rank
    np.testing.assert_allclose(exchanged, np.stack([weights[rank]] * size))
    scattered = gradient(where, lambda t: hvd.reducescatter(t, op=hvd.Sum), x)
    np.testing.assert_allclose(scattered, np.tile([[1.0, 2.0]], (size, 1)) * size)


def test_allreduce_of_indexed_slices_allgathers_them(rank, size):
    slices = tf.IndexedSlices(tf.constant([[float(rank), 1.0]]), tf.constant([rank % 3]),
                              dense_shape=tf.constant([3, 2]))
    result = hvd.allreduce(slices)
    assert isinstance(result, tf.IndexedSlices)
    np.testing.assert_array_equal(result.indices.numpy(), [r % 3 for r in range(size)])
    np.testing.assert_allclose(result.values.numpy(), [[r / size, 1 / size] for r in range(size)])


def test_broadcast_variables_assigns_the_roots_values(rank):
    variables = [tf.Variable(rank_data(rank, (4, 3), np.float32)), tf.Variable(rank_data(rank, (2,), np.int64, 1))]
    hvd.broadcast_variables(variables, root_rank=0)
    np.testing.assert_array_equal(variables[0].numpy(), rank_data(0, (4, 3), np.float32))
    np.testing.assert_array_equal(variables[1].numpy(), rank_data(0, (2,), np.int64, 1))


def test_ops_refuse_bad_arguments_naming_the_rank(rank):
    with pytest.raises(ValueError, match=f"rank {rank}.*average=True and op="):
        hvd.allreduce(tf.ones(2), average=True, op=hvd.Sum)
    with pytest.raises(ValueError, match=f"rank {rank}.*0-d tensor"):
        hvd.allgather(tf.constant(1.0))
    with pytest.raises(TypeError, match="tf.GradientTape"):
        hvd.DistributedGradientTape(object())


@pytest.mark.parametrize("where", WHERE)
def test_ranks_that_disagree_on_a_shape_fail_with_gradsyncs_message(where, rank, size):
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")
    error = gradsync.CollectiveError if where == "eager" else tf.errors.OpError
    with pytest.raises(error, match=f"rank {rank}: allreduce 'disagreeing.{where}': ranks disagree on shape"):
        run(where, lambda x: hvd.allreduce(x, name=f"disagreeing.{where}"), tf.ones((rank + 1,)))


# ---- training -------------------------------------------------------------------------------------

BATCH, FEATURES, HIDDEN, STEPS, LR = 6, 5, 4, 4, 0.1


def make_variables():
    rng = np.random.default_rng(7)  # the same start on every rank
    shapes = [(FEATURES, HIDDEN), (HIDDEN,), (HIDDEN, 1), (1,)]
    return [tf.Variable(rng.normal(size=s)) for s in shapes]


def loss_fn(variables, x, y):
    w1, b1, w2, b2 = variables
    return tf.reduce_mean((tf.tanh(x @ w1 + b1) @ w2 + b2 - y) ** 2)


def batch(rank, step):
    rng = np.random.default_rng(100 * step + rank)
    return rng.normal(size=(BATCH, FEATURES)), rng.normal(size=(BATCH, 1))


def train(variables, batches, distributed):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(variables, x, y)
        if distributed:
            tape = hvd.DistributedGradientTape(tape)
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(LR * g)
    for x, y in batches:
        step(tf.constant(x), tf.constant(y))
    return [v.numpy() for v in variables]


def test_tape_training_in_a_tf_function_equals_one_process_on_the_whole_batch(rank, size):
    got = train(make_variables(), [batch(rank, s) for s in range(STEPS)], distributed=True)
    whole = [tuple(np.concatenate(part) for part in zip(*[batch(r, s) for r in range(size)]))
             for s in range(STEPS)]
    expected = train(make_variables(), whole, distributed=False)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-8)
    everywhere = hvd.allgather(tf.constant(np.concatenate([g.ravel() for g in got])[None]))
    np.testing.assert_array_equal(everywhere.numpy(), np.tile(everywhere.numpy()[:1], (size, 1)))


@pytest.mark.parametrize("where", WHERE)
def test_partial_tape_leaves_local_gradients_unreduced_but_scaled(where, rank, size):
    class Layer:  # anything with trainable_weights
        def __init__(self, value):
            self.trainable_weights = [tf.Variable(value)]

    shared, local = Layer(np.ones(3)), Layer(np.ones(2))

    def grads():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(shared.trainable_weights[0] * (rank + 1.0)) + \
                tf.reduce_sum(local.trainable_weights[0] * (rank + 1.0))
        tape = hvd.PartialDistributedGradientTape(tape, local_layers=[local])
        return tape.gradient(loss, shared.trainable_weights + local.trainable_weights)

    g_shared, g_local = run(where, grads)
    np.testing.assert_allclose(g_shared.numpy(), np.full(3, (size + 1) / 2))
    np.testing.assert_allclose(g_local.numpy(), np.full(2, (rank + 1) / size))


def test_tape_sparse_gradients_allgathered_or_densified(rank, size):
    table = tf.Variable(np.zeros((4, 2)))

    def grads(sparse_as_dense):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, [rank % 4]) * (rank + 1.0))
        return hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense).gradient(loss, [table])[0]

    expected = np.zeros((4, 2))
    for r in range(size):
        expected[r % 4] += (r + 1.0) / size
    sparse = grads(False)
    assert isinstance(sparse, tf.IndexedSlices)
    np.testing.assert_allclose(tf.convert_to_tensor(sparse).numpy(), expected)
    dense = grads(True)
    assert isinstance(dense, tf.Tensor)
    np.testing.assert_allclose(dense.numpy(), expected)
