"""Synthetic Mixture-of-Experts model configs for tests that need none of transformers: a qwen3_moe-like
table (fused experts [E, 2I, H] and [E, H, I], a router, optionally dense layers and a shared expert)
and the same at the sizes of Qwen3-30B-A3B, for the planner."""

from __future__ import annotations

import json

from slidedp.model.config import ModelConfig


def qwen3_moe_like(layers: int = 2, experts: int = 8, top_k: int = 2, hidden: int = 64, inter: int = 32,
                   vocab: int = 256, tied: bool = False, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                   dense_layers: tuple[int, ...] = (), shared: int = 0) -> ModelConfig:
    """A transformers-path qwen3_moe-shaped model: `dense_layers` have a plain MLP of 2 x inter; `shared`
    adds a shared expert of that intermediate size to the MoE layers (always active)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    tables = []
    for i in range(layers):
        t = [("input_layernorm.weight", (hidden,)),
             ("self_attn.q_proj.weight", (q, hidden)), ("self_attn.k_proj.weight", (kv, hidden)),
             ("self_attn.v_proj.weight", (kv, hidden)), ("self_attn.o_proj.weight", (hidden, q)),
             ("self_attn.q_norm.weight", (head_dim,)), ("self_attn.k_norm.weight", (head_dim,)),
             ("post_attention_layernorm.weight", (hidden,))]
        if i in dense_layers:
            t += [("mlp.gate_proj.weight", (2 * inter, hidden)), ("mlp.up_proj.weight", (2 * inter, hidden)),
                  ("mlp.down_proj.weight", (hidden, 2 * inter))]
        else:
            t += [("mlp.gate.weight", (experts, hidden)),
                  ("mlp.experts.gate_up_proj", (experts, 2 * inter, hidden)),
                  ("mlp.experts.down_proj", (experts, hidden, inter))]
            if shared:
                t += [("mlp.shared_expert.gate_proj.weight", (shared, hidden)),
                      ("mlp.shared_expert.up_proj.weight", (shared, hidden)),
                      ("mlp.shared_expert.down_proj.weight", (hidden, shared))]
        tables.append(tuple(t))
    src = {"model_type": "qwen3_moe", "num_experts": experts, "num_experts_per_tok": top_k,
           "hidden_size": hidden, "moe_intermediate_size": inter}
    return ModelConfig(family="qwen3_moe", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       tie_word_embeddings=tied, qk_norm=True, source_config=json.dumps(src),
                       layer_tables=tuple(tables), norm_table=(("weight", (hidden,)),))


def qwen3_30b_a3b() -> ModelConfig:
    """Qwen3-30B-A3B's shape: 48 layers of 128 experts (8 a token) of 768, hidden 2048, 32 heads of 128 (4 kv)."""
    return qwen3_moe_like(layers=48, experts=128, top_k=8, hidden=2048, inter=768, vocab=151_936, heads=32,
                          kv_heads=4, head_dim=128)
