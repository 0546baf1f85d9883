"""The decoder family as pure functions over handed-in parameters.

No module owns weights: a streaming engine holds one layer's tensors at a time and calls
`decoder_layer` with them, so autograd sees plain tensors and the caller decides where they
live. Every op follows Hugging Face's order (RMSNorm in fp32 then cast back, rope tables
computed in fp32 then cast), so fp32 results match `transformers` to rounding.

Long sequences: `layer_forward` and `layer_backward` run the post-attention norm + MLP (whose
intermediate is several times the hidden width) over tiles of `tile_tokens` tokens, so one
tile's MLP activations are live at a time, never the whole sequence's. Attention stays whole:
SDPA needs every key and value of the sequence.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from slidedp.model.attention import Attention, plain_rows
from slidedp.model.config import ModelConfig


# Fused projection names: one [rows, hidden] matrix over neighbouring weights (fuse_projections).
QKV = "self_attn.qkv_proj.weight"
GATE_UP = "mlp.gate_up_proj.weight"
_FUSIONS = ((QKV, ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
            (GATE_UP, ("mlp.gate_proj.weight", "mlp.up_proj.weight")))


def _adjacent_rows(ts: list[Tensor]) -> Tensor | None:
    """One [sum of rows, cols] view over 2-D tensors that lie back to back in one buffer, else None."""
    first = ts[0]
    offset = first.storage_offset()
    for t in ts:
        if (t.dim() != 2 or not t.is_contiguous() or t.shape[1] != first.shape[1] or t.dtype != first.dtype
                or t.device != first.device or t.storage_offset() != offset
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in ts)
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1), first.storage_offset())


def fuse_projections(p: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """p with q/k/v (and gate/up) replaced by one view each where they lie back to back in one buffer.

    A streamed layer's tensors are views of one flat chunk whose layout keeps q, k, v and gate, up
    adjacent (no biases between them), so one GEMM replaces three (two) at no copy; the gradient
    of the fused view lands in the same places of a gradient buffer of the same layout. Where the
    tensors are not adjacent (biases between them, separate tensors), or have biases at all, they
    stay as they are.
    """
    out = dict(p)
    for fused, names in _FUSIONS:
        if any(n.replace(".weight", ".bias") in out for n in names):
            continue  # the fused GEMM has no bias
        if all(n in out for n in names):
            view = _adjacent_rows([out[n] for n in names])
            if view is not None:
                for n in names:
                    del out[n]
                out[fused] = view
    return out


def _inv_freq(cfg: ModelConfig) -> Tensor:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    scaling = dict(cfg.rope_scaling)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: llama3")
    # Llama 3.1: stretch low frequencies by `factor`, keep high ones, interpolate between.
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling.get("original_max_position_embeddings", cfg.max_position_embeddings))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(cfg: ModelConfig, seq_len: int, device, dtype=torch.float32) -> tuple[Tensor, Tensor]:
    """cos, sin of shape [seq_len, head_dim] for positions 0..seq_len-1 (computed in fp32, then cast)."""
    inv_freq = _inv_freq(cfg).to(device)
    pos = torch.arange(seq_len, device=device, dtype=torch.float)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def causal_attention(cfg: ModelConfig, rows: int, seq_len: int, device, dtype=torch.float32) -> Attention:
    """The attention of plain rows (one sequence each, positions 0..seq_len-1), for one-off calls."""
    return plain_rows(rope_tables(cfg, seq_len, device, dtype), rows, seq_len)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def embed(weight: Tensor, ids: Tensor) -> Tensor:
    return F.embedding(ids, weight)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + _rotate_half(x) * sin


def _attention(cfg: ModelConfig, p: Mapping[str, Tensor], h: Tensor, attn: Attention) -> Tensor:
    b, t, _ = h.shape
    nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def proj(name: str, heads: int) -> Tensor:
        bias = p[f"self_attn.{name}.bias"] if cfg.attention_bias else None
        return F.linear(h, p[f"self_attn.{name}.weight"], bias).view(b, t, heads, d)

    if QKV in p:  # one GEMM for the three projections (see fuse_projections)
        q, k, v = F.linear(h, p[QKV]).split((nh * d, nkv * d, nkv * d), dim=-1)
        q, k, v = q.view(b, t, nh, d), k.view(b, t, nkv, d), v.view(b, t, nkv, d)
    else:
        q, k, v = proj("q_proj", nh), proj("k_proj", nkv), proj("v_proj", nkv)
    if cfg.qk_norm:  # Qwen3: per-head RMSNorm before rope
        q = rms_norm(q, p["self_attn.q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, p["self_attn.k_norm.weight"], cfg.rms_norm_eps)
    q, k = _apply_rope(q, attn.cos, attn.sin), _apply_rope(k, attn.cos, attn.sin)
    return F.linear(attn(q, k, v), p["self_attn.o_proj.weight"])


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def _mlp(p: Mapping[str, Tensor], h: Tensor) -> Tensor:
    if GATE_UP in p:
        gate, up = F.linear(h, p[GATE_UP]).chunk(2, dim=-1)
    else:
        gate = F.linear(h, p["mlp.gate_proj.weight"])
        up = F.linear(h, p["mlp.up_proj.weight"])
    return F.linear(silu_mul(gate, up), p["mlp.down_proj.weight"])


def attention_half(cfg: ModelConfig, p: Mapping[str, Tensor], x: Tensor, attn: Attention) -> Tensor:
    """x + attention(norm(x)): the first residual block of a decoder layer."""
    return x + _attention(cfg, p, rms_norm(x, p["input_layernorm.weight"], cfg.rms_norm_eps), attn)


def mlp_half(cfg: ModelConfig, p: Mapping[str, Tensor], x: Tensor) -> Tensor:
    """x + mlp(norm(x)): the second residual block, token by token independent (so it can be tiled)."""
    return x + _mlp(p, rms_norm(x, p["post_attention_layernorm.weight"], cfg.rms_norm_eps))


MLP_HALF_PARAMS = ("post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", GATE_UP,
                   "mlp.down_proj.weight")


def decoder_layer(cfg: ModelConfig, p: Mapping[str, Tensor], x: Tensor, attn: Attention) -> Tensor:
    """One pre-norm decoder layer. x [B, T, H]; p keyed by local names, on x's device and dtype."""
    return mlp_half(cfg, p, attention_half(cfg, p, x, attn))


