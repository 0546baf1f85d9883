"""Settle a speculative AdamW step once the norm is known: correct it in one pass, or undo it.

A speculative update overwrote master and both moments with the unclipped step; keeping a copy
of them would cost 12 B/param. The gradient g is kept anyway (4 B/param, until the verdict), and
with it the step is corrected in place. With t the AdamW step the update used, w = 1 - beta1,
c = 1 - beta2 and X(m, v) = -lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps) (the
fused kernel's update), the speculative state is

    m_s = m + w (g - m),   v_s = beta2 v + c g^2,   p_s = p (1 - lr wd) + X(m_s, v_s)

and the one clipped by coef (gc = g / (1 / coef), as the kernel clips) differs from it only in the
gradient's terms:

    m' = m_s + w (gc - g)                 (at t = 1, the moments were zero: w gc)
    v' = max(0, (v_s - c g^2) + c gc^2)
    p' = (p_s - X(m_s, v_s)) + X(m', v')

The decay term p (1 - lr wd) and the bias corrections are the same in both, so they cancel: one
read and one write of each tensor, no division by beta or by (1 - lr wd). Each term taken out is
recomputed with the operations, in the order, of the kernel that put it in (torch's fused kernel
and slidedp.adamw's compiled one compute c g^2 and X alike; they differ only in the rounding of
m_s, which the correction does not recompute), so it cancels to the rounding of the sum it went
into: at t = 1 the moments come out bit-identical to the clipped step, and elsewhere the error is
the float32 rounding of the speculative values, at most the undo + redo's (tests/clipping).

A skipped step (non-finite norm) is undone instead:

    p = (p_s - X(m_s, v_s)) / (1 - lr wd),   m = (m_s - w g) / beta1,
    v = max(0, (v_s - c g^2) / beta2)   (exactly zero at t = 1)

The correction is one compiled pass (numba: it is AdamW's sqrt and division twice, which torch's
elementwise ops would take a pass over the block each for); where numba is missing it falls back
to the undo then the fused redo, block by block. Both write the bf16 shadow as they go.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from slidedp import adamw
from slidedp.adamw import BLOCK, COMPILED, USE_COMPILED, batches, cast_shadows_, flat_piece, fused_adamw_

if COMPILED:
    import numba
    import numpy as np

    from slidedp.adamw import cast_bf16_

__all__ = ["BLOCK", "COMPILED", "correct_", "fused_adamw_", "settle_", "undo_", "undo_adamw_", "warm_up"]



def undo_adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                scratch: torch.Tensor | None = None) -> None:
    """In place: the state before the fused AdamW step `step` (1-based) that used the unscaled `grad`.
    scratch: room for one tensor of param's size (reused across blocks rather than allocated)."""
    bc2_sqrt = (1 - beta2 ** step) ** 0.5
    step_size = lr / (1 - beta1 ** step)
    # multiplications by reciprocals, not divisions: as exact to float32 rounding, and several times faster
    denom = torch.sqrt(exp_avg_sq, out=scratch[:exp_avg_sq.numel()] if scratch is not None else None)
    denom.mul_(1.0 / bc2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=step_size)
    if weight_decay:
        param.mul_(1.0 / (1 - lr * weight_decay))
    if step == 1:  # the moments started at zero: restore them exactly
        exp_avg.zero_()
        exp_avg_sq.zero_()
        return
    exp_avg.sub_(grad, alpha=1 - beta1).mul_(1.0 / beta1)
    exp_avg_sq.addcmul_(grad, grad, value=-(1 - beta2)).mul_(1.0 / beta2).clamp_min_(0.0)


if COMPILED:
    _KBLOCK = adamw._KBLOCK

    @numba.njit(parallel=True, boundscheck=False, nogil=True, cache=True)
    def _correct_kernel(p, g, m, v, p_bits, shadow, keep, w, c, scale, bc2s, eps, step_size):  # pragma: no cover
        """The speculative step's terms, recomputed as its kernel computed them (float32, its operations in
        its order), taken out, and the clipped step's put in; then the shadow (if any) cast from the new
        master with torch's rounding. No fused multiply-add (numba does not contract), so the bits are
        the same on every machine."""
        n = p.size
        zero = np.float32(0.0)
        for b in numba.prange((n + _KBLOCK - 1) // _KBLOCK):
            lo = b * _KBLOCK
            hi = min(n, lo + _KBLOCK)
            pp, gg, mm, vv = p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi]
            for i in range(hi - lo):  # slices indexed from 0: no wrap-around checks, so it vectorizes
                mi, vi, gi = mm[i], vv[i], gg[i]
                gc = gi / scale  # the clipped gradient, as the kernel clips it
                step_s = -step_size * mi / (np.sqrt(vi) / bc2s + eps)  # the speculative step's update
                mn = keep * mi + w * (gc - keep * gi)  # m_s + (1 - beta1)(gc - g); at t = 1: (1 - beta1) gc
                vn = (vi - c * gi * gi) + c * gc * gc  # v_s less its gradient term plus the clipped one
                vn = vn if vn > zero else zero
                pp[i] = (pp[i] - step_s) + (-step_size * mn / (np.sqrt(vn) / bc2s + eps))
                mm[i] = mn
                vv[i] = vn
            if shadow.size:
                cast_bf16_(p_bits[lo:hi], shadow[lo:hi])


