"""The oracle: one process, plain autograd, torch.optim.AdamW. Every engine is tested against it.

Kept short and obviously right on purpose: whole global batch at once, loss = sum of token
losses / (B * L), weight decay on matrices only, the lr of `schedule.lr_at`, optional clipping.
Rows of documents (chat, prompt/completion, packed or padded): each document of the step runs on
its own, loss = sum of its trained targets' losses over the step / the step's trained targets.

    python -m slidedp.reference job.toml [--steps N] [--set section.key=value ...]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from slidedp.config import JobConfig, load_job, model_config
from slidedp.data.batches import Batches
from slidedp.data.packing import DocBatches
from slidedp.data.setup import open_training
from slidedp.data.targets import IGNORE_INDEX
from slidedp.model import layers
from slidedp.model.dtypes import torch_dtype
from slidedp.schedule import lr_at



@dataclass
class ReferenceResult:
    losses: list[float]
    grad_norms: list[float]  # total norm before clipping
    params: dict[str, torch.Tensor]  # fp32, after the last step
    moments: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # "exp_avg"/"exp_avg_sq" -> name -> fp32


def train_reference(
    job: JobConfig,
    params: dict[str, torch.Tensor],
    batches: Batches,
    steps: int | None = None,
    start_step: int = 0,
    dtype: torch.dtype = torch.float32,
    on_step: Callable[[int, float, float, float], None] | None = None,
) -> ReferenceResult:
    """Train `steps` steps (default: to train.steps) from `start_step` with fresh AdamW moments.

    `dtype` is the compute dtype: the fp32 master parameters are cast for the forward, and
    gradients come back in fp32. `on_step(step, loss, grad_norm, lr)` is called after each step.
    """
    cfg, train = model_config(job), job.train
    steps = train.steps - start_step if steps is None else steps
    master = {k: v.detach().to(torch.float32).clone().requires_grad_(True) for k, v in params.items()}
    matrices = [p for p in master.values() if p.ndim >= 2]
    vectors = [p for p in master.values() if p.ndim < 2]  # norms and biases: no weight decay
    opt = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": train.weight_decay}, {"params": vectors, "weight_decay": 0.0}],
        lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps, foreach=False,
    )
    result = ReferenceResult([], [], {})
    for step in range(start_step, start_step + steps):
        compute = master if dtype == torch.float32 else {k: p.to(dtype) for k, p in master.items()}
        if isinstance(batches, DocBatches):
            loss = documents_loss(cfg, compute, batches, step)
        else:
            batch = torch.from_numpy(batches.batch(step))
            ids, targets = batch[:, :-1], batch[:, 1:]
            logits = layers.forward_logits(cfg, compute, ids)
            loss = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
            ) / targets.numel()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grads = [p.grad for p in master.values() if p.grad is not None]
        if train.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(list(master.values()), train.max_grad_norm)
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        lr = lr_at(train, step)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        result.losses.append(loss.item())
        result.grad_norms.append(float(norm))
        if on_step:
            on_step(step, result.losses[-1], result.grad_norms[-1], lr)
    result.params = {k: p.detach() for k, p in master.items()}
    result.moments = {kind: {k: opt.state[p][kind] for k, p in master.items() if p in opt.state}
                      for kind in ("exp_avg", "exp_avg_sq")}
    return result


def step_documents(batches: DocBatches, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) of every document of the step's rows, targets IGNORE_INDEX where untrained."""
    rows = batches.stream
    out = []
    for r in batches.sequence_ids(step).tolist():
        for d in rows.row_docs[rows.row_offsets[r]:rows.row_offsets[r + 1]].tolist():
            tok, trained = (torch.from_numpy(a.astype("int64")) for a in rows.docs.document(d))
            out.append((tok[:-1], torch.where(trained[1:] == 1, tok[1:], IGNORE_INDEX)))
    return out


def documents_loss(cfg, params, batches: DocBatches, step: int) -> torch.Tensor:
    """Each document alone; the summed loss of the trained targets / their count over the step."""
    docs = step_documents(batches, step)
    count = sum(int((t != IGNORE_INDEX).sum()) for _, t in docs)
    total = sum(F.cross_entropy(layers.forward_logits(cfg, params, ids[None]).float()[0], t, reduction="sum")
                for ids, t in docs)
    return total / count


def initial_params(job: JobConfig) -> dict[str, torch.Tensor]:
    """Starting weights in fp32: the checkpoint's for source "hf", the seeded init for "random"."""
    cfg = model_config(job)
    if job.model.source == "hf":
        from slidedp.model import hf

        index = hf.tensor_index(job.model.path)
        return {n: hf.load_model_tensor(job.model.path, cfg, n, torch.empty(s), index=index)
                for n, s in cfg.parameter_shapes()}
    from slidedp.model.init import init_params

    return init_params(cfg, job.model.init_seed)


def reference_main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m slidedp.reference", description="Train a job with the reference on CPU.")
    ap.add_argument("job", help="job.toml")
    ap.add_argument("--steps", type=int, default=None, help="steps to run (default: train.steps)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a job file value (repeatable)")
    args = ap.parse_args(argv)
    job = load_job(args.job, args.overrides)
    params = initial_params(job)
    batches = open_training(job, model_config(job).vocab_size)
    total = args.steps or job.train.steps

    def report(step: int, loss: float, norm: float, lr: float) -> None:
        print(f"step {step + 1}/{total} loss {loss:.4f} grad_norm {norm:.3f} lr {lr:.3e}", flush=True)

    train_reference(job, params, batches, steps=args.steps, dtype=torch_dtype(job.plan.dtype), on_step=report)
    return 0


if __name__ == "__main__":
    sys.exit(reference_main())
