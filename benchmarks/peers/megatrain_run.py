"""MegaTrain (github.com/DLYuanGod/MegaTrain, Apache-2.0), the SlideDP paper's baseline, on the harness's workload.

MegaTrain is not part of this repository: point --megatrain (or MEGATRAIN_PATH) at a clone (the
default is `.peers/MegaTrain` in the checkout, a folder git ignores); without one the row is a
skipped row that says where it looked. The adapter runs MegaTrain the way its
`examples/sft/train.py` does, with the benchmark's model and batch instead of a hub model and a
chat dataset:

- the model is `AutoModelForCausalLM` of the workload's config (`hf_model.build`, SDPA
  attention: flash-attn is not installed here) in bf16 on the host, handed to
  `infinity.CPUMasterModel` with `CPUMasterConfig` (its defaults: checkpoint every 4 layers,
  12 gradient slabs);
- the optimizer is what train.py picks: DeepSpeedCPUAdam (AdamW mode) when DeepSpeed imports,
  torch's AdamW otherwise (the row's `megatrain_optimizer` says which);
- each step: `forward_and_backward`, `clip_grad_norm_` over its parameters, optimizer step,
  `_sync_params_to_gpu`, zero the gradients (train.py's loop).

Its math, as read in its code (infinity/model/cpu_master.py): the CPU master IS the Hugging Face
model's parameters in `config.dtype` (bf16): weights and gradients are bf16 in host memory (the
gradient slabs are bf16 too); DeepSpeedCPUAdam keeps its moments in fp32
(`fp32_optimizer_states=True`) but writes each update into the bf16 weights, so updates smaller
than a bf16 ulp of the weight are lost. Not fp32-master AdamW.

MegaTrain computes the loss of token t+1 from position t inside each sequence, so the adapter hands
it the T+1-token windows the peers' inputs and targets are cut from: it predicts exactly the
peers' T targets per sequence (and runs one token more per sequence through the model).
MegaTrain passes its 2-D padding mask straight to every layer, which flash-attention 2 (its
default) reads as padding; flash-attn is not installed on the GPU machine, and SDPA cannot take
that mask, so the adapter gives MegaTrain no padding mask (every token is real): the layers run
causal SDPA, which is what flash-attention 2 computes with an all-ones mask.

    python -m benchmarks.peers.megatrain_run --megatrain /path/to/MegaTrain --shape qwen3-4b --batch 8 --seq 2048 --json OUT
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.peers import common, hf_model

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PATH = ROOT / ".peers" / "MegaTrain"
ENV = "MEGATRAIN_PATH"


def megatrain_path(flag: str) -> Path:
    return Path(flag or os.environ.get(ENV) or DEFAULT_PATH).resolve()


def import_megatrain(path: Path) -> tuple[Any, Any, str]:
    """(CPUMasterModel, CPUMasterConfig, commit or '?') from a clone at `path`; a Skip that says why not."""
    if not (path / "infinity" / "__init__.py").is_file():
        raise common.Skip(f"MegaTrain not found at {path} (clone github.com/DLYuanGod/MegaTrain there, "
                          f"or pass --megatrain / set {ENV})")
    sys.path.insert(0, str(path))
    try:
        from infinity import CPUMasterConfig, CPUMasterModel
    except Exception as e:  # noqa: BLE001 -- a missing dependency of MegaTrain's, or a version it needs
        raise common.Skip(f"import infinity (MegaTrain at {path}) failed: {type(e).__name__}: {e}") from None
    return CPUMasterModel, CPUMasterConfig, clone_commit(path)


def clone_commit(path: Path) -> str:
    """The clone's commit: its .git HEAD, or a COMMIT file beside it (a copy carried without .git)."""
    try:
        ref = (path / ".git" / "HEAD").read_text().strip()
        return (path / ".git" / ref[5:]).read_text().strip() if ref.startswith("ref: ") else ref
    except OSError:
        pass
    try:
        return (path / "COMMIT").read_text().strip() or "?"
    except OSError:
        return "?"


class NoPaddingMask:
    """Stands for MegaTrain's attention_mask argument: `.to(device)` gives None, so its layers see no
    mask and run causal attention (see the module's docstring)."""

    def to(self, *args: object, **kwargs: object) -> None:
        return None