def token_slices(n: int, size: int) -> Iterator[slice]:
    """[0, n) in consecutive slices of `size` (the last one short): tiles, loss chunks."""
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


def layer_forward(cfg: ModelConfig, p: Mapping[str, Tensor], x: Tensor, attn: Attention,
                  tile_tokens: int) -> Tensor:
    """`decoder_layer` without autograd (call under torch.no_grad), the MLP half `tile_tokens` tokens
    at a time (0: the whole input at once). Tiles run over the flattened [B * T] tokens."""
    if tile_tokens <= 0:
        return decoder_layer(cfg, p, x, attn)
    y = attention_half(cfg, p, x, attn)
    flat = y.view(-1, y.shape[-1])
    w = p["post_attention_layernorm.weight"]
    for s in token_slices(flat.shape[0], tile_tokens):  # in place: the residual stream becomes the output
        flat[s] += _mlp(p, rms_norm(flat[s], w, cfg.rms_norm_eps))
    return y


def _add_into(grad_acc: Mapping[str, Tensor], names: list[str], grads: tuple[Tensor, ...]) -> None:
    for name, g in zip(names, grads):
        grad_acc[name].add_(g)


def layer_backward(cfg: ModelConfig, p: Mapping[str, Tensor], x: Tensor, attn: Attention,
                   grad_y: Tensor, tile_tokens: int, grad_acc: Mapping[str, Tensor]) -> Tensor:
    """Recompute one layer from its input x and backpropagate grad_y; returns the gradient of x.

    Parameter gradients are added into grad_acc (name -> a tensor of the parameter's shape, fp32 in
    the engine), once per MLP tile, so tiles sum in grad_acc's precision. tile_tokens > 0: attention
    is recomputed at full length with autograd, while the MLP half is recomputed and backpropagated
    tile by tile (one tile's MLP activations live at a time). grad_y is consumed: its storage may
    be reused for the gradient at the attention half's output.
    """
    x = x.detach().requires_grad_(True)
    p = {k: v.detach().requires_grad_(True) for k, v in p.items()}
    if tile_tokens <= 0:
        names = list(p)
        got = torch.autograd.grad(decoder_layer(cfg, p, x, attn), [x] + [p[n] for n in names], grad_y)
        _add_into(grad_acc, names, got[1:])
        return got[0]
    mid = attention_half(cfg, p, x, attn)  # the attention graph stays alive through the MLP tiles
    grad_mid = grad_y.contiguous()
    _mlp_backward_tiled(cfg, p, mid.detach(), grad_mid, tile_tokens, grad_acc)
    names = [n for n in p if n not in MLP_HALF_PARAMS]
    got = torch.autograd.grad(mid, [x] + [p[n] for n in names], grad_mid)
    _add_into(grad_acc, names, got[1:])
    return got[0]


