"""Sequence tiling of the MLP half and of the final norm + head against the untiled autograd path (fp32)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slidedp.model.loss import chunked_cross_entropy_sum, norm_head_backward, rms_norm_of
from slidedp.model import layers
from slidedp.model.config import NAMED_SHAPES, ModelConfig
from slidedp.model.init import init_params

from .test_layers import rel_err

SHAPES = {
    "qk_norm": NAMED_SHAPES["tiny"],  # Qwen3
    "attention_bias": dataclasses.replace(NAMED_SHAPES["tiny-llama"], family="qwen2", attention_bias=True),
}
B, T = 2, 37
TILES = [8, 37, 200]  # 8 divides neither T nor B * T; 37 is one sequence; 200 covers everything


def layer_inputs(cfg: ModelConfig):
    """Layer 1's parameters with norms and biases moved off their trivial 1 and 0, an input and an upstream gradient."""
    gen = torch.Generator().manual_seed(0)
    p = layers.layer_params(init_params(cfg, seed=3), 1)
    for t in p.values():
        if t.dim() == 1:
            t.add_(0.2 * torch.randn(t.shape, generator=gen))
    x = torch.randn(B, T, cfg.hidden_size, generator=gen)
    grad_y = torch.randn(B, T, cfg.hidden_size, generator=gen)
    return p, x, grad_y, layers.causal_attention(cfg, B, T, "cpu")


def reference_backward(cfg, p, x, rope, grad_y):
    x = x.clone().requires_grad_(True)
    leaves = {k: v.clone().requires_grad_(True) for k, v in p.items()}
    layers.decoder_layer(cfg, leaves, x, rope).backward(grad_y)
    return x.grad, {k: v.grad for k, v in leaves.items()}


def tiled_backward(cfg, p, x, rope, grad_y, tile):
    acc = {k: torch.zeros_like(v) for k, v in p.items()}
    gx = layers.layer_backward(cfg, p, x, rope, grad_y.clone(), tile, acc)
    return gx, acc


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tile", TILES)
def test_tiled_forward_matches_decoder_layer(shape, tile):
    cfg = SHAPES[shape]
    p, x, _, rope = layer_inputs(cfg)
    with torch.no_grad():
        ref = layers.decoder_layer(cfg, p, x, rope)
        out = layers.layer_forward(cfg, p, x.clone(), rope, tile)
        assert torch.equal(layers.layer_forward(cfg, p, x, rope, 0), ref)
    assert rel_err(out, ref) < 1e-6


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tile", TILES)
def test_tiled_backward_matches_autograd(shape, tile):
    cfg = SHAPES[shape]
    p, x, grad_y, rope = layer_inputs(cfg)
    ref_gx, ref_gp = reference_backward(cfg, p, x, rope, grad_y)
    gx, gp = tiled_backward(cfg, p, x, rope, grad_y, tile)
    assert rel_err(gx, ref_gx) < 1e-5
    assert sorted(gp) == sorted(ref_gp)
    for name in gp:
        assert rel_err(gp[name], ref_gp[name]) < 1e-5, name


@pytest.mark.parametrize("shape", SHAPES)
def test_untiled_backward_is_plain_autograd(shape):
    cfg = SHAPES[shape]
    p, x, grad_y, rope = layer_inputs(cfg)
    ref_gx, ref_gp = reference_backward(cfg, p, x, rope, grad_y)
    gx, gp = tiled_backward(cfg, p, x, rope, grad_y, 0)
    assert torch.equal(gx, ref_gx)
    assert all(torch.equal(gp[n], ref_gp[n]) for n in gp)


def test_tiled_backward_accumulates_across_calls():
    """Two micro-batches into one accumulator give the sum of their gradients."""
    cfg = SHAPES["qk_norm"]
    p, x, grad_y, rope = layer_inputs(cfg)
    acc = {k: torch.zeros_like(v) for k, v in p.items()}
    for xi, gi in ((x, grad_y), (x.flip(1), grad_y.flip(1))):
        layers.layer_backward(cfg, p, xi, rope, gi.clone(), 8, acc)
    ref_a, ref_b = reference_backward(cfg, p, x, rope, grad_y)[1], reference_backward(cfg, p, x.flip(1), rope, grad_y.flip(1))[1]
    for name in acc:
        assert rel_err(acc[name], ref_a[name] + ref_b[name]) < 1e-5, name


def head_inputs(cfg: ModelConfig):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, cfg.hidden_size, generator=gen)
    norm_w = 1.0 + 0.2 * torch.randn(cfg.hidden_size, generator=gen)
    head_w = 0.1 * torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    targets[0, :5] = -100  # ignored tokens straddle a tile boundary
    return x, norm_w, head_w, targets


@pytest.mark.parametrize("tile", [0] + TILES)
def test_tiled_norm_head_matches_autograd(tile):
    cfg = SHAPES["qk_norm"]
    x, norm_w, head_w, targets = head_inputs(cfg)
    scale = 1.0 / targets.numel()
    xr, nr, hr = (t.clone().requires_grad_(True) for t in (x, norm_w, head_w))
    ref_loss = chunked_cross_entropy_sum(layers.final_norm(cfg, nr, xr).reshape(-1, cfg.hidden_size), hr,
                                         targets.reshape(-1), 16)
    (ref_loss * scale).backward()
    g, norm_acc, head_acc = x.clone(), torch.zeros_like(norm_w), torch.zeros_like(head_w)
    loss = norm_head_backward(g, targets, rms_norm_of(cfg.rms_norm_eps), {"weight": norm_w}, head_w, scale, tile, 16,
                              {"weight": norm_acc}, head_acc)
    assert abs(loss.item() - ref_loss.item()) < 1e-6 * ref_loss.item()
    assert rel_err(g, xr.grad) < 1e-5  # the input's storage now holds its gradient
    assert rel_err(norm_acc, nr.grad) < 1e-5
    assert rel_err(head_acc, hr.grad) < 1e-5
