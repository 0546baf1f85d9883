"""What users run today on one GPU: a `transformers` model with Liger kernels, GPU-resident.

The model is `AutoModelForCausalLM` built from the workload's config (`hf_model.build`), patched
by Liger before it is built (`apply_liger_kernel_to_<family>`: RMSNorm, RoPE, SwiGLU and the
fused linear cross-entropy, which never materializes the logits), with gradient checkpointing
(non-reentrant) and SDPA attention. The math of the Hugging Face Trainer's `bf16=True`: fp32
parameters, gradients and AdamW moments on the GPU, bf16 autocast, torch's fused AdamW
(`adamw_torch_fused`), the global gradient norm clipped to --max-grad-norm. The loss is the sum
of the step's token losses over its token count (`num_items_in_batch`), on the same shifted
targets as every peer (`shift_labels`).

--no-liger: the same model and loop without Liger (transformers' own kernels); it runs on the
CPU too, which is how the tests check that this peer trains the harness's model.

--model-dir DIR: the model is that Hugging Face folder (`from_pretrained`, fp32 parameters, the same weights
SlideDP reads from it), patched by the Liger function of its model_type where Liger has one (gemma3_text;
qwen3_5_text where the installed liger-kernel has it, else a row that says Liger has no kernels for it).

--chat DIR: padding-free packed SFT as transformers does it: the rows of packed conversations that
SlideDP trains (common.chat_batches), each with its position ids, which restart at every document;
transformers turns them into a per-document mask for the attention implementation --attn
(flex_attention: a block mask, nothing computed across documents; sdpa: a dense mask).

    python -m benchmarks.peers.hf_liger --shape qwen3-4b --batch 8 --seq 2048 --steps 6 --warmup 2 --json OUT
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

import torch

from benchmarks.peers import common, hf_model

_LIGER_APPLY = {"qwen3": "apply_liger_kernel_to_qwen3", "qwen2": "apply_liger_kernel_to_qwen2",
                "llama": "apply_liger_kernel_to_llama", "mistral": "apply_liger_kernel_to_mistral",
                "gemma3_text": "apply_liger_kernel_to_gemma3_text", "qwen3_5_text": "apply_liger_kernel_to_qwen3_5",
                "qwen3_moe": "apply_liger_kernel_to_qwen3_moe"}
# the kernels asked of every family, as far as its patch function takes them (Gemma's MLP is GEGLU, not SwiGLU)
_LIGER_KERNELS = {"rope": True, "rms_norm": True, "swiglu": True, "geglu": True, "cross_entropy": False,
                  "fused_linear_cross_entropy": True}
# Liger's RoPE does not cover Qwen3.5's partial rotary embedding (its patch refuses rope=True)
_LIGER_NOT = {"qwen3_5_text": ("rope",)}


def liger_patch(family: str) -> tuple[Callable[..., None], str]:
    """Liger's patch function for the model family and liger-kernel's version; a Skip that says why not."""
    try:
        import liger_kernel
        import liger_kernel.transformers as lt
    except Exception as e:  # noqa: BLE001 -- ImportError, or a triton/transformers mismatch at import
        raise common.Skip(f"import liger_kernel failed: {type(e).__name__}: {e}") from None
    version = getattr(liger_kernel, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("liger-kernel")
    name = _LIGER_APPLY.get(family)
    if name is None or not hasattr(lt, name):
        where = f" (liger-kernel {version} has no {name})" if name else ""
        raise common.Skip(f"Liger has no kernels for {family}{where}")
    return getattr(lt, name), version


def liger_kernels(apply: Callable[..., None], family: str) -> dict[str, bool]:
    """The keyword arguments of `apply` that ask for _LIGER_KERNELS (those it takes; rope off where Liger's does
    not fit the family)."""
    import inspect

    params = inspect.signature(apply).parameters
    return {k: v and k not in _LIGER_NOT.get(family, ()) for k, v in _LIGER_KERNELS.items() if k in params}


def load_folder(args: argparse.Namespace, device: str) -> torch.nn.Module:
    """--model-dir's model as users load it: from_pretrained in fp32 (the Trainer's bf16=True math keeps fp32
    parameters), its own weights, then moved to the device."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32,
                                                 attn_implementation=args.attn)
    model.config.use_cache = False  # training: no KV cache
    return model.to(device)


