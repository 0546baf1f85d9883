"""Cross-entropy over the LM head without ever materializing the full [N, V] logits.

Forward and backward both walk the tokens in chunks; backward recomputes each chunk's
logits from the saved hidden states (one extra matmul per chunk) instead of keeping them,
so peak memory is one chunk of fp32 logits, not N x V. Where forward and backward run
together (the engine's loss), `cross_entropy_sum_and_grad` turns each chunk's logits into
their gradient at once and needs no recompute. `norm_head_backward` puts the final
norm in front and walks a long sequence in tiles, so the norm's fp32 intermediates and the
hidden states the cross-entropy keeps are one tile's, not the sequence's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from .. import log as slog
from ..data.targets import IGNORE_INDEX
from . import layers
from .layers import token_slices

_log = slog.get("loss")



def _logits(h: Tensor, weight: Tensor, softcap: float | None, scale: float = 1.0) -> tuple[Tensor, Tensor | None]:
    """fp32 logits of h @ weight.T times `scale` (Cohere's logit_scale, Granite's 1 / logits_scaling), and
    (softcap: Gemma's cap * tanh(logits / cap)) the tanh, for the backward."""
    logits = (h @ weight.T).float()
    if scale != 1.0:
        logits.mul_(scale)
    if softcap is None:
        return logits, None
    tanh = torch.tanh(logits / softcap)
    return tanh * softcap, tanh


def _uncap_(grad: Tensor, tanh: Tensor | None, scale: float = 1.0) -> Tensor:
    """In place: the gradient of the final logits becomes that of h @ weight.T (under the cap and the scale)."""
    if tanh is not None:
        grad.mul_(1 - tanh * tanh)
    return grad if scale == 1.0 else grad.mul_(scale)


class _ChunkedCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int,
                softcap: float | None = None, scale: float = 1.0) -> Tensor:
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in token_slices(n, chunk_tokens):
            lse[s], loss = _chunk_loss(_logits(hidden[s], weight, softcap, scale)[0], targets[s])
            total += loss
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_tokens, ctx.softcap, ctx.scale = chunk_tokens, softcap, scale
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
            logits, tanh = _logits(h, weight, ctx.softcap, ctx.scale)
            g = _uncap_(_logit_grad_(logits, lse[s], targets[s], g_out), tanh, ctx.scale).to(hidden.dtype)
            if need_h:
                grad_h[s] = g @ weight
            if need_w:
                add_matmul_(grad_w, g.T, h)
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None


def _logit_grad_(logits: Tensor, lse: Tensor, targets: Tensor, g_out: Tensor) -> Tensor:
    """In place: fp32 logits [n, V] become d(g_out * sum(lse - logit[target])) / d logits,
    softmax - onehot(target) scaled by g_out (0 on IGNORE_INDEX rows)."""
    logits.sub_(lse[:, None]).exp_()
    logits.scatter_add_(1, targets.clamp(min=0).unsqueeze(1), -torch.ones_like(logits[:, :1]))
    return logits.mul_(torch.where(targets != IGNORE_INDEX, g_out, 0.0).unsqueeze(1))


