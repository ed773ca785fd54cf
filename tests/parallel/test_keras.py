"""gradsync.keras on every rank, for the Keras backend of KERAS_BACKEND (one job per backend, see
VARIANTS): model.fit with DistributedOptimizer against single-process fit on the concatenated
batch, weights identical on every rank, the callbacks against their formulas, load_model."""

import os
import pathlib

import numpy as np
import pytest

import gradsync

RANKS = ()  # every job names its backend: VARIANTS
# 4 ranks on the tensorflow backend only, whose adapter (graph mode, a host op) is Keras's own; on
# jax and torch, gradsync.keras hands the gradients to gradsync.jax's custom call and to
# gradsync.torch's ops, which their own files run at 4 ranks (a 4-rank Keras job takes 60-80 s of
# CI on 2 cores).
VARIANTS = {
    "jax": {"env": {"KERAS_BACKEND": "jax"}, "ranks": (1, 2)},
    "torch": {"env": {"KERAS_BACKEND": "torch"}, "ranks": (1, 2)},
    "tensorflow": {"env": {"KERAS_BACKEND": "tensorflow"}, "ranks": (1, 2, 4)},
}
BACKEND = os.environ.setdefault("KERAS_BACKEND", "jax")
pytestmark = pytest.mark.keras
pytest.importorskip(BACKEND)  # the backend's framework: skip where it is not installed
keras = pytest.importorskip("keras")
hvd = pytest.importorskip("gradsync.keras")
if BACKEND == "torch":
    import torch

    torch.set_num_threads(1)

B = 4  # samples per rank per step
LR = 0.1


def rank_data(rank, samples, seed=0):
    rng = np.random.default_rng(100 * seed + rank)
    return rng.normal(size=(samples, 5)).astype("float32"), rng.normal(size=(samples, 2)).astype("float32")


def make_model():
    keras.utils.set_random_seed(0)  # the same initial weights on every rank and in the reference
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(2)])


def interleaved(size, steps, per_step, seed=0):
    """Every rank's data, arranged so that batch j of size*per_step samples holds each rank's batch j."""
    data = [rank_data(r, steps * per_step, seed) for r in range(size)]
    xs = [np.concatenate([d[i][j * per_step:(j + 1) * per_step] for d in data]) for j in range(steps)
          for i in (0,)]
    ys = [np.concatenate([d[1][j * per_step:(j + 1) * per_step] for d in data]) for j in range(steps)]
    return np.concatenate(xs), np.concatenate(ys)


def reference_weights(steps, per_update, lr, seed=0):
    """Single-process SGD on the concatenated batches (per_update samples of each rank per update)."""
    x, y = interleaved(gradsync.size(), steps, per_update, seed)
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    model.fit(x, y, batch_size=gradsync.size() * per_update, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


def flat(weights):
    return np.concatenate([np.ravel(w) for w in weights]).astype(np.float64)


def assert_same_on_every_rank(weights, case):
    gathered = gradsync.allgather(flat(weights)[None], name=f"{case}.weights")
    np.testing.assert_array_equal(gathered, np.broadcast_to(gathered[:1], gathered.shape))


def test_fit_equals_single_process_fit_on_the_concatenated_batch(case):
    steps = 3
    x, y = rank_data(gradsync.rank(), steps * B)
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert_same_on_every_rank(model.get_weights(), case)
    np.testing.assert_allclose(flat(model.get_weights()), flat(reference_weights(steps, B, LR)), atol=1e-5)


@pytest.mark.parametrize("how", ["summed", "averaged", "keras-accumulation"])
def test_backward_passes_per_step_communicates_the_aggregate(case, how):
    passes, updates = 2, 2
    x, y = rank_data(gradsync.rank(), passes * updates * B, seed=1)
    model = make_model()
    if how == "keras-accumulation":  # Keras's own gradient_accumulation_steps: averaged
        optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(LR, gradient_accumulation_steps=passes))
    else:
        optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(LR), backward_passes_per_step=passes,
                                             average_aggregated_gradients=how == "averaged")
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    # The update uses the k micro-batch gradients summed (or averaged): plain SGD on all k*B
    # samples of every rank at once, with the learning rate times k when summed.
    expected = reference_weights(updates, passes * B, LR * passes if how == "summed" else LR, seed=1)
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == updates  # Keras counts updates
    np.testing.assert_allclose(flat(model.get_weights()), flat(expected), atol=1e-5)


