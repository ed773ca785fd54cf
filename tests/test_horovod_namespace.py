"""gradsync.torch is horovod.torch 0.28.1's namespace: every public name, Horovod's signatures.

The expected signatures are written out below from Horovod's documented API (horovod/torch's
__init__.py, mpi_ops.py, functions.py, optimizer.py, sync_batch_norm.py, compression.py): the
parameter names in Horovod's order and their defaults. gradsync may add parameters after them
(``process_set=`` where Horovod has none, ``**settings`` on init), never before. Needs no init.
"""

import inspect

import pytest

torch = pytest.importorskip("torch")
import gradsync  # noqa: E402
import gradsync.torch as hvd  # noqa: E402
from gradsync.torch import compression, mpi_ops  # noqa: E402

pytestmark = pytest.mark.torch

R = inspect.Parameter.empty  # a required parameter
NONE = hvd.Compression.none
GLOBAL = hvd.global_process_set
REDUCE_ASYNC = [("tensor", R), ("average", None), ("name", None), ("op", None),
                ("prescale_factor", 1.0), ("postscale_factor", 1.0), ("process_set", GLOBAL)]
REDUCE = REDUCE_ASYNC[:3] + [("compression", NONE)] + REDUCE_ASYNC[3:]
GROUPED_ASYNC = [("tensors", R)] + REDUCE_ASYNC[1:]
GROUPED = [("tensors", R)] + REDUCE[1:]
SCATTER_ASYNC = [("tensor", R), ("name", None), ("op", hvd.Average), ("process_set", GLOBAL),
                 ("prescale_factor", 1.0), ("postscale_factor", 1.0)]
SCATTER = SCATTER_ASYNC[:2] + [("compression", NONE)] + SCATTER_ASYNC[2:]
BROADCAST = [("tensor", R), ("root_rank", R), ("name", None), ("process_set", GLOBAL)]

SIGNATURES = {
    "allreduce_async": REDUCE_ASYNC, "allreduce_async_": REDUCE_ASYNC, "allreduce_": REDUCE_ASYNC,
    "allreduce": REDUCE,
    "grouped_allreduce_async": GROUPED_ASYNC, "grouped_allreduce_async_": GROUPED_ASYNC,
    "grouped_allreduce_": GROUPED_ASYNC, "grouped_allreduce": GROUPED,
    "sparse_allreduce_async": [("tensor", R), ("name", R), ("op", R), ("process_set", GLOBAL)],
    "allgather_async": [("tensor", R), ("name", None), ("process_set", GLOBAL)],
    "allgather": [("tensor", R), ("name", None), ("process_set", GLOBAL)],
    "grouped_allgather_async": [("tensors", R), ("name", None), ("process_set", GLOBAL)],
    "grouped_allgather": [("tensors", R), ("name", None), ("process_set", GLOBAL)],
    "broadcast_async": BROADCAST, "broadcast_async_": BROADCAST, "broadcast_": BROADCAST,
    "broadcast": BROADCAST,
    "alltoall_async": [("tensor", R), ("splits", None), ("name", None), ("process_set", GLOBAL)],
    "alltoall": [("tensor", R), ("splits", None), ("name", None), ("process_set", GLOBAL)],
    "reducescatter_async": SCATTER_ASYNC, "reducescatter": SCATTER,
    "grouped_reducescatter_async": [("tensors", R)] + SCATTER_ASYNC[1:],
    "grouped_reducescatter": [("tensors", R)] + SCATTER[1:],
    "poll": [("handle", R)], "synchronize": [("handle", R)], "join": [("device", -1)],
    "barrier": [("process_set", GLOBAL)],
    "init": [("comm", None), ("process_sets", None)], "shutdown": [], "is_initialized": [],
    "start_timeline": [("file_path", R), ("mark_cycles", False)], "stop_timeline": [],
    "broadcast_parameters": [("params", R), ("root_rank", 0)],
    "broadcast_optimizer_state": [("optimizer", R), ("root_rank", 0), ("model", None)],
    "broadcast_object": [("obj", None), ("root_rank", 0), ("name", None), ("process_set", GLOBAL)],
    "allgather_object": [("obj", R), ("name", None)],
    "DistributedOptimizer": [
        ("optimizer", R), ("named_parameters", None), ("compression", NONE),
        ("backward_passes_per_step", 1), ("op", hvd.Average), ("gradient_predivide_factor", 1.0),
        ("num_groups", 0), ("groups", None), ("sparse_as_dense", False), ("process_set", GLOBAL)],
    "SyncBatchNorm": [("num_features", R), ("eps", 1e-5), ("momentum", 0.1), ("affine", True),
                      ("track_running_stats", True)],
    "remove_process_set": [("process_set", R)], "add_process_set": [("process_set", R)],
}
NO_ARGUMENTS = ["size", "local_size", "cross_size", "rank", "local_rank", "cross_rank",
                "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built",
                "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
                "rocm_built"]
OTHER_NAMES = ["ProcessSet", "global_process_set", "Average", "Sum", "Adasum", "Min", "Max",
               "Product", "HorovodInternalError", "Compression", "handle_average_backwards_compatibility",
               "elastic"]
