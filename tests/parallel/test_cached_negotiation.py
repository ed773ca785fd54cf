"""The response cache in real jobs: steady state negotiates from the cache, a signature change is
negotiated again, a rank whose signature differs gets the usual disagreement error, and eviction
under pressure loses nothing. Results are compared with the exact sums of every rank's known
inputs.

Runs at the default capacity (1024), and again with 5 entries and with 1 (``VARIANTS``). Pins
internals: the capacity and the negotiator's cycle counters are read from the running coordinator
(``gradsync.process.runtime.get().coordinator.negotiator``); tests/test_response_cache.py tests the cache
itself.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference import assert_no_framework_was_imported

import gradsync

RANKS = (2, 4)
VARIANTS = {
    "5-entries": {"env": {"GRADSYNC_CACHE_CAPACITY": "5"}},
    "1-entry": {"env": {"GRADSYNC_CACHE_CAPACITY": "1"}},
}


@pytest.fixture
def negotiator():
    return gradsync.process.runtime.get().coordinator.negotiator


def _capacity(negotiator) -> int:
    return negotiator.cache.capacity if negotiator.cache else 0


def test_after_the_first_step_every_cycle_is_negotiated_from_the_cache(case, rank, size, negotiator):
    """No gather or broadcast at all: only the one small allreduce of the bits."""
    names = [f"{case}.{i}" for i in range(20)]
    wrong, full_after_first_step, cached_before = [], 0, negotiator.cached_cycles
    for step in range(30):
        handles = [gradsync.allreduce_async(np.full(3, rank + i + step, np.float64), name=n,
                                            op=gradsync.Sum) for i, n in enumerate(names)]
        for i, h in enumerate(handles):
            if not np.all(gradsync.synchronize(h) == sum(r + i + step for r in range(size))):
                wrong.append((step, i))
        if step == 0:
            full_after_first_step = negotiator.full_cycles
    assert wrong == []
    if _capacity(negotiator) < len(names):
        return  # too small to hold them all: correctness is what the other tests prove
    assert negotiator.full_cycles == full_after_first_step
    assert negotiator.cached_cycles - cached_before >= 29


def test_a_signature_changed_on_every_rank_is_negotiated_again(case, rank, size):
    outs = [gradsync.allreduce(np.ones(length, np.float32) * (rank + 1), name=case, op=gradsync.Sum)
            for length in (4, 5, 4)]
    for length, out in zip((4, 5, 4), outs):
        assert out.shape == (length,) and np.all(out == sum(range(1, size + 1)))


def test_a_cached_name_whose_signature_differs_on_one_rank_fails_on_every_rank(case, rank, size):
    gradsync.allreduce(np.ones(2, np.float32), name=case)  # now cached
    shape = (3,) if rank == size - 1 else (2,)
    with pytest.raises(gradsync.CollectiveError) as caught:
        gradsync.allreduce(np.ones(shape, np.float32), name=case)
    again = gradsync.allreduce(np.ones(2, np.float32), name=case, op=gradsync.Sum)
    listed = ", ".join(f"rank {r}: {(3,) if r == size - 1 else (2,)}" for r in range(size))
    assert str(caught.value) == f"gradsync: rank {rank}: allreduce {case!r}: ranks disagree on shape: {listed}"
    assert np.all(again == size), "the job and the name are usable"


def test_eviction_under_pressure_loses_nothing(case, rank, size, negotiator):
    """More names than cache entries, submitted in a different order on every rank, repeatedly."""
    names = [f"{case}.{i}" for i in range(3 * max(_capacity(negotiator), 4))]
    rng = np.random.default_rng(rank)
    wrong = []
    for _ in range(5):
        handles = {int(i): gradsync.allreduce_async(np.full(2, float(i * size + rank)), name=names[i],
                                                    op=gradsync.Sum) for i in rng.permutation(len(names))}
        wrong += [i for i, h in sorted(handles.items())
                  if not np.all(gradsync.synchronize(h) == sum(i * size + r for r in range(size)))]
    assert wrong == []


def test_no_test_of_this_file_imported_torch_or_jax(request):
    assert_no_framework_was_imported(request.session)