def _chunk_loss(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """(log-sum-exp per row, sum of the rows' losses) of fp32 logits; IGNORE_INDEX rows add nothing."""
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    return lse, torch.where(targets != IGNORE_INDEX, lse - picked, 0.0).sum()


_OUT_DTYPE_MATMUL = [True]  # torch.addmm(..., out_dtype=) on CUDA; cleared at the first refusal


def add_matmul_(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b, with acc fp32 and a, b perhaps in a lower precision: the products in a's
    dtype, the sum kept in acc's (on CUDA in one GEMM that reads and writes acc in fp32; where
    torch lacks that, each product is rounded to a's dtype before the fp32 add, and a warning says so)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if acc.is_cuda and _OUT_DTYPE_MATMUL[0]:
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError) as e:  # an older torch: no fp32 output for low-precision inputs
            _OUT_DTYPE_MATMUL[0] = False
            _log.warning("torch.addmm(out_dtype=%s) is not available here (%s); gradients accumulated with "
                         "add_matmul_ now round each product to %s first", acc.dtype, str(e).splitlines()[0][:200],
                         a.dtype)
    acc += (a @ b).to(acc.dtype)


@torch.no_grad()  # the logits are rewritten in place: nothing here is for autograd
def cross_entropy_sum_and_grad(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int, scale: float,
                               weight_grad_acc: Tensor, softcap: float | None = None,
                               logit_scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """Forward and backward of the chunked cross-entropy at once, for a caller that needs both now.

    Returns (sum of token losses, fp32 scalar; gradient of scale * that sum with respect to hidden,
    in hidden's dtype) and adds the gradient with respect to weight into weight_grad_acc (fp32
    [V, H]). Each chunk's logits are made once and turned into their gradient in place: no
    recompute, one GEMM fewer per chunk than forward + backward through autograd. softcap: the logits
    are cap * tanh(logits / cap) (Gemma's final_logit_softcapping); logit_scale multiplies the logits
    before it (Cohere's logit_scale, Granite's 1 / logits_scaling).
    """
    grad_h = torch.empty_like(hidden)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    # a fill on the device: torch.tensor(scale, device=...) would copy from the host and wait for the stream
    g_out = torch.full((), scale, dtype=torch.float32, device=hidden.device)
    for s in token_slices(hidden.shape[0], chunk_tokens):
        h, tgt = hidden[s], targets[s]
        logits, tanh = _logits(h, weight, softcap, logit_scale)
        lse, loss = _chunk_loss(logits, tgt)
        total += loss
        g = _uncap_(_logit_grad_(logits, lse, tgt, g_out), tanh, logit_scale).to(hidden.dtype)
        del logits, tanh
        grad_h[s] = g @ weight
        add_matmul_(weight_grad_acc, g.T, h)
    return total, grad_h


def chunked_cross_entropy_sum(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int = 4096,
                              softcap: float | None = None, logit_scale: float = 1.0) -> Tensor:
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
    return _ChunkedCrossEntropySum.apply(hidden, weight, targets.long(), int(chunk_tokens), softcap, logit_scale)


def norm_head_backward(x: Tensor, targets: Tensor, norm: Callable[[Tensor, Mapping[str, Tensor]], Tensor],
                       norm_p: Mapping[str, Tensor], head_w: Tensor, scale: float, tile_tokens: int, chunk_tokens: int,
                       norm_acc: Mapping[str, Tensor], head_acc: Tensor, softcap: float | None = None,
                       logit_scale: float = 1.0) -> Tensor:
    """Final norm + chunked cross-entropy of x [..., H] against targets [...], with its backward.

    norm(x, norm_p) is the family's final norm over its tensors norm_p (name -> tensor). tile_tokens > 0:
    over the flattened tokens, that many at a time (0: all at once). Returns the sum of token losses (fp32
    scalar, no graph). x is overwritten with the gradient of scale * loss (a tile's input is dead once its
    gradient exists); the weights' gradients are added into norm_acc (name -> fp32 tensor) and head_acc
    [V, H] (the head's straight from each chunk's GEMM, in head_acc's precision). softcap, logit_scale:
    see cross_entropy_sum_and_grad.
    """
    names = list(norm_p)
    leaves = {n: norm_p[n].detach().requires_grad_(True) for n in names}
    head_w = head_w.detach()
    h = x.shape[-1]
    if tile_tokens <= 0:
        pieces = [(x, targets)]
    else:
        flat, flat_targets = x.view(-1, h), targets.reshape(-1)
        pieces = [(flat[s], flat_targets[s]) for s in token_slices(flat.shape[0], tile_tokens)]
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    for xs, ts in pieces:
        xt = xs.detach().requires_grad_(True)
        normed = norm(xt, leaves).reshape(-1, h)
        loss, grad_normed = cross_entropy_sum_and_grad(normed.detach(), head_w, ts.reshape(-1).long(), chunk_tokens,
                                                       scale, head_acc, softcap, logit_scale)
        got = torch.autograd.grad(normed, [xt] + [leaves[n] for n in names], grad_normed)
        xs.copy_(got[0])
        total += loss
        for n, g in zip(names, got[1:]):
            norm_acc[n].add_(g)
    return total


def rms_norm_of(eps: float) -> Callable[[Tensor, Mapping[str, Tensor]], Tensor]:
    """The native families' final norm as norm_head_backward takes it (looked up at call: compile_kernels
    swaps layers.rms_norm)."""
    return lambda x, p: layers.rms_norm(x, p["weight"], eps)
