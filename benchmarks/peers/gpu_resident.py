"""GPU-resident peer: the whole training state on the GPU.

fp32 parameters, gradients and AdamW moments on the GPU, bf16 autocast, torch's fused AdamW
on the GPU (after clipping the global gradient norm, --max-grad-norm), per-layer activation
checkpointing (slidedp.model.layers run eagerly, unfused projections); the loss over full logits (--loss full) or
chunked (--loss chunked, 4,096-token chunks, logits recomputed in backward). The upper bound
every offloading system is measured against.

    python -m benchmarks.peers.gpu_resident --shape qwen3-4b --batch 8 --seq 2048 --steps 6 --warmup 2 --json OUT
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from benchmarks.peers import common


def measure(args: argparse.Namespace, row: dict[str, Any], host: common.HostMemory) -> None:
    cfg, device = common.shape_of(args), args.device
    model = common.DecoderLM(cfg, loss=args.loss, device=device)
    model.init_weights(args.seed, on=common.init_on(args))
    common.sync(device)
    opt = torch.optim.AdamW(model.parameters(), lr=common.LR, betas=common.BETAS, eps=common.EPS,
                            weight_decay=common.WEIGHT_DECAY, fused=True)
    common.train_resident(args, row, host, model, lambda ids, targets, n: model(ids, targets) / n, opt,
                          autocast=args.dtype == "bf16")


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--loss", choices=("full", "chunked"), default="full")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="autocast dtype (fp32: no autocast)")
    args = p.parse_args(argv)
    common.check_args(args)
    system = "gpu_resident" if args.loss == "full" else "gpu_resident_chunked"
    amp = "bf16 autocast" if args.dtype == "bf16" else "fp32 compute"
    config = f"{common.batch_text(args)}, fp32 on {args.device.upper()}, {amp}, fused AdamW, {common.clip_text(args.max_grad_norm)}, {args.loss} CE"
    return common.run_peer(system, config, args, lambda row, host: measure(args, row, host), needs_cuda=False)


if __name__ == "__main__":
    sys.exit(main())
