"""gradsync.torch.elastic: Horovod's elastic API (run, TorchState, ElasticSampler) at fixed ranks.

References are exact values: rank 0's values after a sync, the committed values after a restore,
and the index lists of a DistributedSampler-style partition written out by hand.
"""

import sys

import pytest

torch = pytest.importorskip("torch")
import gradsync.torch as hvd  # noqa: E402
from gradsync.errors import CollectiveError  # noqa: E402
from gradsync.run import store  # noqa: E402

pytestmark = pytest.mark.torch
RANKS = (1, 2, 3)


def model_of(seed):
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def trained_state(seed):
    """A TorchState whose model, SGD momentum and counters differ by ``seed``."""
    net = model_of(seed)
    opt = torch.optim.SGD(net.parameters(), lr=0.1 * (seed + 1), momentum=0.9)
    net(torch.ones(1, 3)).sum().backward()
    opt.step()
    return hvd.elastic.TorchState(model=net, optimizer=opt, epoch=seed, history=[seed])


def test_sync_gives_every_rank_rank_0s_model_optimizer_and_attributes():
    state = trained_state(hvd.rank())
    reference = trained_state(0)
    state.sync()
    for got, want in zip(state.model.parameters(), reference.model.parameters()):
        assert torch.equal(got, want)
    got, want = state.optimizer.state_dict(), reference.optimizer.state_dict()
    assert got["param_groups"][0]["lr"] == want["param_groups"][0]["lr"]
    for i in want["state"]:
        assert torch.equal(got["state"][i]["momentum_buffer"], want["state"][i]["momentum_buffer"])
    assert (state.epoch, state.history) == (0, [0])


def test_restore_returns_to_the_last_commit():
    state = trained_state(1)
    committed = [p.detach().clone() for p in state.model.parameters()]
    state.commit()
    with torch.no_grad():
        for p in state.model.parameters():
            p.add_(1.0)
    state.optimizer.param_groups[0]["lr"] = 5.0
    state.epoch = 7
    state.restore()
    assert all(torch.equal(p, c) for p, c in zip(state.model.parameters(), committed))
    assert state.optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    assert state.epoch == 1


def test_sync_sends_rank_0s_committed_attributes_not_its_uncommitted_ones():
    state = hvd.elastic.TorchState(batch=0)
    state.batch = 5 + hvd.rank()
    state.commit()
    state.batch = 100
    state.sync()
    assert state.batch == 5


def test_assigning_a_new_model_saves_it():
    state = hvd.elastic.TorchState(model=model_of(0))
    state.model = model_of(1)
    with torch.no_grad():
        state.model.weight.zero_()
    state.restore()
    assert torch.equal(state.model.weight, model_of(1).weight)


def test_sampler_partitions_like_distributed_sampler():
    sampler = hvd.elastic.ElasticSampler(list(range(10)), shuffle=False)
    padded = list(range(10)) + list(range(10))[:(-10) % hvd.size()]
    assert list(sampler) == padded[hvd.rank()::hvd.size()]
    assert len(sampler) == -(-10 // hvd.size())


def test_shuffled_sampler_splits_one_permutation_of_the_dataset_among_the_ranks():
    sampler = hvd.elastic.ElasticSampler(list(range(12)), seed=3)  # 12: no padding at 1, 2, 3 ranks
    sampler.set_epoch(2)
    everyone = hvd.allgather_object(list(sampler))
    assert sorted(i for part in everyone for i in part) == list(range(12))
    order = [everyone[i % hvd.size()][i // hvd.size()] for i in range(12)]
    assert order != list(range(12))
    sampler.set_epoch(3)
    assert hvd.allgather_object(list(sampler)) != everyone


def test_synced_sampler_resumes_after_rank_0s_recorded_batches():
    sampler = hvd.elastic.ElasticSampler(list(range(12)), shuffle=False)
    state = hvd.elastic.TorchState(sampler=sampler)
    if hvd.rank() == 0:
        sampler.record_batch(0, 2)
    state.sync()
    remaining = list(range(12))[2 * hvd.size():]
    padded = remaining + remaining[:(-len(remaining)) % hvd.size()]
    assert list(sampler) == padded[hvd.rank()::hvd.size()]


def test_run_syncs_the_state_then_calls_the_function_once():
    calls = []

    @hvd.elastic.run
    def train(state, scale):
        calls.append(state.epoch)
        return state.epoch * scale

    assert train(hvd.elastic.TorchState(epoch=10 + hvd.rank()), 2) == 20
    assert calls == [10]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes: Python 3.11")
def test_run_does_not_retry_a_failed_collective_and_says_so():
    @hvd.elastic.run
    def train(state):
        raise CollectiveError("allreduce.x failed")

    with pytest.raises(CollectiveError) as caught:
        train(hvd.elastic.TorchState(epoch=0))
    assert "start the job with `python -m gradsync.run`" in " ".join(caught.value.__notes__)


def test_commit_under_the_driver_writes_the_state_and_run_resumes_from_it(state_dir):
    state = trained_state(0)
    state.commit()
    if hvd.rank() == 0:
        written = torch.load(state_dir / store.COMMITTED, weights_only=False)
        assert written["attrs"] == {"epoch": 0, "history": [0]}
        assert torch.equal(written["handlers"]["model"]["weight"], model_of(0).weight
                           - 0.1 * torch.ones(2, 1) * torch.ones(1, 3))
    hvd.barrier()
    # No temporary file left (beside the commit: rank 0's timing of this launch, docs/elastic.md).
    assert {p.name for p in state_dir.iterdir()} <= {store.COMMITTED, store.TIMING}
    assert (state_dir / store.COMMITTED).exists()
    resets = []
    restarted = trained_state(hvd.rank() + 1)
    restarted.register_reset_callbacks([lambda: resets.append(restarted.epoch)])

    @hvd.elastic.run
    def train(state):
        return state.epoch, [p.detach().clone() for p in state.model.parameters()]

    epoch, parameters = train(restarted)
    assert (epoch, resets) == (0, [0])
    assert all(torch.equal(p, c) for p, c in zip(parameters, state.model.parameters()))
    assert restarted.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)


def test_hosts_updated_interrupts_every_rank_at_the_same_commit(state_dir):
    state = hvd.elastic.TorchState(batch=0)
    state.commit()
    if hvd.rank() == 0:
        (state_dir / store.HOSTS_UPDATED).write_text("localhost:3\n")
    with pytest.raises(hvd.elastic.HostsUpdatedInterrupt):
        state.commit()

    @hvd.elastic.run
    def train(state):
        state.commit()

    with pytest.raises(SystemExit) as caught:
        train(state)
    assert caught.value.code == store.EXIT_HOSTS_UPDATED
