"""The updater's kernels: the blocked AdamW with its shadow, and the one-pass correction of a speculative
step, against the whole-tensor fused kernel, the undo + redo it replaces, and clip_grad_norm_ + AdamW."""

from __future__ import annotations

import math

import pytest
import torch

from slidedp.adamw import step_
from slidedp.clipping.rollback import COMPILED, correct_, fused_adamw_, undo_

from pipeline.harness import rel_err

HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
SIZES = (5, 4099, 70_001)  # a norm weight, a bias-like tail, a matrix of several blocks (block=8192 below)


def _pieces(gen: torch.Generator, steps: int, vscale: float = 1.0, shadow: bool = False):
    """(master, moments after `steps` fused AdamW steps, bf16 shadow) for each of SIZES."""
    out = []
    for n in SIZES:
        p, m, v = torch.randn(n, generator=gen) * 0.02, torch.zeros(n), torch.zeros(n)
        for t in range(1, steps + 1):
            fused_adamw_([p], [torch.randn(n, generator=gen) * 0.01 * vscale], [m], [v], step=t, **HYPER)
        out.append([p, m, v, torch.empty(n, dtype=torch.bfloat16) if shadow else None])
    return out


def _clone(pieces):
    return [[t.clone() if t is not None else None for t in pc] for pc in pieces]


def _with(pieces, grads):
    return [(p, g, m, v, s) for (p, m, v, s), g in zip(pieces, grads)]


@pytest.mark.skipif(not COMPILED, reason="numba is not installed")
@pytest.mark.parametrize("coef", [1.0, 0.37])
def test_the_compiled_step_is_torchs_fused_step_to_float32_rounding_and_the_same_at_any_thread_count(coef):
    """One pass with the shadow and the clipping inside it: within float32 rounding of torch's fused
    kernel, bit for bit the same at 1 and 3 threads, the shadow the master's cast byte for byte, and
    the store's gradient left as it was (torch's kernel writes the clipped gradient back)."""
    gen = torch.Generator().manual_seed(int(coef * 100))
    base = _pieces(gen, 2, shadow=True)
    grads = [torch.randn(n, generator=gen) * 0.01 for n in SIZES]
    want = _clone(base)
    fused_adamw_([w[0] for w in want], [g.clone() for g in grads], [w[1] for w in want], [w[2] for w in want],
                 step=3, coef=coef, **HYPER)
    runs, old = [], torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            got, kept = _clone(base), [g.clone() for g in grads]
            step_(_with(got, kept), step=3, coef=coef, compiled=True, **HYPER)
            assert all(torch.equal(k, g) for k, g in zip(kept, grads))
            runs.append(got)
    finally:
        torch.set_num_threads(old)
    for a, b, w in zip(*runs, want):
        assert all(torch.equal(a[k], b[k]) for k in range(4))
        assert all(rel_err(a[k], w[k]) < 1e-7 for k in range(3)), [rel_err(a[k], w[k]) for k in range(3)]
        assert torch.equal(a[3].view(torch.int16), a[0].to(torch.bfloat16).view(torch.int16))


def test_without_numba_the_step_is_torchs_fused_kernel_then_the_cast():
    gen = torch.Generator().manual_seed(5)
    base = _pieces(gen, 2, shadow=True)
    grads = [torch.randn(n, generator=gen) * 0.01 for n in SIZES]
    want = _clone(base)
    fused_adamw_([w[0] for w in want], [g.clone() for g in grads], [w[1] for w in want], [w[2] for w in want],
                 step=3, coef=0.5, **HYPER)
    got = _clone(base)
    step_(_with(got, [g.clone() for g in grads]), step=3, coef=0.5, compiled=False, **HYPER)
    for a, w in zip(got, want):
        assert all(torch.equal(a[k], w[k]) for k in range(3))
        assert torch.equal(a[3].view(torch.int16), a[0].to(torch.bfloat16).view(torch.int16))


CASES = [  # (steps before, coef, gradient spike, moments' scale): t = 1, a hundredfold clip, tiny v
    (0, 0.9, 1.0, 1.0), (0, 0.01, 10.0, 1.0), (3, 0.9, 1.0, 1.0), (3, 0.2, 10.0, 1.0), (3, 0.01, 1.0, 1.0),
    (3, 0.01, 10.0, 1.0), (3, 0.2, 1.0, 1e-6), (3, 0.01, 1.0, 1e-6),
]


def _speculate_and_correct(base, grads, steps: int, coef: float, compiled: bool):
    got = _clone(base)
    fused_adamw_([w[0] for w in got], grads, [w[1] for w in got], [w[2] for w in got], step=steps + 1, **HYPER)
    correct_(_with(got, grads), step=steps + 1, coef=coef, compiled=compiled, **HYPER)
    return got


