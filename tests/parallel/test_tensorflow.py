"""gradsync.tensorflow on every rank: each collective on tf.Tensor against numpy, eagerly and inside
tf.function, Horovod's gradients against their formulas, and a custom training loop with
DistributedGradientTape in a tf.function against single-process training on the concatenated
batch; Keras 3 variables that share a name broadcast eagerly and in a tf.function, and Horovod's
TF2 MNIST loop on such a model against the same loop in one process."""

import os
import pathlib

import numpy as np
import pytest
from reference import Sum, all_inputs, assert_array, make, reference_allreduce, rows_of

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
pytestmark = pytest.mark.tensorflow
tf = pytest.importorskip("tensorflow")
hvd = pytest.importorskip("gradsync.tensorflow")

RANKS = (1, 2, 4)
TIMEOUT = 240
# The tests beside a joined rank again with the Average divisor of the ranks that have not joined.
VARIANTS = {"join-by-contributors": {"env": {"GRADSYNC_JOIN_DIVISOR": "contributors"}, "ranks": (2, 3),
                                     "k": "joined"}}
tf.config.threading.set_inter_op_parallelism_threads(2)
tf.config.threading.set_intra_op_parallelism_threads(1)


def close(result, expected):
    """A tf.Tensor result equal to the numpy reference: same dtype, shape and values."""
    assert isinstance(result, tf.Tensor), type(result)
    assert_array(np.asarray(result.numpy()), expected)  # a 0-d tensor gives a numpy scalar


def run(where, fn, *args):
    """``fn(*args)`` eagerly, traced into a tf.function and run there, or built into a TF1 graph
    (the arguments as constants) and run by a Session (results as tf.Tensor again)."""
    if where == "eager":
        return fn(*args)
    if where == "function":
        return tf.function(fn)(*args)
    with tf.Graph().as_default() as graph:
        outputs = fn(*[tf.constant(np.asarray(a)) for a in args])
        with tf.compat.v1.Session(graph=graph) as session:
            results = session.run(outputs)
    return [tf.constant(r) for r in results] if isinstance(results, list) else tf.constant(results)


WHERE = ["eager", "function"]
CASES = [("float32", "Sum"), ("float32", "Average"), ("float32", "Min"), ("float64", "Max"),
         ("float32", "Product"), ("float16", "Average"), ("int32", "Average"), ("int64", "Sum"),
         ("uint8", "Max"), ("bool", "Min")]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize(("dtype", "op"), CASES)
def test_allreduce_of_a_tf_tensor_matches_numpy(where, dtype, op, rank, case):
    op = getattr(hvd, op)
    mine = tf.constant(make(case, rank, dtype, (3, 5), op))
    result = run(where, lambda x: hvd.allreduce(x, op=op), mine)
    close(result, reference_allreduce(all_inputs(case, dtype, (3, 5), op), op))


@pytest.fixture(scope="module")
def alone():
    """A process set of this rank alone (one per rank, registered on every rank in order)."""
    import gradsync

    size = gradsync.size()
    if size == 1:
        yield hvd.global_process_set
        return
    sets = [gradsync.add_process_set([r]) for r in range(size)]
    yield sets[hvd.rank()]
    for one in sets:
        gradsync.remove_process_set(one)


@pytest.mark.parametrize("where", WHERE + ["graph"])
@pytest.mark.parametrize(("dtype", "op"), CASES)
def test_an_allreduce_over_one_rank_is_its_input_without_a_host_op(alone, where, dtype, op, rank, case):
    op = getattr(hvd, op)
    mine = make(case, rank, dtype, (3, 5), op)
    result = run(where, lambda x: hvd.grouped_allreduce([x], op=op, process_set=alone)[0],
                 tf.constant(mine))
    close(result, mine)
    graph = tf.function(lambda x: hvd.allreduce(x, op=op, process_set=alone)).get_concrete_function(
        tf.TensorSpec((3, 5), mine.dtype)).graph
    assert not [o.type for o in graph.get_operations() if "PyFunc" in o.type]


