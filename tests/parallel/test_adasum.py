"""op=Adasum: the recursive pairwise adaptive sum, against a numpy reference of the formula.

The reference is written from the formula of Maleki et al. (MLSys 2021) and Horovod's
docs/adasum_user_guide.rst, independently of gradsync.executors.adasum: at level j every rank r combines its
vector a with that of rank r ^ 2**j, b, into (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b,
per tensor, in float64. Every rank knows every rank's input (seeded), so it computes the whole
reduction alone. Runs at 3 ranks too, where Adasum must refuse.
"""

import numpy as np
import pytest

import gradsync

RANKS = (1, 2, 3, 4)


def power_of_two():
    n = gradsync.size()
    if n & (n - 1):
        pytest.skip("Adasum needs a power-of-two number of ranks (tested below)")


def adasum_pair(a, b):
    dot, aa, bb = float(np.dot(a, b)), float(np.dot(a, a)), float(np.dot(b, b))
    ca = 1 - dot / (2 * aa) if aa > 1e-150 else 1.0
    cb = 1 - dot / (2 * bb) if bb > 1e-150 else 1.0
    return ca * a + cb * b


def reference(vectors):
    """The adaptive sum of one tensor over every rank (a list of float64 vectors, one per rank)."""
    current = [np.asarray(v, np.float64).ravel() for v in vectors]
    distance = 1
    while distance < len(current):
        current = [adasum_pair(current[min(r, r ^ distance)], current[max(r, r ^ distance)])
                   for r in range(len(current))]
        distance *= 2
    return current[0]


def inputs(seed, shape, dtype=np.float64):
    return [np.random.default_rng(seed + r).standard_normal(shape).astype(dtype)
            for r in range(gradsync.size())]


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_allreduce_adasum_matches_the_reference(dtype):
    power_of_two()
    every = inputs(1, (4, 5), dtype)
    result = gradsync.allreduce(every[gradsync.rank()], op=gradsync.Adasum)
    expected = reference(every).reshape(4, 5).astype(dtype)
    assert result.dtype == dtype
    tolerance = {np.float64: 1e-12, np.float32: 1e-6, np.float16: 1e-3}[dtype]
    np.testing.assert_allclose(result, expected, rtol=tolerance, atol=tolerance)


def test_every_rank_gets_the_same_bits():
    power_of_two()
    result = gradsync.allreduce(inputs(2, (33,))[gradsync.rank()], op=gradsync.Adasum)
    everyone = gradsync.allgather(result[None])
    assert all(np.array_equal(everyone[0], row) for row in everyone)


def test_parallel_vectors_average_and_orthogonal_ones_add():
    power_of_two()
    n, r = gradsync.size(), gradsync.rank()
    parallel = gradsync.allreduce(np.full(3, 2.0), op=gradsync.Adasum)
    np.testing.assert_allclose(parallel, np.full(3, 2.0))
    basis = np.eye(max(n, 1))[r]
    np.testing.assert_allclose(gradsync.allreduce(basis, op=gradsync.Adasum), np.ones(n))


def test_zero_vectors_leave_the_others_unchanged():
    power_of_two()
    mine = np.arange(4.0) if gradsync.rank() == 0 else np.zeros(4)
    np.testing.assert_allclose(gradsync.allreduce(mine, op=gradsync.Adasum), np.arange(4.0))


def test_grouped_adasum_gives_each_tensor_its_own_coefficients():
    power_of_two()
    r = gradsync.rank()
    first, second = inputs(3, (6,)), inputs(4, (2, 3), np.float64)
    results = gradsync.grouped_allreduce([first[r], second[r]], op=gradsync.Adasum)
    np.testing.assert_allclose(results[0], reference(first), rtol=1e-12)
    np.testing.assert_allclose(results[1], reference(second).reshape(2, 3), rtol=1e-12)


def test_in_place_async_and_scale_factors():
    power_of_two()
    every = inputs(5, (7,))
    mine = every[gradsync.rank()].copy()
    handle = gradsync.allreduce_async_(mine, op=gradsync.Adasum, prescale_factor=0.5,
                                       postscale_factor=3.0)
    assert gradsync.synchronize(handle) is mine
    np.testing.assert_allclose(mine, 3.0 * reference([0.5 * v for v in every]), rtol=1e-12)


def test_adasum_on_a_process_set():
    n, r = gradsync.size(), gradsync.rank()
    if n < 3:
        pytest.skip("needs a set of two ranks that is not every rank")
    pair = gradsync.add_process_set([0, 1])  # at 3 ranks: Adasum on 2 of them
    try:
        if r in (0, 1):
            every = inputs(6, (5,))[:2]
            result = gradsync.allreduce(every[r], op=gradsync.Adasum, process_set=pair)
            np.testing.assert_allclose(result, reference(every), rtol=1e-12)
    finally:
        gradsync.remove_process_set(pair)


def test_integer_tensors_are_refused():
    power_of_two()
    with pytest.raises(TypeError, match="floating-point"):
        gradsync.allreduce(np.arange(3), op=gradsync.Adasum)


def test_reducescatter_refuses_adasum():
    with pytest.raises(NotImplementedError, match="Adasum"):
        gradsync.reducescatter(np.ones(gradsync.size() * 2), op=gradsync.Adasum)


def test_a_rank_count_that_is_not_a_power_of_two_is_refused():
    n = gradsync.size()
    if not n & (n - 1):
        pytest.skip(f"{n} is a power of two")
    with pytest.raises(NotImplementedError, match="power-of-two"):
        gradsync.allreduce(np.ones(3), op=gradsync.Adasum)


@pytest.mark.parametrize("cached", [False, True], ids=["negotiated", "cached"])
def test_adasum_beside_a_joined_rank_fails_on_every_rank(case, cached):
    """The last rank joins; the others' Adasum allreduce fails with one CollectiveError (a stand-in
    of zeros would change the result), negotiated in full or hit in the response cache."""
    power_of_two()
    n, r = gradsync.size(), gradsync.rank()
    if n == 1:
        pytest.skip("needs a rank that joins and one that does not")
    if cached:  # every rank runs it once, so that the second time is a cache hit
        gradsync.allreduce(np.ones(3), name=case, op=gradsync.Adasum)
    if r == n - 1:
        gradsync.join()
        return
    with pytest.raises(gradsync.CollectiveError, match=r"op=Adasum cannot run .* joined"):
        gradsync.allreduce(np.ones(3), name=case, op=gradsync.Adasum)
    gradsync.join()
