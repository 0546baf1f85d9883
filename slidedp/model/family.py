"""The model's math behind one small interface: what the engine, the eval and the planner call.

A `ModelMath` turns a streamed layer's tensors (views of a delivered chunk, keyed by local name) into
the layer's output and its gradients, and owns the embedding, the final norm and the loss. Two
implementations, chosen by the step plan's `layers` (plan.layers in the job; `math_for`):

native        layers.py: SlideDP's own Llama / Mistral / Qwen2 / Qwen3 layers, with fused projections and
              the MLP tiled along the sequence (long rows); the default where they cover the model.
transformers  generic.py: transformers' own decoder layer modules, one per layer structure, run on the
              streamed tensors: every causal LM whose layers form a list (Gemma, Qwen3.5, gpt-oss, Phi-3...).

Each micro-batch's `Attention` (attention.py) becomes the implementation's batch context once
(`batch_context`); every layer's forward, recompute and backward of that micro-batch gets it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
from torch import Tensor

from . import layers as L
from .attention import Attention
from .config import ModelConfig
from .loss import chunked_cross_entropy_sum, norm_head_backward, rms_norm_of
from .router_aux import Routing

class ModelMath(Protocol):
    cfg: ModelConfig
    routing: Routing | None  # the routers' auxiliary loss (router_aux.py), where the job adds it

    def structures(self) -> dict[int, int]: ...  # a layer of each distinct structure -> how many layers share it
    def rope(self, seq_len: int) -> tuple[Tensor, Tensor]: ...  # the tables an Attention is built on
    def batch_context(self, attn: Attention, positions: Tensor | None, documents: Tensor | None,
                      real: Tensor | None = None) -> object: ...  # real: the tokens that are not padding
    def prepare(self, layer: int, p: dict[str, Tensor]) -> dict[str, Tensor]: ...  # params and gradient views
    def layer_forward(self, layer: int, p: Mapping[str, Tensor], x: Tensor, ctx, tile: int) -> Tensor: ...
    def layer_backward(self, layer: int, p: Mapping[str, Tensor], x: Tensor, ctx, grad_y: Tensor, tile: int,
                       acc: Mapping[str, Tensor]) -> Tensor: ...
    def embed(self, weight: Tensor, ids: Tensor) -> Tensor: ...
    def scale_embedding(self, rows: Tensor) -> Tensor: ...  # rows gathered elsewhere (host rows) -> layer 0's input
    def embedding_grad(self, grad_x: Tensor, ids: Tensor) -> Tensor: ...  # d loss / d rows, fp32 [N, H]
    def loss_and_backward(self, x: Tensor, targets: Tensor, norm_p: Mapping[str, Tensor], head_w: Tensor,
                          scale: float, tile: int, chunk: int, norm_acc: Mapping[str, Tensor],
                          head_acc: Tensor) -> Tensor: ...
    def loss(self, x: Tensor, targets: Tensor, norm_p: Mapping[str, Tensor], head_w: Tensor, chunk: int) -> Tensor: ...


class NativeMath:
    """SlideDP's own layers (layers.py) for the families they model."""

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        if not cfg.native:
            raise ValueError(f"SlideDP's own layers do not model this {cfg.family} configuration")
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.routing = None  # no routers
        self._rope: dict[int, tuple[Tensor, Tensor]] = {}
        self._norm = rms_norm_of(cfg.rms_norm_eps)

    def structures(self) -> dict[int, int]:
        return {0: self.cfg.num_layers}

    def rope(self, seq_len: int) -> tuple[Tensor, Tensor]:
        if seq_len not in self._rope:
            self._rope[seq_len] = L.rope_tables(self.cfg, seq_len, self.device, self.dtype)
        return self._rope[seq_len]

    def batch_context(self, attn: Attention, positions: Tensor | None, documents: Tensor | None,
                      real: Tensor | None = None) -> Attention:
        return attn

    def prepare(self, layer: int, p: dict[str, Tensor]) -> dict[str, Tensor]:
        return L.fuse_projections(p)

    def layer_forward(self, layer: int, p: Mapping[str, Tensor], x: Tensor, ctx: Attention, tile: int) -> Tensor:
        return L.layer_forward(self.cfg, p, x, ctx.at_window(self.cfg.window_of(layer)), tile)

    def layer_backward(self, layer: int, p: Mapping[str, Tensor], x: Tensor, ctx: Attention, grad_y: Tensor,
                       tile: int, acc: Mapping[str, Tensor]) -> Tensor:
        return L.layer_backward(self.cfg, p, x, ctx.at_window(self.cfg.window_of(layer)), grad_y, tile, acc)

    def embed(self, weight: Tensor, ids: Tensor) -> Tensor:
        return L.embed(weight, ids)

    def scale_embedding(self, rows: Tensor) -> Tensor:
        return rows

    def embedding_grad(self, grad_x: Tensor, ids: Tensor) -> Tensor:
        return grad_x.reshape(-1, grad_x.shape[-1]).to(torch.float32)

    def loss_and_backward(self, x, targets, norm_p, head_w, scale, tile, chunk, norm_acc, head_acc) -> Tensor:
        return norm_head_backward(x, targets, self._norm, norm_p, head_w, scale, tile, chunk, norm_acc, head_acc)

    def loss(self, x, targets, norm_p, head_w, chunk) -> Tensor:
        h = self._norm(x, norm_p).reshape(-1, x.shape[-1])
        return chunked_cross_entropy_sum(h, head_w, targets.reshape(-1), chunk)


def math_for(cfg: ModelConfig, layers: str, device: torch.device, dtype: torch.dtype,
             compile: bool = False, router_aux: bool = False) -> ModelMath:
    """The model's math on this device: SlideDP's layers (layers = "native") or transformers' (each layer
    structure through torch.compile where `compile`; the native layers compile their pointwise pieces
    process-wide instead, layers.compile_kernels). router_aux: add the routers' auxiliary loss."""
    if layers == "native":
        if router_aux:
            raise ValueError("the routers' auxiliary loss needs transformers' layers (plan.layers)")
        return NativeMath(cfg, device, dtype)
    from .generic import TransformersMath  # imports transformers: only where its layers run

    return TransformersMath(cfg, device, dtype, compile, router_aux)