def test_backward_passes_per_step_must_agree_with_the_optimizers_accumulation():
    with pytest.raises(ValueError, match="backward_passes_per_step=3 must be >= 1 and agree with the "
                                         "optimizer's gradient_accumulation_steps=2"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(LR, gradient_accumulation_steps=2),
                                 backward_passes_per_step=3)


class _Record(keras.callbacks.Callback):
    """Copies the logs and the learning rate as the callbacks before it left them."""

    def __init__(self):
        super().__init__()
        self.epoch_logs, self.rates = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.rates.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict(logs))


def test_metric_average_callback_averages_every_rank_logs(case):
    x, y = rank_data(gradsync.rank(), 2 * B, seed=2 + gradsync.rank())  # a different loss on each rank
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse", metrics=["mae"])
    before, after = _Record(), _Record()
    model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0,
              callbacks=[before, hvd.callbacks.MetricAverageCallback(), after])
    own = np.array([[logs["loss"], logs["mae"]] for logs in before.epoch_logs])
    every = gradsync.allgather(own[None], name=f"{case}.own")
    averaged = np.array([[logs["loss"], logs["mae"]] for logs in after.epoch_logs])
    np.testing.assert_allclose(averaged, every.mean(axis=0), rtol=1e-12)


def test_warmup_callback_follows_horovods_formula(case):
    steps, epochs, initial = 3, 3, 0.2
    x, y = rank_data(gradsync.rank(), steps * B)
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(initial)), loss="mse")
    record = _Record()
    model.fit(x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.LearningRateWarmupCallback(initial, warmup_epochs=2), record])
    n = gradsync.size()
    expected = [initial / n * ((e + b / steps + 1 / steps) * (n - 1) / 2 + 1)
                for e in range(2) for b in range(steps)]
    expected += [expected[-1]] * steps  # after the warm-up the rate stays
    np.testing.assert_allclose(record.rates, expected, rtol=1e-6)
    assert expected[steps * 2 - 1] == pytest.approx(initial)


def test_broadcast_variables_gives_every_rank_the_roots_values(case, rank):
    model = make_model()
    for variable in model.variables:
        variable.assign(np.full(variable.shape, rank + 1.0, "float32"))
    hvd.broadcast_variables(model.variables, root_rank=gradsync.size() - 1)
    np.testing.assert_array_equal(flat(model.get_weights()), np.full(flat(model.get_weights()).shape,
                                                                     float(gradsync.size())))


IMAGE, CLASSES = 8, 10


def digits_model(seed):
    """A small model of Horovod's Keras MNIST examples' kind (convolution, pooling, two Dense
    layers): its layers' variables share the names ``kernel`` and ``bias``."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((IMAGE, IMAGE, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                             keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
                             keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(CLASSES, activation="softmax")])


def digits_data(rank, samples):
    """Rank ``rank``'s images and the labels a fixed linear rule gives them."""
    images = np.random.default_rng(rank).random((samples, IMAGE, IMAGE, 1)).astype("float32")
    rule = np.random.default_rng(5).normal(size=(IMAGE * IMAGE, CLASSES))
    return images, (images.reshape(samples, -1) @ rule).argmax(1).astype("int64")


def test_horovods_keras_mnist_fit_trains_as_one_process_from_the_roots_weights(case, rank):
    """Horovod's examples/tensorflow2/tensorflow2_keras_mnist.py (and keras/keras_mnist.py), the
    import changed to gradsync.keras: each rank starts from its own random weights, the callback
    broadcasts rank 0's, and fit equals one process fitting rank 0's model on the whole batch."""
    size, steps, epochs = gradsync.size(), 3, 2
    scaled_lr = 0.001 * size
    x, y = digits_data(rank, steps * B)
    model = digits_model(seed=100 + rank)
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(scaled_lr), backward_passes_per_step=1,
                                   average_aggregated_gradients=True)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(), optimizer=opt, metrics=["accuracy"])
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
                 hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=2, verbose=0)]
    model.fit(x, y, batch_size=B, epochs=epochs, shuffle=False, callbacks=callbacks, verbose=0)

    data = [digits_data(r, steps * B) for r in range(size)]
    whole = [np.concatenate([d[i][j * B:(j + 1) * B] for j in range(steps) for d in data]) for i in (0, 1)]
    reference = digits_model(seed=100)
    reference.compile(loss=keras.losses.SparseCategoricalCrossentropy(),
                      optimizer=keras.optimizers.Adam(scaled_lr), metrics=["accuracy"])
    reference.fit(*whole, batch_size=size * B, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=2)])
    np.testing.assert_allclose(flat(model.get_weights()), flat(reference.get_weights()), rtol=1e-4, atol=1e-6)
    got = [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]
    want = [keras.ops.convert_to_numpy(v) for v in reference.optimizer.variables]
    np.testing.assert_allclose(flat(got), flat(want), rtol=1e-4, atol=1e-6)
    assert_same_on_every_rank(model.get_weights(), case)


