"""The updater's AdamW over the store's memory: torch's fused kernel, and a compiled pass for what it lacks.

A chunk's update streams master, both moments and the gradient from host memory once (28 B/param:
four read, three written). torch's fused kernel (`torch._fused_adamw_`) does just that, and runs the
plain update. What else an update needs, the compiled kernel (numba; where numba is installed) does
inside the same pass: the bf16 shadow is cast block by block while the new master is in cache (the
shadow costs its 2 B/param write, not a second pass over the master), and a clipped update divides
the gradient in registers (torch's kernel writes the clipped gradient back where it read it, into
the store's gradient slot: 4 B/param more traffic). It is one parallel region per tensor, each
thread taking blocks of `_KBLOCK` elements, with torch's fused kernel's operations in its order
(but no fused multiply-add: numba does not contract), so its results are within float32 rounding of
torch's, and the same bits on every machine and at every thread count.

Which runs (hosttraffic.adamw_kernel, SLIDEDP_ADAMW_KERNEL): by default every update is torch's
kernel (a shadow then a second pass), and the compiled kernels run the corrections of speculated
chunks (slidedp/clipping/rollback.py), 2.8x the undo + redo they replace on the H200 host and 11x
beside a copy. The compiled update ("all") is opt-in: on that host at 16 threads it ran clipped
updates at 0.91x torch's and shadow updates at 0.87x (0.64x beside a copy; benchmarks/RESULTS.md, "One H200:
SlideDP's defaults beside its peers"), and a store with a shadow must train the same bits as one without (the
bf16 delivery is exact only if both stores' updates are the same kernel's). Running torch's kernel
block by block instead, to cast from cache, made every block a parallel region of the updater's
threads, which one preempted thread holds up: measured slower than the second pass.
"""

from __future__ import annotations

import os
import threading
from typing import Iterable, Sequence

import torch

from slidedp.hosttraffic import adamw_kernel

try:  # the compiled kernels; without numba, torch's fused kernel (same results to float32 rounding)
    import numba
    import numpy as np
except ImportError:  # pragma: no cover - numba is a dependency; this keeps an odd install running
    numba = None

COMPILED = numba is not None
# the kernels the updater runs (hosttraffic.adamw_kernel): the compiled correction where numba is there,
# the compiled update for clipped and shadow updates only where SLIDEDP_ADAMW_KERNEL=all asks for it
USE_COMPILED = COMPILED and adamw_kernel() != "torch"
STEP_COMPILED = COMPILED and adamw_kernel() == "all"

# Elements per block of the torch-op paths (the undo, and the correction without numba): a block of
# the four tensors (16 MiB) stays in the last-level cache from one op to the next, and a 100 M-parameter
# chunk takes about a hundred blocks (each op is one parallel region of the updater's threads).
BLOCK = 1 << 20

# Elements a thread of the compiled kernels takes at a time: 64 KiB a tensor, in L2 from the update
# to the shadow's cast.
_KBLOCK = 16384

# (master, grad, exp_avg, exp_avg_sq, bf16 shadow or None) of one contiguous piece of a chunk
Piece = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"]


def fused_adamw_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, step: int, coef: float = 1.0) -> None:
    """torch's fused AdamW step `step` on every tensor, the gradients clipped by `coef` (< 1: the kernel
    divides them by 1 / coef, writing the clipped gradient back; 1: untouched, the unclipped update)."""
    device = params[0].device
    scale = torch.tensor(1.0 / coef, dtype=torch.float32, device=device) if coef < 1.0 else None
    step_t = torch.tensor(float(step), device=device)
    torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], [step_t] * len(params), lr=lr, beta1=beta1,
                        beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
                        grad_scale=scale, found_inf=None)


def flat_piece(piece: Sequence[torch.Tensor | None]) -> Piece:
    """The piece's tensors as 1-D views (they are contiguous: store views, gradient slots)."""
    return tuple(t.view(-1) if t is not None else None for t in piece)  # type: ignore[return-value]


def batches(pieces: Iterable[Sequence[torch.Tensor | None]], block: int = BLOCK) -> Iterable[list[Piece]]:
    """The pieces cut into blocks of at most `block` elements (each cut at a multiple of `block` inside
    its tensor: torch's fused kernel gives the same bits as on the whole tensor), grouped so that a batch
    holds at most `block` elements: small tensors (norms, biases) share one call, large ones take one
    call per block."""
    batch: list[Piece] = []
    size = 0
    for piece in pieces:
        flat = flat_piece(piece)
        n = flat[0].numel()
        for lo in range(0, n, block):
            part = tuple(t[lo:lo + block] if t is not None else None for t in flat)
            k = part[0].numel()
            if batch and size + k > block:
                yield batch
                batch, size = [], 0
            batch.append(part)  # type: ignore[arg-type]
            size += k
    if batch:
        yield batch


def cast_shadows_(batch: Sequence[Piece]) -> None:
    """Each piece's bf16 shadow from its master: torch's own cast, bit for bit master.to(torch.bfloat16)."""
    for p, _, _, _, shadow in batch:
        if shadow is not None:
            shadow.copy_(p)