def test_scale_factors_still_apply_over_one_rank(alone, rank, case):
    mine = make(case, rank, "float32", (6,))
    result = hvd.allreduce(tf.constant(mine), op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0,
                           process_set=alone)
    close(result, reference_allreduce([mine], Sum, 0.5, 3.0))


@pytest.mark.parametrize("where", WHERE)
def test_allreduce_average_flag_scale_factors_and_fp16_compression(where, rank, case):
    mine = tf.constant(make(case, rank, "float32", (6,)))
    everyone = all_inputs(case, "float32", (6,))
    result = run(where, lambda x: hvd.allreduce(x, average=False, prescale_factor=0.5,
                                                postscale_factor=3.0, name=f"scaled.{where}"), mine)
    close(result, reference_allreduce(everyone, Sum, 0.5, 3.0))
    compressed = run(where, lambda x: hvd.allreduce(x, compression=hvd.Compression.fp16), mine)
    assert compressed.dtype == tf.float32
    np.testing.assert_allclose(compressed.numpy(), reference_allreduce(everyone, hvd.Average),
                               rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("where", WHERE)
def test_grouped_allreduce_of_mixed_dtypes_matches_numpy(where, rank, case):
    specs = [((8, 3), "float32"), ((3,), "float64"), ((5,), "int32"), ((), "float32")]
    mine = [tf.constant(make(f"{case}.{i}", rank, d, s)) for i, (s, d) in enumerate(specs)]
    result = run(where, lambda *xs: hvd.grouped_allreduce(list(xs), op=hvd.Sum), *mine)
    for i, (shape, dtype) in enumerate(specs):
        close(result[i], reference_allreduce(all_inputs(f"{case}.{i}", dtype, shape), Sum))


@pytest.mark.parametrize("where", WHERE)
def test_allgather_takes_uneven_first_dimensions(where, rank, size, case):
    shapes = [(r + 1, 3) for r in range(size)]
    result = run(where, lambda x: hvd.allgather(x), tf.constant(make(case, rank, "float32", shapes[rank])))
    close(result, np.concatenate(all_inputs(case, "float32", shapes)))


@pytest.mark.parametrize("where", WHERE)
def test_broadcast_gives_every_rank_the_roots_tensor(where, rank, size, case):
    mine = tf.constant(make(case, rank, "int8", (3, 2)))
    close(run(where, lambda x: hvd.broadcast(x, size - 1), mine), make(case, size - 1, "int8", (3, 2)))


@pytest.mark.parametrize("where", WHERE)
def test_unsigned_dtypes_are_moved_bit_for_bit(where, rank, size):
    mine = np.array([[65535 - rank, rank]], np.uint16)
    gathered = run(where, lambda x: hvd.allgather(x), tf.constant(mine))
    close(gathered, np.array([[65535 - r, r] for r in range(size)], np.uint16))
    close(run(where, lambda x: hvd.broadcast(x, size - 1), tf.constant(mine.astype(np.uint32))),
          np.array([[65535 - size + 1, size - 1]], np.uint32))


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
def test_reducescatter_gives_each_rank_its_block(where, rank, size, case):
    rows = 2 * size + 1
    result = run(where, lambda x: hvd.reducescatter(x, op=hvd.Sum),
                 tf.constant(make(case, rank, "float32", (rows, 2))))
    close(result, reference_allreduce(all_inputs(case, "float32", (rows, 2)), Sum)[rows_of(rows, rank, size)])


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
def test_gradients_of_the_collectives_are_horovods(where, rank, size, case):
    x = tf.constant(make(case, rank, "float64", (size, 2)))
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


def test_allreduce_and_grouped_allreduce_of_indexed_slices_allgather_them(rank, size):
    slices = tf.IndexedSlices(tf.constant([[float(rank), 1.0]]), tf.constant([rank % 3]),
                              dense_shape=tf.constant([3, 2]))
    result, dense = hvd.grouped_allreduce([slices, tf.ones(2)])
    np.testing.assert_array_equal(dense.numpy(), np.ones(2))
    assert isinstance(result, tf.IndexedSlices)
    np.testing.assert_array_equal(hvd.allreduce(slices).indices.numpy(), result.indices.numpy())
    np.testing.assert_array_equal(result.indices.numpy(), [r % 3 for r in range(size)])
    np.testing.assert_allclose(result.values.numpy(), [[r / size, 1 / size] for r in range(size)])


def test_broadcast_variables_assigns_the_roots_values(rank, case):
    specs = [("float32", (4, 3)), ("int64", (2,))]
    variables = [tf.Variable(make(f"{case}.{i}", rank, d, s)) for i, (d, s) in enumerate(specs)]
    hvd.broadcast_variables(variables, root_rank=0)
    for i, (variable, (dtype, shape)) in enumerate(zip(variables, specs)):
        assert_array(variable.numpy(), make(f"{case}.{i}", 0, dtype, shape))


def test_bad_arguments_found_while_the_op_runs_raise_horovods_error(rank, size):
    with pytest.raises(tf.errors.InvalidArgumentError, match=f"rank {rank}: alltoall .*splits"):
        hvd.alltoall(tf.ones((2, 1)), splits=[3] + [0] * (size - 1))


def test_ops_refuse_bad_arguments_naming_the_rank(rank):
    with pytest.raises(ValueError, match=f"rank {rank}.*average=True and op="):
        hvd.allreduce(tf.ones(2), average=True, op=hvd.Sum)
    with pytest.raises(ValueError, match=f"rank {rank}.*0-d tensor"):
        hvd.allgather(tf.constant(1.0))
    with pytest.raises(TypeError, match="tf.GradientTape"):
        hvd.DistributedGradientTape(object())


@pytest.mark.parametrize("where", WHERE + ["graph"])
def test_ranks_that_disagree_on_a_shape_fail_with_gradsyncs_message(where, rank, size):
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")
    with pytest.raises(tf.errors.FailedPreconditionError,  # Horovod's class, also in a graph
                       match=f"rank {rank}: allreduce 'disagreeing.{where}': ranks disagree on shape"):
        run(where, lambda x: hvd.allreduce(x, name=f"disagreeing.{where}"), tf.ones((rank + 1,)))


def test_tf1_graph_runs_independent_collectives_in_creation_order(rank, size, case):
    # 24 collectives no data orders, on two inter-op threads: unordered, they stall (docs/tensorflow.md)
    mine = [make(f"{case}.{i}", rank, "float32", (5,)) for i in range(24)]
    results = run("graph", lambda *xs: [hvd.allreduce(x, op=hvd.Sum) for x in xs[:16]]
                  + [hvd.allgather(x) for x in xs[16:]], *mine)
    for i, result in enumerate(results):
        everyone = all_inputs(f"{case}.{i}", "float32", (5,))
        close(result, reference_allreduce(everyone, Sum) if i < 16 else np.concatenate(everyone))


def test_tf1_graph_broadcast_gradient_runs_the_allreduce_on_every_rank(rank, size):
    # off the root the gradient is zeros: the allreduce behind it must still run there
    with tf.Graph().as_default() as graph:
        x = tf.constant(np.full(5, rank + 1.0, np.float32))
        grads = [tf.gradients(hvd.broadcast(x, root), x, tf.ones([5]))[0] for root in range(size)]
        with tf.compat.v1.Session(graph=graph) as session:
            results = session.run(grads)
    for root, result in enumerate(results):
        assert_array(result, np.full(5, float(rank == root), np.float32))


def truncated(array, factor):
    return (array.astype(np.float64) * factor).astype(array.dtype)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_integer_scale_factors_scale_in_float64_and_truncate(where, op, rank, size, case):
    mine = tf.constant(make(case, rank, "int32", (7,)))
    everyone = [truncated(x, 0.37) for x in all_inputs(case, "int32", (7,))]
    result = run(where, lambda x: hvd.allreduce(x, op=getattr(hvd, op), prescale_factor=0.37,
                                                postscale_factor=2.5), mine)
    summed = np.sum(np.stack(everyone).astype(np.int64), axis=0).astype(np.int32)
    close(result, truncated(summed, 2.5 / size if op == "Average" else 2.5))


@pytest.mark.parametrize("where", WHERE + ["graph"])
def test_grouped_allgather_gathers_every_member(where, rank, size, case):
    specs = [("float32", (2, 3)), ("int64", (1,)), ("uint8", (3, 2)), ("float32", (4,))]
    mine = [make(f"{case}.{i}", rank, d, (s[0] + rank,) + s[1:]) for i, (d, s) in enumerate(specs)]
    result = run(where, lambda *xs: hvd.grouped_allgather(list(xs)), *mine)
    for i, (dtype, shape) in enumerate(specs):
        close(result[i], np.concatenate([make(f"{case}.{i}", r, dtype, (shape[0] + r,) + shape[1:])
                                         for r in range(size)]))


@pytest.mark.parametrize("where", WHERE + ["graph"])
def test_grouped_reducescatter_gives_each_rank_its_block_of_each_member(where, rank, size, case):
    specs = [("float32", (2 * size + 1, 2)), ("float64", (size,)), ("int32", (3 * size,))]
    mine = [make(f"{case}.{i}", rank, d, s) for i, (d, s) in enumerate(specs)]
    result = run(where, lambda *xs: hvd.grouped_reducescatter(list(xs), op=hvd.Sum, prescale_factor=0.5),
                 *mine)
    for i, (dtype, shape) in enumerate(specs):
        everyone = all_inputs(f"{case}.{i}", dtype, shape)
        if dtype == "int32":
            reduced = np.sum(np.stack([truncated(x, 0.5) for x in everyone]), axis=0).astype(np.int32)
        else:
            reduced = reference_allreduce(everyone, Sum, 0.5)
        close(result[i], reduced[rows_of(shape[0], rank, size)])


def test_grouped_reducescatter_and_allgather_gradients_are_horovods(rank, size):
    x = tf.constant(np.arange(2 * size, dtype=np.float32) + rank)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        scattered = hvd.grouped_reducescatter([x], op=hvd.Sum)[0]
        gathered = hvd.grouped_allgather([x])[0]
        loss_scatter = tf.reduce_sum(scattered * (rank + 1.0))
        loss_gather = tf.reduce_sum(gathered * tf.range(2.0 * size * size))
    # reducescatter (Sum): the allgather of every rank's (rank + 1) rows, times size
    expected = np.repeat(np.arange(1.0, size + 1), 2) * size
    np.testing.assert_allclose(tape.gradient(loss_scatter, x).numpy(), expected)
    # allgather: this rank's rows of the averaged gradient (the same on every rank)
    np.testing.assert_allclose(tape.gradient(loss_gather, x).numpy(),
                               np.arange(2.0 * size * size)[2 * size * rank:2 * size * (rank + 1)])


@pytest.mark.parametrize("where", ["eager", "graph"])
def test_broadcast_inplace_assigns_and_returns_the_roots_values(where, rank, size, case):
    root = size - 1
    specs = [("float32", (3, 2)), ("int32", (4,))]
    if where == "eager":
        variables = [tf.Variable(make(f"{case}.{i}", rank, d, s)) for i, (d, s) in enumerate(specs)]
        returned = [r.numpy() for r in hvd.broadcast_(variables, root)]
        values = [v.numpy() for v in variables]
    else:
        with tf.Graph().as_default() as graph:
            variables = [tf.compat.v1.Variable(make(f"{case}.{i}", rank, d, s)) for i, (d, s) in enumerate(specs)]
            returned_op = hvd.broadcast_(variables, root)
            with tf.compat.v1.Session(graph=graph) as session:
                session.run(tf.compat.v1.global_variables_initializer())
                returned = session.run(returned_op)
                values = session.run(variables)
    for i, (dtype, shape) in enumerate(specs):
        assert_array(returned[i], make(f"{case}.{i}", root, dtype, shape))
        assert_array(values[i], make(f"{case}.{i}", root, dtype, shape))


def test_broadcast_global_variables_is_a_tf1_graph_op(rank, case):
    with pytest.raises(RuntimeError, match="needs a TF1 graph"):
        hvd.broadcast_global_variables(0)
    with tf.Graph().as_default() as graph:
        variables = [tf.compat.v1.Variable(make(f"{case}.{i}", rank, "float64", (i + 1,))) for i in range(3)]
        broadcast = hvd.broadcast_global_variables(0)
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(broadcast)
            values = session.run(variables)
    for i, value in enumerate(values):
        assert_array(value, make(f"{case}.{i}", 0, "float64", (i + 1,)))


def test_indexed_slices_refuse_ops_and_factors_as_horovod(rank):
    slices = tf.IndexedSlices(tf.ones((1, 3)), tf.constant([rank]))
    with pytest.raises(NotImplementedError, match=f"rank {rank}: .*not Min"):
        hvd.allreduce(slices, op=hvd.Min)
    with pytest.raises(NotImplementedError, match="postscale_factor=0.5 are not supported"):
        hvd.grouped_allreduce([slices], op=hvd.Sum, postscale_factor=0.5)
    with pytest.raises(NotImplementedError, match="not Adasum"):  # before the dense members' checks
        hvd.grouped_allreduce([tf.ones(2, tf.int32), slices], op=hvd.Adasum)


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


# ---- variables that share a name (Keras 3: every Dense layer's "kernel" and "bias") --------------

IMAGE, CLASSES = 8, 10


def keras_digits_model(seed):
    """A Keras 3 model of Horovod's TF2 MNIST example's kind (convolution, pooling, two Dense
    layers), small: its layers' variables share the names ``kernel`` and ``bias``."""
    keras = tf.keras
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((IMAGE, IMAGE, 1)),
                             keras.layers.Conv2D(4, 3, activation="relu"),
                             keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
                             keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(CLASSES, activation="softmax")])