def _mlp_backward_tiled(cfg: ModelConfig, p: Mapping[str, Tensor], mid: Tensor, grad: Tensor, tile_tokens: int,
                        grad_acc: Mapping[str, Tensor]) -> None:
    """Turn grad (of the layer output, in place) into the gradient of mid, the MLP half's input."""
    names = [n for n in MLP_HALF_PARAMS if n in p]
    leaves = [p[n] for n in names]
    h = mid.shape[-1]
    mid_flat, grad_flat = mid.view(-1, h), grad.view(-1, h)
    for s in token_slices(mid_flat.shape[0], tile_tokens):
        xt = mid_flat[s].detach().requires_grad_(True)
        got = torch.autograd.grad(mlp_half(cfg, p, xt), [xt] + leaves, grad_flat[s])
        grad_flat[s] = got[0]  # the tile's upstream gradient is used up: reuse its storage
        _add_into(grad_acc, names, got[1:])


def final_norm(cfg: ModelConfig, weight: Tensor, x: Tensor) -> Tensor:
    return rms_norm(x, weight, cfg.rms_norm_eps)


def layer_params(params: Mapping[str, Tensor], layer: int) -> dict[str, Tensor]:
    prefix = f"model.layers.{layer}."
    return {name[len(prefix):]: t for name, t in params.items() if name.startswith(prefix)}


def forward_hidden(cfg: ModelConfig, params: Mapping[str, Tensor], ids: Tensor) -> Tensor:
    """The whole model up to and including the final norm: [B, T] ids -> [B, T, H]."""
    x = embed(params["model.embed_tokens.weight"], ids)
    attn = causal_attention(cfg, *ids.shape, x.device, x.dtype)
    for layer in range(cfg.num_layers):
        x = decoder_layer(cfg, layer_params(params, layer), x, attn.at_window(cfg.window_of(layer)))
    return final_norm(cfg, params["model.norm.weight"], x)


def forward_logits(cfg: ModelConfig, params: Mapping[str, Tensor], ids: Tensor) -> Tensor:
    """Full logits [B, T, V]: for tests and the reference trainer, never the streaming path."""
    return F.linear(forward_hidden(cfg, params, ids), params[cfg.head_name])


_EAGER = {"rms_norm": rms_norm, "_apply_rope": _apply_rope, "silu_mul": silu_mul}


_DYNAMO_SETTINGS: dict[str, object] = {}  # dynamo's settings before compile_kernels changed them


def compile_kernels(enable: bool = True, backend: str = "inductor", fallback: bool = False) -> None:
    """Run the layers' pointwise pieces (RMSNorm, rope, SiLU * up) as torch.compile'd kernels.

    Each piece is a chain of memory-bound ops in eager mode (RMSNorm alone is seven passes over
    its input); compiled, each becomes one or two fused kernels, forward and backward. GEMMs and
    attention stay eager. Process-wide: the worker calls it once before its first step (they
    compile at first use). fallback: a piece that fails to compile runs eagerly (torch logs why)
    instead of raising. enable=False restores the eager pieces and dynamo's settings.
    """
    import torch._dynamo

    cfg = torch._dynamo.config
    if enable:
        _DYNAMO_SETTINGS.setdefault("cache_size_limit", cfg.cache_size_limit)
        _DYNAMO_SETTINGS.setdefault("suppress_errors", cfg.suppress_errors)
        # one graph per piece, shape and grad mode: 18 for a tiled Qwen3 layer and its loss
        cfg.cache_size_limit = max(cfg.cache_size_limit, 64)
        cfg.suppress_errors = fallback
    else:
        for name, value in _DYNAMO_SETTINGS.items():
            setattr(cfg, name, value)
        _DYNAMO_SETTINGS.clear()
    for name, fn in _EAGER.items():
        globals()[name] = torch.compile(fn, backend=backend, dynamic=False) if enable else fn


def compiled_kernels_wanted(setting: str, device: torch.device) -> bool:
    """train.compile: "on", "off", or "auto" (on for CUDA devices, where the pointwise chains cost)."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")
