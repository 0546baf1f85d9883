"""The bf16 delivery is exact: the store's bf16 shadow streamed instead of the fp32 master trains bit for bit
as the master cast on the device does, for a bf16 compute.

Real runs on CPU (daemons, workers, shared memory), bf16 compute, 5 steps with exact clipping at a threshold
the norms cross (steps that speculate and are corrected, steps that speculate and keep, steps that defer):
the shadow must be current when a forward reads it. Losses, norms, final weights and both AdamW moments
are compared with torch.equal against the same run delivering fp32; the copies in move half the bytes.
"""

from __future__ import annotations

import pytest
import torch

from slidedp.store.client import call
from slidedp.store.shm import unlink_store

from .harness import TINY, checkpoint_state, checkpoint_weights, launch, metrics, store_segments, unique_store
from .test_equivalence import STEPS, job_sets

# (workers, micro-batches per rank, shape, param_route, grad_route, more job file values)
CASES = [
    # tied: the embedding fetched whole for the head (-m slow: the suite's time; the third case is tied too)
    pytest.param(1, 2, "tiny", "replicated", "host", (), marks=pytest.mark.slow),
    (2, 1, "tiny-llama", "sharded", "reduce_scatter", ()),  # untied: the host embedding's rows, shards gathered
    (2, 2, "tiny", "replicated", "host", ("plan.device_layers=1",)),  # a held layer keeps its fp32 master
]
# bf16 norms of tiny, steps 0-4: 1.046, 1.051, 0.923, 1.135 (clips after speculating: corrected), 0.953 (after a
# clipped step: deferred)
CLIP = 1.1


def _run(tmp_path, name: str, delivery: str, workers, micro, shape, param_route, grad_route, extra):
    run_dir = tmp_path / name
    store = unique_store("bf")
    sets = job_sets(workers, micro, CLIP, shape, store, run_dir, "host", param_route, grad_route) + list(extra)
    sets = [s for s in sets if not s.startswith("plan.compute_dtype")] + [
        'plan.compute_dtype="bf16"', f'plan.delivery="{delivery}"',
        f"store.shadow_bf16={'true' if delivery == 'bf16' else 'false'}"]
    try:
        proc = launch(TINY, *sets, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        said = {"bf16": "weights delivered as the bf16 shadow", "fp32": "weights delivered as the fp32 master"}[delivery]
        assert all(f"rank {r}/{workers} on cpu" in proc.stderr for r in range(workers))
        assert proc.stderr.count(said) == workers, proc.stderr
        assert store_segments(store) == []
    finally:  # a launcher killed (a timeout, an interrupt) before its teardown leaves its store
        unlink_store(store)
    return run_dir


@pytest.mark.parametrize("workers,micro,shape,param_route,grad_route,extra", CASES)
def test_the_bf16_shadow_trains_bit_for_bit_as_the_fp32_master(tmp_path, monkeypatch, workers, micro, shape,
                                                               param_route, grad_route, extra):
    monkeypatch.setenv("SLIDEDP_LOG_LEVEL", "INFO")  # the workers' start-up lines say what they stream
    fp32 = _run(tmp_path, "fp32", "fp32", workers, micro, shape, param_route, grad_route, extra)
    bf16 = _run(tmp_path, "bf16", "bf16", workers, micro, shape, param_route, grad_route, extra)
    a, b = metrics(fp32), metrics(bf16)
    assert [m["step"] for m in b] == list(range(STEPS))
    for key in ("loss", "grad_norm", "clipped", "speculated", "speculated_chunks", "corrected_chunks", "d2h_bytes"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    # the threshold is crossed both ways: a step that speculated and was corrected, one that kept its updates
    assert any(m["corrected_chunks"] for m in b) and any(m["speculated"] and not m["clipped"] for m in b)
    assert [m["h2d_bytes"] for m in a] == [2 * m["h2d_bytes"] for m in b]  # half the bytes in, every one of them
    final = f"checkpoints/step-{STEPS:08d}"
    for load in (checkpoint_weights, checkpoint_state):
        mine, theirs = load(bf16 / final), load(fp32 / final)
        assert mine.keys() == theirs.keys() and mine
        differ = [k for k in mine if not torch.equal(mine[k], theirs[k])]
        assert differ == [], differ[:4]


def test_a_store_without_the_shadow_keeps_fp32_or_refuses_bf16(tmp_path, monkeypatch):
    """plan.delivery = "auto" on a store made without the shadow delivers fp32 and says why; "bf16" is
    refused before anything runs, naming store.shadow_bf16. Nothing in the store is touched."""
    monkeypatch.setenv("SLIDEDP_LOG_LEVEL", "INFO")  # the plan's note and the workers' start-up lines
    store = unique_store("bf")
    call(store, "create", source="random", shape="tiny", vocab_size=512, init_seed=0, persist=True)
    try:
        base = [f'store.name="{store}"', "train.steps=1", 'plan.compute_dtype="bf16"', "store.persist=true"]
        proc = launch(TINY, *base, "store.shadow_bf16=true", f'run.dir="{tmp_path / "auto"}"', cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = proc.stdout + proc.stderr
        assert f"delivery fp32: store {store!r} was created without the bf16 shadow (store.shadow_bf16)" in out
        assert "weights delivered as the fp32 master" in out
        before = call(store, "status")
        proc = launch(TINY, *base, 'plan.delivery="bf16"', f'run.dir="{tmp_path / "bf16"}"', cwd=tmp_path)
        assert proc.returncode != 0
        assert (f'plan.delivery = "bf16" streams the store\'s bf16 shadow, but store {store!r} was created '
                f"without one") in proc.stdout + proc.stderr
        assert "store.shadow_bf16 = true" in proc.stdout + proc.stderr
        after = call(store, "status")
        assert (after["committed_step"], after["generation"], after["torn"]) == (
            before["committed_step"], before["generation"], None)
    finally:  # the segments themselves: a destroy request would wait on a daemon a failed launch left running
        unlink_store(store)