@pytest.mark.parametrize("where", WHERE)
def test_keras_variables_that_share_a_name_are_broadcast_each_from_the_root(where, rank, case):
    model = keras_digits_model(seed=0)
    assert [v.name for v in model.variables].count("kernel") == 3  # the names repeat
    for i, variable in enumerate(model.variables):
        variable.assign(make(f"{case}.{i}", rank, "float32", tuple(variable.shape)))

    def broadcast():  # a tf.function runs its stateful ops whatever it returns
        hvd.broadcast_variables(model.variables, root_rank=0)
    run(where, broadcast)
    for i, variable in enumerate(model.variables):
        assert_array(variable.numpy(), make(f"{case}.{i}", 0, "float32", tuple(variable.shape)))


@pytest.mark.parametrize("where", WHERE)
def test_broadcast_inplace_of_variables_that_share_a_name_assigns_the_roots_values(where, rank, size,
                                                                                    case):
    variables = [tf.Variable(make(f"{case}.{i}", rank, "float64", (3,)), name="w") for i in range(3)]
    assert len({v.name for v in variables}) == 1
    root = size - 1
    values = run(where, lambda: hvd.broadcast_(variables, root_rank=root, name="shared"))
    for i, (variable, value) in enumerate(zip(variables, values)):
        assert_array(variable.numpy(), make(f"{case}.{i}", root, "float64", (3,)))
        assert_array(value.numpy(), make(f"{case}.{i}", root, "float64", (3,)))


