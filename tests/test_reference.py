from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from slidedp.config import load_job, model_config
from slidedp.data.batches import open_batches
from slidedp.model import layers
from slidedp.reference import initial_params, reference_main, train_reference

TINY = Path(__file__).resolve().parent.parent / "examples" / "tiny.toml"


def setup(*overrides: str):
    job = load_job(TINY, overrides)
    cfg = model_config(job)
    return job, cfg, initial_params(job), open_batches(job, cfg.vocab_size)


def test_loss_falls_on_the_example():
    job, _, params, batches = setup()
    res = train_reference(job, params, batches, steps=10)
    assert len(res.losses) == len(res.grad_norms) == 10
    assert res.losses[0] == pytest.approx(math.log(512), abs=0.05)  # a fresh model guesses uniformly
    assert sum(res.losses[-3:]) / 3 < res.losses[0] - 0.5
    assert all(p.dtype == torch.float32 for p in res.params.values())
    assert set(res.params) == set(params)
    assert params["model.norm.weight"].eq(1).all()  # the caller's tensors are not touched


def hand_written(job, cfg, params, batches, steps):
    """AdamW spelled out: decoupled decay on matrices only, bias correction, global-norm clipping."""
    t = job.train
    p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in params.items()}
    v2 = {k: torch.zeros_like(v) for k, v in params.items()}
    losses, norms = [], []
    for step in range(steps):
        batch = torch.from_numpy(batches.batch(step))
        logits = layers.forward_logits(cfg, p, batch[:, :-1])
        logp = torch.log_softmax(logits, dim=-1)
        loss = -logp.gather(-1, batch[:, 1:, None]).mean()  # mean over all B * L target tokens
        grads = dict(zip(p, torch.autograd.grad(loss, list(p.values()))))
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
        coef = min(1.0, t.max_grad_norm / (float(norm) + 1e-6)) if t.max_grad_norm > 0 else 1.0
        lr = t.lr * (step + 1) / t.warmup_steps  # both steps are inside the warmup
        n = step + 1
        with torch.no_grad():
            for k, w in p.items():
                g = grads[k] * coef
                if w.ndim >= 2:
                    w.mul_(1 - lr * t.weight_decay)
                m[k] = t.beta1 * m[k] + (1 - t.beta1) * g
                v2[k] = t.beta2 * v2[k] + (1 - t.beta2) * g * g
                denom = v2[k].sqrt() / math.sqrt(1 - t.beta2**n) + t.eps
                w.sub_(lr / (1 - t.beta1**n) * m[k] / denom)
        losses.append(loss.item())
        norms.append(float(norm))
    return losses, norms, {k: w.detach() for k, w in p.items()}


@pytest.mark.parametrize("max_grad_norm", [0.5, 0.0])
def test_matches_hand_written_adamw(max_grad_norm):
    job, cfg, params, batches = setup(
        f"train.max_grad_norm={max_grad_norm}", "train.weight_decay=0.1", "train.warmup_steps=3", "train.lr=1e-2"
    )
    res = train_reference(job, params, batches, steps=2)
    losses, norms, want = hand_written(job, cfg, params, batches, 2)
    assert res.losses == pytest.approx(losses, rel=1e-6)
    assert res.grad_norms == pytest.approx(norms, rel=1e-5)
    if max_grad_norm:
        assert min(norms) > max_grad_norm  # clipping really acted
    for k in want:
        torch.testing.assert_close(res.params[k], want[k], rtol=0, atol=2e-6, msg=k)
        assert not torch.equal(res.params[k], params[k]), k  # every tensor moved


def test_start_step_picks_that_steps_batch_and_lr():
    job, cfg, params, batches = setup("train.max_grad_norm=0")
    res = train_reference(job, params, batches, steps=1, start_step=5)
    batch = torch.from_numpy(batches.batch(5))
    logits = layers.forward_logits(cfg, params, batch[:, :-1])
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 512), batch[:, 1:].reshape(-1))
    assert res.losses[0] == pytest.approx(want.item(), rel=1e-6)
    # first Adam step moves every matrix entry with a gradient by about lr (lr_at(5) = 3e-3, the peak)
    delta = (res.params["model.layers.0.mlp.up_proj.weight"] - params["model.layers.0.mlp.up_proj.weight"]).abs()
    assert delta.max().item() == pytest.approx(3e-3, rel=0.01)


def test_bf16_compute_keeps_fp32_master():
    job, _, params, batches = setup()
    fp32 = train_reference(job, params, batches, steps=2)
    bf16 = train_reference(job, params, batches, steps=2, dtype=torch.bfloat16)
    assert bf16.losses[0] == pytest.approx(fp32.losses[0], abs=0.03)
    assert bf16.losses[0] != fp32.losses[0]
    assert all(p.dtype == torch.float32 for p in bf16.params.values())


def test_cli_prints_a_loss_per_step(capsys):
    assert reference_main([str(TINY), "--steps", "3", "--set", "train.lr=1e-3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3
    pat = re.compile(r"^step (\d)/3 loss (\d+\.\d{4}) grad_norm \d+\.\d{3} lr (\S+)$")
    matches = [pat.match(line) for line in lines]
    assert all(matches), lines
    job, _, params, batches = setup("train.lr=1e-3")
    want = train_reference(job, params, batches, steps=3).losses
    assert [float(mt.group(2)) for mt in matches] == [round(x, 4) for x in want]
    assert [float(mt.group(3)) for mt in matches] == [2e-4, 4e-4, 6e-4]