if numba is not None:
    # numba's own thread pool (no second OpenMP runtime beside torch's), unless the user chose one
    if "NUMBA_THREADING_LAYER" not in os.environ:
        numba.config.THREADING_LAYER = "workqueue"
    _NO_SHADOW = np.empty(0, dtype=np.uint16)
    _lock = threading.Lock()  # numba's workqueue pool takes one caller at a time

    @numba.njit(inline="always")
    def cast_bf16_(bits, out):  # pragma: no cover - compiled
        """out = the bf16 bits of the float32 `bits`, as torch casts: nearest even, NaN 0x7FC0."""
        for i in range(bits.size):
            u = bits[i]
            r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                r = np.uint32(0x7FC0)
            out[i] = np.uint16(r)

    @numba.njit(parallel=True, boundscheck=False, nogil=True, cache=True)
    def _adamw_kernel(p, g, m, v, p_bits, shadow, decay, w, b2, c, scale, bc2s, eps, step_size):  # pragma: no cover
        """torch's fused AdamW (ADAMW mode) on float32, element by element: the gradient divided by
        `scale` (1: unclipped, exact), then the block's shadow. numba does not contract a * b + c
        into a fused multiply-add, so the bits do not depend on the machine."""
        n = p.size
        for b in numba.prange((n + _KBLOCK - 1) // _KBLOCK):
            lo = b * _KBLOCK
            hi = min(n, lo + _KBLOCK)
            pp, gg, mm, vv = p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi]
            for i in range(hi - lo):  # slices indexed from 0: no wrap-around checks, so it vectorizes
                gi = gg[i] / scale
                mi = mm[i] + w * (gi - mm[i])
                vi = vv[i] * b2 + c * gi * gi
                pp[i] = pp[i] * decay + (-step_size * mi) / (np.sqrt(vi) / bc2s + eps)
                mm[i] = mi
                vv[i] = vi
            if shadow.size:
                cast_bf16_(p_bits[lo:hi], shadow[lo:hi])


def numpy_of(t: torch.Tensor, dtype=None):
    """A zero-copy 1-D numpy view of a contiguous CPU tensor (`dtype`: reinterpret the bytes)."""
    a = t.detach().view(-1).numpy()
    return a.view(dtype) if dtype is not None else a


def shadow_of(shadow: torch.Tensor | None):
    """The bf16 shadow as the uint16 array the compiled kernels write (an empty one for none)."""
    return numpy_of(shadow.view(torch.int16), np.uint16) if shadow is not None else _NO_SHADOW


def compiled_threads() -> None:
    """The compiled kernels use as many threads as torch does (the updater's CPUs)."""
    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))


def constants(*, lr: float, beta1: float, beta2: float, eps: float, step: int) -> dict:
    """The float32 constants torch's fused kernel computes from the hyperparameters (in double first)."""
    f32 = np.float32
    return dict(w=f32(1 - beta1), b2=f32(beta2), c=f32(1 - beta2), bc2s=f32((1 - beta2 ** step) ** 0.5),
                eps=f32(eps), step_size=f32(lr / (1 - beta1 ** step)))


def _compiled_step_(pieces: list[Piece], *, lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float, step: int, coef: float) -> None:
    k = constants(lr=lr, beta1=beta1, beta2=beta2, eps=eps, step=step)
    decay = np.float32(1 - lr * weight_decay)
    scale = np.float32(1.0 / coef) if coef < 1.0 else np.float32(1.0)  # torch's grad_scale tensor: float32
    with _lock:
        compiled_threads()
        for p, g, m, v, shadow in pieces:
            if p.numel():
                _adamw_kernel(numpy_of(p), numpy_of(g), numpy_of(m), numpy_of(v), numpy_of(p, np.uint32),
                              shadow_of(shadow), decay, k["w"], k["b2"], k["c"], scale, k["bc2s"], k["eps"],
                              k["step_size"])


def step_(pieces: Iterable[Sequence[torch.Tensor | None]], *, lr: float, beta1: float, beta2: float, eps: float,
          weight_decay: float, step: int, coef: float = 1.0, compiled: bool = STEP_COMPILED) -> None:
    """AdamW step `step` over every piece (master, grad, exp_avg, exp_avg_sq, shadow or None), the
    gradient clipped by `coef`, each shadow cast from its new master. compiled, where there is a shadow
    or a clipping to fold in: one pass, the store's gradient left as it was; else torch's fused kernel
    (which writes a clipped gradient back), then the shadows' cast."""
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step, coef=coef)
    pieces = [flat_piece(pc) for pc in pieces]
    if compiled and (coef < 1.0 or any(pc[4] is not None for pc in pieces)):
        _compiled_step_(pieces, **hyper)
        return
    fused_adamw_(*([pc[k] for pc in pieces] for k in range(4)), **hyper)
    cast_shadows_(pieces)