def image_batch(rank, step):
    """Rank ``rank``'s batch ``step``: images and labels that a fixed linear rule decides."""
    rng = np.random.default_rng(1000 * step + rank)
    images = rng.random((BATCH, IMAGE, IMAGE, 1)).astype("float32")
    rule = np.random.default_rng(5).normal(size=(IMAGE * IMAGE, CLASSES))
    return images, (images.reshape(BATCH, -1) @ rule).argmax(1).astype("int64")


def horovods_tf2_loop(batches, size):
    """Horovod's examples/tensorflow2/tensorflow2_mnist.py, its import changed to
    gradsync.tensorflow: a tf.function step with DistributedGradientTape, then on the first batch
    the model's and the optimizer's variables broadcast from rank 0. Each rank starts from its own
    random weights, as Horovod's ranks do."""
    model = keras_digits_model(seed=100 + hvd.rank())
    loss = tf.keras.losses.SparseCategoricalCrossentropy()
    opt = tf.keras.optimizers.Adam(0.001 * size)

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss_value = loss(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss_value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)  # Keras 3: a list, not opt.variables()
        return loss_value

    dataset = tf.data.Dataset.from_tensor_slices(tuple(np.concatenate(part) for part in zip(*batches)))
    for number, (images, labels) in enumerate(dataset.batch(BATCH)):
        training_step(images, labels, number == 0)
    return model, opt


