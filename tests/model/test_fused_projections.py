"""Fused projections: one GEMM over q/k/v and over gate/up where a flat chunk keeps them adjacent."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch._dynamo

from slidedp.store.layout import unit_tensors, units_of
from slidedp.model import layers
from slidedp.model.config import NAMED_SHAPES
from slidedp.model.init import init_params
from slidedp.store.layout import make_layout

from .test_layers import rel_err

QWEN3 = NAMED_SHAPES["tiny"]
QWEN2 = dataclasses.replace(NAMED_SHAPES["tiny-llama"], family="qwen2", attention_bias=True)


def flat_layer(cfg, layer: int = 1):
    """Layer `layer`'s tensors as views of one flat buffer laid out as the store lays out its chunk."""
    layout = make_layout(cfg)
    unit = units_of(layout)[f"layer.{layer}"]
    flat = torch.zeros(unit.numel)
    views = unit_tensors(flat, unit, strip=f"model.layers.{layer}.")
    gen = torch.Generator().manual_seed(0)
    for name, t in layers.layer_params(init_params(cfg, seed=3), layer).items():
        views[name].copy_(t + (0.2 * torch.randn(t.shape, generator=gen) if t.dim() == 1 else 0))
    return flat, unit, views


def test_qwen3_chunk_fuses_qkv_and_gate_up_as_views_of_the_chunk():
    flat, _, views = flat_layer(QWEN3)
    fused = layers.fuse_projections(views)
    d, nh, nkv, h = QWEN3.head_dim, QWEN3.num_heads, QWEN3.num_kv_heads, QWEN3.hidden_size
    assert fused[layers.QKV].shape == ((nh + 2 * nkv) * d, h)
    assert fused[layers.GATE_UP].shape == (2 * QWEN3.intermediate_size, h)
    assert not any(n in fused for n in ("self_attn.q_proj.weight", "mlp.up_proj.weight"))
    # views, not copies: rows of the fused matrix are the original tensors' rows
    assert fused[layers.QKV].data_ptr() == views["self_attn.q_proj.weight"].data_ptr()
    assert torch.equal(fused[layers.QKV][nh * d:(nh + nkv) * d], views["self_attn.k_proj.weight"])
    assert torch.equal(fused[layers.GATE_UP][QWEN3.intermediate_size:], views["mlp.up_proj.weight"])


def test_separate_or_biased_tensors_stay_unfused():
    _, _, views = flat_layer(QWEN2)  # biases sit between q, k and v: only gate/up fuse
    fused = layers.fuse_projections(views)
    assert layers.QKV not in fused and "self_attn.q_proj.weight" in fused
    assert layers.GATE_UP in fused
    separate = layers.layer_params(init_params(QWEN3, seed=3), 1)  # each its own storage
    assert layers.fuse_projections(separate).keys() == separate.keys()
    # q, k, v back to back with their biases kept elsewhere: the fused GEMM would drop the biases
    d, h = QWEN2.head_dim, QWEN2.hidden_size
    rows = (QWEN2.num_heads * d, QWEN2.num_kv_heads * d, QWEN2.num_kv_heads * d)
    flat = torch.zeros(sum(rows) * h)
    weights = dict(zip(("q", "k", "v"), flat.split([r * h for r in rows])))
    p = {f"self_attn.{n}_proj.weight": w.view(r, h) for (n, w), r in zip(weights.items(), rows)}
    assert layers.QKV in layers.fuse_projections(p)  # adjacent, no biases: fused
    p.update({f"self_attn.{n}_proj.bias": torch.zeros(r) for n, r in zip("qkv", rows)})
    assert layers.QKV not in layers.fuse_projections(p)


@pytest.mark.parametrize("cfg", [QWEN3, QWEN2], ids=["qwen3", "qwen2-bias"])
@pytest.mark.parametrize("tile", [0, 8])
def test_fused_layer_equals_the_unfused_layer_forward_and_backward(cfg, tile):
    flat, unit, views = flat_layer(cfg)
    gen = torch.Generator().manual_seed(1)
    b, t = 2, 19
    x = torch.randn(b, t, cfg.hidden_size, generator=gen)
    grad_y = torch.randn(b, t, cfg.hidden_size, generator=gen)
    rope = layers.causal_attention(cfg, b, t, "cpu")
    with torch.no_grad():
        ref_y = layers.layer_forward(cfg, views, x.clone(), rope, tile)
        got_y = layers.layer_forward(cfg, layers.fuse_projections(views), x.clone(), rope, tile)
    assert rel_err(got_y, ref_y) < 1e-6

    def backward(fuse: bool):
        acc_flat = torch.zeros_like(flat)
        acc = unit_tensors(acc_flat, unit, strip="model.layers.1.")
        p = layers.fuse_projections(views) if fuse else views
        a = layers.fuse_projections(acc) if fuse else acc
        gx = layers.layer_backward(cfg, p, x, rope, grad_y.clone(), tile, a)
        return gx, acc_flat

    ref_gx, ref_acc = backward(False)
    got_gx, got_acc = backward(True)
    assert ref_acc.abs().sum() > 0
    assert rel_err(got_gx, ref_gx) < 1e-6
    assert rel_err(got_acc, ref_acc) < 1e-6  # the fused gradient lands in the unfused tensors' places


def test_compiled_kernels_give_the_eager_layer(monkeypatch):
    """compile_kernels swaps the pointwise pieces for torch.compile'd ones (here through the
    aot_eager backend, which needs no C compiler): same forward and gradients; off restores them."""
    flat, unit, views = flat_layer(QWEN3)
    p = layers.fuse_projections(views)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 11, QWEN3.hidden_size, generator=gen)
    gy = torch.randn(2, 11, QWEN3.hidden_size, generator=gen)
    rope = layers.causal_attention(QWEN3, 2, 11, "cpu")

    def run():
        acc_flat = torch.zeros_like(flat)
        acc = layers.fuse_projections(unit_tensors(acc_flat, unit, strip="model.layers.1."))
        with torch.no_grad():
            y = layers.layer_forward(QWEN3, p, x.clone(), rope, 0)
        return y, layers.layer_backward(QWEN3, p, x, rope, gy.clone(), 0, acc), acc_flat

    eager = run()
    eager_norm = layers.rms_norm
    before = (torch._dynamo.config.cache_size_limit, torch._dynamo.config.suppress_errors)
    try:
        layers.compile_kernels(backend="aot_eager")
        assert layers.rms_norm is not eager_norm and torch._dynamo.config.cache_size_limit >= 64
        compiled = run()
    finally:
        layers.compile_kernels(False)
    assert layers.rms_norm is eager_norm
    assert (torch._dynamo.config.cache_size_limit, torch._dynamo.config.suppress_errors) == before
    for got, ref in zip(compiled, eager):
        assert rel_err(got, ref) < 1e-6


def test_compile_setting():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert layers.compiled_kernels_wanted("auto", cuda) and not layers.compiled_kernels_wanted("auto", cpu)
    assert layers.compiled_kernels_wanted("on", cpu) and not layers.compiled_kernels_wanted("off", cuda)
