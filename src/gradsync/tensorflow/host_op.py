"""One gradsync collective as one TensorFlow op: a stateful ``tf.numpy_function`` that hands the
tensors' host (numpy) values to the core, waits for the result and hands it back.

**Order in a TF1 graph.** A ``numpy_function`` that waits for the other ranks holds one of the
session's inter-op threads. Inside a ``tf.function`` TensorFlow's automatic control dependencies run
stateful ops in program order, so the collectives start in the same order on every rank. In a plain
``tf.compat.v1`` graph run by ``Session.run`` nothing orders them: independent collectives would
start in any order, each rank's threads would end up waiting on collectives the other ranks have
not started, and the job would stall (Horovod's asynchronous kernels hold no thread). So in a TF1
graph each collective is two ops: a *start* op that runs the collective in a thread of its own
and returns at once, built with a control dependency on the previous collective's start op of that
graph, and a *wait* op, the outputs, that waits for that thread. The start ops run in creation
order, the same on every rank (the same program builds the same graph), and never block, so every
rank starts the collectives a wait op needs. The price is Session semantics: running a collective
also starts the collectives built before it in that graph (a control input always runs), on every
rank alike; nobody waits for those, they finish in their threads. A graph built once and run step
after step (a TF1 training loop) runs what it would run anyway.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from ..engine.protocol import ReduceOp
from ..errors import CollectiveError
from ..handles import GroupHandle, Handle

Average, Sum = ReduceOp.Average, ReduceOp.Sum

#: The start op of the last gradsync collective built in each TF1 graph (not function graphs): the
#: next one is chained after it.
_LAST_STARTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Started:
    """A collective's host function running in a thread of its own (module docstring)."""

    def __init__(self, host: Callable[..., list[np.ndarray]], arrays: tuple[Any, ...],
                 after: _Started | None) -> None:
        self._done = threading.Event()
        self._value: list[np.ndarray] | None = None
        self._error: BaseException | None = None
        threading.Thread(target=self._run, args=(host, arrays, after), daemon=True,
                         name="gradsync-tf1-collective").start()

    def _run(self, host: Callable[..., list[np.ndarray]], arrays: tuple[Any, ...],
             after: _Started | None) -> None:
        try:
            if after is not None:  # the collective of the same name started before it, on every rank
                after._done.wait()
            self._value = host(*arrays)
        except BaseException as exc:  # handed to the waiting op
            self._error = exc
        finally:
            self._done.set()

    def result(self) -> list[np.ndarray]:
        """The host function's results (raises its exception)."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value


def _tf1_graph() -> tf.Graph | None:
    """The default graph if ops are being built into a TF1 graph (not eagerly, not a tf.function)."""
    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    return None if graph.building_function else graph


#: How many unnamed collectives each TF1 graph has: the next one's number.
_UNNAMED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tf1_graph_number() -> int | None:
    """In a TF1 graph, the creation number of the next unnamed collective of that graph (the same
    on every rank), which makes its name unique there: its start op may run while others are in
    flight. None eagerly and in a tf.function (where collectives run one after another)."""
    graph = _tf1_graph()
    if graph is None:
        return None
    number = _UNNAMED.get(graph, 0)
    _UNNAMED[graph] = number + 1
    return number


#: Per TF1 graph, the last collective started under each name.
_BY_NAME: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _started_then_waited(graph: tf.Graph, host: Callable[..., list[np.ndarray]],
                         inputs: list[tf.Tensor], dtypes: list[tf.DType], name: str,
                         collective: str | None) -> list[tf.Tensor]:
    """The TF1 graph form of a collective op (module docstring): a start op, chained after the
    previous collective's start op of ``graph``, runs ``host`` in a thread and returns at once
    (the thread first waits for the collective of the same name ``collective``, or this op's own
    of an earlier run, started before it on every rank: one name is never in flight twice); the
    wait op (the outputs) waits for it."""
    started: list[_Started | None] = [None]
    by_name = _BY_NAME.setdefault(graph, {})

    def start(*arrays: Any) -> np.ndarray:
        previous = by_name.get(collective, started[0]) if collective is not None else started[0]
        started[0] = _Started(host, arrays, previous)
        if collective is not None:
            by_name[collective] = started[0]
        return np.int64(0)

    previous = _LAST_STARTED.get(graph)
    with tf.control_dependencies([previous] if previous is not None else []):
        token = tf.numpy_function(start, inputs, tf.int64, stateful=True, name=f"{name}Start")
    _LAST_STARTED[graph] = token.op
    return tf.numpy_function(lambda _: started[0].result(), [token], dtypes, stateful=True, name=name)


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
                 dtypes: Sequence[tf.DType], shapes: Sequence[tf.TensorShape],
                 name: str | None = None) -> list[tf.Tensor]:
    """One stateful ``tf.numpy_function`` running ``on_host`` (numpy inputs -> list of numpy
    results of ``dtypes``), its outputs given the static ``shapes`` known when tracing; ``name``:
    the collective's name (in a TF1 graph, collectives of one name run one after another). (A 0-d
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

    op_name, out_dtypes, graph = f"Gradsync{kind.title().replace('_', '')}", list(dtypes), _tf1_graph()
    if graph is not None:
        outputs = _started_then_waited(graph, host, list(inputs), out_dtypes + [tf.string], op_name,
                                       name)
    else:
        outputs = tf.numpy_function(host, list(inputs), out_dtypes + ([] if eager else [tf.string]),
                                    stateful=True, name=op_name)
    if not isinstance(outputs, (list, tuple)):  # one output comes back bare, eagerly
        outputs = [outputs]
    if not eager:
        outputs = _checked(list(outputs[:-1]), outputs[-1])
    for output, shape in zip(outputs, shapes):
        output.set_shape(shape)
    return list(outputs)


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