def reference_tf2_loop(size, steps):
    """That loop in one process: the first update is rank 0's weights minus the average of every
    rank's gradient at its own starting weights (Horovod broadcasts after the first step), every
    later update the gradient of the concatenated batch."""
    models = [keras_digits_model(seed=100 + r) for r in range(size)]
    loss = tf.keras.losses.SparseCategoricalCrossentropy()
    model, opt = models[0], tf.keras.optimizers.Adam(0.001 * size)

    def gradients(net, images, labels):
        with tf.GradientTape() as tape:
            loss_value = loss(labels, net(images, training=True))
        return tape.gradient(loss_value, net.trainable_variables)

    first = [gradients(net, *image_batch(r, 0)) for r, net in enumerate(models)]
    opt.apply_gradients(zip([tf.add_n(list(g)) / size for g in zip(*first)], model.trainable_variables))
    for step in range(1, steps):
        images, labels = (np.concatenate(part) for part in zip(*[image_batch(r, step) for r in range(size)]))
        opt.apply_gradients(zip(gradients(model, images, labels), model.trainable_variables))
    return model, opt


def test_horovods_tf2_keras_loop_trains_as_one_process_on_the_whole_batch(rank, size):
    model, opt = horovods_tf2_loop([image_batch(rank, s) for s in range(STEPS)], size)
    expected_model, expected_opt = reference_tf2_loop(size, STEPS)
    for got, want in [(model.variables, expected_model.variables), (opt.variables, expected_opt.variables)]:
        assert [tuple(v.shape) for v in got] == [tuple(v.shape) for v in want]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-4, atol=1e-6, err_msg=g.name)
    weights = np.concatenate([v.numpy().ravel() for v in model.variables])[None]
    everywhere = hvd.allgather(tf.constant(weights)).numpy()
    np.testing.assert_array_equal(everywhere, np.tile(everywhere[:1], (size, 1)))


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


