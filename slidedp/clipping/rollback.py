"""Undo one fused AdamW step from the gradient it used, and redo it clipped.

A speculative update overwrote master and both moments; keeping a copy of them would cost
12 B/param. The gradient is kept anyway (4 B/param, until the verdict), and with it the step
inverts algebraically, with t the AdamW step count the update used:

    p_t = p' + lr / (1 - beta1^t) * m_t / (sqrt(v_t) / sqrt(1 - beta2^t) + eps)  then / (1 - lr * wd)
    m_{t-1} = (m_t - (1 - beta1) g) / beta1
    v_{t-1} = max(0, (v_t - (1 - beta2) g^2) / beta2)

What it costs is float32 rounding of the speculative values: each restored element is within
a few ulp of the speculative master/moment it came from (tests/clipping measures it). A chunk's
first step (t = 1) restores its moments exactly: they were zero. The redo is then the same fused
kernel the deferred updates run (gradient divided by 1/coef). Both run block by block, so the
pair touches the chunk's memory about once: a correction costs about one AdamW of the chunk.
"""

from __future__ import annotations

import torch

# Elements per pass: the four tensors' blocks (16 MiB) stay in the last-level cache between the undo and
# the redo, and a 100 M-parameter chunk takes about a hundred passes (each op of a pass is one parallel
# region of the updater's threads: smaller blocks would spend the time forking them).
BLOCK = 1 << 20


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


def settle_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
            lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
            coef: float | None) -> None:
    """Correct a speculative (unclipped) AdamW step `step` in place: redo it with the gradient clipped by
    `coef`, or, with coef None (the step is skipped), only undo it. Block by block (see BLOCK)."""
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)
    flat = [t.view(-1) for t in (param, grad, exp_avg, exp_avg_sq)]
    n = flat[0].numel()
    scratch = torch.empty(min(n, BLOCK), dtype=param.dtype, device=param.device)
    for lo in range(0, n, BLOCK):
        p, g, m, v = (t[lo:lo + BLOCK] for t in flat)
        undo_adamw_(p, g, m, v, scratch=scratch, **hyper)
        if coef is not None:
            fused_adamw_([p], [g], [m], [v], coef=coef, **hyper)
