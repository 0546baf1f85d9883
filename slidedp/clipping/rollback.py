"""Settle a speculative AdamW step once the norm is known: correct it in one pass, or undo it.

A speculative update overwrote master and both moments with the unclipped step; keeping a copy
of them would cost 12 B/param. The gradient g is kept anyway (4 B/param, until the verdict), and
with it the step is corrected in place. With t the AdamW step the update used, bc1 = 1 - beta1^t,
bc2 = 1 - beta2^t, u(m, v) = m / (sqrt(v) + eps * sqrt(bc2)) and a = lr * sqrt(bc2) / bc1 (the
fused kernel's m / (sqrt(v) / sqrt(bc2) + eps) times lr / bc1, rewritten), the speculative state is

    m_s = beta1 m + (1 - beta1) g,   v_s = beta2 v + (1 - beta2) g^2,   p_s = p (1 - lr wd) - a u(m_s, v_s)

and the one clipped by coef (g replaced by coef g) differs from it only in the gradient's terms:

    m' = m_s - (1 - beta1)(1 - coef) g
    v' = max(0, v_s - (1 - beta2)(1 - coef^2) g^2)
    p' = p_s + a (u(m_s, v_s) - u(m', v'))

The decay term p (1 - lr wd) and the bias corrections are the same in both, so they cancel: one
read and one write of each tensor, no division by beta or by (1 - lr wd). At t = 1 the moments
were zero, so m' = (1 - beta1) coef g and v' = (1 - beta2) coef^2 g^2 outright (no cancellation
of m_s against its gradient term at a small coef). What it costs is float32 rounding of the
speculative values, as the undo and redo it replaces (tests/clipping measure both).

A skipped step (non-finite norm) is undone instead:

    p = (p_s + a u(m_s, v_s)) / (1 - lr wd),   m = (m_s - (1 - beta1) g) / beta1,
    v = max(0, (v_s - (1 - beta2) g^2) / beta2)   (exactly zero at t = 1)

The correction is one compiled pass (numba: it is the sqrt and division of AdamW twice, which
torch's elementwise ops would take a pass each for); where numba is missing it falls back to the
undo then the fused redo, block by block. Both write the block's bf16 shadow from cache.
"""

from __future__ import annotations

import os
import threading
from typing import Iterable, Sequence

import torch

from slidedp.adamw import BLOCK, batches, cast_shadows_, flat_piece, fused_adamw_

try:  # the compiled correction; without it the (slower) undo + redo, same results to float32 rounding
    import numba
    import numpy as np
except ImportError:  # pragma: no cover - numba is a dependency; this keeps an odd install running
    numba = None

__all__ = ["BLOCK", "COMPILED", "correct_", "fused_adamw_", "settle_", "undo_", "undo_adamw_", "warm_up"]

COMPILED = numba is not None


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


if numba is not None:
    # numba's own thread pool (no second OpenMP runtime beside torch's), unless the user chose one
    if "NUMBA_THREADING_LAYER" not in os.environ:
        numba.config.THREADING_LAYER = "workqueue"
    _KBLOCK = 16384  # elements a thread corrects before casting their shadow: 64 KiB a tensor, in L2

    @numba.njit(parallel=True, boundscheck=False, nogil=True, cache=True)
    def _correct_kernel(p, g, m, v, p_bits, shadow, keep, w, c, scale, bc2s, eps, step_size):  # pragma: no cover
        """The speculative step's terms, recomputed as torch's fused kernel computed them (its operations in
        its order, float32), taken out, and the clipped step's put in; then the shadow (if any) cast from
        the new master with torch's rounding (nearest even; NaN 0x7FC0). No fused multiply-add (numba does
        not contract), so the bits are the same on every machine."""
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
                bits, out = p_bits[lo:hi], shadow[lo:hi]
                for i in range(hi - lo):
                    u = bits[i]
                    r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
                    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                        r = np.uint32(0x7FC0)
                    out[i] = np.uint16(r)

    _NO_SHADOW = np.empty(0, dtype=np.uint16)
    _lock = threading.Lock()


def _numpy(t: torch.Tensor, dtype=None):
    a = t.detach().view(-1).numpy()
    return a.view(dtype) if dtype is not None else a


def _correct_compiled(piece, *, lr, beta1, beta2, eps, step, coef) -> None:
    p, g, m, v, shadow = flat_piece(piece)
    f32 = np.float32
    out = _numpy(shadow.view(torch.int16), np.uint16) if shadow is not None else _NO_SHADOW
    with _lock:  # numba's workqueue pool takes one caller at a time
        numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))
        _correct_kernel(_numpy(p), _numpy(g), _numpy(m), _numpy(v), _numpy(p, np.uint32), out,
                        f32(0.0 if step == 1 else 1.0), f32(1 - beta1), f32(1 - beta2),
                        f32(1.0 / coef),  # the fused kernel's grad_scale, a float32 tensor of 1 / coef
                        f32((1 - beta2 ** step) ** 0.5), f32(eps), f32(lr / (1 - beta1 ** step)))


def correct_(pieces: Iterable[Sequence[torch.Tensor | None]], *, lr: float, beta1: float, beta2: float,
             eps: float, weight_decay: float, step: int, coef: float, compiled: bool = COMPILED,
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
    """Compile (or load from numba's cache) the correction before the first one is due: a correction
    waiting a second for the compiler would hold up the next forward."""
    if COMPILED:
        t = [torch.ones(4) for _ in range(4)]
        correct_([(*t, torch.empty(4, dtype=torch.bfloat16))], lr=0.0, beta1=0.9, beta2=0.95, eps=1e-8,
                 weight_decay=0.0, step=2, coef=0.5)


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
