"""gradsync.jax.elastic under the elastic driver: a JaxState (parameters and an optax state) that a
killed worker's restart restores exactly.

The job is tests/workers/elastic_train_jax.py. References: the pytree the restarted job starts from
must equal, leaf for leaf and exactly, the commit it restarted from (read back with pickle, as
written); and the final parameters must equal exactly those of a 2-rank job started from a copy of
that commit with no failure.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from elastic_jobs import indices, read_log, run_driver
from mpi_launch import WORKERS

pytestmark = [pytest.mark.mpi, pytest.mark.jax]
jax = pytest.importorskip("jax")

SCRIPT = WORKERS / "elastic_train_jax.py"


def test_a_restart_restores_the_exact_pytree_of_the_last_commit(tmp_path):
    slots, log, commit = tmp_path / "slots", tmp_path / "log", tmp_path / "commit.pt"
    slots.write_text("localhost:3\n")
    status, output = run_driver(
        ["--min-np", "2", "--max-np", "3", "--host-discovery-script", f"cat {slots}",
         "--state-dir", str(tmp_path / "s")], SCRIPT,
        f"--log {log} --epochs 2 --out {tmp_path / 'out.npz'} --kill 1:5 --slots-file {slots} "
        f"--commit-copy {commit}", timeout=300)
    assert status == 0, output
    assert "gradsyncrun: restart 1:" in output and "launching 2 ranks on localhost:2" in output, output
    entries = read_log(log)
    after = sorted((e for e in entries if e["event"] == "step" and e["launch"] == 1), key=lambda e: e["step"])
    assert {e["size"] for e in after} == {2} and after[0]["step"] == 5  # the commit after step 4
    assert after[0]["resets"] == [2]  # the reset callbacks ran once, at the new size
    with commit.open("rb") as stored:
        committed = pickle.load(stored)
    want = jax.tree_util.tree_leaves((committed["trees"]["params"], committed["trees"]["opt_state"]))
    assert committed["attrs"] == {"epoch": 0, "batch": 5, "step": 5}
    for e in after[:2]:  # both ranks of the first step after the restart
        assert e["step"] == 5
        for got, leaf in zip(e["leaves"], want, strict=True):
            assert np.array_equal(np.asarray(got, leaf.dtype), leaf), (got, leaf)
    # Every sample of epoch 0 once: steps 0-4 before the kill, the rest after the restart.
    assert sorted(indices(entries, 0, 0, before_step=5) + indices(entries, 0, 1)) == list(range(48))

    reference = tmp_path / "reference"
    reference.mkdir()
    (reference / "committed.pt").write_bytes(commit.read_bytes())
    status, output = run_driver(["-np", "2", "--state-dir", str(reference)], SCRIPT,
                                f"--log {tmp_path / 'reference.log'} --epochs 2 --out {tmp_path / 'ref.npz'}",
                                timeout=300)
    assert status == 0, output
    got, ref = np.load(tmp_path / "out.npz"), np.load(tmp_path / "ref.npz")
    assert sorted(got.files) == ["b", "w"]
    for name in ref.files:
        assert np.array_equal(got[name], ref[name]), (name, got[name], ref[name])