def test_a_model_with_dropout_keeps_every_ranks_weights_identical(case, rank):
    """Horovod's Keras MNIST examples have Dropout layers, whose seed state is a model variable
    (uint32 on jax, int64 on the other backends): the broadcast callback moves it with the
    weights, and fit keeps every variable identical on every rank."""
    x, y = digits_data(rank, 3 * B)
    keras.utils.set_random_seed(100 + rank)
    model = keras.Sequential([keras.Input((IMAGE, IMAGE, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                              keras.layers.Dropout(0.25), keras.layers.Flatten(),
                              keras.layers.Dense(16, activation="relu"), keras.layers.Dropout(0.5),
                              keras.layers.Dense(CLASSES, activation="softmax")])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(),
                  optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)))
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    state = [v for v in model.variables if "seed" in v.path]
    assert state, [v.path for v in model.variables]
    assert_same_on_every_rank([keras.ops.convert_to_numpy(v) for v in model.variables], case)


def test_the_wrapped_optimizer_keeps_its_config_and_load_model_wraps_it_again(case, tmp_path):
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01, beta_1=0.8))
    assert isinstance(optimizer, keras.optimizers.Adam)
    again = type(optimizer).from_config(optimizer.get_config())
    assert type(again) is type(optimizer) and again.get_config() == optimizer.get_config()
    x, y = rank_data(gradsync.rank(), B)
    model = make_model()
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=B, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = hvd.load_model(path)
    assert type(loaded.optimizer).__mro__[1].__name__ == "_Distributed"
    assert loaded.optimizer.get_config()["beta_1"] == pytest.approx(0.8)
    np.testing.assert_array_equal(flat(loaded.get_weights()), flat(model.get_weights()))
    loaded.fit(x, y, batch_size=B, verbose=0)  # trains on: its gradients are averaged again
    assert_same_on_every_rank(loaded.get_weights(), case)


def test_fp16_compression_trains_as_the_reference_to_half_precision(case):
    steps = 2
    x, y = rank_data(gradsync.rank(), steps * B)
    model = make_model()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(LR), compression=hvd.Compression.fp16)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_same_on_every_rank(model.get_weights(), case)
    assert all(w.dtype == np.float32 for w in model.get_weights())
    # each rank's gradient rounded to float16 (relative 2**-11) before the average: LR * |g| * 1e-3
    difference = np.abs(flat(model.get_weights()) - flat(reference_weights(steps, B, LR)))
    assert 1e-6 < difference.max() < 2e-3  # rounded (so it was compressed), but only that much


def test_gradient_predivide_factor_trains_as_the_plain_average(case):
    steps = 2
    x, y = rank_data(gradsync.rank(), steps * B)
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR), gradient_predivide_factor=4.0,
                                                     sparse_as_dense=True, num_groups=2), loss="mse")
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_same_on_every_rank(model.get_weights(), case)
    np.testing.assert_allclose(flat(model.get_weights()), flat(reference_weights(steps, B, LR)), atol=1e-5)
    with pytest.raises(ValueError, match="gradient_predivide_factor=4.0 needs op=Average"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(LR), gradient_predivide_factor=4.0, op=hvd.Sum)


def test_broadcast_callback_leaves_local_variables_alone(rank):
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")  # rate 0: the weights stay as set
    for variable in model.variables:
        variable.assign(np.full(variable.shape, rank + 1.0, "float32"))
    local = list(model.layers[0].variables)
    root = gradsync.size() - 1
    x, y = rank_data(rank, B)
    model.fit(x, y, batch_size=B, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(root, local_variables=local)])
    for variable in model.variables:
        expected = rank + 1.0 if any(variable is v for v in local) else root + 1.0
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), np.full(variable.shape, expected))


def fit_with_the_broadcast_callback_then_assert_same_state(model, rank, steps, case):
    """``steps`` batches of this rank's data through ``model.fit`` with the broadcast callback; then
    the weights and the optimizer's variables must be the same on every rank."""
    x, y = rank_data(rank, steps * B)
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert_same_on_every_rank(model.get_weights(), case)
    assert_same_on_every_rank([keras.ops.convert_to_numpy(v) for v in model.optimizer.variables], f"{case}.opt")


