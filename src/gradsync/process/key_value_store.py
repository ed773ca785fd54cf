"""A key-value store that every rank sees, over MPI: rank 0 keeps the keys, the others ask it.

torch.distributed's process groups take a store that every rank shares (torch's own rendezvous
starts a TCPStore on ``MASTER_ADDR:MASTER_PORT``); c10d's store barrier
(``TORCH_DIST_INIT_BARRIER=1``) and libraries that exchange keys through it need one. This one
needs no port and no file: it travels on a communicator of its own, duplicated from the world.

Rank 0 answers from a thread that polls for requests (``MPI_Improbe``) and sleeps between polls:
0.1 ms for 0.1 s after a request (the next one of a barrier or a rendezvous comes soon), then
doubling up to 20 ms while none comes, so an idle store costs 50 wake-ups a second and no core (a
thread blocked in ``MPI_Recv`` spins a core under MPICH): a request answers in well under a
millisecond when the store is busy, in up to 20 ms after a quiet spell. A request is a
small pickled tuple; each one's answer comes back on a tag of its own, so threads of one rank may
ask at once. Blocking reads (``get`` of a key not set yet, ``wait``) are polls by the caller,
so the server never holds a request open. Rank 0's own calls read the keys directly.

Keys are strings, values bytes, counters (``add``) decimal ASCII, as in torch's TCPStore.
"""

from __future__ import annotations

import itertools
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .polling import poll_pause, poll_until

#: The tag of requests to rank 0; answers come on tags 1 .. MPI_TAG_UB, one per request.
REQUEST_TAG = 0
#: rank 0's polling, in seconds, as :data:`.polling.CALLER_POLL`: every 0.1 ms for 0.1 s after a
#: request, then doubling from 1 ms up to 20 ms.
SERVER_POLL = (0.0001, 0.1, 0.02)


