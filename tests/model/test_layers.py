"""The per-layer model functions against `transformers`, in fp32, for every family."""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from slidedp.model import hf, layers  # noqa: E402
from slidedp.model.config import ModelConfig  # noqa: E402
from slidedp.model.init import _stable_seed, init_params, init_tensor_  # noqa: E402

_CONFIGS = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 500000.0}


def hf_model(family: str, tied: bool, **overrides):
    """A tiny random transformers model whose norms and biases are not the trivial 1 and 0."""
    kw = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied, max_position_embeddings=128,
              rms_norm_eps=1e-5, attn_implementation="eager")
    kw.update(overrides)
    model = transformers.AutoModelForCausalLM.from_config(_CONFIGS[family](**kw)).float().eval()
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else (0.1 if p.dim() == 1 else 0.08) * noise)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def ids_for(cfg: ModelConfig, batch: int = 2, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(7))


def load_all(folder) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg = hf.read_config(folder)
    hf.check_folder(folder, cfg)
    index = hf.tensor_index(folder)
    return cfg, {name: hf.load_tensor(folder, name, index=index) for name, _ in cfg.parameter_shapes()}


CASES = [(f, t, {}) for f in _CONFIGS for t in (False, True)] + [
    ("qwen3", True, {"head_dim": 32}),  # head_dim != hidden / heads
    ("llama", False, {"num_key_value_heads": 4}),  # plain MHA
    ("llama", False, {"rope_parameters": LLAMA3_ROPE}),
]


@pytest.mark.parametrize("family,tied,overrides", CASES,
                         ids=[f"{f}-{'tied' if t else 'untied'}-{'-'.join(o) or 'base'}" for f, t, o in CASES])
def test_logits_match_transformers(tmp_path, family, tied, overrides):
    model = hf_model(family, tied, **overrides)
    model.save_pretrained(tmp_path)
    cfg, params = load_all(tmp_path)
    assert (cfg.family, cfg.tie_word_embeddings, cfg.num_layers, cfg.head_dim) == (
        family, tied, 2, overrides.get("head_dim", 16))
    ids = ids_for(cfg, seq=48)
    with torch.no_grad():
        ref = model(ids).logits
        ours = layers.forward_logits(cfg, params, ids)
    assert ours.shape == ref.shape == (2, 48, 96)
    assert rel_err(ours, ref) < 1e-5
    if "rope_parameters" in overrides:  # the scaling is read and it matters
        assert dict(cfg.rope_scaling)["factor"] == 8.0 and cfg.rope_theta == 500000.0
        plain = layers.forward_logits(dataclasses.replace(cfg, rope_scaling=()), params, ids)
        assert rel_err(plain, ref) > 1e-3


def test_decoder_layer_is_differentiable_and_matches_hf_layer():
    model = hf_model("qwen2", False, attn_implementation="sdpa")  # sdpa is causal without a mask
    cfg = ModelConfig.from_hf(model.config.to_dict())
    params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    x = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    rope = layers.causal_attention(cfg, 2, 10, x.device)
    out = layers.decoder_layer(cfg, layers.layer_params(params, 1), x, rope)
    out.square().sum().backward()
    local = layers.layer_params(params, 1)
    assert sorted(local) == sorted(n for n, _ in cfg.layer_parameter_shapes())
    assert all(local[n].grad is not None and local[n].grad.abs().sum() > 0 for n in local)
    assert params["model.layers.0.mlp.up_proj.weight"].grad is None

    # the same layer through transformers, gradients included
    hf_layer = model.model.layers[1]
    x2 = x.detach().clone().requires_grad_(True)
    cos, sin = model.model.rotary_emb(x2, torch.arange(10)[None])
    ref = hf_layer(x2, position_embeddings=(cos, sin), attention_mask=None,
                   position_ids=torch.arange(10)[None])
    ref = ref[0] if isinstance(ref, tuple) else ref
    assert rel_err(out.detach(), ref.detach()) < 1e-6
    ref.square().sum().backward()
    assert rel_err(x.grad, x2.grad) < 1e-5
    assert rel_err(local["self_attn.q_proj.bias"].grad, hf_layer.self_attn.q_proj.bias.grad) < 1e-5


