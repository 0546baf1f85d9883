"""FSDP2 peer: PyTorch's own way to train from host memory (CPUOffloadPolicy) or sharded on the GPUs.

env:// init (a world of one, or torchrun's N ranks; NCCL on CUDA, gloo on CPU), `fully_shard`
on every layer and on the root over all ranks, MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32). --offload (the default): CPUOffloadPolicy() (sharded fp32 parameters,
gradients and AdamW state in pinned host memory), torch AdamW on the CPU; --no-offload:
GPU-resident FSDP2, everything sharded over the GPUs, AdamW on the GPU. AdamW fused (--fused,
the default) or foreach (--no-fused). Each rank takes batch / N sequences; rank 0 writes the
row. Gradients are clipped to --max-grad-norm (one global norm over the shards) before the step;
the optimizer step and the clipping are timed together (row key optimizer_s).

    python -m benchmarks.peers.fsdp2_offload --shape qwen3-4b --batch 8 --seq 2048 --steps 6 --warmup 2 --json OUT
    python -m torch.distributed.run --standalone --nproc-per-node 4 -m benchmarks.peers.fsdp2_offload --gpus 4 ...
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.peers import common


def _fsdp():
    try:  # public since torch 2.6
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    return CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard


def measure(args: argparse.Namespace, row: dict[str, Any], host: common.HostMemory) -> None:
    CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard = _fsdp()
    from torch.distributed.device_mesh import init_device_mesh

    cfg, device = common.shape_of(args), args.device
    rank, local, world = common.rank_and_world()
    if world != args.gpus:
        raise RuntimeError(f"--gpus {args.gpus} but {world} rank(s) started: run it under torchrun --nproc-per-node")
    if device == "cuda":
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method="env://", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh(device, (world,))
        # built on the host: offloaded, the state stays there; else fully_shard moves each shard to its GPU
        model = common.DecoderLM(cfg, loss=args.loss, device="cpu")
        model.init_weights(args.seed, on=common.init_on(args))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        offload = {"offload_policy": CPUOffloadPolicy(pin_memory=device == "cuda")} if args.offload else {}
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp, **offload)
        fully_shard(model, mesh=mesh, mp_policy=mp, **offload)
        kind = {"fused": True} if args.fused else {"foreach": True}
        opt = torch.optim.AdamW(model.parameters(), lr=common.LR, betas=common.BETAS, eps=common.EPS,
                                weight_decay=common.WEIGHT_DECAY, **kind)
        ids, targets = common.random_batch(cfg, args.batch, args.seq, device, args.seed, rank, world)
        batches, n_tokens = common.micro_batches(ids, targets, args.micro_batch), ids.numel()
        row["parameters"] = cfg.num_parameters()
        row["cpu_threads"] = torch.get_num_threads()

        def step(watch: common.Stopwatch) -> float:
            total = torch.zeros((), device=device)
            for mb_ids, mb_targets in batches:
                loss = model(mb_ids, mb_targets) / n_tokens  # FSDP averages over ranks: the global mean
                loss.backward()
                total += loss.detach()
            with watch.section("optimizer"):  # synchronized first: the offloaded grads have landed
                common.clip_gradients(model.parameters(), args.max_grad_norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
            dist.all_reduce(total, op=dist.ReduceOp.AVG)  # the global batch's mean loss, as the others report
            return total.item()

        times, sections, losses = common.timed_steps(step, args.steps, device, common.log)
        common.fill_measurements(row, times, sections, losses, args.warmup)
        common.fill_memory(row, device, host)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True,
                   help="fused CPU AdamW (default); --no-fused: foreach, torch's default")
    p.add_argument("--loss", choices=("full", "chunked"), default="chunked")
    p.add_argument("--offload", action=argparse.BooleanOptionalAction, default=True,
                   help="CPUOffloadPolicy (default); --no-offload: GPU-resident FSDP2 sharded over the ranks")
    args = p.parse_args(argv)
    common.check_args(args)
    opt = "fused" if args.fused else "foreach"
    if args.offload:
        system = "fsdp2_offload" if args.fused else "fsdp2_offload_foreach"
        pin = "" if args.device == "cuda" else " (unpinned)"
        where = f"CPUOffloadPolicy{pin}, CPU AdamW {opt}"
    else:
        system, where = "fsdp2", f"sharded over {args.gpus} rank(s), GPU AdamW {opt}"
    config = f"{common.batch_text(args)}, bf16/fp32 reduce, {where}, {common.clip_text(args.max_grad_norm)}, {args.loss} CE"
    return common.run_peer(system, config, args, lambda row, host: measure(args, row, host), needs_cuda=False)


if __name__ == "__main__":
    sys.exit(main())
