"""gradsync's key-value store shared by the ranks (gradsync.process.key_value_store), without torch:
what one rank sets every rank reads, counters add up across ranks and threads, and a key never set
or a value that is not a counter give an error naming it, on the rank that asked. Keys of each test
are its own (the store lives as long as gradsync, across the tests of a session).
"""

from __future__ import annotations

import threading

import pytest
from reference import assert_no_framework_was_imported, raises

from gradsync.process import runtime

RANKS = (1, 2, 4)
TIMEOUT = 30.0  # seconds for anything that should take milliseconds


@pytest.fixture
def store():
    return runtime.get().key_value_store()


def test_what_each_rank_sets_every_rank_reads(store, rank, size):
    store.set(f"set/{rank}", f"value of rank {rank}".encode(), TIMEOUT)
    keys = [f"set/{other}" for other in range(size)]
    assert store.multi_get(keys, TIMEOUT) == [f"value of rank {other}".encode() for other in range(size)]
    assert store.get(f"set/{(rank + 1) % size}", TIMEOUT) == f"value of rank {(rank + 1) % size}".encode()
    store.wait(keys, TIMEOUT)
    assert store.check(keys, TIMEOUT)


def test_counters_add_up_across_ranks_and_threads(store, rank, size):
    threads, adds = 4, 50

    def add() -> None:
        for _ in range(adds):
            store.add("counter", rank + 1, TIMEOUT)

    workers = [threading.Thread(target=add) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    store.set(f"counter-done/{rank}", b"", TIMEOUT)
    store.wait([f"counter-done/{other}" for other in range(size)], TIMEOUT)
    assert store.add("counter", 0, TIMEOUT) == threads * adds * size * (size + 1) // 2


def test_compare_set_and_append_follow_torchs_stores(store, rank):
    """TCPStore's and HashStore's compare_set: an unset key is set only when ``expected`` is empty."""
    key = f"compare/{rank}"
    assert store.compare_set(key, b"something", b"new", TIMEOUT) == b"something"
    assert not store.check([key], TIMEOUT)
    assert store.compare_set(key, b"", b"first", TIMEOUT) == b"first"
    assert store.compare_set(key, b"wrong", b"second", TIMEOUT) == b"first"
    assert store.compare_set(key, b"first", b"second", TIMEOUT) == b"second"
    store.append(key, b"+more", TIMEOUT)
    assert store.get(key, TIMEOUT) == b"second+more"
    assert store.delete_key(key, TIMEOUT)
    assert not store.delete_key(key, TIMEOUT)


def test_num_keys_counts_the_keys_under_a_prefix(store, rank):
    prefix = f"count/{rank}/"
    store.multi_set([prefix + "a", prefix + "b", prefix + "c"], [b"1", b"2", b"3"], TIMEOUT)
    assert store.num_keys(prefix, TIMEOUT) == 3


def test_a_key_never_set_raises_timeout_error_naming_it_and_the_rank(store, rank):
    with raises(TimeoutError, f"rank {rank}", "never-set", "0.2 s"):
        store.get("never-set", 0.2)
    with raises(TimeoutError, f"rank {rank}", "never-set"):
        store.wait(["never-set"], 0.2)


def test_adding_to_a_value_that_is_no_counter_raises_on_the_rank_that_asked(store, rank):
    key = f"not-a-counter/{rank}"
    store.set(key, b"abc", TIMEOUT)
    with raises(ValueError, key, "not a decimal integer"):
        store.add(key, 1, TIMEOUT)
    assert store.get(key, TIMEOUT) == b"abc"


def test_no_test_of_this_file_imported_a_framework(request):
    assert_no_framework_was_imported(request.session)
