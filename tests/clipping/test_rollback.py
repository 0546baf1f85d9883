"""Undoing a fused AdamW step from the gradient it used, and redoing it clipped: what the rounding costs."""

from __future__ import annotations

import pytest
import torch

from slidedp.clipping.rollback import BLOCK, fused_adamw_, settle_, undo_adamw_

from pipeline.harness import rel_err

HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
N = BLOCK + 1000  # more than one block, the last one short


def _state(steps: int, gen: torch.Generator) -> list[torch.Tensor]:
    p, m, v = torch.randn(N, generator=gen) * 0.02, torch.zeros(N), torch.zeros(N)
    for t in range(1, steps + 1):
        fused_adamw_([p], [torch.randn(N, generator=gen) * 0.01], [m], [v], step=t, **HYPER)
    return [p, m, v]


@pytest.mark.parametrize("steps", [0, 3])
def test_undo_restores_the_state_before_the_step(steps):
    gen = torch.Generator().manual_seed(steps)
    before = _state(steps, gen)
    p, m, v = (t.clone() for t in before)
    g = torch.randn(N, generator=gen) * 0.01
    fused_adamw_([p], [g], [m], [v], step=steps + 1, **HYPER)
    assert rel_err(p, before[0]) > 1e-5  # the step did change the weights
    undo_adamw_(p, g, m, v, step=steps + 1, **HYPER)
    assert rel_err(p, before[0]) < 1e-7
    if steps == 0:  # a chunk's first step: the moments were zero, and are again, exactly
        assert not m.any() and not v.any()
    else:
        assert rel_err(m, before[1]) < 1e-6 and rel_err(v, before[2]) < 1e-6
        assert (v >= 0).all()


@pytest.mark.parametrize("coef", [0.9, 0.2, 0.01])
@pytest.mark.parametrize("spike", [1.0, 10.0])
def test_settle_equals_the_clipped_step_to_float32_rounding(coef, spike):
    """speculate (unclipped) + settle(coef) against the clipped step run directly. A gradient 10x the
    moments' history (a spike) clipped 100x is the worst case: the moments it speculated are far larger
    than the corrected ones, whose rounding the undo carries."""
    gen = torch.Generator().manual_seed(int(coef * 100 + spike))
    before = _state(3, gen)
    g = torch.randn(N, generator=gen) * 0.01 * spike
    want = [t.clone() for t in before]
    fused_adamw_([want[0]], [g.clone()], [want[1]], [want[2]], step=4, coef=coef, **HYPER)
    got, g_kept = [t.clone() for t in before], g.clone()
    fused_adamw_([got[0]], [g_kept], [got[1]], [got[2]], step=4, **HYPER)  # speculative: g_kept untouched
    assert torch.equal(g_kept, g)
    settle_(got[0], g_kept, got[1], got[2], step=4, coef=coef, **HYPER)
    bound = 1e-5 if spike > 1 else 1e-6
    for a, b in zip(got, want):
        assert rel_err(a, b) < bound, rel_err(a, b)
    undone = [t.clone() for t in before]
    fused_adamw_([undone[0]], [g.clone()], [undone[1]], [undone[2]], step=4, **HYPER)
    settle_(undone[0], g.clone(), undone[1], undone[2], step=4, coef=None, **HYPER)  # a skipped step: undo only
    for a, b in zip(undone, before):
        assert rel_err(a, b) < bound
