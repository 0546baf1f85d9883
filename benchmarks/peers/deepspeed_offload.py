"""DeepSpeed ZeRO-Offload peer: ZeRO stage 2, optimizer state offloaded to pinned host memory.

bf16, DeepSpeedCPUAdam (AdamW mode; its AVX kernel is JIT-compiled at first use, about a
minute, before the timed steps), overlap_comm, contiguous gradients, world size 1, gradient
clipping to --max-grad-norm (DeepSpeed's `gradient_clipping`: one global norm). When
`import deepspeed` fails the row says so (with the error text) instead of crashing. The
final engine.step() of each optimizer step, where the CPU Adam runs, is timed separately
(row key optimizer_s).

--zenflow: DeepSpeed's ZenFlow (`zero_optimization.zenflow`; in 0.19.8, deepspeed/runtime/zenflow/), the
tutorial's settings: each step updates the top-k gradient columns (topk_ratio 0.05, chosen by
gradient norm) on the GPU, and the other 95 % of the gradient is accumulated and applied by
the CPU Adam every `update_interval` (4) steps, overlapped with the next steps' compute
(overlap_step). The math differs from AdamW: most of each update lands up to 4 steps late.
DeepSpeed builds its ZenFlowCPUAdam from the config's optimizer block. ZenFlow takes over
DeepSpeed's gradient accumulation for its update interval, so it runs one micro-batch per
step (a smaller --micro-batch is a skipped row). Its steps differ by design (every 4th one
carries the CPU update unless it overlaps), so its row's step time is the mean of the timed
steps, not the median.

    python -m benchmarks.peers.deepspeed_offload --shape qwen3-4b --batch 8 --seq 2048 --steps 6 --warmup 2 --json OUT
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from benchmarks.peers import common

BUCKET = int(5e8)  # elements; DeepSpeed's default reduce/allgather bucket sizes
# DeepSpeed's ZenFlow tutorial (deepspeed.ai/tutorials/zenflow)
ZENFLOW = {"topk_ratio": 0.05, "select_strategy": "auto", "select_interval": "auto", "update_interval": 4,
           "full_warm_up_rounds": 0, "overlap_step": True}


def ds_config(args: argparse.Namespace) -> dict[str, Any]:
    gas = args.batch // args.micro_batch
    config = {
        "train_batch_size": args.batch,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": gas,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "reduce_bucket_size": BUCKET,
            "allgather_bucket_size": BUCKET,
        },
        "gradient_clipping": float(args.max_grad_norm),
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if getattr(args, "zenflow", False):
        config["zero_optimization"]["zenflow"] = dict(ZENFLOW)
        # ZenFlow's CPU optimizer (ZenFlowCPUAdam) is built by DeepSpeed from this block
        config["optimizer"] = {"type": "AdamW", "params": {"lr": common.LR, "betas": list(common.BETAS),
                                                           "eps": common.EPS, "weight_decay": common.WEIGHT_DECAY}}
    return config


def _import_deepspeed():
    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # noqa: BLE001 -- ImportError, or whatever its import-time probing raises
        raise common.Skip(f"import deepspeed failed: {type(e).__name__}: {e}") from None
    return deepspeed, DeepSpeedCPUAdam


def measure(args: argparse.Namespace, row: dict[str, Any], host: common.HostMemory) -> None:
    deepspeed, DeepSpeedCPUAdam = _import_deepspeed()
    row["deepspeed"] = getattr(deepspeed, "__version__", "?")
    cfg, device = common.shape_of(args), args.device
    common.single_process_env()
    torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl", auto_mpi_discovery=False)
    if args.zenflow and args.micro_batch != args.batch:
        raise common.Skip(f"ZenFlow runs one micro-batch per step (its update interval is DeepSpeed's gradient "
                          f"accumulation); --micro-batch {args.micro_batch} < --batch {args.batch}")
    model = common.DecoderLM(cfg, loss=args.loss, device="cpu")  # DeepSpeed moves the bf16 copy to the GPU
    model.init_weights(args.seed, on=common.init_on(args))
    config = ds_config(args)
    row["ds_config"] = config
    if args.zenflow:
        common.log("building ZenFlow's CPU Adam from the config (compiles its kernel on first use)")
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        common.log("building DeepSpeedCPUAdam (compiles its kernel on first use)")
        opt = DeepSpeedCPUAdam(model.parameters(), lr=common.LR, betas=common.BETAS, eps=common.EPS,
                               weight_decay=common.WEIGHT_DECAY, adamw_mode=True)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    ids, targets = common.random_batch(cfg, args.batch, args.seq, device, args.seed)
    batches, n_tokens = common.micro_batches(ids, targets, args.micro_batch), ids.numel()
    gas = config["gradient_accumulation_steps"]
    row["parameters"] = cfg.num_parameters()
    row["cpu_threads"] = torch.get_num_threads()

    def step(watch: common.Stopwatch) -> float:
        total = torch.zeros((), device=device)
        for i, (mb_ids, mb_targets) in enumerate(batches):
            loss = engine(mb_ids, mb_targets) / n_tokens
            # DeepSpeed divides by gradient_accumulation_steps itself; our loss is already the
            # mean over the whole step, so undo its division (same update as every other peer).
            engine.backward(loss * gas)
            total += loss.detach().float()
            if i + 1 < len(batches):
                engine.step()  # a micro-step: DeepSpeed only counts it
            else:
                with watch.section("optimizer"):
                    engine.step()  # the boundary: gradients to the host, CPU Adam, parameters back
        return total.item()

    times, sections, losses = common.timed_steps(step, args.steps, device, common.log)
    common.fill_measurements(row, times, sections, losses, args.warmup, stat="mean" if args.zenflow else "median")
    common.fill_memory(row, device, host)


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--loss", choices=("full", "chunked"), default="chunked")
    p.add_argument("--zenflow", action="store_true", help="DeepSpeed ZenFlow (approximate: top-k on the GPU, the rest late)")
    args = p.parse_args(argv)
    common.check_args(args)
    clip = common.clip_text(args.max_grad_norm)
    if args.zenflow:
        z = ZENFLOW
        config = (f"{common.batch_text(args)}, ZeRO-2 + ZenFlow: top {z['topk_ratio']:.0%} of gradient columns updated "
                  f"on the GPU each step, the rest applied by the CPU Adam every {z['update_interval']} steps "
                  f"(approximate: not AdamW's math), bf16, {clip}, {args.loss} CE, mean step")
    else:
        config = f"{common.batch_text(args)}, ZeRO-2, optimizer offload (pinned), bf16, DeepSpeedCPUAdam, {clip}, {args.loss} CE"
    return common.run_peer("zenflow" if args.zenflow else "deepspeed", config, args,
                           lambda row, host: measure(args, row, host), needs_cuda=True)


if __name__ == "__main__":
    sys.exit(main())