# horovod.torch.mpi_ops's autograd functions: forward's arguments after ctx.
AUTOGRAD = {
    "HorovodAllreduce": ["tensor", "average", "name", "op", "prescale_factor", "postscale_factor",
                         "process_set"],
    "HorovodGroupedAllreduce": ["average", "name", "op", "prescale_factor", "postscale_factor",
                                "process_set", "*tensors"],
    "HorovodAllgather": ["tensor", "name", "process_set"],
    "HorovodGroupedAllgather": ["name", "process_set", "*tensors"],
    "HorovodBroadcast": ["tensor", "root_rank", "name", "process_set"],
    "HorovodAlltoall": ["tensor", "splits", "name", "process_set"],
    "HorovodReducescatter": ["tensor", "name", "op", "process_set", "prescale_factor",
                             "postscale_factor"],
    "HorovodGroupedReducescatter": ["name", "op", "process_set", "prescale_factor",
                                    "postscale_factor", "*tensors"],
}


def parameters(function):
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def test_every_horovod_name_is_exported():
    expected = set(SIGNATURES) | set(NO_ARGUMENTS) | set(OTHER_NAMES)
    missing = sorted(name for name in expected if not hasattr(hvd, name))
    assert not missing
    assert expected <= set(hvd.__all__)


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_horovod_parameters_come_first_in_horovods_order_with_its_defaults(name):
    ours = parameters(getattr(hvd, name))
    horovod = SIGNATURES[name]
    assert ours[:len(horovod)] == horovod
    assert all(default is not R for _, default in ours[len(horovod):]), "gradsync's extras need defaults"


@pytest.mark.parametrize("name", NO_ARGUMENTS)
def test_queries_take_no_arguments(name):
    assert parameters(getattr(hvd, name)) == []


@pytest.mark.parametrize("name", sorted(AUTOGRAD))
def test_autograd_functions_take_horovods_forward_arguments(name):
    forward = getattr(mpi_ops, name).forward
    names = []
    for p in list(inspect.signature(forward).parameters.values())[1:]:
        names.append(f"*{p.name}" if p.kind == p.VAR_POSITIONAL else p.name)
    assert names == AUTOGRAD[name]
    assert issubclass(getattr(mpi_ops, name), torch.autograd.Function)


def test_compression_classes_work_without_an_instance():
    tensor = torch.ones(3, dtype=torch.float64)
    packed, ctx = compression.FP16Compressor.compress(tensor)
    assert packed.dtype == torch.float16
    assert compression.FP16Compressor.decompress(packed, ctx).dtype == torch.float64
    assert compression.NoneCompressor.compress(tensor)[0] is tensor
    assert compression.Compressor in compression.FP16Compressor.__mro__
    assert hvd.Compression is gradsync.Compression


def test_build_flags_need_no_init():
    assert hvd.mpi_built() is True and hvd.gloo_built() is False and hvd.ccl_built() is False
    assert hvd.ddl_built() is False and hvd.rocm_built() is False and hvd.gloo_enabled() is False
    version = gradsync.nccl_version()
    code = hvd.nccl_built()
    assert isinstance(code, int)
    if version is None:
        assert code == 0
    else:
        assert code == version[0] * 10000 + version[1] * 100 + version[2] or version < (2, 9)


def test_average_backwards_compatibility():
    with pytest.warns(DeprecationWarning):
        assert hvd.handle_average_backwards_compatibility(None, False) == hvd.Sum
    assert hvd.handle_average_backwards_compatibility(None, None) == hvd.Average
    assert hvd.handle_average_backwards_compatibility(hvd.Max, None) == hvd.Max
    with pytest.raises(ValueError):
        hvd.handle_average_backwards_compatibility(hvd.Max, True)


def test_the_ops_are_gradsyncs_reduce_ops():
    assert [hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product, hvd.Adasum] == [
        gradsync.Average, gradsync.Sum, gradsync.Min, gradsync.Max, gradsync.Product,
        gradsync.Adasum]


def test_duplicate_names_are_refused_before_init():
    assert not gradsync.is_initialized()
    first, second = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    opt = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    with pytest.raises(ValueError, match="duplicate names"):
        hvd.DistributedOptimizer(opt, named_parameters=[*first.named_parameters(),
                                                         *second.named_parameters()])
    with pytest.raises(ValueError, match="pairs"):
        hvd.DistributedOptimizer(opt, named_parameters=[first.weight])


def test_the_core_namespace_keeps_its_own_allreduce():
    assert "average" not in inspect.signature(gradsync.allreduce).parameters
    assert gradsync.DistributedOptimizer is hvd.DistributedOptimizer


def test_elastic_has_horovods_names_and_signatures():
    assert sorted(hvd.elastic.__all__) == ["ElasticSampler", "HostsUpdatedInterrupt", "TorchState", "run"]
    assert parameters(hvd.elastic.run) == [("func", R)]
    assert parameters(hvd.elastic.TorchState) == [("model", None), ("optimizer", None)]
    assert parameters(hvd.elastic.ElasticSampler) == [("dataset", R), ("shuffle", True), ("seed", 0)]
    assert issubclass(hvd.elastic.ElasticSampler, torch.utils.data.Sampler)