def test_rms_norm_keeps_input_dtype_semantics():
    x = torch.randn(3, 8, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    w = torch.full((8,), 2.0, dtype=torch.bfloat16)
    xf = x.float()
    expect = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    out = layers.rms_norm(x, w, 1e-6)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expect)


def test_rope_tables_shape_and_values():
    cfg = ModelConfig(family="llama", vocab_size=8, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, rope_theta=10000.0)
    cos, sin = layers.rope_tables(cfg, 5, "cpu")
    assert cos.shape == sin.shape == (5, 16) and cos.dtype == torch.float32
    assert torch.equal(cos[0], torch.ones(16)) and torch.equal(sin[0], torch.zeros(16))
    assert abs(cos[3, 0].item() - torch.cos(torch.tensor(3.0)).item()) < 1e-7  # frequency 1 in slot 0
    assert abs(sin[2, 7].item() - torch.sin(torch.tensor(2.0 * 10000.0 ** (-14 / 16))).item()) < 1e-7
    assert torch.equal(cos[:, :8], cos[:, 8:])
    cb, _ = layers.rope_tables(cfg, 5, "cpu", torch.bfloat16)
    assert cb.dtype == torch.bfloat16 and torch.equal(cb, cos.to(torch.bfloat16))


# ---- init ------------------------------------------------------------------------------
def _tiny(tied: bool = False) -> ModelConfig:
    return ModelConfig(family="qwen2", vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=tied, attention_bias=True)


def test_init_is_deterministic_and_per_name():
    cfg = _tiny()
    a, b, c = init_params(cfg, seed=5), init_params(cfg, seed=5), init_params(cfg, seed=6)
    assert list(a) == [n for n, _ in cfg.parameter_shapes()]
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert a["model.layers.0.input_layernorm.weight"].eq(1).all() and a["model.norm.weight"].eq(1).all()
    assert a["model.layers.1.self_attn.k_proj.bias"].eq(0).all()
    q0, q1 = a["model.layers.0.self_attn.q_proj.weight"], a["model.layers.1.self_attn.q_proj.weight"]
    assert not torch.equal(q0, q1)  # same shape, different names -> different values
    assert not torch.equal(q0, c["model.layers.0.self_attn.q_proj.weight"])  # different seed
    emb = a["model.embed_tokens.weight"]
    assert abs(emb.std().item() - 0.02) < 0.003 and abs(emb.mean().item()) < 0.003
    # any destination (a bf16 buffer, a non-contiguous view) gets the same values, cast
    out = torch.empty(32, 32, dtype=torch.bfloat16)
    init_tensor_("model.layers.0.self_attn.q_proj.weight", out, 5)
    assert torch.equal(out, q0.to(torch.bfloat16))
    big = torch.zeros(32, 64)
    init_tensor_("model.layers.0.self_attn.q_proj.weight", big[:, ::2], 5)
    assert torch.equal(big[:, ::2], q0) and big[:, 1::2].eq(0).all()


def test_init_is_the_same_in_another_process():
    # blake2b-derived seeds: the same values in every process and run (Python's hash() is salted)
    assert _stable_seed(0, "model.norm.weight") == 1087658818655310248  # pinned: never changes between runs
    assert _stable_seed(42, "lm_head.weight") == 7274547781827940629
    t = init_tensor_("model.layers.0.mlp.up_proj.weight", torch.empty(2, 3), 0)
    again = init_tensor_("model.layers.0.mlp.up_proj.weight", torch.empty(2, 3), 0)
    assert torch.equal(t, again)
    import os
    import subprocess
    import sys
    code = ("import torch; from slidedp.model.init import init_tensor_; "
            "print(init_tensor_('model.layers.0.mlp.up_proj.weight', torch.empty(2, 3), 0).flatten().tolist())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "123"}).stdout
    assert eval(other) == t.flatten().tolist()


def test_bf16_forward_stays_bf16_and_close_to_fp32():
    cfg = _tiny()
    params = init_params(cfg, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    ref = layers.forward_logits(cfg, params, ids)
    out = layers.forward_logits(cfg, {n: t.bfloat16() for n, t in params.items()}, ids)
    assert out.dtype == torch.bfloat16 and rel_err(out.float(), ref) < 3e-2
