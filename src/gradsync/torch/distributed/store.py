"""The store that ``gradsync://`` hands torch: gradsync's key-value store, shared by every rank.

A ``torch.distributed.Store`` whose keys live on rank 0 and travel over MPI
(:mod:`gradsync.process.key_value_store`), as torch's TCPStore's live on ``MASTER_ADDR`` but with no
port: c10d's store barrier (``TORCH_DIST_INIT_BARRIER=1``) and code that exchanges keys through
``dist.distributed_c10d._get_default_store()`` work across ranks. Each rendezvous gets keys of its
own (a new default group after ``destroy_process_group`` starts empty, as a new TCPStore would).
Timeouts are the store's (``init_process_group``'s ``timeout``, or :meth:`set_timeout`); a key not
set in time raises ``torch.distributed.DistStoreError``, as torch's stores do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from ...process.key_value_store import KeyValueStore

T = TypeVar("T")

#: Every GradsyncStore made in this process. torch holds a Python store subclass by its C++ part
#: only: once no Python reference is left its methods are gone, and a call (a group that outlived
#: ``gradsync.shutdown()``, a store torch kept) fails with torch's internal assertion instead of
#: gradsync's error. One small object per ``init_process_group``; never freed, deliberately.
_MADE: list[GradsyncStore] = []


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class GradsyncStore(dist.Store):
    """``torch.distributed.Store`` over gradsync's shared key-value store ``shared``, its keys under
    ``prefix`` (see the module's docstring). Same semantics as torch's TCPStore: ``get`` and ``wait``
    block up to the timeout, ``add`` counts in decimal ASCII, ``compare_set`` as TCPStore's."""

    def __init__(self, shared: KeyValueStore, prefix: str) -> None:
        super().__init__()
        self._shared = shared
        self._prefix = prefix
        _MADE.append(self)

    def _seconds(self, timeout: timedelta | None = None) -> float:
        return (timeout if timeout is not None else self.timeout).total_seconds()

    def _run(self, call: Callable[[], T]) -> T:
        try:
            return call()
        except TimeoutError as error:
            raise dist.DistStoreError(str(error)) from error

    def set(self, key: str, value: bytes | str) -> None:
        self._run(lambda: self._shared.set(self._prefix + key, _bytes(value), self._seconds()))

    def get(self, key: str) -> bytes:
        return self._run(lambda: self._shared.get(self._prefix + key, self._seconds()))

    def add(self, key: str, value: int) -> int:
        return self._run(lambda: self._shared.add(self._prefix + key, value, self._seconds()))

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        return self._run(lambda: self._shared.compare_set(
            self._prefix + key, _bytes(expected_value), _bytes(desired_value), self._seconds()))

    def append(self, key: str, value: bytes | str) -> None:
        self._run(lambda: self._shared.append(self._prefix + key, _bytes(value), self._seconds()))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return self._run(lambda: self._shared.multi_get([self._prefix + key for key in keys],
                                                        self._seconds()))

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        self._run(lambda: self._shared.multi_set([self._prefix + key for key in keys],
                                                 [_bytes(value) for value in values], self._seconds()))

    def check(self, keys: Sequence[str]) -> bool:
        return self._run(lambda: self._shared.check([self._prefix + key for key in keys],
                                                    self._seconds()))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        self._run(lambda: self._shared.wait([self._prefix + key for key in keys],
                                            self._seconds(timeout)))

    def delete_key(self, key: str) -> bool:
        return self._run(lambda: self._shared.delete_key(self._prefix + key, self._seconds()))

    def num_keys(self) -> int:
        """How many keys this rendezvous's store holds."""
        return self._run(lambda: self._shared.num_keys(self._prefix, self._seconds()))

    # torch's PrefixStore (every store torch hands out wraps this one in it) looks these two up by
    # their C++ names
    getNumKeys = num_keys  # noqa: N815
    deleteKey = delete_key  # noqa: N815

    def has_extended_api(self) -> bool:
        return True


def rendezvous_store(runtime: Any) -> GradsyncStore:
    """A store for a new rendezvous on ``runtime``'s shared key-value store. Collective: every rank
    calls it, in the same order (the rendezvous of ``init_process_group``)."""
    shared = runtime.key_value_store()
    return GradsyncStore(shared, shared.namespace())