@pytest.mark.skipif(not COMPILED, reason="numba is not installed")
@pytest.mark.parametrize("steps,coef,spike,vscale", CASES)
def test_the_one_pass_correction_equals_the_clipped_step_and_is_no_worse_than_undo_and_redo(steps, coef, spike,
                                                                                          vscale):
    """Speculate unclipped, correct in one pass, against the clipped step run directly. At t = 1 the
    moments come out bit-identical (the speculative terms cancel exactly); elsewhere the error is the
    speculative values' float32 rounding, and no larger than the undo + redo's (a gradient a million
    times its moments' history, clipped a hundredfold, is where both lose most)."""
    gen = torch.Generator().manual_seed(steps * 100 + int(coef * 100))
    base = _pieces(gen, steps, vscale)
    grads = [torch.randn(n, generator=gen) * 0.01 * spike for n in SIZES]
    want = _clone(base)
    fused_adamw_([w[0] for w in want], [g.clone() for g in grads], [w[1] for w in want], [w[2] for w in want],
                 step=steps + 1, coef=coef, **HYPER)
    one = _speculate_and_correct(base, grads, steps, coef, compiled=True)
    two = _speculate_and_correct(base, grads, steps, coef, compiled=False)
    cat = [lambda x, k=k: torch.cat([pc[k] for pc in x]) for k in range(3)]
    err_one = [rel_err(c(one), c(want)) for c in cat]
    err_two = [rel_err(c(two), c(want)) for c in cat]
    bound = 1e-6 if vscale == 1.0 and coef > 0.01 else 3e-5
    assert max(err_one) < bound, err_one
    if steps == 0:
        assert all(torch.equal(a[k], b[k]) for a, b in zip(one, want) for k in (1, 2))
    for k, name in enumerate(("master", "exp_avg", "exp_avg_sq")):
        assert err_one[k] <= 2 * err_two[k] + 1e-7, (name, err_one, err_two)
    assert all((pc[2] >= 0).all() for pc in one)


def _reference(params0, grads, max_norm: float):
    """torch.nn.utils.clip_grad_norm_ then torch.optim.AdamW (decay on every tensor), one step."""
    ps = [torch.nn.Parameter(p.clone()) for p in params0]
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    norm = float(torch.nn.utils.clip_grad_norm_(ps, max_norm))
    opt = torch.optim.AdamW(ps, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], foreach=False)
    opt.step()
    return norm, [(p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]) for p in ps]


@pytest.mark.parametrize("compiled", [True, False] if COMPILED else [False])
def test_a_corrected_first_step_equals_clip_grad_norm_and_adamw(compiled):
    """t = 1 against torch's own clipping and AdamW: weights and moments to float32 rounding, and the
    shadow the weights' cast byte for byte."""
    gen = torch.Generator().manual_seed(7)
    params0 = [torch.randn(n, generator=gen) * 0.02 for n in SIZES]
    grads = [torch.randn(n, generator=gen) * 3.0 for n in SIZES]  # norm ~ 800: coef ~ 1e-3
    norm, ref = _reference(params0, grads, 1.0)
    coef = min(1.0, 1.0 / (norm + 1e-6))
    state = [[p.clone(), torch.zeros_like(p), torch.zeros_like(p), torch.empty(p.numel(), dtype=torch.bfloat16)]
             for p in params0]
    step_(_with(state, grads), step=1, **HYPER)  # the speculative step
    correct_(_with(state, grads), step=1, coef=coef, compiled=compiled, **HYPER)
    for (p, m, v, s), (rp, rm, rv) in zip(state, ref):
        assert rel_err(p, rp) < 1e-6 and rel_err(m, rm) < 1e-6 and rel_err(v, rv) < 1e-6
        assert torch.equal(s.view(torch.int16), p.to(torch.bfloat16).view(torch.int16))


