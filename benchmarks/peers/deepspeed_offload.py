"""DeepSpeed ZeRO-Offload peer: ZeRO stage 2, optimizer state offloaded to pinned host memory.

bf16, DeepSpeedCPUAdam (AdamW mode; its AVX kernel is JIT-compiled at first use, about a
minute, before the timed steps), overlap_comm, contiguous gradients, world size 1. When
`import deepspeed` fails the row says so (with the error text) instead of crashing. The
final engine.step() of each optimizer step, where the CPU Adam runs, is timed separately
(row key optimizer_s).

    python -m benchmarks.peers.deepspeed_offload --shape qwen3-4b --batch 8 --seq 2048 --steps 6 --warmup 2 --json OUT
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from benchmarks.peers import common

BUCKET = int(5e8)  # elements; DeepSpeed's default reduce/allgather bucket sizes


def ds_config(args: argparse.Namespace) -> dict[str, Any]:
    gas = args.batch // args.micro_batch
    return {
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
        "gradient_clipping": 0.0,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


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
    model = common.DecoderLM(cfg, loss=args.loss, device="cpu")  # DeepSpeed moves the bf16 copy to the GPU
    model.init_weights(args.seed, on=common.init_on(args))
    common.log("building DeepSpeedCPUAdam (compiles its kernel on first use)")
    opt = DeepSpeedCPUAdam(model.parameters(), lr=common.LR, betas=common.BETAS, eps=common.EPS,
                           weight_decay=common.WEIGHT_DECAY, adamw_mode=True)
    config = ds_config(args)
    row["ds_config"] = config
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
    common.fill_measurements(row, times, sections, losses, args.warmup)
    common.fill_memory(row, device, host)


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--loss", choices=("full", "chunked"), default="chunked")
    args = p.parse_args(argv)
    common.check_args(args)
    config = f"{common.batch_text(args)}, ZeRO-2, optimizer offload (pinned), bf16, DeepSpeedCPUAdam, {args.loss} CE"
    return common.run_peer("deepspeed", config, args, lambda row, host: measure(args, row, host), needs_cuda=True)


if __name__ == "__main__":
    sys.exit(main())
