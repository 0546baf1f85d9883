"""The bf16 shadow written inside the updater's passes: after every update, correction and undo it is
the master's cast byte for byte, and the state is the one without a shadow to float32 rounding (with a
shadow the compiled kernel runs the plain update too, torch's kernel without one). (A checkpoint restore and a
device-held unit's write-back recast the whole store or unit: store.refresh_shadow, torch's own cast.)"""

from __future__ import annotations

import math

import torch

from slidedp.store.store import STATE_KINDS

from pipeline.harness import rel_err

from clipping.test_cores import CROSSING, NO_CLIP, made_up_grads, stores  # noqa: F401 (the fixture)


def _shadow_is_the_cast(store) -> bool:
    return torch.equal(store.flat("shadow").view(torch.int16), store.flat("master").to(torch.bfloat16).view(torch.int16))


def test_the_shadow_is_the_masters_cast_after_every_kind_of_update(stores):  # noqa: F811 (the fixture)
    shadowed, plain = stores(max_norm=1.0, shadow=True), stores(max_norm=1.0)
    assert shadowed.store.has_shadow and not plain.store.has_shadow
    layout = shadowed.store.layout
    # kept speculation; speculated then corrected; deferred and clipped (after a clipped step); deferred
    # unclipped; speculated and kept; speculated and undone (a non-finite gradient)
    plan = [NO_CLIP, CROSSING, CROSSING, NO_CLIP, NO_CLIP, None]
    seen = []
    for step, sq in enumerate(plan):
        grads = made_up_grads(layout, sq or NO_CLIP, 20 + step)
        if sq is None:
            grads[layout.layer_chunk(0).id][3] = math.inf
        done = shadowed.step(step, {c: g.clone() for c, g in grads.items()})
        plain.step(step, {c: g.clone() for c, g in grads.items()})
        seen.append((done.speculated, done.corrected, done.clipped, done.skipped))
        assert _shadow_is_the_cast(shadowed.store), f"step {step}"
        a, b = shadowed.state(), plain.state()
        assert all(rel_err(a[k], b[k]) < 1e-6 for k in STATE_KINDS), (step, [rel_err(a[k], b[k]) for k in STATE_KINDS])
    assert seen == [(4, 0, 0, 0), (2, 2, 1, 0), (0, 0, 1, 0), (0, 0, 0, 0), (4, 0, 0, 0), (2, 2, 0, 1)]
