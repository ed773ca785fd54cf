"""N-rank training with DistributedOptimizer equals one process training on the concatenated
batch: SGD with momentum and weight decay, Adam with gradient accumulation, and either with the
gradients reduced in groups (``num_groups``). The training itself (every rank also trains the
single-process reference alone) is tests/workers/train_equivalence.py, which the launch tests
(srun, two hosts, autotune) run as a script.
"""

from __future__ import annotations

import pytest
from train_equivalence import Settings, train

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
torch.set_num_threads(1)

RANKS = (2, 4)

SETTINGS = {
    "sgd": Settings(optimizer="sgd"),
    "sgd-in-2-groups": Settings(optimizer="sgd", num_groups=2),
    "adam-2-passes": Settings(optimizer="adam", passes=2),
    "adam-2-passes-in-3-groups": Settings(optimizer="adam", passes=2, num_groups=3),
}


@pytest.fixture(scope="module", params=list(SETTINGS))
def trained(request):
    """(settings, outcome) of one training run per settings, shared by the tests below."""
    settings = SETTINGS[request.param]
    return settings, train(settings)


def test_training_ends_within_1e_5_of_one_process_on_the_concatenated_batch(trained):
    _, outcome = trained
    assert outcome.worst <= 1e-5, outcome.worst


def test_training_ends_with_bit_identical_parameters_on_every_rank(trained):
    assert trained[1].identical


def test_with_num_groups_each_steps_gradients_move_in_that_many_grouped_responses(trained):
    settings, outcome = trained
    if not settings.num_groups:
        pytest.skip("the gradients are not grouped")
    for grads in outcome.gradient_responses:
        assert len(grads) == settings.num_groups, grads
        assert all(name.startswith("grad.group.") for names in grads for name in names), grads
        assert sum(len(names) for names in grads) == outcome.trained, grads