def test_allreduce_gradients_with_a_predivide_factor_still_averages(rank, size):
    grads = [tf.constant([float(rank), 1.0]), None]
    averaged, none = hvd.allreduce_gradients(grads, gradient_predivide_factor=2.0)
    assert none is None
    np.testing.assert_allclose(averaged.numpy(), [(size - 1) / 2, 1.0])
    with pytest.raises(ValueError, match=f"rank {rank}: .*gradient_predivide_factor=2.0 needs op=Average"):
        hvd.allreduce_gradients(grads, op=hvd.Sum, gradient_predivide_factor=2.0)


ROWS = 5


def gradients_of(r):
    """Rank r's gradients, as numpy: a dense one, and the values and row indices of a sparse one
    (rows that overlap between ranks, so that the densified sum adds several ranks' rows)."""
    dense = np.random.default_rng(10 + r).standard_normal((3, 2))
    rows = [r % ROWS, (r + 2) % ROWS, ROWS - 1]
    values = np.arange(6, dtype=np.float64).reshape(3, 2) + 10.0 * r
    return dense, values, rows


def densified(values, rows):
    dense = np.zeros((ROWS, 2))
    np.add.at(dense, rows, values)
    return dense


def reduced_gradients(rank, factor):
    """``allreduce_gradients`` of this rank's dense and sparse gradients, as numpy (both dense)."""
    dense, values, rows = gradients_of(rank)
    sparse = tf.IndexedSlices(tf.constant(values), tf.constant(rows), dense_shape=tf.constant([ROWS, 2]))
    got_dense, got_sparse = hvd.allreduce_gradients([tf.constant(dense), sparse], gradient_predivide_factor=factor)
    assert isinstance(got_sparse, tf.IndexedSlices)
    return got_dense.numpy(), tf.convert_to_tensor(got_sparse).numpy()


