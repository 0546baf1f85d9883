"""kill -9 during a correction of a speculative update (exact clipping): the store is torn and refused,
never clean at a wrong state, and the run resumed from its checkpoint ends bit-identical to the
uninterrupted one.

The job's norms cross its threshold (1.05; the norms, steps 0-5: 1.101 1.289 1.186 1.000 1.101 1.122): step 0
and step 4 (after the unclipped step 3) speculate and are corrected, the steps after a clipped one defer
every update. The updater holds half-way through its first correction of step HOLD_STEP or later (step 4) (a fault point,
slidedp/faults.py: it writes a marker and waits), so the kill lands there whatever the machine's speed.
Killed there, the updater leaves the chunk marked as being updated. The aggregator killed while the
updater corrects: the updater then finishes (the marker removed), so every chunk may reach the step's
end with no commit recorded; either way the store says it is torn.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import psutil
import pytest
import torch

from slidedp.faults import ENV as HOLD_ENV
from slidedp.store import checkpoint as ckpt
from slidedp.store.client import StoreRequestError, call

from . import (TINY, RunningJob, drop_store, fast_sets, manifest_state, run_uninterrupted, unique_store, wait_gone,
               wait_marker)
from pipeline.harness import checkpoint_state, checkpoint_weights, metrics

STEPS = 6
HOLD_STEP = 3  # after the checkpoint of step 2


def _sets(store: str, run_dir: Path) -> list[str]:
    return fast_sets(store, run_dir, f"train.steps={STEPS}", "checkpoint.every=2", "checkpoint.keep=4",
                     "train.max_grad_norm=1.05", "runtime.workers=1", "plan.micro_batch=4")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clip-crash-ref")
    store = unique_store("clipref")
    run_uninterrupted(tmp, store, _sets(store, tmp / "run"), 300)
    return tmp / "run"


@pytest.mark.parametrize("victim", [pytest.param("updater_member", marks=pytest.mark.slow), "aggregator"])  # slow: time
def test_kill_during_a_correction_is_torn_then_resumes_exactly(tmp_path, victim, uninterrupted):
    store = unique_store(f"clipcr-{victim[:3]}")
    run_dir, marker = tmp_path / "run", tmp_path / "held"
    try:
        run = RunningJob.start(TINY, _sets(store, run_dir), tmp_path, store, env={HOLD_ENV: f"correct@{HOLD_STEP}:{marker}"})
        try:
            held = wait_marker(run, marker)
            assert held["step"] >= HOLD_STEP
            deadline = time.monotonic() + 120  # the held step does not stop the checkpoint of step 2 being written
            while ckpt.latest_valid(run_dir / "checkpoints") is None:
                assert time.monotonic() < deadline, run.output[-4000:]
                time.sleep(0.05)
            proc = psutil.Process(held["pid"]) if victim == "updater_member" else run.find("aggregator")
            proc.kill()
            if victim == "aggregator":
                marker.unlink()  # the updater finishes its correction into a step that will never commit
            m = run.wait_for(r"ERROR \[launcher\] job failed: (.*)", 60)
            name = "slidedp-updater" if victim == "updater_member" else "slidedp-aggregator"
            assert name in m.group(1), m.group(1)
            assert run.wait_exit(60) == 1
            assert wait_gone(run.seen_pids, 30) == []
        finally:
            run.cleanup()
        committed, versions, torn = manifest_state(store)
        assert torn is not None, (committed, versions)  # never clean at a wrong state
        assert committed == held["step"]  # the step being corrected never committed
        if victim == "updater_member":
            assert re.match(rf"chunk\(s\) \[{held['chunk']}\] were being updated when their writer stopped", torn), torn
        with pytest.raises(StoreRequestError, match=r"is torn \(.+\); restore a checkpoint first"):
            call(store, "attach", job="next", pid=0, layout_hash="", world=1, grad_slots=3)
        # resumed from the newest valid checkpoint: the same end as the uninterrupted run, bit for bit
        latest = ckpt.latest_valid(run_dir / "checkpoints")
        assert latest is not None and int(latest.name[5:]) <= held["step"]
        resumed = RunningJob.start(TINY, _sets(store, run_dir), tmp_path, store, extra=("--resume", "latest"))
        try:
            assert resumed.wait_exit(300) == 0, resumed.output[-4000:]
        finally:
            resumed.cleanup()
        final = f"step-{STEPS:08d}"
        for load in (checkpoint_weights, checkpoint_state):
            mine, ref = load(run_dir / "checkpoints" / final), load(uninterrupted / "checkpoints" / final)
            assert mine.keys() == ref.keys()
            differ = [k for k in ref if not torch.equal(mine[k], ref[k])]
            assert differ == [], f"{len(differ)} tensor(s) differ from the uninterrupted run, e.g. {differ[:3]}"
        want = {r["step"]: r for r in metrics(uninterrupted)}
        # the first step and the one after an unclipped step speculated and corrected; the rest deferred
        assert [(w["clipped"], w["speculated"], w["corrected_chunks"] > 0) for w in want.values()] == \
            [(True, True, True), (True, False, False), (True, False, False), (False, False, False),
             (True, True, True), (True, False, False)]
        for r in metrics(run_dir):  # the steps run twice (killed run, then resumed) decided alike
            w = want[r["step"]]
            keys = ("loss", "grad_norm", "clipped", "speculated", "speculated_chunks")
            assert [r[k] for k in keys] == [w[k] for k in keys], r["step"]
        assert manifest_state(store) == (STEPS, [STEPS] * len(versions), None)
    finally:
        drop_store(store)
