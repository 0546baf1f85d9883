"""The zero-overhead limit: SlideDP's own kernels and step order with the whole training state on the GPU.

SlideDP's ratio to this row is what keeping the state in host memory costs (the host-residence
overhead); its ratio to `gpu_resident` mixes that with the difference in kernels. Everything the
engine computes is here, imported from slidedp rather than copied:

- fp32 master weights, fp32 gradients and both AdamW moments on the GPU, one flat tensor per
  unit (embedding, each decoder layer, final norm, untied head) in the store's order, so
  `layers.fuse_projections` turns q/k/v and gate/up into one GEMM each, as in the engine;
- each layer's weights cast to the compute dtype on the device when used (the engine casts
  each fetched layer the same way), the embedding/head once per step;
- the layer-major step of `slidedp.engine`: forward under no_grad keeping each layer's input,
  the final norm + chunked cross-entropy with its backward at once
  (`slidedp.loss.norm_head_backward`: no logits recompute), then every layer recomputed and
  backpropagated (`layers.layer_backward`) into its fp32 gradient, the embedding's rows last;
- the layers' pointwise pieces through torch.compile (`layers.compile_kernels`, as the worker
  does for `train.compile = "auto"` on CUDA);
- one global gradient norm and clipping (--max-grad-norm), then torch's fused AdamW on the GPU.

No stream overlaps anything: there is nothing to copy.

    python -m benchmarks.peers.resident_same_kernels --shape qwen3-4b --batch 8 --seq 2048 --steps 6 --warmup 2 --json OUT
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterator
from typing import Any

import torch

from benchmarks.peers import common
from slidedp.model.loss import norm_head_backward, rms_norm_of
from slidedp.model import layers as L
from slidedp.model.attention import Attention
from slidedp.model.config import ModelConfig

SYSTEM = "resident_same_kernels"


def _views(flat: torch.Tensor, shapes: list[tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """name -> a view of `flat`, tensors back to back in `shapes`' order."""
    out, offset = {}, 0
    for name, shape in shapes:
        n = math.prod(shape)
        out[name] = flat[offset:offset + n].view(shape)
        offset += n
    return out