@pytest.mark.parametrize("factor", [1.0, 4.0])
def test_sparse_and_dense_gradients_with_a_predivide_factor_average_as_numpy(rank, size, factor):
    got_dense, got_sparse = reduced_gradients(rank, factor)
    everyone = [gradients_of(r) for r in range(size)]
    np.testing.assert_allclose(got_dense, sum(d for d, _, _ in everyone) / size, rtol=1e-12)
    np.testing.assert_allclose(got_sparse, sum(densified(v, i) for _, v, i in everyone) / size, rtol=1e-12)


def join_divisor(size):
    """What an Average divides by while one rank has joined, by the job's GRADSYNC_JOIN_DIVISOR."""
    return size - 1 if os.environ.get("GRADSYNC_JOIN_DIVISOR") == "contributors" else size


@pytest.mark.parametrize("factor", [1.0, 4.0])
def test_gradients_beside_a_joined_rank_divide_by_the_cores_divisor(rank, size, factor):
    if size == 1:
        pytest.skip("needs a rank that joins and one that does not")
    joined = size - 1  # joins at once; the others average their gradients, then join
    if rank == joined:
        hvd.join()
        return
    got_dense, got_sparse = reduced_gradients(rank, factor)
    hvd.join()
    contributors = [gradients_of(r) for r in range(joined)]
    divisor = join_divisor(size)
    np.testing.assert_allclose(got_dense, sum(d for d, _, _ in contributors) / divisor, rtol=1e-12)
    np.testing.assert_allclose(got_sparse, sum(densified(v, i) for _, v, i in contributors) / divisor,
                               rtol=1e-12)


def test_tensorflow_state_syncs_restores_and_commits_as_horovods(rank):
    # Horovod's test_elastic_state (test_tensorflow.py), eager.
    v = 1.0 if rank == 0 else 2.0
    variables = [tf.Variable(np.full((2, 2), v)), tf.Variable(np.full(2, v))]
    other = [np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([0.0, 0.0])]
    state = hvd.elastic.TensorFlowState(variables, batch=20 + rank, epoch=10 + rank)
    def assert_roots_state():  # rank 0's values and counters
        for variable in variables:
            np.testing.assert_array_equal(variable.numpy(), np.ones(variable.shape))
        assert (state.batch, state.epoch) == (20, 10)

    def change():
        for variable, value in zip(variables, other):
            variable.assign(value)
        state.batch, state.epoch = 21, 11

    state.sync()
    assert_roots_state()
    change()
    state.restore()
    assert_roots_state()
    change()
    state.commit()
    state.restore()
    for variable, value in zip(variables, other):
        np.testing.assert_array_equal(variable.numpy(), value)
    assert (state.batch, state.epoch) == (21, 11)


def test_tensorflow_state_resumes_a_commit_exactly(case, rank, tmp_path_factory, monkeypatch):
    directory = hvd.broadcast_object(str(tmp_path_factory.mktemp("elastic")) if rank == 0 else None,
                                     root_rank=0, name=f"{case}.dir")
    monkeypatch.setenv("GRADSYNC_ELASTIC_STATE_DIR", directory)
    values = np.random.default_rng(rank).normal(size=(3, 4)).astype(np.float32)
    state = hvd.elastic.TensorFlowState([tf.Variable(values)], step=rank)
    state.sync()  # rank 0's
    expected = state.variables[0].numpy()
    state.step = 7
    state.commit()  # rank 0 writes it
    fresh = hvd.elastic.TensorFlowState([tf.Variable(np.zeros((3, 4), np.float32))], step=-1)
    fresh.resume(pathlib.Path(directory))  # what hvd.elastic.run does first in a restarted job
    np.testing.assert_array_equal(fresh.variables[0].numpy(), expected)
    assert fresh.step == 7
