"""One gradsync collective as one TensorFlow op: a stateful ``tf.numpy_function`` that hands the
tensors' host (numpy) values to the core, waits for the result and hands it back.

**Order in a TF1 graph.** A ``numpy_function`` holds one of the session's inter-op threads while it
waits for the other ranks. Inside a ``tf.function`` TensorFlow's automatic control dependencies run
stateful ops in program order; in a plain ``tf.compat.v1`` graph run by ``Session.run`` nothing
orders them, so independent collectives start in any order, each rank's threads end up waiting on
collectives the other ranks have not started, and the job stalls (Horovod's asynchronous kernels
hold no thread). So in a graph that is not a function graph, each collective op is built with a
control dependency on the previous gradsync collective of that graph: they run in creation order,
which is the same on every rank (the same program builds the same graph). The price is Session
semantics: running a collective also runs the collectives built before it in that graph, as
``Session.run`` runs any op's control inputs, on every rank alike.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from ..errors import CollectiveError
from ..handles import GroupHandle, Handle
from ..protocol import ReduceOp

Average, Sum = ReduceOp.Average, ReduceOp.Sum

#: The last gradsync collective op built in each TF1 graph (not function graphs): the next one is
#: chained after it.
_LAST_COLLECTIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def _in_creation_order() -> Iterator[Callable[[tf.Operation], None]]:
    """Build an op after the previous collective of the current TF1 graph (module docstring);
    yields the function that records the new op as the last one. Eagerly and in a
    ``tf.function`` it adds nothing (automatic control dependencies order stateful ops there)."""
    if tf.executing_eagerly():
        yield lambda op: None
        return
    graph = tf.compat.v1.get_default_graph()
    if graph.building_function:
        yield lambda op: None
        return
    previous = _LAST_COLLECTIVE.get(graph)
    with tf.control_dependencies([previous] if previous is not None else []):
        yield lambda op: _LAST_COLLECTIVE.__setitem__(graph, op)


def _failed_precondition(message: tf.Tensor) -> tf.Operation:
    """An op that raises ``tf.errors.FailedPreconditionError`` carrying ``message`` when it runs.
    A graph's Python function can raise only ``UnknownError`` (or ``InvalidArgumentError`` for
    a ValueError), and no TensorFlow op raises that class with a message of ours but a file
    operation whose path is not a directory: writing ``/dev/null/<message>`` fails with
    "<path>; Not a directory" as FailedPreconditionError, and writes nothing."""
    return tf.io.write_file(tf.strings.join(["/dev/null/", tf.strings.substr(message, 0, 3000)]), "")


def _checked(outputs: list[tf.Tensor], error: tf.Tensor) -> list[tf.Tensor]:
    """``outputs`` passed on only if ``error`` (the op's error message) is empty; otherwise
    Horovod's FailedPreconditionError with the message is raised when they are used."""
    check = tf.cond(tf.equal(error, ""), tf.no_op, lambda: _failed_precondition(error))
    with tf.control_dependencies([check]):
        return [tf.identity(output) for output in outputs]


def call_on_host(kind: str, on_host: Callable[..., list[np.ndarray]], inputs: Sequence[tf.Tensor],
                 dtypes: Sequence[tf.DType], shapes: Sequence[tf.TensorShape]) -> list[tf.Tensor]:
    """One stateful ``tf.numpy_function`` running ``on_host`` (numpy inputs -> list of numpy
    results of ``dtypes``), its outputs given the static ``shapes`` known when tracing. (A 0-d
    input reaches a numpy_function as a numpy scalar: made a 0-d array again for the core.)

    Errors are Horovod's classes, eagerly, in a tf.function and in a TF1 graph: a
    :class:`~gradsync.CollectiveError` (ranks that disagree) raises
    ``tf.errors.FailedPreconditionError``, a TypeError or ValueError of the core (bad splits, a
    dtype it lacks) ``tf.errors.InvalidArgumentError``, with gradsync's message. (In a graph the
    function returns the disagreement as a message that :func:`_checked` raises, since TensorFlow
    reports a graph function's own exceptions as UnknownError except ValueError and TypeError,
    which it reports as InvalidArgumentError.) In a TF1 graph the op runs after the collectives
    built before it (module docstring)."""
    eager = tf.executing_eagerly()
    placeholders = [np.zeros([d or 0 for d in tf.TensorShape(s)] if tf.TensorShape(s).rank is not None
                             else [], d.as_numpy_dtype) for s, d in zip(shapes, dtypes)]

    def host(*arrays: Any) -> list[np.ndarray]:
        try:
            results = on_host(*map(np.asarray, arrays))
        except CollectiveError as exc:  # Horovod's error for ranks that disagree
            if eager:
                raise tf.errors.FailedPreconditionError(None, None, str(exc)) from exc
            return placeholders + [np.asarray(str(exc).encode())]
        except (TypeError, ValueError) as exc:  # Horovod's (and a graph's) error for bad arguments
            if eager:
                raise tf.errors.InvalidArgumentError(None, None, str(exc)) from exc
            raise ValueError(str(exc)) from exc
        return results if eager else results + [np.asarray(b"")]

    with _in_creation_order() as record:
        outputs = tf.numpy_function(host, list(inputs), list(dtypes) + ([] if eager else [tf.string]),
                                    stateful=True, name=f"Gradsync{kind.title().replace('_', '')}")
    if not isinstance(outputs, (list, tuple)):  # one output comes back bare, eagerly
        outputs = [outputs]
    if not eager:
        record(outputs[0].op)
        outputs = _checked(list(outputs[:-1]), outputs[-1])
    for output, shape in zip(outputs, shapes):
        output.set_shape(shape)
    return list(outputs)


#: Unsigned dtypes TensorFlow has and gradsync's core does not: the collectives that only move
#: data (allgather, broadcast, alltoall) move them as the signed dtype of the same width, bit for bit.
_MOVED_AS = {np.dtype(np.uint16): np.int16, np.dtype(np.uint32): np.int32, np.dtype(np.uint64): np.int64}


def moved(array: np.ndarray) -> np.ndarray:
    """``array`` as the core can move it: a uint16/32/64 array viewed as int16/32/64 (no copy)."""
    return array.view(_MOVED_AS[array.dtype]) if array.dtype in _MOVED_AS else array


def restored(result: np.ndarray, like: np.ndarray) -> np.ndarray:
    """The moved ``result`` viewed in the dtype of ``like`` again."""
    return result.view(like.dtype) if result.dtype != like.dtype else result




def _scaled(array: np.ndarray, factor: float) -> np.ndarray:
    """Horovod's integer scaling: ``array`` times ``factor`` in float64, truncated toward zero
    back to its dtype."""
    return array if factor == 1.0 else (array.astype(np.float64) * factor).astype(array.dtype)


def start_reduction(start: Callable[[list[np.ndarray], ReduceOp, float, float], Handle | GroupHandle],
                    arrays: list[np.ndarray], op: ReduceOp, prescale: float,
                    postscale: float) -> Callable[[], list[np.ndarray]]:
    """Start the reduction ``start(arrays, op, prescale, postscale)`` (a core allreduce or
    reducescatter, single or grouped, of one dtype) and return the function that waits for it and
    returns the list of results, with Horovod's scale factors on integer arrays, which the core
    scales only in floating point: each input multiplied by ``prescale`` in float64 and
    truncated, the core's ``Sum`` (for Average) or ``op``, and each result multiplied by
    ``postscale`` (over the core's Average divisor for Average) in float64 and truncated.
    Integer Average without factors stays the core's (the floor of the mean)."""
    integer = arrays[0].dtype.kind in "iu" and (prescale != 1.0 or postscale != 1.0)
    if integer:
        arrays, core_op = [_scaled(a, prescale) for a in arrays], Sum if op == Average else op
        handle = start(arrays, core_op, 1.0, 1.0)
    else:
        handle = start(arrays, op, prescale, postscale)

    def finish() -> list[np.ndarray]:
        results = handle.wait()
        results = results if isinstance(results, list) else [results]
        if not integer:
            return results
        return [_scaled(r, postscale / handle.divisor if op == Average else postscale) for r in results]

    return finish