class ResidentSameKernels:
    """The training state and one optimizer step; a core that the peer's main and the tests drive."""

    def __init__(self, cfg: ModelConfig, device: str, dtype: torch.dtype, max_grad_norm: float,
                 chunk_tokens: int = common.CHUNK_TOKENS, tile_tokens: int = 0) -> None:
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.max_grad_norm, self.chunk_tokens, self.tile_tokens = max_grad_norm, chunk_tokens, tile_tokens
        h, v = cfg.hidden_size, cfg.vocab_size
        self.layer_shapes = cfg.layer_parameter_shapes()
        layer_numel = sum(math.prod(s) for _, s in self.layer_shapes)
        sizes = {"embed": v * h, **{f"layer.{i}": layer_numel for i in range(cfg.num_layers)}, "norm": h}
        if not cfg.tie_word_embeddings:
            sizes["head"] = v * h
        self.master = {k: torch.empty(n, dtype=torch.float32, device=self.device) for k, n in sizes.items()}
        for t in self.master.values():
            t.grad = torch.zeros_like(t)
        self.opt = torch.optim.AdamW(list(self.master.values()), lr=common.LR, betas=common.BETAS, eps=common.EPS,
                                     weight_decay=common.WEIGHT_DECAY, fused=True)
        self._rope: dict[tuple[int, int], Attention] = {}

    def named_tensors(self, which: str = "master") -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, view) of every parameter (which="master") or its gradient ("grad")."""
        cfg = self.cfg
        get = (lambda k: self.master[k]) if which == "master" else (lambda k: self.master[k].grad)
        yield "model.embed_tokens.weight", get("embed").view(cfg.vocab_size, cfg.hidden_size)
        for i in range(cfg.num_layers):
            for name, t in _views(get(f"layer.{i}"), self.layer_shapes).items():
                yield f"model.layers.{i}.{name}", t
        yield "model.norm.weight", get("norm")
        if not cfg.tie_word_embeddings:
            yield "lm_head.weight", get("head").view(cfg.vocab_size, cfg.hidden_size)

    def init_weights(self, seed: int, on: str) -> None:
        common.init_named_(self.named_tensors(), seed, on)

    def _attention_for(self, rows: int, seq: int) -> Attention:
        """Plain causal rows' attention (the engine's for rows of one sequence each)."""
        if (rows, seq) not in self._rope:
            self._rope[(rows, seq)] = L.causal_attention(self.cfg, rows, seq, self.device, self.dtype)
        return self._rope[(rows, seq)]

    def _layer(self, i: int, which: str = "master") -> dict[str, torch.Tensor]:
        """Layer i's weights in the compute dtype (one cast of its flat, as the engine's delivery),
        or its fp32 gradient views; q/k/v and gate/up fused either way."""
        flat = self.master[f"layer.{i}"]
        flat = flat.to(self.dtype) if which == "master" else flat.grad
        return L.fuse_projections(_views(flat, self.layer_shapes))

    def _matrix(self, unit: str) -> torch.Tensor:
        return self.master[unit].to(self.dtype).view(self.cfg.vocab_size, self.cfg.hidden_size)

    def step(self, ids: torch.Tensor, targets: torch.Tensor, micro_batch: int) -> torch.Tensor:
        """One optimizer step over [B, T] ids/targets in micro-batches of `micro_batch` sequences;
        returns the step's mean token loss (fp32 scalar)."""
        loss = self.backward(ids, targets, micro_batch)
        self.update()
        return loss

    def backward(self, ids: torch.Tensor, targets: torch.Tensor, micro_batch: int) -> torch.Tensor:
        """Forward, loss and backward, layer-major as the engine runs them, the gradients of the
        mean token loss added into the fp32 gradients; returns that loss (fp32 scalar)."""
        cfg, h, tile = self.cfg, self.cfg.hidden_size, self.tile_tokens
        scale = 1.0 / targets.numel()
        ids_mb, targets_mb = ids.split(micro_batch), targets.split(micro_batch)
        rope = self._attention_for(micro_batch, ids.shape[-1])
        embed_w = self._matrix("embed")
        saved: list[list[torch.Tensor]] = []
        with torch.no_grad():
            xs = [L.embed(embed_w, i) for i in ids_mb]
            for layer in range(cfg.num_layers):
                p = self._layer(layer)
                saved.append(xs)
                xs = [L.layer_forward(cfg, p, x, rope, tile) for x in xs]
                del p
        norm_w = self.master["norm"].to(self.dtype)
        head_w = embed_w if cfg.tie_word_embeddings else self._matrix("head")
        head_grad = self.master["embed" if cfg.tie_word_embeddings else "head"].grad.view(cfg.vocab_size, h)
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        for x, tgt in zip(xs, targets_mb):  # each x becomes the gradient of its input, in place
            loss += norm_head_backward(x, tgt, rms_norm_of(cfg.rms_norm_eps), {"weight": norm_w}, head_w, scale,
                                       tile, self.chunk_tokens, {"weight": self.master["norm"].grad}, head_grad)
        grads = xs
        del xs, norm_w, head_w, embed_w
        for layer in reversed(range(cfg.num_layers)):
            p, acc = self._layer(layer), self._layer(layer, "grad")
            inputs = saved.pop()
            grads = [L.layer_backward(cfg, p, x, rope, g, tile, acc) for x, g in zip(inputs, grads)]
            del p, acc, inputs
        embed_grad = self.master["embed"].grad.view(cfg.vocab_size, h)
        for i, g in zip(ids_mb, grads):
            embed_grad.index_add_(0, i.reshape(-1), g.reshape(-1, h).to(torch.float32))
        del grads
        return loss * scale

    def update(self) -> None:
        """Clip to one global norm, fused AdamW, gradients back to zero."""
        params = list(self.master.values())
        common.clip_gradients(params, self.max_grad_norm)
        self.opt.step()
        torch._foreach_zero_([p.grad for p in params])


def measure(args: argparse.Namespace, row: dict[str, Any], host: common.HostMemory) -> None:
    cfg, device = common.shape_of(args), args.device
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    compiled = args.compile == "on" or (args.compile == "auto" and device == "cuda")
    if compiled:
        L.compile_kernels(fallback=args.compile == "auto")
    row["compiled_kernels"] = compiled
    model = ResidentSameKernels(cfg, device, dtype, args.max_grad_norm, tile_tokens=args.seq_tile_tokens)
    model.init_weights(args.seed, on=common.init_on(args))
    common.sync(device)
    ids, targets = common.random_batch(cfg, args.batch, args.seq, device, args.seed)
    row["parameters"] = cfg.num_parameters()
    times, sections, losses = common.timed_steps(lambda watch: model.step(ids, targets, args.micro_batch).item(),
                                                 args.steps, device, common.log)
    common.fill_measurements(row, times, sections, losses, args.warmup)
    common.fill_memory(row, device, host)


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="compute dtype (SlideDP's plan.compute_dtype)")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="the layers' pointwise kernels through torch.compile (auto: on CUDA), as train.compile")
    p.add_argument("--seq-tile-tokens", type=int, default=0, help="MLP/loss tiles along the tokens (0: untiled)")
    args = p.parse_args(argv)
    common.check_args(args)
    kernels = "compiled pointwise" if args.compile == "on" or (args.compile == "auto" and args.device == "cuda") else "eager"
    config = (f"{common.batch_text(args)}, fp32 master/grads/moments on {args.device.upper()}, {args.dtype} compute, "
              f"SlideDP's kernels (fused q/k/v and gate/up, {kernels}, chunked loss without recompute), "
              f"fused AdamW, {common.clip_text(args.max_grad_norm)}")
    return common.run_peer(SYSTEM, config, args, lambda row, host: measure(args, row, host), needs_cuda=False)


if __name__ == "__main__":
    sys.exit(main())
