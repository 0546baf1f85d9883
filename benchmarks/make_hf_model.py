"""A random-initialised Hugging Face model folder of a named config, written by `transformers` itself.

    python -m benchmarks.make_hf_model gemma3-4b /tmp/gemma3-4b [--dtype bf16] [--vocab N]

For the harness's `--model-dir DIR` (SlideDP reads the folder with model.source = "hf", the
transformers peers with `from_pretrained`): families that SlideDP trains through transformers' own
layer modules (plan.layers = "auto" picks them for gemma3_text, qwen3_5_text). The model is built
with `AutoModelForCausalLM.from_config(config, dtype=...)` (on the GPU when there is one: its
initialisation takes seconds there) and written with `save_pretrained` (safetensors).

  gemma3-4b    the text model of google/gemma-3-4b-pt (Gemma3TextConfig, model_type gemma3_text)
  qwen3.5-4b   the text model of Qwen/Qwen3.5-4B (Qwen3_5TextConfig, model_type qwen3_5_text): Gated
               DeltaNet linear attention in 3 layers of 4, full attention in the 4th
  qwen3-moe-5.8b  a Qwen3-MoE shape (Qwen3MoeConfig, model_type qwen3_moe) of 5.8 B parameters, 1.5 B active:
               Qwen3-30B-A3B's layer (hidden 2,048, 32 heads of 128, 4 kv heads, experts of 768, top-8) with 64
               experts and 16 layers, so that transformers' own run fits one H200 beside it; the folder keeps one
               tensor per expert, as transformers saves it
  qwen3-moe-4.5b  the same layers, 12 of them (4.5 B parameters): transformers' own run with everything on the GPU
               fits an 80 GB card (H100) at 8 x 2,048 sequences a forward
  tiny-gemma3, tiny-qwen3.5   the same families at hidden 64, 4 layers, vocabulary 512 (CPU tests)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def _gemma3_layers(n: int, pattern: int = 6) -> list[str]:
    """Gemma 3's layer types: 5 sliding-window layers, then one of full attention."""
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]


def _qwen3_5_layers(n: int, interval: int = 4) -> list[str]:
    """Qwen3.5's layer types: 3 linear-attention (Gated DeltaNet) layers, then one of full attention."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


# Gemma 3's two rotary embeddings: the global layers' (theta 1e6, linear scaling 8 as gemma-3-4b-pt's
# rope_scaling) and the sliding layers' local base 10,000 (the old rope_local_base_freq).
_GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
# Qwen3.5: rotary on a quarter of each head's dimensions, theta 1e7 (text positions: the 3 M-RoPE sections agree)
_QWEN3_5_ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}

# Qwen3-30B-A3B's layer with 64 experts (the MoE shapes differ only in their number of layers)
_QWEN3_MOE_LAYERS = dict(
    vocab_size=151_936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=64,
    num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    output_router_logits=False, hidden_act="silu", rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=32_768, attention_dropout=0.0,
    attention_bias=False)

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma3-4b": ("gemma3_text", dict(
        vocab_size=262_208, hidden_size=2560, intermediate_size=10_240, num_hidden_layers=34,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
        sliding_window=1024, layer_types=_gemma3_layers(34), query_pre_attn_scalar=256,
        rope_parameters=_GEMMA3_ROPE, rms_norm_eps=1e-6, tie_word_embeddings=True,
        max_position_embeddings=131_072, attention_dropout=0.0, attention_bias=False)),
    "qwen3.5-4b": ("qwen3_5_text", dict(
        vocab_size=248_320, hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256, hidden_act="silu",
        layer_types=_qwen3_5_layers(32), linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        rope_parameters=_QWEN3_5_ROPE, rms_norm_eps=1e-6, tie_word_embeddings=True,
        max_position_embeddings=262_144, attention_dropout=0.0, attention_bias=False)),
    "qwen3-moe-5.8b": ("qwen3_moe", dict(_QWEN3_MOE_LAYERS, num_hidden_layers=16)),
    "qwen3-moe-4.5b": ("qwen3_moe", dict(_QWEN3_MOE_LAYERS, num_hidden_layers=12)),
    "tiny-gemma3": ("gemma3_text", dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, hidden_activation="gelu_pytorch_tanh", sliding_window=16,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], query_pre_attn_scalar=16,
        rope_parameters=_GEMMA3_ROPE, rms_norm_eps=1e-6, tie_word_embeddings=True,
        max_position_embeddings=4096, attention_dropout=0.0, attention_bias=False)),
    "tiny-qwen3.5": ("qwen3_5_text", dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, hidden_act="silu", layer_types=_qwen3_5_layers(4),
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, rope_parameters=_QWEN3_5_ROPE, rms_norm_eps=1e-6, tie_word_embeddings=True,
        max_position_embeddings=4096, attention_dropout=0.0, attention_bias=False)),
}


def make_config(name: str, vocab: int = 0) -> Any:
    """The transformers config of a named model (vocab: another vocabulary size, 0 = its own)."""
    from transformers import AutoConfig

    if name not in CONFIGS:
        raise SystemExit(f"unknown model {name!r}; known: {', '.join(CONFIGS)}")
    model_type, kwargs = CONFIGS[name]
    kwargs = json.loads(json.dumps(kwargs))  # a copy: the config may change its dicts
    if vocab:
        kwargs["vocab_size"] = vocab
    return AutoConfig.for_model(model_type, **kwargs)


def make(name: str, out: Path, dtype: torch.dtype = torch.bfloat16, vocab: int = 0) -> int:
    """Write the folder; its parameter count (tied weights once)."""
    from transformers import AutoModelForCausalLM

    config = make_config(name, vocab)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # random init on a GPU: seconds, not minutes
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    count = sum(p.numel() for p in model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    return count


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name", choices=tuple(CONFIGS))
    p.add_argument("out_dir")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="the weights' dtype in the folder")
    p.add_argument("--vocab", type=int, default=0, help="vocabulary size (0: the config's own)")
    args = p.parse_args(argv)
    count = make(args.name, Path(args.out_dir), DTYPES[args.dtype], args.vocab)
    print(f"{args.name}: {count:,} parameters ({count / 1e9:.2f} B), {args.dtype}, written to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
