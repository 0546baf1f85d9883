"""Cross-entropy over the LM head without ever materializing the full [N, V] logits.

Forward and backward both walk the tokens in chunks; backward recomputes each chunk's
logits from the saved hidden states (one extra matmul per chunk) instead of keeping them,
so peak memory is one chunk of fp32 logits, not N x V. `norm_head_backward` puts the final
norm in front and walks a long sequence in tiles, so the norm's fp32 intermediates and the
hidden states the cross-entropy keeps are one tile's, not the sequence's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .model.layers import rms_norm, token_slices

IGNORE_INDEX = -100  # targets equal to this contribute no loss and no gradient (as in F.cross_entropy)


class _ChunkedCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int) -> Tensor:
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in token_slices(n, chunk_tokens):
            logits = (hidden[s] @ weight.T).float()
            lse[s] = torch.logsumexp(logits, dim=-1)
            tgt = targets[s]
            valid = tgt != IGNORE_INDEX
            picked = logits.gather(1, tgt.clamp(min=0).unsqueeze(1)).squeeze(1)
            total += torch.where(valid, lse[s] - picked, 0.0).sum()
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_tokens = chunk_tokens
        return total

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        hidden, weight, targets, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        g_out = grad_out.float()
        for s in token_slices(hidden.shape[0], ctx.chunk_tokens):
            h = hidden[s]
            tgt = targets[s]
            valid = tgt != IGNORE_INDEX
            # d(lse - logit[t]) / d logits = softmax - onehot(t), scaled by the upstream grad
            g = torch.exp((h @ weight.T).float() - lse[s, None])
            g.scatter_add_(1, tgt.clamp(min=0).unsqueeze(1), -torch.ones_like(g[:, :1]))
            g *= torch.where(valid, g_out, 0.0).unsqueeze(1)
            g = g.to(hidden.dtype)
            if need_h:
                grad_h[s] = g @ weight
            if need_w:
                if g.dtype == torch.float32:
                    grad_w.addmm_(g.T, h)
                else:  # matmul in the compute dtype, accumulation across chunks in fp32
                    grad_w += (g.T @ h).float()
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None


def chunked_cross_entropy_sum(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int = 4096) -> Tensor:
    """Sum (not mean) of token cross-entropies of `hidden @ weight.T` against `targets`, an fp32 scalar.

    hidden [N, H], weight [V, H] (same dtype), targets [N] int64 (IGNORE_INDEX = -100 skipped).
    Logits are computed chunk_tokens rows at a time (matmul in the inputs' dtype, softmax in fp32).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"chunked_cross_entropy_sum: hidden {tuple(hidden.shape)} and weight "
                         f"{tuple(weight.shape)} must be [N, H] and [V, H]")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"chunked_cross_entropy_sum: targets {tuple(targets.shape)} must be [{hidden.shape[0]}]")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"chunked_cross_entropy_sum: hidden is {hidden.dtype} but weight is {weight.dtype}")
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    return _ChunkedCrossEntropySum.apply(hidden, weight, targets.long(), int(chunk_tokens))


def norm_head_backward(x: Tensor, targets: Tensor, norm_w: Tensor, head_w: Tensor, eps: float, scale: float,
                       tile_tokens: int, chunk_tokens: int, norm_acc: Tensor, head_acc: Tensor) -> Tensor:
    """Final RMSNorm + chunked cross-entropy of x [..., H] against targets [...], with its backward.

    tile_tokens > 0: over the flattened tokens, that many at a time (0: all at once). Returns the sum
    of token losses (fp32 scalar, no graph). x is overwritten with the gradient of scale * loss (a
    tile's input is dead once its gradient exists); the weights' gradients are added into norm_acc
    [H] and head_acc [V, H].
    """
    norm_w, head_w = norm_w.detach().requires_grad_(True), head_w.detach().requires_grad_(True)
    h = x.shape[-1]
    if tile_tokens <= 0:
        pieces = [(x, targets)]
    else:
        flat, flat_targets = x.view(-1, h), targets.reshape(-1)
        pieces = [(flat[s], flat_targets[s]) for s in token_slices(flat.shape[0], tile_tokens)]
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    for xs, ts in pieces:
        xt = xs.detach().requires_grad_(True)
        loss = chunked_cross_entropy_sum(rms_norm(xt, norm_w, eps).reshape(-1, h), head_w, ts.reshape(-1), chunk_tokens)
        gx, gn, gh = torch.autograd.grad(loss * scale, [xt, norm_w, head_w])
        xs.copy_(gx)
        total += loss.detach()
        norm_acc += gn
        head_acc += gh
    return total