def _correct_compiled(piece, *, lr, beta1, beta2, eps, step, coef) -> None:
    p, g, m, v, shadow = flat_piece(piece)
    k = adamw.constants(lr=lr, beta1=beta1, beta2=beta2, eps=eps, step=step)
    f32, arr = np.float32, adamw.numpy_of
    with adamw._lock:
        adamw.compiled_threads()
        _correct_kernel(arr(p), arr(g), arr(m), arr(v), arr(p, np.uint32), adamw.shadow_of(shadow),
                        f32(0.0 if step == 1 else 1.0), k["w"], k["c"],
                        f32(1.0 / coef),  # the fused kernel's grad_scale, a float32 tensor of 1 / coef
                        k["bc2s"], k["eps"], k["step_size"])


def correct_(pieces: Iterable[Sequence[torch.Tensor | None]], *, lr: float, beta1: float, beta2: float,
             eps: float, weight_decay: float, step: int, coef: float, compiled: bool = USE_COMPILED,
             block: int = BLOCK) -> None:
    """Correct speculative (unclipped) AdamW step `step` on every piece (master, grad, exp_avg, exp_avg_sq,
    shadow or None) to the step clipped by `coef`, in place, shadows included. compiled=False: the undo
    and the fused redo, block by block (what runs without numba)."""
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, step=step)
    if compiled:
        for piece in pieces:
            if piece[0].numel():
                _correct_compiled(piece, coef=coef, **hyper)
        return
    _blockwise(pieces, weight_decay=weight_decay, coef=coef, block=block, **hyper)


def undo_(pieces: Iterable[Sequence[torch.Tensor | None]], *, lr: float, beta1: float, beta2: float, eps: float,
          weight_decay: float, step: int, block: int = BLOCK) -> None:
    """Undo speculative AdamW step `step` on every piece (a skipped step), shadows included."""
    _blockwise(pieces, coef=None, block=block, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
               weight_decay=weight_decay, step=step)


def warm_up() -> None:
    """Compile (or load from numba's cache) the AdamW and correction kernels before the first update is
    due: an update waiting a second for the compiler would hold up the step."""
    if USE_COMPILED:
        t = [torch.ones(4) for _ in range(4)]
        hyper = dict(lr=0.0, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=2, coef=0.5)
        piece = [(*t, torch.empty(4, dtype=torch.bfloat16))]
        adamw.step_(piece, **hyper)
        correct_(piece, **hyper)


def _blockwise(pieces, *, coef: float | None, block: int, weight_decay: float, **hyper) -> None:
    """Undo, and redo clipped by coef unless coef is None, block by block, each block's shadow from cache."""
    scratch = None
    for batch in batches(pieces, block):
        for p, g, m, v, _ in batch:
            if scratch is None:
                scratch = torch.empty(block, dtype=p.dtype, device=p.device)
            undo_adamw_(p, g, m, v, scratch=scratch, weight_decay=weight_decay, **hyper)
        if coef is not None:
            fused_adamw_([b[0] for b in batch], [b[1] for b in batch], [b[2] for b in batch], [b[3] for b in batch],
                         weight_decay=weight_decay, coef=coef, **hyper)
        cast_shadows_(batch)


def settle_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
            lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
            coef: float | None, shadow: torch.Tensor | None = None) -> None:
    """Settle a speculative (unclipped) AdamW step `step` in place: correct it to the gradient clipped by
    `coef`, or, with coef None (the step is skipped), undo it; `shadow` (bf16) follows the master."""
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)
    piece = [(param, grad, exp_avg, exp_avg_sq, shadow)]
    if coef is None:
        undo_(piece, **hyper)
    else:
        correct_(piece, coef=coef, **hyper)
