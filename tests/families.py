"""Tiny random models of the transformers families SlideDP's generic layer path is meant to carry.

Each family gets a config small enough to run on a CPU in milliseconds (vocab 512, so the demo's chat
tokenizer fits; hidden 64; 3 or 4 layers; 4 heads of 16, 2 kv heads) that still keeps what makes the family
itself: qwen3_5's Gated DeltaNet layers beside full attention, gemma3/gemma4's sliding and full layers (gemma4
with a wider global head), gpt_oss's experts and attention sinks, mistral's sliding window, olmo2's
post-norms, phi3's fused projections; the MoE families' routers (softmax, sigmoid with groups), shared experts
and dense first layers, deepseek_v3's latent attention, qwen3_5_moe's DeltaNet beside experts. `write_family_folder` saves such a model as the hub would ship it, with
every weight pushed off its trivial init (a norm of exact ones, a zero bias or sink would hide a weight that
was dropped or misplaced), so that transformers' own forward is an oracle for SlideDP's.
"""

from __future__ import annotations

from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CHAT = ROOT / "examples" / "data" / "chat"
VOCAB = 512

# Mixture-of-Experts families (gpt_oss aside, which keeps its experts fused on disk): transformers saves their
# experts one tensor each and fuses them on load, as SlideDP's store does (model/expert_files.py).
MOE_FAMILIES = ("gpt_oss", "qwen3_moe", "mixtral", "olmoe", "qwen3_5_moe", "glm4_moe", "deepseek_v3")
FAMILIES = ("llama", "qwen3", "qwen3_5", "gemma3", "gemma4", "phi3", "olmo2", "mistral") + MOE_FAMILIES
# The MoE families whose causal LM adds the routers' auxiliary loss when config.json says output_router_logits
# (GLM-4-MoE's and DeepSeek-V3's routers balance by a bias instead).
AUX_FAMILIES = ("gpt_oss", "qwen3_moe", "mixtral", "olmoe", "qwen3_5_moe")

# The model_type each family's text-only causal LM is registered under.
MODEL_TYPES = {
    "llama": "llama", "qwen3": "qwen3", "qwen3_5": "qwen3_5_text", "gemma3": "gemma3_text",
    "gemma4": "gemma4_text", "gpt_oss": "gpt_oss", "phi3": "phi3", "olmo2": "olmo2", "mistral": "mistral",
    "qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "olmoe": "olmoe", "qwen3_5_moe": "qwen3_5_moe_text",
    "glm4_moe": "glm4_moe", "deepseek_v3": "deepseek_v3",
}

# The kinds of layer each family's tiny model mixes (config.layer_types); absent: one kind only.
LAYER_KINDS = {
    "qwen3_5": {"linear_attention", "full_attention"},
    "qwen3_5_moe": {"linear_attention", "full_attention"},
    "gemma3": {"sliding_attention", "full_attention"},
    "gemma4": {"sliding_attention", "full_attention"},
    "gpt_oss": {"sliding_attention", "full_attention"},
}

SLIDING_WINDOW = 12


