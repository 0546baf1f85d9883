"""The GPU work of one step, piece by piece: one decoder layer and the loss, in each way we can run them.

Answers "where does the GPU time of a step go, and what does each kernel-level choice buy",
without the pipeline around it. For a shape and a micro-batch it times, per 2,048-token
sequence batch of `--tokens` tokens in all:

  layer    forward without grad + recompute-and-backward (what the engine runs per layer), for
           the separate projections, the fused ones (layers.fuse_projections), and torch.compile'd
           kernels (layers.compile_kernels); and the GPU-resident peer's layer (fp32 weights,
           bf16 autocast, checkpointed) at the same micro-batch
  loss     final norm + chunked cross-entropy with its backward: the engine's (no recompute,
           head gradient in fp32), the autograd path through chunked_cross_entropy_sum, and
           the peer's full-logits F.cross_entropy

    python -m benchmarks.layer_bench --shape qwen3-4b --micro 2 8 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

import torch
import torch.nn.functional as F

from slidedp.model.loss import chunked_cross_entropy_sum
from slidedp.model import layers as L
from slidedp.model.config import named_shape
from slidedp.planner import measure


def timed(fn: Callable[[], None], repeat: int) -> float:
    """Median seconds of fn over `repeat` runs after two warm-up runs (compiles happen there)."""
    return measure.timed(fn, torch.cuda.synchronize, repeat)


def layer_case(cfg, micro: int, seq: int, tokens: int, fuse: bool, repeat: int) -> float:
    """Engine's per-layer work for `tokens` tokens in micro-batches of `micro` sequences (the planner's
    measured block: slidedp.planner.measure.layer_work)."""
    forward, backward = measure.layer_work(cfg, micro, seq, tokens // (micro * seq), 0, "cuda", torch.bfloat16, fuse)
    return timed(lambda: (forward(), backward()), repeat)


def peer_layer_case(cfg, micro: int, seq: int, tokens: int, repeat: int) -> float:
    from benchmarks.peers.common import DecoderLayer

    layer = DecoderLayer(cfg, checkpointing=True, device="cuda")
    for prm in layer.parameters():
        torch.nn.init.normal_(prm, 0, 0.02) if prm.dim() > 1 else torch.nn.init.ones_(prm)
    n = tokens // (micro * seq)
    attn = L.causal_attention(cfg, micro, seq, "cuda", torch.float32)
    xs = [torch.randn(micro, seq, cfg.hidden_size, device="cuda", requires_grad=True) for _ in range(n)]

    def run() -> None:
        for x in xs:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = layer(x, attn)
            y.backward(torch.ones_like(y) * 1e-3)

    return timed(run, repeat)


def loss_cases(cfg, micro: int, seq: int, tokens: int, chunk: int, repeat: int) -> dict[str, float]:
    h, v = cfg.hidden_size, cfg.vocab_size
    n = tokens // (micro * seq)
    head = torch.empty(v, h, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02)
    norm_w = torch.ones(h, device="cuda", dtype=torch.bfloat16)
    xs = [torch.randn(micro, seq, h, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    tg = [torch.randint(0, v, (micro, seq), device="cuda") for _ in range(n)]
    norm_acc = torch.zeros(h, device="cuda")
    head_acc = torch.zeros(v, h, device="cuda")

    engine = measure.loss_work(cfg, micro, seq, n, 0, chunk, "cuda", torch.bfloat16)  # the planner's measured block

    def autograd_path() -> None:  # what the engine ran before: recompute in backward, bf16 head gradient
        for x, t in zip(xs, tg):
            xt = x.detach().requires_grad_(True)
            nw, hw = norm_w.detach().requires_grad_(True), head.detach().requires_grad_(True)
            loss = chunked_cross_entropy_sum(L.rms_norm(xt, nw, cfg.rms_norm_eps).reshape(-1, h), hw, t.reshape(-1), chunk)
            gx, gn, gh = torch.autograd.grad(loss / tokens, [xt, nw, hw])
            norm_acc.add_(gn)
            head_acc.add_(gh)

    w32 = head.float().requires_grad_(True)
    x_all = torch.cat(xs).float().requires_grad_(True)
    t_all = torch.cat(tg)

    def peer_full() -> None:  # the GPU-resident peer's --loss full at the whole batch
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hn = L.rms_norm(x_all, torch.ones(h, device="cuda"), cfg.rms_norm_eps)
        logits = F.linear(hn.reshape(-1, h).bfloat16(), w32.bfloat16()).float()
        F.cross_entropy(logits, t_all.reshape(-1), reduction="sum").backward()

    return {"loss engine (fused fwd+bwd, fp32 head grad)": timed(engine, repeat),
            "loss autograd chunked (recompute)": timed(autograd_path, repeat),
            "loss peer full logits": timed(peer_full, repeat)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument("--micro", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--loss-chunk", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile'd kernels")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager layer cases")
    ap.add_argument("--no-loss", action="store_true", help="skip the loss cases")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    cfg = named_shape(args.shape)
    rows: dict[str, float] = {}

    def put(name: str, seconds: float) -> None:
        rows[name] = seconds
        print(f"{name:60s} {seconds * 1e3:9.2f} ms", flush=True)

    for m in [] if args.no_eager else args.micro:
        put(f"layer m={m} separate", layer_case(cfg, m, args.seq, args.tokens, False, args.repeat))
        put(f"layer m={m} fused", layer_case(cfg, m, args.seq, args.tokens, True, args.repeat))
        put(f"layer m={m} peer (fp32 weights, autocast, checkpoint)", peer_layer_case(cfg, m, args.seq, args.tokens, args.repeat))
    if args.compile:
        L.compile_kernels()
        for m in args.micro:
            put(f"layer m={m} fused + compiled kernels", layer_case(cfg, m, args.seq, args.tokens, True, args.repeat))
            put(f"layer m={m} separate + compiled kernels", layer_case(cfg, m, args.seq, args.tokens, False, args.repeat))
        L.compile_kernels(False)
        eager_layer = L.decoder_layer
        L.decoder_layer = torch.compile(eager_layer, dynamic=False)  # the whole layer as one graph
        for m in args.micro:
            put(f"layer m={m} fused + compiled whole layer", layer_case(cfg, m, args.seq, args.tokens, True, args.repeat))
        L.decoder_layer = eager_layer
    for name, s in {} if args.no_loss else loss_cases(cfg, args.micro[0], args.seq, args.tokens, args.loss_chunk, args.repeat).items():
        put(name, s)
    layers_total = {k: v * cfg.num_layers for k, v in rows.items() if k.startswith("layer")}
    print("per step (x %d layers):" % cfg.num_layers)
    for k, v in layers_total.items():
        print(f"  {k:58s} {v:8.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "seq": args.seq, "tokens": args.tokens, "loss_chunk": args.loss_chunk,
                       "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "seconds": rows, "layers_per_step_s": layers_total}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
