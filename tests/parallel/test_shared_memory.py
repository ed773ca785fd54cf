"""The shared-memory allreduce (gradsync/backends/shared.py), against numpy references:

* with the default settings, ranks that share one host reduce large host buffers through shared
  memory, and the engine's allreduce gives the reduction of every rank's tensor, the same bits on
  every rank, for every dtype and op it takes, with buffers that need several chunks;
* :class:`~gradsync.backends.shared.SharedMemory` itself reduces any length (shorter than the
  number of ranks, not a multiple of it, several segments long) in rank order, and scales it (an
  Average's divisor folded in) to the bits of a multiply after the sum;
* where the file cannot be created, every rank falls back to MPI_Allreduce, none alone;
* ``GRADSYNC_SHARED_MEMORY_BYTES=0`` turns the path off (the ``off`` variant).

test_ops.py and test_process_sets.py run their allreduce tests through shared memory too, with a
4 KiB segment and no threshold (their ``shared-memory`` variants), so that every small case of
theirs takes this path and is cut into chunks.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI
from reference import all_inputs, assert_array, dtype_op_params, reference_allreduce

import gradsync as gs
from gradsync.backends import shared
from gradsync.engine.protocol import ReduceOp
from gradsync.process import runtime

RANKS = (1, 2, 3)  # 3: the fold in rank order past two ranks
VARIANTS = {
    "off": {"env": {"GRADSYNC_SHARED_MEMORY_BYTES": "0"}, "k": "engine"},
}
OFF = os.environ.get("GRADSYNC_SHARED_MEMORY_BYTES") == "0"
# Past the 512 KiB threshold in every dtype, and past the 4 MiB segment in the 8-byte ones.
LARGE = (700, 1000)


def test_engine_reduces_through_shared_memory_when_every_rank_is_on_this_host(size):
    backend = runtime.get().backend
    if size == 1 or OFF:
        assert backend.shared is None
        assert "shared memory" not in backend.describe()
    else:
        assert backend.shared is not None
        assert "shared memory" in backend.describe()


@pytest.mark.parametrize(("dtype", "op"), dtype_op_params(ops=(gs.Average, gs.Sum, gs.Min, gs.Max)))
def test_engine_allreduce_of_a_large_tensor_is_the_reduction_of_every_ranks_tensor(case, rank, dtype, op):
    inputs = all_inputs(case, dtype, LARGE, op)
    got = gs.allreduce(inputs[rank], name=case, op=op)
    everyone = MPI.COMM_WORLD.allgather(got.tobytes())
    assert_array(got, reference_allreduce(inputs, op))
    assert all(other == everyone[0] for other in everyone), "ranks got different bits"


def _memory(segment_bytes: int = 4096, threshold: int = 0):
    return shared.open_shared(MPI.COMM_WORLD, segment_bytes, threshold)


@pytest.mark.parametrize("count", [0, 1, 3, 1024, 4097, 10_000])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "uint8"])
def test_shared_memory_reduces_any_length_in_rank_order(case, rank, size, count, dtype):
    memory = _memory()
    if size == 1:
        assert memory is None
        return
    inputs = all_inputs(case, dtype, (count,), gs.Sum)
    data = inputs[rank].copy()
    memory.allreduce(data, ReduceOp.Sum)
    want = inputs[0].copy()
    for term in inputs[1:]:  # rank order, the dtype's own arithmetic (wrapping, as MPI_SUM)
        want = np.add(want, term, dtype=want.dtype)
    memory.close()
    assert_array(data, want)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_shared_memory_scales_each_slice_as_a_multiply_after_the_sum_would(case, rank, size, dtype):
    """``scale`` (an Average's 1/size, folded in): the bits of ``np.multiply(sum, scale)``."""
    memory = _memory()
    if size == 1:
        return
    inputs = all_inputs(case, dtype, (10_000,), gs.Sum)
    data = inputs[rank].copy()
    memory.allreduce(data, ReduceOp.Sum, scale=1.0 / size)
    memory.close()
    want = inputs[0].copy()
    for term in inputs[1:]:
        want = np.add(want, term, dtype=want.dtype)
    assert data.tobytes() == np.multiply(want, 1.0 / size).tobytes()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("postscale", [1.0, 3.0])
def test_engine_average_in_place_is_the_sum_times_the_scale_bit_for_bit(case, rank, size, dtype, postscale):
    """A lone tensor's Average in its own memory (the scale folded into the shared-memory
    reduction, or unpack's pass over the result through MPI): the same bits as numpy's sum in rank
    order times ``postscale / size``, on every rank."""
    inputs = all_inputs(case, dtype, LARGE, gs.Sum)
    data = inputs[rank].copy()
    gs.allreduce_(data, name=case, op=gs.Average, postscale_factor=postscale)
    want = inputs[0].copy()
    for term in inputs[1:]:
        want = np.add(want, term, dtype=want.dtype)
    everyone = MPI.COMM_WORLD.allgather(data.tobytes())
    assert data.tobytes() == np.multiply(want, postscale / size).tobytes()
    assert all(other == everyone[0] for other in everyone), "ranks got different bits"


@pytest.mark.parametrize("count", [3, 10_000])
def test_shared_memory_reduces_from_a_source_into_the_buffer_leaving_the_source(case, rank, size, count):
    """``source`` as MPI_Allreduce's sendbuf: a read-only input, the result in another buffer, the
    same bits as in place (scaled too), the input unchanged."""
    memory = _memory()
    if size == 1:
        return
    inputs = all_inputs(case, "float32", (count,), gs.Sum)
    source = inputs[rank].copy()
    source.flags.writeable = False
    out = np.full(count, np.nan, np.float32)
    memory.allreduce(out, ReduceOp.Sum, scale=0.5, source=source)
    in_place = inputs[rank].copy()
    memory.allreduce(in_place, ReduceOp.Sum, scale=0.5)
    memory.close()
    assert out.tobytes() == in_place.tobytes()
    assert source.tobytes() == inputs[rank].tobytes()


@pytest.mark.parametrize("shape", [(5,), LARGE])
@pytest.mark.parametrize("op", [gs.Average, gs.Sum])
def test_engine_out_of_place_allreduce_of_a_read_only_input_leaves_it(case, rank, size, shape, op):
    """A lone out-of-place allreduce is reduced from its input into its output (no copy of the
    input first): small (MPI), large (shared memory): every rank's reduction, the input unchanged."""
    inputs = all_inputs(case, "float64", shape, op)
    given = inputs[rank].copy()
    given.flags.writeable = False
    got = gs.allreduce(given, name=case, op=op)
    assert got is not given and got.flags.writeable
    assert_array(got, reference_allreduce(inputs, op))
    assert given.tobytes() == inputs[rank].tobytes()


class _Recorded:
    """The backend's communicator, recording the send argument of every allreduce."""

    def __init__(self, comm):
        self.comm, self.sends = comm, []

    def Allreduce(self, send, *args, **kwargs):  # noqa: N802 - mpi4py's names
        self.sends.append(send)
        return self.comm.Allreduce(send, *args, **kwargs)

    def Iallreduce(self, send, *args, **kwargs):  # noqa: N802
        self.sends.append(send)
        return self.comm.Iallreduce(send, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.comm, name)


@pytest.mark.parametrize("count", [1000, 40_000])  # MPI_Iallreduce, blocking MPI_Allreduce
def test_mpi_gets_the_in_place_form_on_every_rank_whatever_each_ranks_input(case, rank, size, count):
    """Rank 0 reduces in place, the others out of place (each rank's own choice): MPI defines
    MPI_IN_PLACE only when every rank passes it, so every rank passes it."""
    backend = runtime.get().backend
    recorded = _Recorded(backend.comm)
    inputs = all_inputs(case, "float32", (count,), gs.Sum)
    given = inputs[rank].copy()
    backend.comm = recorded
    try:
        got = gs.allreduce_(given, name=case, op=gs.Sum) if rank == 0 else gs.allreduce(given, name=case,
                                                                                          op=gs.Sum)
    finally:
        backend.comm = recorded.comm
    assert_array(got, reference_allreduce(inputs, gs.Sum))
    data = [send for send in recorded.sends if send is not MPI.IN_PLACE]
    assert not data, f"rank {rank} sent from a separate buffer"


@pytest.mark.parametrize(("op", "combine"), [(ReduceOp.Sum, np.logical_or), (ReduceOp.Min, np.logical_and)])
def test_shared_memory_reduces_bool_data_logically(case, rank, size, op, combine):
    memory = _memory()
    if size == 1:
        return
    inputs = [np.asarray(np.random.default_rng([r, 7]).random(9000) < 0.4) for r in range(size)]
    data = inputs[rank].astype(np.uint8)
    memory.allreduce(data, op, logical=True)
    memory.close()
    want = inputs[0]
    for term in inputs[1:]:
        want = combine(want, term)
    assert_array(data, want.astype(np.uint8))


def test_shared_memory_takes_only_what_every_rank_decides_alike(size):
    memory = _memory(threshold=1024)
    if size == 1:
        return
    takes = [memory.takes(np.zeros(n, dtype), op) for n, dtype, op in [
        (256, np.float32, ReduceOp.Sum),  # exactly the threshold
        (255, np.float32, ReduceOp.Sum),  # below it
        (1 << 20, np.float64, ReduceOp.Max),  # far larger than a segment: in chunks
        (4096, np.float32, ReduceOp.Adasum),  # not a ufunc
        (4096, np.float32, ReduceOp.Average),  # sent as Sum by the plan; never seen here
    ]]
    memory.close()
    assert takes == [True, False, True, False, False]


def test_every_rank_falls_back_to_mpi_when_the_file_cannot_be_created(rank, size, monkeypatch):
    if rank == 0:  # only the rank that creates the file sees the problem
        monkeypatch.setattr(shared, "SHM_DIRECTORY", "/nonexistent/gradsync-test")
    memory = _memory()
    assert memory is None


def test_the_file_is_gone_once_every_rank_has_mapped_it(size):
    before = set(os.listdir(shared.SHM_DIRECTORY))
    memory = _memory()
    MPI.COMM_WORLD.Barrier()  # local rank 0 unlinks it after the others mapped it: past that on every rank
    after = set(os.listdir(shared.SHM_DIRECTORY))
    if memory is not None:
        memory.close()
    assert not {name for name in after - before if name.startswith("gradsync-")}