def measure(args: argparse.Namespace, row: dict[str, Any], host: common.HostMemory) -> None:
    device = args.device
    family = common.model_dir_config(args)["model_type"] if args.model_dir else common.shape_of(args).family
    if args.liger:
        apply, row["liger_kernel"] = liger_patch(family)
        row["liger_kernels"] = kernels = liger_kernels(apply, family)
        apply(**kernels)
    import transformers

    row["transformers"] = transformers.__version__
    if args.model_dir:
        model = load_folder(args, device)
        row["init"] = f"the folder's weights ({args.model_dir})"
    else:
        model = hf_model.build(cfg=common.shape_of(args), device=device, dtype=torch.float32, seed=args.seed,
                               on=common.init_on(args), attn_implementation=args.attn)
    if hasattr(model, "activation_checkpointing_enable"):  # newer transformers' name (the old one warns)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    common.sync(device)
    opt = torch.optim.AdamW(model.parameters(), lr=common.LR, betas=common.BETAS, eps=common.EPS,
                            weight_decay=common.WEIGHT_DECAY, fused=True)

    def loss_of(ids: torch.Tensor, targets: torch.Tensor, step_tokens: int) -> torch.Tensor:
        # the sum of the token losses over the step's count: the step's token-mean, as every peer
        return model(input_ids=ids, labels=targets, shift_labels=targets, num_items_in_batch=step_tokens).loss

    if args.chat:
        train_packed(args, row, host, model, opt)
    else:
        common.train_resident(args, row, host, model, loss_of, opt, autocast=args.dtype == "bf16")


def train_packed(args: argparse.Namespace, row: dict[str, Any], host: common.HostMemory, model: torch.nn.Module,
                 opt: Any) -> None:
    """Step s trains SlideDP's rows of step s: each micro-batch's rows with their position ids, the loss the
    sum of the trained targets' losses over the step's count (as SlideDP's loss scale)."""
    device = args.device
    batches = common.chat_batches(args, common.shape_of(args))
    steps = []
    for s in range(args.steps):
        b = batches.batch(s)
        ids, targets, positions = (torch.from_numpy(a).to(device) for a in (b.ids, b.targets, b.positions))
        micro = [(ids[i:i + args.micro_batch], targets[i:i + args.micro_batch], positions[i:i + args.micro_batch])
                 for i in range(0, args.batch, args.micro_batch)]
        steps.append((micro, b.trained_tokens))
    amp = torch.autocast(device, dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    row["parameters"] = sum(p.numel() for p in model.parameters())
    row["trained_tokens"] = [n for _, n in steps]
    at = iter(range(args.steps))

    def step(watch: common.Stopwatch) -> float:
        micro, trained = steps[next(at)]
        total = torch.zeros((), device=device)
        for mb_ids, mb_targets, mb_positions in micro:
            with amp:
                loss = model(input_ids=mb_ids, position_ids=mb_positions, labels=mb_targets,
                             shift_labels=mb_targets, num_items_in_batch=trained).loss
            loss.backward()
            total += loss.detach().float()
        common.clip_gradients(model.parameters(), args.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total.item()

    times, sections, losses = common.timed_steps(step, args.steps, device, common.log)
    common.fill_measurements(row, times, sections, losses, args.warmup)
    common.fill_memory(row, device, host)


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--liger", action=argparse.BooleanOptionalAction, default=True,
                   help="patch the model with Liger's kernels (default); --no-liger: transformers' own")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="autocast dtype (fp32: no autocast)")
    p.add_argument("--attn", default="sdpa", help="transformers' attention implementation (sdpa, flex_attention, eager)")
    args = p.parse_args(argv)
    common.check_args(args)
    kernels = "Liger RMSNorm/RoPE/SwiGLU + fused linear CE" if args.liger else "transformers' kernels, full-logits CE"
    amp = "bf16 autocast" if args.dtype == "bf16" else "fp32 compute"
    rows = f", packed chat rows with position ids, {args.attn}" if args.chat else f", {args.attn}"
    config = (f"{common.batch_text(args)}{rows}, transformers, {kernels}, fp32 params/grads/moments on "
              f"{args.device.upper()}, {amp}, gradient checkpointing, fused AdamW, {common.clip_text(args.max_grad_norm)}")
    system = "hf_liger" if args.liger else "hf"
    return common.run_peer(system, config, args, lambda row, host: measure(args, row, host),
                           needs_cuda=args.liger, model_dir_ok=not args.chat)


if __name__ == "__main__":
    sys.exit(main())
