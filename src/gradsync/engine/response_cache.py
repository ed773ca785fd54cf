"""The response cache: steady-state negotiation with one bit per known collective.

Every rank keeps the same cache, because every rank updates it at the same points of the same ordered
response list: a collective that completed through negotiation is *put* (or *touched*, if known), and
the least recently used entry is evicted when the cache is full. A collective's bit is its slot.

When a request arrives whose name and signature (every field of the request but the rank) match a
cached entry, the rank only sets that bit in its local *ready* vector; one bitwise-AND allreduce of the
ready vectors gives the set of cached collectives ready everywhere, in the same bit order on every rank.
A name that is cached with another signature is *invalid*: the rank flags the bit (an OR across ranks,
sent inverted inside the same AND allreduce), every rank evicts it, and the request is negotiated in full.
"""

from __future__ import annotations

import collections
import enum

import numpy as np

from . import fusion
from .protocol import Kind, Request

# Alltoall is not: its responses carry the split matrix, which may change from call to call.
CACHEABLE = frozenset({Kind.ALLREDUCE, Kind.BROADCAST, Kind.REDUCESCATTER})


class Lookup(enum.Enum):
    HIT = 0
    MISS = 1
    INVALID = 2


def signature(request: Request) -> tuple:
    """Every field of the request but the rank: what must be equal for a cache hit."""
    return request.signature()


class ResponseCache:
    """Name -> (bit, signature) with deterministic LRU eviction; see the module docstring."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # name -> (bit, signature, request, bytes in a fusion buffer)
        self._slots: collections.OrderedDict[str, tuple[int, tuple, Request, int]] = (
            collections.OrderedDict())
        self._names: dict[int, str] = {}
        self._by_bit: dict[int, tuple[Request, int]] = {}  # bit -> (request, bytes): the cycle's reads
        self._free = list(range(capacity - 1, -1, -1))  # pop() gives the lowest free bit

    def __len__(self) -> int:
        return len(self._slots)

    def lookup(self, request: Request) -> tuple[Lookup, int]:
        """Whether ``request`` is cached (HIT), unknown (MISS) or cached differently (INVALID),
        and its bit (-1 on MISS). Never changes the cache."""
        slot = self._slots.get(request.name)
        if slot is None or request.kind not in CACHEABLE:
            return Lookup.MISS, -1
        if slot[2] == request:  # this rank's own request, cached: one C comparison, no signature
            return Lookup.HIT, slot[0]
        return (Lookup.HIT if slot[1] == request.signature() else Lookup.INVALID), slot[0]

    def own_bit(self, request: Request) -> int:
        """``request``'s bit if this cache holds ``request`` itself (equal in every field, so
        cacheable, as ``put`` stored it): a HIT of :meth:`lookup` without the signature; else -1,
        and :meth:`lookup` decides."""
        slot = self._slots.get(request.name)
        return slot[0] if slot is not None and slot[2] == request else -1

    def put(self, request: Request) -> int | None:
        """Record that ``request`` completed; returns the bit evicted to make room, if any."""
        if request.kind not in CACHEABLE or self.capacity == 0:
            return None
        if request.name in self._slots:
            self._slots.move_to_end(request.name)
            return None
        evicted = None
        if not self._free:
            _, (evicted, *_) = self._slots.popitem(last=False)
            del self._names[evicted], self._by_bit[evicted]
            self._free.append(evicted)
        bit = self._free.pop()
        self._slots[request.name] = (bit, signature(request), request, fusion.nbytes(request))
        self._names[bit] = request.name
        self._by_bit[bit] = (request, fusion.nbytes(request))
        return evicted

    def evict(self, bit: int) -> None:
        """Forget the entry at ``bit`` (all ranks do this for every invalid bit)."""
        name = self._names.pop(bit, None)
        if name is not None:
            del self._slots[name], self._by_bit[bit]
            self._free.append(bit)
            self._free.sort(reverse=True)

    def request(self, bit: int) -> Request:
        """The request cached at ``bit`` (as some rank sent it)."""
        return self._by_bit[bit][0]

    def nbytes(self, bit: int) -> int:
        """Bytes the collective at ``bit`` occupies in a fusion buffer."""
        return self._by_bit[bit][1]

    def entries(self, bits: list[int]) -> list[tuple[Request, int]]:
        """(request, bytes in a fusion buffer) cached at each of ``bits``, in that order."""
        return list(map(self._by_bit.__getitem__, bits))


def bits_from_list(bits: list[int], words: int) -> int:
    """The Python int with exactly ``bits`` set (each below ``64 * words``). Many bits: one numpy
    scatter instead of one big-int OR per bit (1000 bits: about 30 us against 60-110 us here);
    a few: the ORs (numpy's fixed cost is some microseconds)."""
    if len(bits) < 64:
        value = 0
        for bit in bits:
            value |= 1 << bit
        return value
    flags = np.zeros(64 * words, np.uint8)
    flags[np.fromiter(bits, np.intp, len(bits))] = 1
    return int.from_bytes(np.packbits(flags, bitorder="little").tobytes(), "little")


def bits_to_words(bits: int, words: int) -> bytes:
    """A Python int bit set as ``words`` little-endian 64-bit words."""
    return bits.to_bytes(words * 8, "little")


def iter_bits(bits: int):
    """The set bits of ``bits``, lowest first."""
    while bits:
        low = bits & -bits
        yield low.bit_length() - 1
        bits ^= low


def set_bits(bits: int) -> list[int]:
    """The set bits of ``bits`` (>= 0), lowest first, as a list: :func:`iter_bits`, with numpy
    for many bits (1000 ready tensors in one cycle: tens of microseconds instead of milliseconds)."""
    if not bits & (bits - 1):  # none or one (a blocking op's cycle): no generator
        return [bits.bit_length() - 1] if bits else []
    if bits.bit_count() <= 16:
        return list(iter_bits(bits))
    raw = np.frombuffer(bits.to_bytes((bits.bit_length() + 7) // 8, "little"), np.uint8)
    return np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()
