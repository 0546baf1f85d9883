"""A model whose layers are cut into several chunks (plan.layer_chunk_numel; store/layout.py) trains to the
same weights as with one chunk a layer: the layer still comes to the device whole and computes whole, its
gradient leaves chunk by chunk and each chunk is summed and updated on its own.

Real runs on CPU (daemons, workers, shared memory, sockets) of gpt-oss's tiny folder (tests/families.py:
fused experts [E, ...], the router, attention sinks), fp32, on the transformers path. Without clipping
every step is the same arithmetic on the same elements (AdamW and the ranks' sums are elementwise), so the
weights and both moments are compared with torch.equal. With clipping the global norm is the sum of the
chunks' squared norms, and more chunks add it in other groupings: the norm, and so the clipping coefficient,
differs in float32 rounding (the updates by about 1e-7 of a step), so there the weights are compared to 1e-6.

The default suite's cut is the layout's own rule (plan.layer_chunk_numel = "auto": a Mixture-of-Experts layer
cut at its active parameters) on one rank with clipping, read from test_family_equivalence's run of the same
job (launched once a session); -m slow adds a limit of two experts and 64 elements on 2 ranks, and on the
sharded routes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slidedp.store.shm import unlink_store

from data.test_equivalence import job_sets
from data.test_family_equivalence import family_run
from pipeline.harness import TINY, checkpoint_state, checkpoint_weights, launch, metrics, rel_err, unique_store

pytest.importorskip("transformers")

STEPS = 3
EXPERT = 64 * 96  # one expert of gate_up_proj [4, 64, 96]: a limit of 2 experts cuts it between experts
CUT = 2 * EXPERT + 64

# (ranks, micro-batches per rank, clipping, more job file values, the cut: an element limit, or "auto" for the
# layout's rule, a Mixture-of-Experts layer cut at its active parameters: test_family_equivalence's run of gpt-oss)
CASES = [
    pytest.param(2, 1, 0.0, (), CUT, marks=pytest.mark.slow),  # the aggregator sums the ranks' chunks (-m slow: time)
    pytest.param(2, 2, 0.0, ('plan.grad_route="reduce_scatter"', 'plan.param_route="sharded"', "plan.device_layers=1"),
                 CUT, marks=pytest.mark.slow),  # the sharded routes over cut layers (-m slow: 23 s)
    (1, 2, 0.5, (), "auto"),  # clipping that acts: speculated, corrected and deferred chunks
]


@pytest.fixture(scope="module")
def folder(family_folders):
    return family_folders["gpt_oss"]


def _read(run_dir: Path) -> tuple:
    plan = json.loads((run_dir / "plan.json").read_text())
    final = run_dir / "checkpoints" / f"step-{STEPS:08d}"
    return plan, metrics(run_dir), checkpoint_weights(final), checkpoint_state(final)


def _run(tmp_path, folder, name: str, limit: int, workers: int, micro: int, clip: float, extra) -> tuple:
    run_dir, store = tmp_path / name, unique_store("lc")
    sets = [s for s in job_sets(folder, workers, micro, "packed", clip, store, run_dir)
            if not s.startswith(("train.steps", "train.lr"))]
    sets += [f"train.steps={STEPS}", "train.lr=5e-4", f"plan.layer_chunk_numel={limit}", *extra]
    try:
        proc = launch(TINY, *sets, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    finally:  # a launcher killed before its teardown leaves its store
        unlink_store(store)
    return _read(run_dir)


@pytest.mark.parametrize("workers,micro,clip,extra,limit", CASES)
def test_layers_cut_into_chunks_train_as_whole_layers(tmp_path, tmp_path_factory, folder, workers, micro, clip, extra,
                                                      limit):
    whole = _run(tmp_path, folder, "whole", 0, workers, micro, clip, extra)
    if limit == "auto":  # the family's run: the same job, the layout's rule (plan.layer_chunk_numel = "auto")
        assert (workers, micro, clip, extra) == (1, 2, 0.5, ())
        proc, run_dir, _, _ = family_run(tmp_path_factory, folder, workers, micro)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        cut = _read(run_dir)
        layer = sum(t.numel() for n, t in whole[2].items() if n.startswith("model.layers.0."))
        assert 0 < cut[0]["layer_chunk_numel"] < layer, (cut[0]["layer_chunk_numel"], layer)  # the rule cuts it
    else:
        cut = _run(tmp_path, folder, "cut", limit, workers, micro, clip, extra)
        assert cut[0]["layer_chunk_numel"] == limit
    assert whole[0]["layer_chunk_numel"] == 0
    (_, m0, w0, s0), (_, m1, w1, s1) = whole, cut
    assert [m["step"] for m in m1] == list(range(STEPS))
    assert [m["d2h_bytes"] for m in m0] == [m["d2h_bytes"] for m in m1]  # the same gradients leave, in more pieces
    assert w0.keys() == w1.keys() and s0.keys() == s1.keys() and w0
    if not clip:
        assert [m["loss"] for m in m0] == [m["loss"] for m in m1]
        for a, b in ((w0, w1), (s0, s1)):
            differ = [k for k in a if not torch.equal(a[k], b[k])]
            assert differ == [], differ[:4]
    else:
        assert any(m["clipped"] for m in m1)
        for a, b in zip(m0, m1):
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6 * a["grad_norm"]
            assert a["clipped"] == b["clipped"]
        worst = max((rel_err(w1[k].double(), w0[k].double()), k) for k in w0)
        assert worst[0] <= 1e-6, worst
