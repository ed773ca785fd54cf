"""The response cache alone: deterministic LRU, signatures. In real MPI jobs:
tests/parallel/test_cached_negotiation.py."""


from gradsync.engine.protocol import Kind, ReduceOp, Request
from gradsync.engine.response_cache import Lookup, ResponseCache, iter_bits


def request(name, shape=(4,), rank=0, kind=Kind.ALLREDUCE):
    return Request(name, kind, rank, "float32", shape, ReduceOp.Sum)


def test_hit_miss_and_invalid():
    cache = ResponseCache(4)
    assert cache.lookup(request("a")) == (Lookup.MISS, -1)
    cache.put(request("a"))
    assert cache.lookup(request("a", rank=3)) == (Lookup.HIT, 0)  # the rank is not part of it
    assert cache.lookup(request("a", shape=(5,))) == (Lookup.INVALID, 0)


def test_least_recently_used_is_evicted_and_its_bit_reused():
    cache = ResponseCache(2)
    assert cache.put(request("a")) is None
    assert cache.put(request("b")) is None
    cache.put(request("a"))  # touch: b is now the least recently used
    assert cache.put(request("c")) == 1
    assert cache.lookup(request("c")) == (Lookup.HIT, 1)
    assert cache.lookup(request("b")) == (Lookup.MISS, -1)


def test_evicted_bits_are_reused_lowest_first():
    cache = ResponseCache(3)
    for name in "abc":
        cache.put(request(name))
    cache.evict(0)
    cache.evict(2)
    cache.put(request("d"))
    assert cache.lookup(request("d")) == (Lookup.HIT, 0)


def test_allgather_and_barrier_are_never_cached():
    cache = ResponseCache(4)
    cache.put(request("g", kind=Kind.ALLGATHER))
    assert cache.lookup(request("g", kind=Kind.ALLGATHER)) == (Lookup.MISS, -1)
    assert len(cache) == 0


def test_iter_bits_lowest_first():
    assert list(iter_bits(0b1010_0001)) == [0, 5, 7]
    assert list(iter_bits(1 << 1000)) == [1000]
