"""N-rank training with DistributedOptimizer equals one process training on the concatenated
batch: SGD with momentum and weight decay, Adam with gradient accumulation, and either with the
gradients reduced in groups (``num_groups``). The training itself (every rank also trains the
single-process reference alone) is tests/workers/train_equivalence.py, which the launch tests
(srun, two hosts) run as a script. In the variant ``autotune``, the same training with autotune
searching fusion thresholds and cycle times as it goes.
"""

from __future__ import annotations

import logging

import pytest
from train_equivalence import Settings, train

import gradsync
from gradsync.engine.autotune import CYCLE_TIMES, FUSION_THRESHOLDS

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
torch.set_num_threads(1)

RANKS = (2, 4)
# A window of 10 ms lets the search (9 settings) end early in a 200-step training.
VARIANTS = {"autotune": {"env": {"GRADSYNC_AUTOTUNE": "1", "GRADSYNC_AUTOTUNE_WINDOW": "0.01"},
                         "k": "autotune"},
            # The gradients through shared memory, in chunks of one page (backends/shared.py).
            "shared-memory": {"env": {"GRADSYNC_SHARED_MEMORY_THRESHOLD": "0",
                                      "GRADSYNC_SHARED_MEMORY_BYTES": "4096"},
                              "k": "one_process or bit_identical"}}

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


class _Choices(logging.Handler):
    """Records the (fusion threshold, cycle time) of each ``gradsync autotune: chose`` log record."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.choices: list[tuple[int, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("gradsync autotune: chose"):
            self.choices.append(tuple(record.args[:2]))


def test_autotune_ends_every_rank_on_rank_0s_choice_and_training_still_equals_one_process():
    runtime = gradsync.process.runtime.get()
    if not runtime.config.autotune:
        pytest.skip("runs in the variant autotune (GRADSYNC_AUTOTUNE=1)")
    recorder = _Choices()
    logger = logging.getLogger("gradsync")
    logger.addHandler(recorder)
    try:
        outcome = train(Settings(steps=200))
    finally:
        logger.removeHandler(recorder)
    choices = gradsync.broadcast_object(recorder.choices, root_rank=0)  # rank 0 searches
    negotiator = runtime.coordinator.negotiator
    in_use = gradsync.allgather_object((negotiator.fusion_threshold, negotiator.cycle_time))
    assert outcome.worst <= 1e-5 and outcome.identical, outcome.worst
    assert len(choices) == 1, f"rank 0 chose {len(choices)} times: {choices}"
    threshold, cycle_time = choices[0]
    assert threshold in FUSION_THRESHOLDS and cycle_time in CYCLE_TIMES, choices
    assert in_use == [(threshold, cycle_time)] * gradsync.size(), in_use