def _optimizer(params: list[torch.Tensor]) -> tuple[torch.optim.Optimizer, str]:
    """train.py's choice: DeepSpeedCPUAdam when it imports, else torch's AdamW."""
    kwargs = dict(lr=common.LR, betas=common.BETAS, eps=common.EPS, weight_decay=common.WEIGHT_DECAY)
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # noqa: BLE001 -- as train.py: any failure falls back to torch
        return torch.optim.AdamW(params, **kwargs), "torch AdamW (DeepSpeed not importable)"
    return DeepSpeedCPUAdam(params, adamw_mode=True, **kwargs), "DeepSpeedCPUAdam (fp32 moments)"


def measure(args: argparse.Namespace, row: dict[str, Any], host: common.HostMemory) -> None:
    CPUMasterModel, CPUMasterConfig, row["megatrain_commit"] = import_megatrain(megatrain_path(args.megatrain))
    cfg = common.shape_of(args)
    model_hf = hf_model.build(cfg, "cuda", torch.bfloat16, args.seed, common.init_on(args)).to("cpu")
    common.sync("cuda")
    config = CPUMasterConfig(
        model_name=f"random {args.shape}", dataset_path="(the harness's batch)", batch_size=args.micro_batch,
        max_seq_len=args.seq + 1, gradient_accumulation_steps=args.batch // args.micro_batch, num_steps=args.steps,
        learning_rate=common.LR, weight_decay=common.WEIGHT_DECAY, max_grad_norm=args.max_grad_norm,
        beta1=common.BETAS[0], beta2=common.BETAS[1], eps=common.EPS, device=0, dtype=torch.bfloat16,
        attn_implementation="sdpa", checkpoint_interval=args.checkpoint_interval, num_grad_slabs=args.grad_slabs)
    model = CPUMasterModel(model_hf, config)
    del model_hf
    params = model.get_parameters()
    row["master_dtypes"] = sorted({str(p.dtype).removeprefix("torch.") for p in params})
    opt, row["megatrain_optimizer"] = _optimizer(params)
    stream = common.batch_stream(cfg, args.batch, args.seq, args.seed)
    windows = stream.unfold(0, args.seq + 1, args.seq)  # [B, T+1]: inputs and targets of the peers
    batches = list(windows.split(args.micro_batch))
    row["parameters"] = sum(p.numel() for p in params)
    row["cpu_threads"] = torch.get_num_threads()

    def step(watch: common.Stopwatch) -> float:
        losses = []
        for w in batches:
            loss, _, _ = model.forward_and_backward(w, NoPaddingMask(), w)  # its own mean over the micro-batch
            losses.append(loss)
        with watch.section("optimizer"):
            if args.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            opt.step()
            model._sync_params_to_gpu()
            model.zero_grad()
            opt.zero_grad()
        return sum(losses) / len(losses)

    try:
        times, sections, losses = common.timed_steps(step, args.steps, "cuda", common.log)
    finally:
        model.cleanup()
    common.fill_measurements(row, times, sections, losses, args.warmup)
    common.fill_memory(row, "cuda", host)


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--megatrain", default="", help=f"MegaTrain clone (default ${ENV}, else {DEFAULT_PATH})")
    p.add_argument("--checkpoint-interval", type=int, default=4, help="CPUMasterConfig.checkpoint_interval (its default 4)")
    p.add_argument("--grad-slabs", type=int, default=12, help="CPUMasterConfig.num_grad_slabs (its default 12)")
    args = p.parse_args(argv)
    common.check_args(args)
    # as MegaTrain's train.py sets it at import: before CUDA's allocator starts (run_peer touches CUDA)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    config = (f"{common.batch_text(args)}, MegaTrain CPUMasterModel: bf16 weights and gradients on the host "
              f"(not fp32 master), CPU Adam with fp32 moments, bf16 compute, checkpoint every "
              f"{args.checkpoint_interval} layers, SDPA, {common.clip_text(args.max_grad_norm)}")
    return common.run_peer("megatrain", config, args, lambda row, host: measure(args, row, host), needs_cuda=True)


if __name__ == "__main__":
    sys.exit(main())
