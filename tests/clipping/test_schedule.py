"""The speculation schedule alone: which chunks update before the norm is known, in which order, and the verdict."""

from __future__ import annotations

import math

import pytest
import torch

from slidedp.clipping import StepNorm, Verdict, clip_coefficient, norm_order
from slidedp.clipping.schedule import would_clip
from slidedp.model.config import named_shape
from slidedp.store.layout import make_layout, unit_name


def _names(layout, order):
    return [f"{unit_name(layout.chunks[c])}#{c}" for c in order]


def test_norm_order_is_the_engines_send_order_then_the_held_chunks():
    tied = make_layout(named_shape("tiny"))  # embed, layer 0, layer 1, norm
    assert _names(tied, norm_order(tied)) == ["norm#3", "layer.1#2", "layer.0#1", "embed#0"]
    untied = make_layout(named_shape("tiny-llama"))
    names = [n.split("#")[0] for n in _names(untied, norm_order(untied))]
    heads = names.count("head")
    assert heads >= 1 and names[:1 + heads] == ["norm"] + ["head"] * heads
    assert names[1 + heads:] == ["layer.1", "layer.0"] + ["embed"] * names.count("embed")
    # chunks held on the devices report their norms after the backward: they come last
    held = frozenset({tied.layer_chunk(1).id})
    assert _names(tied, norm_order(tied, held)) == ["norm#3", "layer.0#1", "embed#0", "layer.1#2"]


def test_verdict_is_clip_grad_norms_factor():
    for norm in (0.3, 0.999999, 1.0, 1.2, 40.0):
        g = torch.full((4,), norm / 2, dtype=torch.float64)
        p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
        p.grad = g.clone()
        total = torch.nn.utils.clip_grad_norm_([p], 1.0)
        v = Verdict.of(float(total), 1.0)
        assert v.coef == pytest.approx(float(p.grad[0] / g[0]), rel=1e-12)
        assert v.clipped == (v.coef < 1.0) and not v.skip
    assert clip_coefficient(0.5, 1.0) == 1.0 and Verdict.of(1.0, 1.0).clipped  # 1 / (1 + 1e-6) < 1: clips
    for bad in (math.inf, math.nan):
        v = Verdict.of(bad, 1.0)
        assert v.skip and not v.clipped
        assert would_clip(bad, 1.0)  # min(1, 1 / nan) would be 1.0: a NaN must never pass for "no clip"


def test_the_partial_norm_speculates_until_it_would_clip_then_every_later_chunk_waits():
    order = (3, 2, 1, 0)
    st = StepNorm(order, 1.0)
    assert st.add(3, 0.09) == [(3, True)]
    assert st.add(2, 0.5) == [(2, True)]  # 0.59: under 1
    assert st.add(1, 0.5) == [(1, False)]  # 1.09: over; from here on the chunks wait
    assert not st.complete
    assert st.add(0, 0.0) == [(0, False)]  # a zero gradient after the crossing still waits: the norm only grows
    assert st.speculated == [3, 2] and st.deferred == [1, 0]
    v = st.verdict()
    assert v.norm == pytest.approx(math.sqrt(1.09)) and v.clipped


def test_decisions_follow_the_fixed_order_not_the_arrival_order():
    """Every arrival order gives the same decisions and the same norm, bit for bit: a chunk that comes
    early waits for those before it in the order (this is what keeps a resumed run exact)."""
    order = (3, 2, 1, 0)
    sq = {3: 0.1, 2: 0.2, 1: 0.3, 0: 0.45}  # crosses at chunk 0: 1.05
    import itertools

    seen = set()
    for arrival in itertools.permutations(order):
        st = StepNorm(order, 1.0)
        decided = [d for c in arrival for d in st.add(c, sq[c])]
        assert [c for c, _ in decided] == list(order)  # always handed out in the order
        seen.add((tuple(decided), st.verdict().norm))
    assert seen == {(((3, True), (2, True), (1, True), (0, False)), math.sqrt(0.1 + 0.2 + 0.3 + 0.45))}
    st = StepNorm(order, 1.0)
    assert st.add(0, 0.45) == [] and st.add(2, 0.2) == []  # nothing decided until chunk 3 is in
    assert st.add(3, 0.1) == [(3, True), (2, True)]
    with pytest.raises(ValueError, match="added twice"):
        st.add(2, 0.2)
    with pytest.raises(RuntimeError, match="not complete"):
        st.verdict()


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_chunk_is_never_speculated_and_skips_the_step(bad):
    st = StepNorm((3, 2, 1, 0), 1.0)
    assert st.add(3, 0.01) == [(3, True)]
    assert st.add(2, bad) == [(2, False)]
    assert st.add(1, 0.01) + st.add(0, 0.0) == [(1, False), (0, False)]
    v = st.verdict()
    assert v.skip and not v.clipped and st.speculated == [3]


def test_device_held_chunks_add_to_the_norm_and_are_never_handed_out():
    st = StepNorm((3, 2, 1, 0), 1.0, device_chunks=frozenset({1, 0}))
    assert st.add(3, 0.2) + st.add(2, 0.2) == [(3, True), (2, True)]
    assert st.add(0, 0.3) == []  # waits for chunk 1 (the order), and is the devices' anyway
    assert st.add(1, 0.4) == [] and st.complete
    assert st.verdict().clipped  # 1.1: the held chunks' norms made the step clip; chunks 3 and 2 get corrected