def _alternating(n: int) -> list[str]:
    """sliding, full, sliding, ..."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


def config_kwargs(family: str, tied: bool | None = None) -> dict:
    """The keyword arguments `tiny_config` hands the family's config class (tie_word_embeddings left out
    when `tied` is None: the family's usual)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
              eos_token_id=2, pad_token_id=0, bos_token_id=None, attention_dropout=0.0)
    if family in ("llama", "qwen3", "mistral", "gemma3", "gemma4", "gpt_oss", "qwen3_5", "qwen3_moe", "mixtral",
                  "qwen3_5_moe", "glm4_moe"):
        kw["head_dim"] = 16
    # 4 experts, 2 per token; a dense first layer where the family has one (qwen3_moe, glm4_moe, deepseek_v3)
    experts = dict(num_experts_per_tok=2, moe_intermediate_size=48)
    if family in ("qwen3_5", "qwen3_5_moe"):
        kw.update(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
                  linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4)
    if family == "qwen3_5_moe":
        kw.update(num_experts=4, shared_expert_intermediate_size=48, **experts)
    elif family == "qwen3_moe":
        kw.update(num_experts=4, mlp_only_layers=[0], **experts)
    elif family == "mixtral":
        kw.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)
    elif family == "olmoe":
        kw.update(num_experts=4, num_experts_per_tok=2, intermediate_size=48)
    elif family in ("glm4_moe", "deepseek_v3"):
        kw.update(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                  **experts)
    if family == "deepseek_v3":  # multi-head latent attention: its heads are all key-value heads
        kw.update(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
                  v_head_dim=16)
    elif family == "gemma3":
        kw.update(layer_types=_alternating(3), sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=16)
    elif family == "gemma4":
        # 4 layers: gemma4 forces its last layer to full, so 3 could not alternate.
        kw.update(num_hidden_layers=4, layer_types=_alternating(4), sliding_window=SLIDING_WINDOW,
                  global_head_dim=32, hidden_size_per_layer_input=0, vocab_size_per_layer_input=VOCAB,
                  num_kv_shared_layers=0)
    elif family == "gpt_oss":
        kw.update(layer_types=_alternating(3), sliding_window=SLIDING_WINDOW, num_local_experts=4,
                  num_experts_per_tok=2, intermediate_size=48,
                  rope_parameters={"rope_type": "default", "rope_theta": 150000.0})
    elif family == "phi3":
        kw.update(resid_pdrop=0.0, embd_pdrop=0.0, original_max_position_embeddings=256)
    elif family == "mistral":
        kw.update(sliding_window=SLIDING_WINDOW)
    if tied is not None:
        kw["tie_word_embeddings"] = tied
    return kw


def tiny_config(family: str, tied: bool | None = None):
    """A transformers config of `family`'s text-only causal LM, tiny and fp32-friendly; see the module
    docstring. `tied` None keeps the family's usual tie_word_embeddings."""
    import transformers

    return transformers.AutoConfig.for_model(MODEL_TYPES[family], **config_kwargs(family, tied))


def tiny_model(family: str, seed: int = 0, tied: bool | None = None):
    """The fp32 model `write_family_folder` saves: fresh from the config, then every parameter perturbed
    (matrices by 0.02 * randn, 1-D tensors such as norms, biases, sinks, dt_bias, A_log by 0.1 * randn, as
    are saved float buffers), seeded by `seed`. In eval mode."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, tied), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((0.02 if p.ndim >= 2 else 0.1) * torch.randn_like(p))
        # Saved buffers that are no parameter (gemma4's per-layer layer_scalar, ones at init) move too.
        for value in model.state_dict(keep_vars=True).values():
            if not isinstance(value, torch.nn.Parameter) and value.is_floating_point():
                value.add_(0.1 * torch.randn_like(value))
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    model.generation_config.bos_token_id = None
    return model.eval()


def write_family_folder(folder: Path, family: str, seed: int = 0, tied: bool | None = None) -> Path:
    """`tiny_model(family, seed, tied)` saved by transformers itself (config.json, generation_config.json,
    model.safetensors) plus the chat tokenizer's files: a folder as the hub would ship it."""
    import transformers

    folder = Path(folder)
    tiny_model(family, seed, tied).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(CHAT).save_pretrained(folder)
    return folder


class FamilyFolders(dict):
    """family -> its folder under `root` (write_family_folder, `seed`), written on first use: a module that
    launches a few families does not write all of them, and modules given one map share its folders."""

    def __init__(self, root: Path, seed: int, router_aux: float | None = None) -> None:
        """router_aux: each config.json set to add the routers' auxiliary loss at this coefficient (with_router_aux)."""
        super().__init__()
        self.root, self.seed, self.router_aux = Path(root), seed, router_aux

    def __missing__(self, family: str) -> Path:
        folder = write_family_folder(self.root / family, family, seed=self.seed)
        self[family] = folder if self.router_aux is None else with_router_aux(folder, self.router_aux)
        return self[family]


def with_router_aux(folder: Path, coef: float) -> Path:
    """The folder's config.json set to add the routers' auxiliary loss at `coef` (transformers' default 0.001
    would hide its gradient under float32 rounding in a test)."""
    import json

    path = Path(folder) / "config.json"
    conf = json.loads(path.read_text())
    path.write_text(json.dumps({**conf, "output_router_logits": True, "router_aux_loss_coef": coef}, indent=2))
    return Path(folder)
