"""A chat fine-tuning job on a model folder that transformers wrote, tokenizer taken from the folder:
its checkpoint's model/ is ready to serve (transformers loads it, apply_chat_template works on it, it
generates), the eval loss in metrics.jsonl equals transformers' loss on the checkpoint, and the
TensorBoard event files hold the same scalars."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from slidedp.config import load_job, model_config
from slidedp.data.targets import IGNORE_INDEX
from slidedp.data.setup import open_eval

from pipeline.harness import TINY, launch, metrics, store_segments, unique_store
from data.common import CHAT, conversations, write_model_folder

transformers = pytest.importorskip("transformers")

STEPS, EVERY = 4, 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    folder = write_model_folder(tmp / "source", family="llama", tied=False, seed=1)
    store, run_dir = unique_store("serve"), tmp / "run"
    sets = ['model.source="hf"', f'model.path="{folder}"', "model.vocab_size=0", 'data.tokenizer=""',
            f'data.path="{CHAT / "train.jsonl"}"', f'data.eval_path="{CHAT / "eval.jsonl"}"', "train.seq_len=64",
            f"train.steps={STEPS}", f"train.eval_every={EVERY}", "train.global_batch=8", "plan.micro_batch=2",
            'plan.compute_dtype="fp32"', "runtime.workers=2", f'store.name="{store}"', f'run.dir="{run_dir}"',
            'checkpoint.dtype="fp32"', "run.tensorboard=true"]
    proc = launch(TINY, *sets, cwd=tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert store_segments(store) == []
    return folder, run_dir, sets, proc


def test_the_checkpoint_is_ready_to_serve(run):
    source, run_dir, _, _ = run
    model_dir = run_dir / "checkpoints" / f"step-{STEPS:08d}" / "model"
    names = sorted(p.name for p in model_dir.iterdir())
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
            "config.json", "model.safetensors"} <= set(names), names
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (model_dir / name).read_bytes() == (source / name).read_bytes(), name
    src, out = (json.loads((d / "config.json").read_text()) for d in (source, model_dir))
    assert src["pad_token_id"] == 0
    kept = {k for k in src if k not in ("dtype", "torch_dtype")}
    assert {k: out[k] for k in kept} == {k: src[k] for k in kept}
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    messages = conversations(1)[0][:-1]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert tok.decode(ids["input_ids"][0]).endswith("<|im_start|>assistant\n")
    out = model.generate(**ids, max_new_tokens=6, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]
    assert model.generation_config.eos_token_id == 2 and model.generation_config.pad_token_id == 0


def test_eval_loss_equals_transformers_on_the_checkpoint(run):
    _, run_dir, sets, proc = run
    got = metrics(run_dir)
    evals = {m["step"]: m["eval_loss"] for m in got}
    assert [s for s, v in evals.items() if v is not None] == [EVERY - 1, STEPS - 1]
    assert f"eval_loss={evals[STEPS - 1]:.4f}" in proc.stdout
    job = load_job(TINY, sets)
    rows = open_eval(job, model_config(job).vocab_size)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        run_dir / "checkpoints" / f"step-{STEPS:08d}" / "model", dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for d in range(len(rows.docs)):
            tok, trained = (torch.from_numpy(a.astype("int64")) for a in rows.docs.document(d))
            targets = torch.where(trained[1:] == 1, tok[1:], IGNORE_INDEX)
            logits = model(input_ids=tok[None, :-1]).logits[0].float()
            total += float(F.cross_entropy(logits, targets, reduction="sum"))
            count += int((targets != IGNORE_INDEX).sum())
    assert abs(evals[STEPS - 1] - total / count) <= 1e-5 * (total / count)
    assert got[-1]["trained_tokens"] < got[-1]["tokens"]  # prompts and padding are not trained


def test_tensorboard_and_the_report_show_both_losses(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from slidedp.launch.report import summary

    _, run_dir, _, _ = run
    records = metrics(run_dir)
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    train = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert train == [(m["step"] + 1, pytest.approx(m["loss"], rel=1e-6)) for m in records]
    assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in acc.Scalars("eval/loss")] == [
        (m["step"] + 1, m["eval_loss"]) for m in records if m["eval_loss"] is not None]
    text = "\n".join(summary(records))
    assert f"eval loss    {records[EVERY - 1]['eval_loss']:.4f} -> {records[-1]['eval_loss']:.4f} (2 eval(s)" in text


@pytest.mark.parametrize("extra", [
    ('plan.param_route="sharded"', 'plan.grad_route="reduce_scatter"', "plan.device_layers=1",
     'plan.embedding="device"', "plan.resident_layers=1"),
])
def test_eval_between_steps_reads_current_weights_on_every_route(tmp_path, monkeypatch, extra):
    """Eval after steps 2 and 4 with sharded parameters (gathers paired between 2 ranks), reduce-scattered
    gradients, a device-held first layer and embedding: each eval loss equals the loss of the
    checkpoint taken at that step, computed by our plain forward, each document alone."""
    from slidedp.model import layers

    from pipeline.harness import checkpoint_weights

    run_dir = tmp_path / "run"
    sets = ['model.shape="tiny-llama"', f'data.path="{CHAT / "train.jsonl"}"', f'data.tokenizer="{CHAT / "tokenizer.json"}"',
            f'data.eval_path="{CHAT / "eval.jsonl"}"', "train.seq_len=64", f"train.steps={STEPS}",
            f"train.eval_every={EVERY}", "train.global_batch=4", "plan.micro_batch=1", 'plan.compute_dtype="fp32"',
            "runtime.workers=2", f'store.name="{unique_store("sev")}"', f'run.dir="{run_dir}"',
            'checkpoint.dtype="fp32"', f"checkpoint.every={EVERY}", *extra]
    proc = launch(TINY, *sets, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = load_job(TINY, sets)
    cfg = model_config(job)
    rows = open_eval(job, cfg.vocab_size)
    evals = {m["step"]: m["eval_loss"] for m in metrics(run_dir) if m["eval_loss"] is not None}
    assert sorted(evals) == [EVERY - 1, STEPS - 1]
    for step, got in evals.items():
        params = checkpoint_weights(run_dir / "checkpoints" / f"step-{step + 1:08d}")
        total, count = 0.0, 0
        with torch.no_grad():
            for d in range(len(rows.docs)):
                tok, trained = (torch.from_numpy(a.astype("int64")) for a in rows.docs.document(d))
                targets = torch.where(trained[1:] == 1, tok[1:], IGNORE_INDEX)
                logits = layers.forward_logits(cfg, params, tok[None, :-1])[0]
                total += float(F.cross_entropy(logits, targets, reduction="sum"))
                count += int((targets != IGNORE_INDEX).sum())
        assert abs(got - total / count) <= 1e-5 * (total / count), (step, got, total / count)
    assert evals[STEPS - 1] != evals[EVERY - 1]


def test_report_plots_the_eval_loss(run, tmp_path):
    pytest.importorskip("matplotlib")
    from slidedp.launch import report

    _, run_dir, _, _ = run
    assert report.main([str(run_dir)]) == 0
    assert (run_dir / "report" / "loss.png").stat().st_size > 0


def test_a_chat_template_override_is_what_the_checkpoint_serves(tmp_path):
    from slidedp.data.serve import stage_serve_files

    folder = write_model_folder(tmp_path / "src")
    template = tmp_path / "other.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    job = load_job(TINY, ['model.source="hf"', f'model.path="{folder}"', "model.vocab_size=0", 'data.tokenizer=""',
                          f'data.path="{CHAT / "train.jsonl"}"', f'data.chat_template="{template}"',
                          f'run.dir="{tmp_path / "run"}"'])
    files = stage_serve_files(job, tmp_path / "serve")
    assert sorted(f.name for f in files) == ["chat_template.jinja", "config.json", "generation_config.json",
                                            "tokenizer.json", "tokenizer_config.json"]
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "serve")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "user: hi\n"
