"""Autotune: the search order and choice with a fake clock. A tuned job that still trains exactly,
with every rank on rank 0's choice: tests/parallel/test_training.py, variant autotune."""

from gradsync.engine import autotune
from gradsync.engine.autotune import CYCLE_TIMES, FUSION_THRESHOLDS, Autotuner


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run_search(monkeypatch, throughput):
    """Drive an Autotuner whose job reduces throughput(setting) bytes per second; return it and the
    settings it switched to, in order."""
    clock = FakeClock()
    monkeypatch.setattr(autotune.time, "perf_counter", clock)
    tuner = Autotuner(1 << 20, 1.0, window=1.0)
    switches = []
    while not tuner.done:
        tuner.record(0)  # opens the window
        clock.now += 1.0
        tuner.record(int(throughput(tuner.current)))
        proposal = tuner.poll()
        if proposal is not None:
            switches.append(proposal)
    return tuner, switches


def test_coordinate_search_picks_the_best_threshold_then_cycle_time(monkeypatch):
    def throughput(setting):
        threshold, cycle = setting
        return 1000 - abs(threshold - (4 << 20)) / 1e4 - abs(cycle - 2.0) * 10

    tuner, switches = run_search(monkeypatch, throughput)
    thresholds_tried = [s for s in switches[: len(FUSION_THRESHOLDS)]]
    assert thresholds_tried == [(t, 1.0) for t in FUSION_THRESHOLDS]
    cycles_tried = switches[len(FUSION_THRESHOLDS):-1]
    assert cycles_tried == [(4 << 20, c) for c in CYCLE_TIMES if c != 1.0]
    assert tuner.current == switches[-1] == (4 << 20, 2.0)
    assert tuner.poll() is None  # done: no further switches


def test_the_unscored_warm_up_window_is_not_a_candidate(monkeypatch):
    tuner, _ = run_search(monkeypatch, lambda setting: 100.0)
    assert len(tuner.scores) == len(FUSION_THRESHOLDS) + len(CYCLE_TIMES) - 1

