"""gradsync.jax's host memory handling, in one process: which transfers copy, and the error texts.

The multi-rank behaviour (every collective against numpy, training against one process) is in
tests/parallel/test_jax_ranks.py.
"""

import subprocess
import sys

import numpy as np
import pytest

from mpi_launch import REPO

pytestmark = pytest.mark.jax
jax = pytest.importorskip("jax")
pytest.importorskip("optax")
jnp = jax.numpy
array = pytest.importorskip("gradsync.jax.array")

from gradsync.arrays.dispatch import adapter_for  # noqa: E402


def test_the_host_view_of_a_cpu_jax_array_is_its_own_buffer_and_read_only():
    x = jnp.arange(1000, dtype=jnp.float32)
    view = array.host_view(x)
    assert view.ctypes.data == x.unsafe_buffer_pointer(), "the input was copied"
    assert not view.flags.writeable


def test_the_host_view_of_a_bfloat16_array_is_not_a_copy_either():
    x = jnp.ones(64, jnp.bfloat16)
    view = array.host_view(x)
    assert view.dtype == jnp.bfloat16 and view.ctypes.data == x.unsafe_buffer_pointer()


@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (3, 5), (1000,)])
def test_result_buffers_are_aligned_for_xla(shape):
    buffer = array.aligned_empty(shape, np.float32)
    assert buffer.shape == shape and buffer.dtype == np.float32 and buffer.flags.c_contiguous
    assert buffer.size == 0 or buffer.ctypes.data % array.ALIGNMENT == 0  # no data, no address


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int32", "int16", "int8", "uint8",
                                   "bool"])
def test_aligned_results_become_jax_arrays_without_a_copy(dtype):
    dtype = jnp.dtype(dtype)
    buffers = [array.aligned_empty(shape, dtype) for shape in [(3, 7), (), (1000,)]]
    for buffer in buffers:
        buffer[...] = np.arange(buffer.size).reshape(buffer.shape).astype(dtype)
    results = array.to_jax(buffers, [None] * len(buffers))
    for result, buffer in zip(results, buffers):
        assert result.dtype == dtype
        assert result.unsafe_buffer_pointer() == buffer.ctypes.data, "the result was copied"
        np.testing.assert_array_equal(np.asarray(result), buffer)


def test_a_result_lands_on_the_device_asked_for():
    device = jax.devices()[-1]
    (result,) = array.to_jax([array.aligned_empty((2,), np.float32)], [device])
    assert result.devices() == {device}


def test_the_core_routes_jax_arrays_to_the_jax_adapter():
    adapter = adapter_for(jnp.ones(2))
    assert adapter is array.ADAPTER
    info = adapter.info(jnp.ones((2, 3), jnp.bfloat16))
    assert (info.dtype, info.shape, info.device) == ("bfloat16", (2, 3), "cpu")


def test_the_adapter_refuses_a_traced_value():
    def probe(x):
        with pytest.raises(TypeError, match="traced jax value.*inside jax.jit"):
            array.ADAPTER.info(x)
        return x

    jax.jit(probe)(jnp.ones(2))