def test_broadcast_callback_syncs_a_model_that_keras_builds_in_the_first_step(case, rank):
    """Horovod's tensorflow2_keras_mnist.py builds its Sequential without an input shape: Keras 3
    creates the weights (and on TensorFlow the optimizer's) in the first train step, after
    on_train_begin. Each rank starts from its own random weights; every rank ends with the same."""
    keras.utils.set_random_seed(100 + rank)
    model = keras.Sequential([keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(2)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    fit_with_the_broadcast_callback_then_assert_same_state(model, rank, 3, case)


def test_broadcast_callback_syncs_an_optimizer_built_on_the_root_only(case, rank):
    """A job resumed as Horovod's keras_imagenet_resnet50.py resumes: rank 0 has its optimizer's
    state (here built and set by hand), the others a fresh optimizer. No rank waits for a
    broadcast another rank does not make, and every rank ends with rank 0's state trained on."""
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    if rank == 0:
        model.optimizer.build(model.trainable_variables)
        for variable in model.optimizer.variables[2:]:  # after iterations and the learning rate
            variable.assign(np.full(variable.shape, 0.5, "float32"))
    fit_with_the_broadcast_callback_then_assert_same_state(model, rank, 2, case)


def test_broadcast_variables_refuses_different_numbers_of_variables_on_every_rank(rank, size):
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")
    model = make_model()
    variables = model.variables if rank == 0 else model.variables[:1]
    counts = ", ".join(f"rank {r}: {len(model.variables) if r == 0 else 1}" for r in range(size))
    with pytest.raises(ValueError, match=f"pass different numbers of variables \\({counts}\\)"):
        hvd.broadcast_variables(variables, root_rank=0)
    hvd.broadcast_variables(model.variables, root_rank=0)  # and the next broadcast works


def test_value_collectives_against_numpy(rank, size):
    value = np.arange(6, dtype="float32").reshape(3, 2) * (rank + 1)
    ranks_sum = size * (size + 1) / 2
    np.testing.assert_allclose(keras.ops.convert_to_numpy(hvd.allreduce(value, name="keras.ar")),
                               value / (rank + 1) * ranks_sum / size)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(hvd.allreduce(value, name="keras.ar_sum", average=False)),
                               value / (rank + 1) * ranks_sum)
    gathered = keras.ops.convert_to_numpy(hvd.allgather(value[: rank + 1], name="keras.ag"))
    np.testing.assert_array_equal(gathered, np.concatenate([value[: r + 1] / (rank + 1) * (r + 1)
                                                            for r in range(size)]))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(hvd.broadcast(value, size - 1, name="keras.bc")),
                                  value / (rank + 1) * size)
    rows = np.arange(size * 2, dtype="float32").reshape(size, 2)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(hvd.reducescatter(rows * (rank + 1), name="keras.rs")),
                               rows[rank: rank + 1] * ranks_sum / size)
    assert float(keras.ops.convert_to_numpy(hvd.allreduce(3.0, name="keras.scalar", op=hvd.Sum))) == 3.0 * size


def test_python_values_travel_in_the_dtypes_horovods_tf_constant_gives_them(size):
    def dtype(result):
        return keras.ops.convert_to_numpy(result).dtype

    assert dtype(hvd.allreduce(0.5, name="keras.float", op=hvd.Sum)) == np.float32
    assert dtype(hvd.allreduce([0.5, 1.5], name="keras.floats")) == np.float32
    assert dtype(hvd.broadcast(3, 0, name="keras.int")) == np.int32
    assert dtype(hvd.allreduce(np.array([0.5], np.float16), name="keras.numpy")) == np.float16  # arrays keep theirs
    assert int(keras.ops.convert_to_numpy(hvd.allreduce(3, name="keras.int_sum", op=hvd.Sum))) == 3 * size


@pytest.mark.parametrize("factor", [1.0, 4.0])
@pytest.mark.parametrize("sparse_as_dense", [True, False])
def test_embedding_gradients_average_dense_or_sparse(case, sparse_as_dense, factor):
    """On the TensorFlow backend an embedding's gradient is a tf.IndexedSlices: allgathered unless
    densified, and averaged with or without a gradient_predivide_factor."""
    def embedding_model():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(10, 2),
                                 keras.layers.Flatten(), keras.layers.Dense(2)])

    ids = [np.random.default_rng(r).integers(0, 10, (B, 3)).astype("int32") for r in range(gradsync.size())]
    targets = [np.random.default_rng(50 + r).normal(size=(B, 2)).astype("float32") for r in range(gradsync.size())]
    model = embedding_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR), sparse_as_dense=sparse_as_dense,
                                                     gradient_predivide_factor=factor), loss="mse")
    model.fit(ids[gradsync.rank()], targets[gradsync.rank()], batch_size=B, verbose=0, shuffle=False)
    reference = embedding_model()
    reference.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    reference.fit(np.concatenate(ids), np.concatenate(targets), batch_size=B * gradsync.size(), verbose=0)
    assert_same_on_every_rank(model.get_weights(), case)
    np.testing.assert_allclose(flat(model.get_weights()), flat(reference.get_weights()), atol=1e-5)