class KeyValueStore:
    """The ranks' shared keys on ``comm`` (a communicator of its own: the store frees it at
    :meth:`close`). Made collectively: every rank of ``comm`` constructs one. ``rank`` names this
    process in errors (its world rank).

    Every method may be called from any thread of any rank. ``timeout`` arguments are seconds: how
    long to wait for each answer of rank 0 and, in ``get``, ``multi_get`` and ``wait``, for the keys
    to be set; every method raises TimeoutError, naming the rank and what it waited for, once one
    has passed.
    """

    def __init__(self, comm: Any, rank: int) -> None:
        from mpi4py import MPI

        self._comm = comm
        self._rank = rank
        self._server = comm.Get_rank() == 0
        self._tag_bound = int(comm.Get_attr(MPI.TAG_UB))
        self._tags = itertools.count()
        self._namespaces = itertools.count()
        self._lock = threading.Lock()
        self._keys: dict[str, bytes] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._server:
            self._thread = threading.Thread(target=self._serve, name="gradsync-key-value-store",
                                            daemon=True)
            self._thread.start()

    # -- the operations (torch's Store methods, by the same names)
    def set(self, key: str, value: bytes, timeout: float) -> None:
        """Set ``key`` to ``value``."""
        self._call("set", (key, value), timeout)

    def add(self, key: str, amount: int, timeout: float) -> int:
        """Add ``amount`` to the counter ``key`` (0 where unset) and return its new value.

        Raises:
            ValueError: ``key`` holds something other than a decimal integer.
        """
        return self._call("add", (key, amount), timeout)

    def compare_set(self, key: str, expected: bytes, desired: bytes, timeout: float) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (or is unset and ``expected`` is
        empty); return the value it holds afterwards (``expected`` where it is unset and
        ``expected`` is not empty), as torch's TCPStore and HashStore do."""
        return self._call("compare_set", (key, expected, desired), timeout)

    def append(self, key: str, value: bytes, timeout: float) -> None:
        """Append ``value`` to ``key``'s value (set it where unset)."""
        self._call("append", (key, value), timeout)

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes], timeout: float) -> None:
        """Set each of ``keys`` to the value at the same position of ``values``."""
        self._call("multi_set", (list(keys), list(values)), timeout)

    def check(self, keys: Sequence[str], timeout: float) -> bool:
        """Whether every one of ``keys`` is set (does not wait)."""
        return self._call("check", (list(keys),), timeout)

    def delete_key(self, key: str, timeout: float) -> bool:
        """Remove ``key``; whether it was set."""
        return self._call("delete_key", (key,), timeout)

    def num_keys(self, prefix: str, timeout: float) -> int:
        """How many keys that start with ``prefix`` are set."""
        return self._call("num_keys", (prefix,), timeout)

    def get(self, key: str, timeout: float) -> bytes:
        """``key``'s value, waiting up to ``timeout`` for it to be set.

        Raises:
            TimeoutError: ``key`` was not set within ``timeout``; the message names it and the rank.
        """
        return self.multi_get([key], timeout)[0]

    def multi_get(self, keys: Sequence[str], timeout: float) -> list[bytes]:
        """The values of ``keys``, waiting up to ``timeout`` for all of them to be set.

        Raises:
            TimeoutError: a key was not set within ``timeout``.
        """
        keys = list(keys)
        values = self._poll(lambda: self._call("multi_get", (keys,), timeout),
                            lambda values: None not in values, keys, timeout)
        return values

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        """Return once every one of ``keys`` is set.

        Raises:
            TimeoutError: a key was not set within ``timeout``.
        """
        keys = list(keys)
        self._poll(lambda: self._call("check", (keys,), timeout), bool, keys, timeout)

    # -- lifetime
    def namespace(self) -> str:
        """A new key prefix, the same on every rank that asks in the same order (one per torch
        rendezvous: a new default group does not see the keys of an earlier one)."""
        return f"{next(self._namespaces)}/"

    def close(self) -> None:
        """Stop rank 0's thread and free the communicator (at ``gradsync.shutdown()``); a caller
        still waiting for an answer, and every call after, gets a TimeoutError that says so."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._comm.Free()

    # -- the caller's side
    def _call(self, op: str, args: tuple, timeout: float) -> Any:
        if self._stop.is_set():
            raise TimeoutError(f"gradsync: rank {self._rank}: the key-value store is closed: "
                               f"gradsync.shutdown() was called (before destroy_process_group(), "
                               f"if this is torch's store); {op} was not sent")
        if self._server:
            return self._apply(op, args)
        tag = 1 + next(self._tags) % self._tag_bound
        sent = self._comm.isend((op, args, tag), dest=0, tag=REQUEST_TAG)
        message = self._poll(lambda: self._comm.improbe(source=0, tag=tag),
                             lambda message: message is not None, None, timeout, op)
        ok, result = message.recv()
        sent.wait()
        if not ok:
            raise result
        return result

    def _poll(self, attempt: Callable[[], Any], done: Callable[[Any], bool],
              keys: list[str] | None, timeout: float, op: str = "") -> Any:
        """``attempt()`` until ``done`` holds of its result, sleeping between attempts; TimeoutError
        after ``timeout`` seconds naming ``keys`` (the keys waited for) or ``op`` (an answer from
        rank 0 waited for). Each attempt that asks rank 0 waits up to ``timeout`` for its answer."""
        def timed_out() -> TimeoutError:
            what = (f"key(s) {keys} were not set" if keys is not None else
                    f"the store's {op} got no answer from rank 0 (is rank 0 still running?)")
            return TimeoutError(f"gradsync: rank {self._rank}: {what} within {timeout:g} s")

        return poll_until(attempt, done, timeout, timed_out, self._stop.is_set)

    # -- rank 0's side
    def _serve(self) -> None:
        from mpi4py import MPI

        status = MPI.Status()
        sending: list[Any] = []
        pause = SERVER_POLL[0]
        last_request = time.monotonic()
        while not self._stop.is_set():
            message = self._comm.improbe(source=MPI.ANY_SOURCE, tag=REQUEST_TAG, status=status)
            if message is None:
                sending = [request for request in sending if not request.Test()]
                pause = poll_pause(last_request, time.monotonic(), pause, SERVER_POLL)
                self._stop.wait(pause)
                continue
            last_request = time.monotonic()
            op, args, tag = message.recv()
            try:
                answer = (True, self._apply(op, args))
            except Exception as error:  # noqa: BLE001 - the caller raises it
                answer = (False, error if _picklable(error) else RuntimeError(repr(error)))
            sending.append(self._comm.isend(answer, dest=status.Get_source(), tag=tag))

    def _apply(self, op: str, args: tuple) -> Any:
        with self._lock:
            return getattr(self, f"_do_{op}")(*args)

    def _do_set(self, key: str, value: bytes) -> None:
        self._keys[key] = bytes(value)

    def _do_add(self, key: str, amount: int) -> int:
        value = self._keys.get(key, b"0")
        if not value.strip().lstrip(b"-").isdigit():
            raise ValueError(f"add: key {key!r} holds {value!r}, not a decimal integer")
        total = int(value) + int(amount)
        self._keys[key] = str(total).encode()
        return total

    def _do_compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        current = self._keys.get(key)
        if current is None:
            if expected:
                return bytes(expected)
        elif current != expected:
            return current
        self._keys[key] = bytes(desired)
        return bytes(desired)

    def _do_append(self, key: str, value: bytes) -> None:
        self._keys[key] = self._keys.get(key, b"") + bytes(value)

    def _do_multi_set(self, keys: list[str], values: list[bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        for key, value in zip(keys, values):
            self._keys[key] = bytes(value)

    def _do_check(self, keys: list[str]) -> bool:
        return all(key in self._keys for key in keys)

    def _do_multi_get(self, keys: list[str]) -> list[bytes | None]:
        return [self._keys.get(key) for key in keys]

    def _do_delete_key(self, key: str) -> bool:
        return self._keys.pop(key, None) is not None

    def _do_num_keys(self, prefix: str) -> int:
        return sum(key.startswith(prefix) for key in self._keys)


def _picklable(error: Exception) -> bool:
    try:
        pickle.dumps(error)
    except Exception:  # noqa: BLE001 - any failure means: send its text instead
        return False
    return True