def test_importing_gradsync_imports_neither_jax_nor_optax():
    code = ("import sys, gradsync, gradsync.metrics; "
            "print(sorted(m for m in ('jax', 'jaxlib', 'optax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=REPO, env={"PYTHONPATH": str(REPO / "src"), "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_gradsync_jax_has_no_in_place_ops_and_says_why():
    import gradsync.jax as gj

    with pytest.raises(AttributeError, match="immutable.*use gradsync.jax.broadcast,"):
        gj.broadcast_  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        gj.nothing  # noqa: B018


# ---- the in-place custom call of reductions inside jit (gradsync/jax/xla_ffi.py) ------------

xla_ffi = pytest.importorskip("gradsync.jax.xla_ffi")


def test_a_custom_call_body_writes_its_results_into_xlas_buffers():
    seen = []

    def body(outputs):
        seen.append([(o.shape, o.dtype, o.flags.writeable) for o in outputs])
        outputs[0] *= 3
        outputs[1] += 1

    step = jax.jit(lambda a, b: xla_ffi.call(body, [a * 2, b]))
    a, b = np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(5, dtype=np.int32)
    out_a, out_b = step(a, b)
    np.testing.assert_array_equal(np.asarray(out_a), a * 6)
    np.testing.assert_array_equal(np.asarray(out_b), b + 1)
    assert seen == [[((3, 4), np.float32, True), ((5,), np.int32, True)]]


def test_the_custom_call_runs_once_per_execution_and_its_outputs_alias_its_inputs():
    calls = []
    step = jax.jit(lambda x: xla_ffi.call(lambda outputs: calls.append(1), [x + 1])[0])
    for _ in range(3):
        jax.block_until_ready(step(jnp.ones(4)))
    assert len(calls) == 3
    hlo = step.lower(jnp.ones(4)).as_text()
    assert xla_ffi.TARGET in hlo and "output_operand_aliases" in hlo
    # Pure: a side effect would take every call off jax's C++ dispatch path (docs/jax.md).
    assert "has_side_effect" not in hlo


def test_extra_outputs_of_the_custom_call_come_after_the_aliased_ones():
    def body(outputs):
        outputs[0] += 1
        outputs[1][...] = 0.25

    step = jax.jit(lambda x: xla_ffi.call(body, [x * 2], [jax.ShapeDtypeStruct((), jnp.float32)]))
    out, extra = step(jnp.arange(3, dtype=jnp.float32))
    np.testing.assert_array_equal(np.asarray(out), [1, 3, 5])
    assert extra.shape == () and extra.dtype == jnp.float32 and float(extra) == 0.25


def test_an_error_in_the_body_is_raised_from_the_jitted_call_with_its_message():
    def body(outputs):
        raise ValueError("rank 0: tensor 'w' disagrees")

    with pytest.raises(Exception, match=r"ValueError: rank 0: tensor 'w' disagrees"):
        jax.block_until_ready(jax.jit(lambda x: xla_ffi.call(body, [x])[0])(jnp.ones(2)))


def test_inside_jit_an_allreduce_is_the_custom_call_not_a_host_callback():
    import gradsync
    import gradsync.jax as gj

    gradsync.init()
    try:  # a scale factor: even one rank has something to do
        step = jax.jit(lambda t: gj.grouped_allreduce(t, name="hlo", prescale_factor=2.0))
        tree = {"w": jnp.ones((3, 2)), "b": jnp.arange(3, dtype=jnp.float32)}
        hlo = step.lower(tree).as_text()
        assert xla_ffi.TARGET in hlo and "callback" not in hlo
        result = step(tree)
        np.testing.assert_array_equal(np.asarray(result["w"]), np.full((3, 2), 2.0, np.float32))
        np.testing.assert_array_equal(np.asarray(result["b"]), 2 * np.arange(3, dtype=np.float32))
    finally:
        gradsync.shutdown()


@pytest.mark.parametrize("kind", ["allreduce", "grouped_allreduce"])
def test_at_one_rank_an_allreduce_inside_jit_leaves_the_program_as_it_is(kind):
    """One rank, no scale factor: the reduction is the identity, so the jitted function compiles
    to the same program as without it (no custom call, no callback, no copy)."""
    import gradsync
    import gradsync.jax as gj

    gradsync.init()
    try:
        reduce = getattr(gj, kind)
        plain = jax.jit(lambda t: jax.tree_util.tree_map(lambda a: a * 2, t))
        step = jax.jit(lambda t: reduce(jax.tree_util.tree_map(lambda a: a * 2, t), name="one"))
        tree = {"w": jnp.ones((3, 2)), "b": jnp.arange(3, dtype=jnp.int32)}
        hlo = step.lower(tree).compile().as_text()
        assert xla_ffi.TARGET not in hlo and "callback" not in hlo
        assert hlo.count("fusion") == plain.lower(tree).compile().as_text().count("fusion")
        result = step(tree)
        np.testing.assert_array_equal(np.asarray(result["w"]), np.full((3, 2), 2.0, np.float32))
        np.testing.assert_array_equal(np.asarray(result["b"]), 2 * np.arange(3, dtype=np.int32))
    finally:
        gradsync.shutdown()
