"""Which of a layer's tensors are routed experts, and how many of them a token uses: the shape of a
Mixture-of-Experts model, from its parameter table and config.json alone (no torch).

A transformers-path MoE layer stores its routed experts fused: one tensor per projection whose
dim 0 is the expert (`mlp.experts.gate_up_proj` [E, 2I, H] or [E, H, 2I], `mlp.experts.down_proj`,
gpt-oss's `mlp.experts.gate_up_proj_bias` [E, 2I]). Every token runs through top_k of the E experts,
so a layer's GPU work is that of its *active* parameters (everything else, the router and shared
experts included, plus top_k / E of the expert tensors), while the host moves, sums and updates all
of them. The layout cuts an expert tensor between experts (dim 0), never inside one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import ModelConfig

# config.json's name for the number of routed experts, and for the experts each token is routed to
# (Qwen3-MoE / Qwen2-MoE / OLMoE: num_experts; Mixtral / gpt-oss: num_local_experts; DeepSeek:
# n_routed_experts; gpt-oss also experts_per_token)
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "num_experts_per_token")


def num_experts(cfg: ModelConfig) -> int:
    """The routed experts per MoE layer (0: not an MoE model, or its config.json does not say)."""
    src = cfg.source()
    return next((int(src[k]) for k in EXPERT_KEYS if isinstance(src.get(k), int) and src[k] > 0), 0)


def experts_per_token(cfg: ModelConfig) -> int:
    """The experts each token is routed to (top_k), at most num_experts; 0 where not an MoE model."""
    e = num_experts(cfg)
    if not e:
        return 0
    src = cfg.source()
    k = next((int(src[k]) for k in TOP_K_KEYS if isinstance(src.get(k), int) and src[k] > 0), e)
    return min(k, e)


def is_expert_tensor(name: str, shape: tuple[int, ...], experts: int) -> bool:
    """Whether a layer tensor (local name) holds the routed experts: under an `experts` module (not
    `shared_experts` / `shared_expert`) and with one entry per expert along dim 0."""
    return experts > 0 and len(shape) >= 2 and shape[0] == experts and "experts" in name.split(".")


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer's parameters by kind."""

    total: int  # every parameter of the layer
    expert: int  # in its routed-expert tensors
    experts: int  # routed experts (0: a dense layer)
    top_k: int  # experts each token uses

    @property
    def dense(self) -> int:
        """Parameters every token uses: attention, norms, the router, shared experts."""
        return self.total - self.expert

    @property
    def active(self) -> int:
        """Parameters a token computes with: the dense part and top_k / E of the experts."""
        return self.dense + (self.expert * self.top_k // self.experts if self.experts else 0)


def layer_shape(cfg: ModelConfig, layer: int) -> LayerShape:
    e = num_experts(cfg)
    shapes = cfg.layer_parameter_shapes(layer)
    expert = sum(math.prod(s) for n, s in shapes if is_expert_tensor(n, s, e))
    total = sum(math.prod(s) for _, s in shapes)
    return LayerShape(total, expert, e if expert else 0, experts_per_token(cfg) if expert else 0)


def is_moe(cfg: ModelConfig) -> bool:
    """Whether some layer has routed-expert tensors."""
    return any(layer_shape(cfg, i).expert for i in range(cfg.num_layers))


def active_fraction(cfg: ModelConfig) -> float:
    """The layers' active parameters over their total (1.0 for a dense model): what a layer's GPU work
    scales with, against what the host moves."""
    shapes = [layer_shape(cfg, i) for i in range(cfg.num_layers)]
    total = sum(s.total for s in shapes)
    return sum(s.active for s in shapes) / total if total else 1.0
