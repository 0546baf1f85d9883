"""torchao's CPUOffloadOptimizer: the model on the GPU, the optimizer step on the host.

The harness's model (`common.DecoderLM`, per-layer checkpointing, chunked loss) with fp32
parameters on the GPU under bf16 autocast; `torchao.optim.CPUOffloadOptimizer` keeps an fp32
copy of every parameter and its AdamW moments in (pinned) host memory, copies each gradient to
the host as soon as backward produces it (a post-accumulate-grad hook), runs torch's fused CPU
AdamW per parameter and copies the parameter back. Exact AdamW in fp32, one GPU only, and no
gradient clipping: each gradient has left for the host before the global norm exists, so the
row trains unclipped whatever --max-grad-norm says (its config says so). With one micro-batch
per step the GPU gradients are freed once copied (`offload_gradients=True`); gradient
accumulation needs them kept.

    python -m benchmarks.peers.torchao_offload --shape qwen3-4b --batch 8 --seq 2048 --steps 6 --warmup 2 --json OUT
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from benchmarks.peers import common


def _cpu_offload_optimizer():
    try:
        import torchao
        from torchao.optim import CPUOffloadOptimizer
    except Exception as e:  # noqa: BLE001 -- ImportError, or a torch version it refuses
        raise common.Skip(f"import torchao.optim.CPUOffloadOptimizer failed: {type(e).__name__}: {e}") from None
    return CPUOffloadOptimizer, getattr(torchao, "__version__", "?")


def measure(args: argparse.Namespace, row: dict[str, Any], host: common.HostMemory) -> None:
    CPUOffloadOptimizer, row["torchao"] = _cpu_offload_optimizer()
    cfg, device = common.shape_of(args), args.device
    model = common.DecoderLM(cfg, loss=args.loss, device=device)
    model.init_weights(args.seed, on=common.init_on(args))
    common.sync(device)
    offload_grads = args.micro_batch == args.batch
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=offload_grads, fused=True,
                              lr=common.LR, betas=common.BETAS, eps=common.EPS, weight_decay=common.WEIGHT_DECAY)
    row["offload_gradients"] = offload_grads
    row["cpu_threads"] = torch.get_num_threads()
    # no clipping: each gradient is on its way to the host before the global norm exists
    common.train_resident(args, row, host, model, lambda ids, targets, n: model(ids, targets) / n, opt,
                          clip=False, time_optimizer=True)


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--loss", choices=("full", "chunked"), default="chunked")
    args = p.parse_args(argv)
    common.check_args(args)
    clip = "no clipping (CPUOffloadOptimizer cannot clip)" if args.max_grad_norm > 0 else "no clipping"
    config = (f"{common.batch_text(args)}, fp32 params on the GPU, bf16 autocast, fp32 master + moments on the host, "
              f"torchao CPUOffloadOptimizer (fused CPU AdamW, exact), {clip}, {args.loss} CE")
    args.max_grad_norm = 0.0  # what it trains with; the row records it
    return common.run_peer("torchao_offload", config, args, lambda row, host: measure(args, row, host), needs_cuda=True)


if __name__ == "__main__":
    sys.exit(main())