@pytest.mark.parametrize("scale", [True, False])
def test_partial_distributed_optimizer_keeps_local_layers_gradients_local(case, rank, size, scale):
    x, y = rank_data(rank, B)
    model = make_model()
    optimizer = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(LR), local_layers=model.layers[0],
                                                scale_local_gradients=scale)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    # layer 1: averaged as by DistributedOptimizer; layer 0: this rank's own SGD step, its gradient
    # divided by the size when scale_local_gradients
    averaged = flat(reference_weights(1, B, LR)[2:])
    alone = make_model()
    alone.compile(optimizer=keras.optimizers.SGD(LR / size if scale else LR), loss="mse")
    alone.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(flat(model.get_weights()[2:]), averaged, atol=1e-5)
    np.testing.assert_allclose(flat(model.get_weights()[:2]), flat(alone.get_weights()[:2]), atol=1e-6)
    if size > 1:
        assert not np.allclose(flat(model.get_weights()[:2]), flat(reference_weights(1, B, LR)[:2]), atol=1e-6)


def _set_all(model, value):
    for variable in model.variables:
        variable.assign(np.full(variable.shape, value, "float32"))


def test_keras_state_syncs_restores_and_commits_as_horovods(rank):
    # Horovod's test_elastic_state (test_tensorflow2_keras.py), on any backend.
    model, other = make_model(), make_model()
    _set_all(model, rank + 1.0)
    _set_all(other, 7.0)
    state = hvd.elastic.KerasState(model, keras.optimizers.Adam(0.001), batch=20 + rank, epoch=10 + rank)
    state.sync()
    for weight in model.get_weights():
        np.testing.assert_array_equal(weight, np.ones_like(weight))  # rank 0's
    assert (state.batch, state.epoch) == (20, 10)
    synced = model.get_weights()
    model.set_weights(other.get_weights())
    state.batch, state.epoch = 21, 11
    state.restore()
    for weight, expected in zip(model.get_weights(), synced):
        np.testing.assert_array_equal(weight, expected)
    assert (state.batch, state.epoch) == (20, 10)
    model.set_weights(other.get_weights())
    state.batch, state.epoch = 21, 11
    state.commit()
    state.restore()
    for weight, expected in zip(model.get_weights(), other.get_weights()):
        np.testing.assert_array_equal(weight, expected)
    assert (state.batch, state.epoch) == (21, 11)


def test_keras_state_commit_resumes_model_optimizer_and_counters_exactly(case, rank, tmp_path_factory,
                                                                          monkeypatch):
    # What a restarted job's rank 0 reads back: the committed weights, Adam's slots and counters.
    directory = gradsync.broadcast_object(str(tmp_path_factory.mktemp("elastic")) if rank == 0 else None,
                                          root_rank=0, name=f"{case}.dir")
    monkeypatch.setenv("GRADSYNC_ELASTIC_STATE_DIR", directory)
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    x, y = rank_data(rank, 3 * B)
    model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0,
              callbacks=[hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
                         hvd.elastic.CommitStateCallback(state, batches_per_commit=2)])  # Horovod's order
    assert (state.batch, state.epoch) == (0, 2)
    committed = [model.get_weights(), [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]]
    fresh = make_model()
    fresh.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    resumed = hvd.elastic.KerasState(fresh, batch=-1, epoch=-1)
    resumed.resume(pathlib.Path(directory))  # what hvd.elastic.run does first in a restarted job
    assert (resumed.batch, resumed.epoch) == (0, 2)
    for weight, expected in zip(fresh.get_weights(), committed[0]):
        np.testing.assert_array_equal(weight, expected)
    optimizer = [keras.ops.convert_to_numpy(v) for v in fresh.optimizer.variables]
    assert len(optimizer) == len(committed[1]) and len(optimizer) > 2  # iterations, rate, Adam's slots
    for value, expected in zip(optimizer, committed[1]):
        np.testing.assert_array_equal(value, expected)


def test_keras_state_refuses_a_model_without_variables():
    with pytest.raises(ValueError, match="has no variables yet"):
        hvd.elastic.KerasState(keras.Sequential([keras.layers.Dense(2)]))
