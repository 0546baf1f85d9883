"""The updater's AdamW over the store's memory: torch's fused kernel, block by block in cache.

A chunk's update streams master, both moments and the gradient from host memory once (28 B/param:
four read, three written). Run block by block, what follows the kernel on the same block finds
it still in cache: the bf16 shadow's cast reads the new master from there (the shadow costs its
2 B/param write, not a second pass over the master), and a clipped update reads the gradient into
a scratch block that the kernel divides in place (torch's kernel writes the clipped gradient back
where it read it: into the store's gradient slot, 4 B/param more traffic, otherwise).

Blocks start at multiples of BLOCK inside each tensor and the kernel is elementwise, so the
result is bit for bit the kernel's on the whole tensor (tests/clipping/test_kernels.py).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

# Elements per block: a block of the four tensors (16 MiB) stays in the last-level cache from the
# kernel to the shadow's cast, and a 100 M-parameter chunk takes about a hundred blocks (each call is
# one parallel region of the updater's threads: smaller blocks would spend the time forking them).
# benchmarks/updater_rates.py measures the rate at other sizes.
BLOCK = 1 << 20

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
    its tensor), grouped so that a batch holds at most `block` elements: small tensors (norms,
    biases) share one kernel call, large ones take one call per block."""
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
    """Each piece's bf16 shadow from its master (just written, in cache): torch's own cast, so the shadow
    is bit for bit master.to(torch.bfloat16)."""
    for p, _, _, _, shadow in batch:
        if shadow is not None:
            shadow.copy_(p)


def step_(pieces: Iterable[Sequence[torch.Tensor | None]], *, lr: float, beta1: float, beta2: float, eps: float,
          weight_decay: float, step: int, coef: float = 1.0, block: int = BLOCK) -> None:
    """AdamW step `step` over every piece (master, grad, exp_avg, exp_avg_sq, shadow or None), block by
    block, the gradient clipped by `coef` (read into scratch: the store's gradient is left as it was),
    then the block's shadow cast while it is in cache."""
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step, coef=coef)
    scratch: torch.Tensor | None = None
    for batch in batches(pieces, block):
        grads = [b[1] for b in batch]
        if coef < 1.0:
            if scratch is None:
                scratch = torch.empty(block, dtype=batch[0][1].dtype, device=batch[0][1].device)
            lo, copies = 0, []
            for g in grads:
                copies.append(scratch[lo:lo + g.numel()].copy_(g))
                lo += g.numel()
            grads = copies
        fused_adamw_([b[0] for b in batch], grads, [b[2] for b in batch], [b[3] for b in batch], **hyper)
        cast_shadows_(batch)
