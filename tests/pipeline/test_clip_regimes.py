"""Exact clipping end to end, in its three regimes, against the plain PyTorch reference.

never: max_grad_norm above every step's norm (every chunk speculated and kept: bit-identical to the
run without clipping); always: under every norm (the first step's speculated chunks corrected, the
rest deferred; every later step defers all: it follows a clipped one); crossing: a threshold between
the steps' norms, with a margin of 1.8% or more, so that the run goes from clipping to not and back
(a step after an unclipped one speculates, and is corrected where it clips). N ranks x M micro-batches, fp32 on CPU, real processes; weights, AdamW
moments, losses and norms to float32 rounding, and metrics.jsonl saying which steps clipped.

Default suite: one run per regime that together cover each N, each M and the sharded routes;
`-m slow`: the whole grid.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from .harness import TINY, checkpoint_state, checkpoint_weights, launch, metrics, rel_err, unique_store
from .test_equivalence import STEPS, assert_matches_reference, job_sets, launched, reference

# reference norms, steps 0-4 (with the clipping each threshold causes): tiny 1.049 1.053 0.923 1.135 0.953,
# tiny-llama 0.905 0.943 1.031 1.294 1.080
THRESHOLDS = {"never": {"tiny": 2.0, "tiny-llama": 2.0}, "always": {"tiny": 0.5, "tiny-llama": 0.5},
              "crossing": {"tiny": 1.0, "tiny-llama": 1.1}}
CROSSES = {"tiny": [True, True, False, True, False], "tiny-llama": [False, False, False, True, False]}

# (workers, micro-batches per rank, regime, shape, param_route, grad_route, embedding)
DEFAULT = [
    (1, 2, "never", "tiny-llama", "replicated", "host", "device"),  # its run without clipping: test_matches_reference's
    (2, 1, "crossing", "tiny-llama", "sharded", "reduce_scatter", "host"),
    (3, 4, "always", "tiny", "replicated", "host", "device"),
]
# the grid: tied and untied shapes alternate; with several ranks, the replicated/host routes and the
# sharded/reduce_scatter ones alternate too
GRID = [(n, m, regime, shape, *(("sharded", "reduce_scatter") if n > 1 and (n + m) % 2 else ("replicated", "host")),
         "host")
        for (n, m), regime in itertools.product(itertools.product((1, 2, 3), (1, 2, 4)), THRESHOLDS)
        for shape in (("tiny", "tiny-llama")[(n + m + len(regime)) % 2],)]


def _run(tmp_path, name: str, workers, micro, clip, shape, param_route, grad_route, embedding):
    run_dir = tmp_path / name
    sets = job_sets(workers, micro, clip, shape, unique_store("clip"), run_dir, embedding, param_route, grad_route)
    proc = launch(TINY, *sets, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir, sets


def check_regime(tmp_path, tmp_path_factory, workers, micro, regime, shape, param_route, grad_route,
                 embedding) -> None:
    clip = THRESHOLDS[regime][shape]
    run_dir, sets = _run(tmp_path, "run", workers, micro, clip, shape, param_route, grad_route, embedding)
    # Weights and moments relative per tensor: the engine sums micro-batches and ranks in another order
    # than the reference's whole batch, and AdamW's 1/sqrt(v) magnifies last-bit differences where a
    # gradient is near zero (1.26e-5 on tiny, one rank, 2 micro-batches, clipping off); a correction's
    # undo adds its own rounding of about 1e-7 (tests/clipping).
    bound = 3e-5
    assert_matches_reference(run_dir, sets, bound)
    ref = reference(sets)
    final = run_dir / "checkpoints" / f"step-{STEPS:08d}"
    state = checkpoint_state(final)
    for kind, tensors in ref.moments.items():
        worst = max((rel_err(state[f"{kind}.{n}"], t), n) for n, t in tensors.items())
        assert worst[0] < bound, (kind, worst)
    got = metrics(run_dir)
    want_clipped = {"never": [False] * STEPS, "always": [True] * STEPS, "crossing": CROSSES[shape]}[regime]
    assert [m["clipped"] for m in got] == want_clipped
    assert [n + 1e-6 > clip for n in ref.grad_norms] == want_clipped  # the reference clipped the same steps
    # a step speculates only after one that did not clip (the first step always): the others defer everything
    assert [m["speculated"] for m in got] == [True] + [not c for c in want_clipped[:-1]]
    for m in got:
        if m["speculated"]:
            assert m["speculated_chunks"] >= 1  # the final norm's chunk comes first, far under any threshold
        else:
            assert m["speculated_chunks"] == 0, m
        assert m["corrected_chunks"] == (m["speculated_chunks"] if m["clipped"] else 0), m
        assert (m["correction_s"] > 0) == (m["clipped"] and m["speculated"]), m
    if regime == "never":  # every speculative update kept: bit for bit the run without clipping
        # the same job without clipping, launched once a session (test_matches_reference checks it too)
        proc, off_dir, _, _ = launched(tmp_path_factory, workers, micro, 0.0, shape, embedding, param_route,
                                       grad_route)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        off = off_dir / "checkpoints" / f"step-{STEPS:08d}"
        for mine, theirs in ((checkpoint_weights(final), checkpoint_weights(off)), (state, checkpoint_state(off))):
            assert mine.keys() == theirs.keys()
            differ = [k for k in mine if not torch.equal(mine[k], theirs[k])]
            assert differ == [], differ[:4]
        assert [m["speculated_chunks"] for m in metrics(off_dir)] == [0] * STEPS


@pytest.mark.parametrize("workers,micro,regime,shape,param_route,grad_route,embedding", DEFAULT)
def test_clipping_regime(tmp_path, tmp_path_factory, workers, micro, regime, shape, param_route, grad_route,
                         embedding):
    check_regime(tmp_path, tmp_path_factory, workers, micro, regime, shape, param_route, grad_route,
                 embedding)


@pytest.mark.slow
@pytest.mark.parametrize("workers,micro,regime,shape,param_route,grad_route,embedding", GRID)
def test_clipping_regime_grid(tmp_path, tmp_path_factory, workers, micro, regime, shape, param_route,
                              grad_route, embedding):
    check_regime(tmp_path, tmp_path_factory, workers, micro, regime, shape, param_route, grad_route,
                 embedding)
