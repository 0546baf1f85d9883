"""Chunked cross-entropy against plain F.cross_entropy: value and both gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slidedp.model.loss import add_matmul_, chunked_cross_entropy_sum, cross_entropy_sum_and_grad
from slidedp.data.targets import IGNORE_INDEX


def _inputs(n: int = 37, h: int = 16, v: int = 50, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_(True)
    weight = (0.5 * torch.randn(v, h, generator=g)).to(dtype).requires_grad_(True)
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


def _reference(hidden, weight, targets, grad_scale: float = 1.0):
    h = hidden.detach().float().requires_grad_(True)
    w = weight.detach().float().requires_grad_(True)
    loss = F.cross_entropy(h @ w.T, targets, reduction="sum")
    (loss * grad_scale).backward()
    return loss.detach(), h.grad, w.grad


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("chunk", [1, 5, 8, 37, 4096])  # 5 and 8 do not divide 37
def test_matches_cross_entropy_fp32(chunk):
    hidden, weight, targets = _inputs()
    ref_loss, ref_gh, ref_gw = _reference(hidden, weight, targets, grad_scale=0.75)
    loss = chunked_cross_entropy_sum(hidden, weight, targets, chunk_tokens=chunk)
    assert loss.dtype == torch.float32 and loss.shape == ()
    (loss * 0.75).backward()  # a non-unit upstream gradient
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32
    assert _rel(hidden.grad, ref_gh) < 1e-6
    assert _rel(weight.grad, ref_gw) < 1e-6


def test_ignore_index_matches_cross_entropy():
    hidden, weight, targets = _inputs()
    targets[::3] = -100
    ref_loss, ref_gh, ref_gw = _reference(hidden, weight, targets)
    loss = chunked_cross_entropy_sum(hidden, weight, targets, chunk_tokens=6)
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
    assert hidden.grad[::3].eq(0).all()
    assert _rel(hidden.grad, ref_gh) < 1e-6 and _rel(weight.grad, ref_gw) < 1e-6


def test_only_one_input_needs_grad():
    hidden, weight, targets = _inputs()
    _, ref_gh, _ = _reference(hidden, weight, targets)
    chunked_cross_entropy_sum(hidden, weight.detach(), targets, chunk_tokens=7).backward()
    assert _rel(hidden.grad, ref_gh) < 1e-6


def test_bf16_inputs_give_bf16_grads_close_to_fp32():
    hidden, weight, targets = _inputs(dtype=torch.bfloat16)
    ref_loss, ref_gh, ref_gw = _reference(hidden, weight, targets)
    loss = chunked_cross_entropy_sum(hidden, weight, targets, chunk_tokens=8)
    loss.backward()
    assert loss.dtype == torch.float32
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    assert abs(loss.item() - ref_loss.item()) < 2e-2 * abs(ref_loss.item())
    assert _rel(hidden.grad, ref_gh) < 3e-2 and _rel(weight.grad, ref_gw) < 3e-2


def test_never_builds_full_logits():
    # record the shape of every tensor any aten op produces, forward and backward
    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.seen.append(tuple(t.shape))
            return out

    hidden, weight, targets = _inputs(n=64, v=50)
    with Shapes():
        chunked_cross_entropy_sum(hidden, weight, targets, chunk_tokens=16).backward()
    assert (16, 50) in Shapes.seen  # chunk logits exist ...
    assert max(a * b for a, b in (s for s in Shapes.seen if len(s) == 2)) < 64 * 50  # ... the full ones never


def test_bad_inputs():
    hidden, weight, targets = _inputs()
    with pytest.raises(ValueError, match=r"hidden is torch.float32 but weight is torch.bfloat16"):
        chunked_cross_entropy_sum(hidden, weight.bfloat16(), targets)
    with pytest.raises(ValueError, match=r"targets \(36,\) must be \[37\]"):
        chunked_cross_entropy_sum(hidden, weight, targets[1:])
    with pytest.raises(ValueError, match="chunk_tokens must be positive, got 0"):
        chunked_cross_entropy_sum(hidden, weight, targets, chunk_tokens=0)


@pytest.mark.parametrize("chunk", [5, 37])
def test_forward_and_backward_at_once_matches_cross_entropy(chunk):
    """cross_entropy_sum_and_grad: the loss, the hidden gradient of scale * loss, and the weight
    gradient added onto what the accumulator already held, with ignored targets skipped."""
    hidden, weight, targets = _inputs()
    targets[3] = targets[20] = IGNORE_INDEX
    keep = targets != IGNORE_INDEX
    h = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)
    ref_loss = F.cross_entropy(h[keep] @ w.T, targets[keep], reduction="sum")
    (ref_loss * 0.25).backward()
    acc = torch.full(weight.shape, 0.5)
    loss, grad_h = cross_entropy_sum_and_grad(hidden.detach(), weight.detach(), targets, chunk, 0.25, acc)
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
    assert _rel(grad_h, h.grad) < 1e-6
    assert grad_h[3].abs().max() == 0
    assert _rel(acc - 0.5, w.grad) < 1e-6
    # inputs that require grad are fine: nothing here builds a graph (the logits are rewritten in place)
    again, _ = cross_entropy_sum_and_grad(hidden, weight, targets, chunk, 0.25, torch.zeros(weight.shape))
    assert not again.requires_grad and again.item() == loss.item()


def test_forward_and_backward_at_once_in_bf16_keeps_the_weight_gradient_in_fp32():
    hidden, weight, targets = _inputs(n=64, h=32, v=80, dtype=torch.bfloat16)
    _, ref_gh, ref_gw = _reference(hidden, weight, targets, grad_scale=1.0 / 64)
    acc = torch.zeros(weight.shape, dtype=torch.float32)
    _, grad_h = cross_entropy_sum_and_grad(hidden.detach(), weight.detach(), targets, 16, 1.0 / 64, acc)
    assert grad_h.dtype == torch.bfloat16 and acc.dtype == torch.float32
    assert _rel(grad_h, ref_gh) < 2e-2 and _rel(acc, ref_gw) < 2e-2


def test_add_matmul_accumulates_low_precision_products_in_fp32():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 32, generator=g), torch.randn(32, 4, generator=g)
    acc = torch.ones(8, 4)
    add_matmul_(acc, a.bfloat16(), b.bfloat16())
    assert acc.dtype == torch.float32
    assert _rel(acc, 1 + a.bfloat16().float() @ b.bfloat16().float()) < 1e-2
    acc32 = torch.ones(8, 4)
    add_matmul_(acc32, a, b)
    assert torch.allclose(acc32, 1 + a @ b, rtol=1e-6, atol=1e-6)