@pytest.mark.skipif(not COMPILED, reason="numba is not installed")
def test_the_corrections_shadow_is_torchs_cast_on_adversarial_values():
    """lr = 0 leaves the master as it is, so the shadow is cast from chosen values: ties to even both
    ways, subnormals, the largest floats (which round to inf), infinities, signed zeros."""
    tie_even, tie_odd = 0x3F808000, 0x3F818000  # exactly half an ulp of bf16: round down / up
    bits = [tie_even, tie_odd, tie_even | 1, 0x00000001, 0x00008000, 0x007FFFFF, 0x80018000, 0x7F7FFFFF,
            0xFF7FFFFF, 0x7F7F8000, 0x7F800000, 0xFF800000, 0x00000000, 0x80000000, 0x3F800000]
    n = 40_000  # several of the kernel's blocks
    raw = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int64).to(torch.int32)
    p = raw.repeat(n // len(bits) + 1)[:n].view(torch.float32).clone()
    p[len(bits):] += torch.randn(n - len(bits)) * 1e-3  # and ordinary values around them
    g, m, v = torch.randn(n) * 1e-3, torch.randn(n) * 1e-3, torch.rand(n) * 1e-6
    shadow = torch.empty(n, dtype=torch.bfloat16)
    correct_([(p, g, m, v, shadow)], lr=0.0, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=2, coef=0.5)
    assert torch.equal(shadow.view(torch.int16), p.to(torch.bfloat16).view(torch.int16))
    assert torch.isinf(shadow[7]) and shadow[0].view(torch.int16) == 0x3F80 and shadow[1].view(torch.int16) == 0x3F82


def test_undo_restores_the_moments_and_the_shadow_follows():
    """A skipped step: the state before the speculative step (moments exactly zero at t = 1), and the
    shadow the restored master's cast."""
    gen = torch.Generator().manual_seed(3)
    for steps in (0, 2):
        base = _pieces(gen, steps, shadow=True)
        grads = [torch.randn(n, generator=gen) * 0.01 for n in SIZES]
        got = _clone(base)
        step_(_with(got, grads), step=steps + 1, **HYPER)
        undo_(_with(got, grads), step=steps + 1, block=8192, **HYPER)
        for a, b in zip(got, base):
            assert rel_err(a[0], b[0]) < 1e-7
            assert torch.equal(a[3].view(torch.int16), a[0].to(torch.bfloat16).view(torch.int16))
            if steps == 0:
                assert not a[1].any() and not a[2].any()
            else:
                assert rel_err(a[1], b[1]) < 1e-6 and rel_err(a[2], b[2]) < 1e-6


def test_a_correction_by_one_is_the_speculative_step():
    """coef = 1 (what a caller never asks for, but the algebra must hold): the first moment is left as
    it is (its gradient terms cancel exactly), the second and the master move by float32 rounding."""
    if not COMPILED:
        pytest.skip("numba is not installed")
    gen = torch.Generator().manual_seed(11)
    base = _pieces(gen, 2)
    grads = [torch.randn(n, generator=gen) * 0.01 for n in SIZES]
    spec = _clone(base)
    fused_adamw_([w[0] for w in spec], grads, [w[1] for w in spec], [w[2] for w in spec], step=3, **HYPER)
    got = _clone(spec)
    correct_(_with(got, grads), step=3, coef=1.0, **HYPER)
    for a, b in zip(got, spec):
        assert torch.equal(a[1], b[1])
        ulp = torch.finfo(torch.float32).eps
        assert ((a[2] - b[2]).abs() <= 2 * ulp * b[2]).all()
        assert (a[0] - b[0]).abs().max() <= 2 * ulp * b[0].abs().max()
        assert math.isfinite(float(a[0].sum()))


@pytest.mark.skipif(not COMPILED, reason="numba is not installed")
@pytest.mark.parametrize("steps,coef,spike,vscale", [CASES[1], CASES[5], CASES[7]])
def test_the_correction_of_a_compiled_step_equals_the_compiled_clipped_step(steps, coef, spike, vscale):
    """The updater speculates with the compiled kernel: its correction lands on the compiled clipped step
    (moments bit-identical at t = 1, float32 rounding elsewhere), the shadow following."""
    gen = torch.Generator().manual_seed(steps + int(coef * 1000))
    base = _pieces(gen, steps, vscale, shadow=True)
    grads = [torch.randn(n, generator=gen) * 0.01 * spike for n in SIZES]
    want, got = _clone(base), _clone(base)
    step_(_with(want, grads), step=steps + 1, coef=coef, compiled=True, **HYPER)
    step_(_with(got, grads), step=steps + 1, compiled=True, **HYPER)
    correct_(_with(got, grads), step=steps + 1, coef=coef, compiled=True, **HYPER)
    for k, bound in ((0, 3e-6), (1, 1e-5), (2, 3e-5)):
        assert rel_err(torch.cat([a[k] for a in got]), torch.cat([w[k] for w in want])) < bound, k
    if steps == 0:
        assert all(torch.equal(a[k], w[k]) for a, w in zip(got, want) for k in (1, 2))
    assert all(torch.equal(a[3].view(torch.int16), a[0].to(torch.bfloat16).view(torch.int16)) for a in got)
