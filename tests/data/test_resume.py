"""Resume mid-epoch on shuffled, packed chat data: a run stopped after step 5 and resumed from its
checkpoint (into a new store) ends bit-identical to the uninterrupted run, every step with the same
loss: the resumed run saw the same rows in the same order, into the next epoch."""

from __future__ import annotations

import json

import torch

from slidedp.config import load_job, model_config
from slidedp.data.setup import open_training

from pipeline.harness import TINY, checkpoint_weights, launch, metrics, unique_store
from data.common import CHAT, CHAT_TOKENIZER

STEPS, STOP = 9, 5


def sets(data, run_dir, steps: int, *extra: str) -> list[str]:
    return [f'data.path="{data}"', f'data.tokenizer="{CHAT_TOKENIZER}"', "data.shuffle=true", "data.seed=11",
            "train.seq_len=64", "train.global_batch=8", "plan.micro_batch=2", f"train.steps={steps}",
            'train.schedule="constant"', "train.warmup_steps=0", 'plan.compute_dtype="fp32"', "runtime.workers=2",
            f'store.name="{unique_store("sres")}"', f'run.dir="{run_dir}"', 'checkpoint.dtype="fp32"', *extra]


def test_resume_mid_epoch_is_bit_identical(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIDEDP_LOG_LEVEL", "INFO")  # the launcher says what it resumed from
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join((CHAT / "train.jsonl").read_text().splitlines()[:60]) + "\n")
    job = load_job(TINY, sets(data, tmp_path / "x", STEPS))
    batches = open_training(job, model_config(job).vocab_size)
    per_epoch = batches.num_sequences / 8
    assert STOP < per_epoch < STEPS  # stopped inside the first epoch, the run goes on into the second
    whole, first, rest = tmp_path / "whole", tmp_path / "first", tmp_path / "rest"
    for run_dir, steps, extra in ((whole, STEPS, ()), (first, STOP, ())):
        proc = launch(TINY, *sets(data, run_dir, steps, *extra), cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    checkpoint = first / "checkpoints" / f"step-{STOP:08d}"
    state = json.loads((checkpoint / "state.json").read_text())["extra"]["data"]
    assert state == batches.state(STOP) and state["epoch"] == 0 and state["position"] == STOP * 8
    proc = launch(TINY, *sets(data, rest, STEPS, f'checkpoint.resume="{checkpoint}"'), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"resumed from {checkpoint} (step {STOP})" in proc.stdout + proc.stderr
    want = {m["step"]: m for m in metrics(whole)}
    got = metrics(first) + metrics(rest)
    assert [m["step"] for m in got] == list(range(STEPS))
    assert all((m["loss"], m["grad_norm"]) == (want[m["step"]]["loss"], want[m["step"]]["grad_norm"]) for m in got)
    a, b = (checkpoint_weights(d / "checkpoints" / f"step-{STEPS:08d}") for d in (rest, whole))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
