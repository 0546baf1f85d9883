from __future__ import annotations

import os
from pathlib import Path

import pytest

from slidedp.config import (
    ConfigError,
    JobConfig,
    TrainSection,
    job_from_dict,
    job_to_dict,
    job_to_toml,
    load_job,
    model_config,
)

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny.toml"

BASE = """\
[data]
format = "npy"
path = "tokens.npy"

[train]
steps = 10
global_batch = 8
seq_len = 16
lr = 1e-3

[plan]
micro_batch = 2
"""


@pytest.fixture
def jobdir(tmp_path: Path) -> Path:
    (tmp_path / "tokens.npy").write_bytes(b"")  # existence is all the config checks
    return tmp_path


def write(jobdir: Path, text: str, name: str = "job.toml") -> Path:
    p = jobdir / name
    p.write_text(text)
    return p


def error(path: Path, overrides=()) -> str:
    with pytest.raises(ConfigError) as e:
        load_job(path, overrides)
    return str(e.value)


def test_example_job_loads_with_resolved_paths(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    job = load_job(TINY)
    assert job.model.source == "random" and job.model.vocab_size == 512
    assert job.data.path == str(ROOT / "examples" / "data" / "tiny.jsonl")
    assert job.data.tokenizer == str(ROOT / "examples" / "data" / "tokenizer.json")
    t = job.train
    assert (t.steps, t.global_batch, job.plan.micro_batch, t.seq_len, t.lr, t.warmup_steps) == (60, 8, 2, 64, 3e-3, 5)
    assert (t.schedule, t.weight_decay, t.max_grad_norm, job.plan.compute_dtype) == ("cosine", 0.01, 1.0, "fp32")
    assert (job.runtime.device, job.runtime.workers, job.checkpoint.dtype) == ("cpu", 2, "fp32")
    assert job.run.name == "tiny" and job.store_name == "tiny"
    assert job.run_dir == tmp_path / "runs" / "tiny"
    assert job.checkpoint_dir == tmp_path / "runs" / "tiny" / "checkpoints"
    cfg = model_config(job)
    assert cfg.vocab_size == 512 and cfg.hidden_size == 64


def test_defaults(jobdir):
    job = load_job(write(jobdir, BASE))
    assert job.model.source == "random" and job.model.shape == "tiny" and job.model.vocab_size == 0
    assert (job.train.min_lr_ratio, job.train.beta1, job.train.beta2, job.train.eps) == (0.1, 0.9, 0.95, 1e-8)
    assert (job.train.max_grad_norm, job.plan.compute_dtype, job.plan.dtype, job.train.schedule) == (
        1.0, "auto", "bf16", "cosine")
    assert job.memory.device_budget_gib == 24.0
    assert (job.store.name, job.store.persist, job.store.grad_slots) == ("", False, 0)
    assert (job.checkpoint.every, job.checkpoint.keep, job.checkpoint.final, job.checkpoint.resume) == (0, 3, True, "")
    assert (job.runtime.workers, job.runtime.updaters, job.runtime.timeout_s) == (1, 0, 120.0)
    assert job.store_name == "job"
    assert model_config(job).vocab_size == 512  # the tiny shape's own


def test_round_trip_through_toml(jobdir, monkeypatch):
    job = load_job(write(jobdir, BASE + '\n[store]\nname = "s1"\n'), ["data.text_key=\"t\\u00e9\\\"x\\u007f\""])
    assert job.data.text_key == 't\u00e9"x\x7f'
    text = job_to_toml(job)
    monkeypatch.chdir(jobdir.parent)  # reloading elsewhere changes nothing: paths are absolute
    again = load_job(write(jobdir, text, "resolved.toml"))
    assert again == job
    assert job_to_dict(again)["store"] == {"name": "s1", "persist": False, "shadow_bf16": "auto", "grad_slots": 0}


def test_ints_accepted_as_floats(jobdir):
    job = load_job(write(jobdir, BASE.replace("lr = 1e-3", "lr = 1")))
    assert job.train.lr == 1.0 and isinstance(job.train.lr, float)


def test_malformed_toml_names_file_and_line(jobdir):
    p = write(jobdir, "[train]\nsteps = 10\nlr = = 3\n")
    msg = error(p)
    assert msg.startswith(f"{p}: malformed TOML: ")
    assert "line 3" in msg


def test_missing_job_file(tmp_path):
    assert error(tmp_path / "nope.toml") == f"job file {str(tmp_path / 'nope.toml')!r} does not exist"


def test_unknown_section(jobdir):
    p = write(jobdir, BASE + "[optim]\nlr = 1\n")
    assert error(p) == (
        f"{p}: unknown section [optim]; allowed sections: model, data, train, plan, memory, store, checkpoint, run, "
        "runtime"
    )


def test_top_level_key_rejected(jobdir):
    p = write(jobdir, "steps = 3\n" + BASE)
    assert error(p) == (
        f"{p}: unknown top-level key 'steps'; allowed sections: "
        "model, data, train, plan, memory, store, checkpoint, run, runtime"
    )


def test_unknown_key(jobdir):
    p = write(jobdir, BASE + "[memory]\ngpu_budget = 3\n")
    assert error(p) == f"{p}: unknown key memory.gpu_budget; allowed keys in [memory]: device_budget_gib"


def test_the_old_name_of_the_device_budget_is_read_with_a_warning_naming_the_new_one(jobdir, caplog):
    p = write(jobdir, BASE + "[memory]\ngpu_budget_gib = 3.5\n")
    with caplog.at_level("WARNING", logger="slidedp.config"):
        job = load_job(p)
    assert job.memory.device_budget_gib == 3.5
    assert [r.getMessage() for r in caplog.records] == [
        "memory.gpu_budget_gib is deprecated: call it memory.device_budget_gib"]
    assert "gpu_budget_gib" not in job_to_toml(job) and "device_budget_gib = 3.5" in job_to_toml(job)
    caplog.clear()
    with caplog.at_level("WARNING", logger="slidedp.config"):  # an override, by either name, wins over the file
        assert load_job(p, ["memory.device_budget_gib=7"]).memory.device_budget_gib == 7
        assert load_job(write(jobdir, BASE + "[memory]\ndevice_budget_gib = 2.0\n", "new.toml"),
                        ["memory.gpu_budget_gib=9"]).memory.device_budget_gib == 9
    assert [r.getMessage() for r in caplog.records] == [
        "memory.gpu_budget_gib is deprecated: call it memory.device_budget_gib"]


def test_the_device_budget_under_both_names_is_refused(jobdir):
    p = write(jobdir, BASE + "[memory]\ngpu_budget_gib = 3.5\ndevice_budget_gib = 4.0\n")
    assert error(p) == (f"{p}: memory.gpu_budget_gib and memory.device_budget_gib are both set: "
                        f"memory.gpu_budget_gib is the old name of memory.device_budget_gib; keep only "
                        f"memory.device_budget_gib")


def test_missing_required_key(jobdir):
    p = write(jobdir, BASE.replace("seq_len = 16\n", ""))
    assert error(p) == f"{p}: train.seq_len is required"


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.steps='10'", "train.steps must be an integer, got '10' (str)"),
        ("train.steps=true", "train.steps must be an integer, got true (bool)"),
        ("train.lr=true", "train.lr must be a number, got true (bool)"),
        ("train.steps=1.5", "train.steps must be an integer, got 1.5 (float)"),
        ("data.shuffle=1", "data.shuffle must be true or false, got 1 (int)"),
        ("run.name=3", "run.name must be a string, got 3 (int)"),
        ("train.steps=[1]", "train.steps must be an integer, got [1] (list)"),
    ],
)
def test_wrong_type(jobdir, override, message):
    p = write(jobdir, BASE)
    assert error(p, [override]) == f"{p}: {message}"


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.steps=0", "train.steps must be >= 1; got 0"),
        ("train.lr=0", "train.lr must be > 0; got 0.0"),
        ("train.lr=nan", "train.lr must be > 0; got nan"),
        ("train.min_lr_ratio=1.5", "train.min_lr_ratio must be in [0, 1]; got 1.5"),
        ("train.beta2=1", "train.beta2 must be in [0, 1); got 1.0"),
        ("train.eps=0", "train.eps must be > 0; got 0.0"),
        ("train.max_grad_norm=-1", "train.max_grad_norm must be >= 0; got -1.0"),
        ("train.schedule='step'", "train.schedule must be one of 'cosine', 'constant', 'linear'; got 'step'"),
        ("train.router_aux_loss=maybe", "train.router_aux_loss must be one of 'auto', 'on', 'off'; got 'maybe'"),
        ("plan.compute_dtype=fp16", "plan.compute_dtype must be one of 'auto', 'bf16', 'fp32'; got 'fp16'"),
        ("memory.device_budget_gib=0", "memory.device_budget_gib must be > 0; got 0.0"),
        ("plan.prefetch_depth=0", 'plan.prefetch_depth must be "auto" or an integer in [1, 8]; got 0'),
        ("plan.prefetch_depth=9", 'plan.prefetch_depth must be "auto" or an integer in [1, 8]; got 9'),
        ("store.grad_slots=1", "store.grad_slots must be 0 (auto) or at least 2, got 1"),
        ("checkpoint.keep=0", "checkpoint.keep must be >= 1; got 0"),
        ("checkpoint.dtype=fp16", "checkpoint.dtype must be one of 'bf16', 'fp32'; got 'fp16'"),
        ("runtime.device=tpu", "runtime.device must be one of 'cpu', 'cuda'; got 'tpu'"),
        ("runtime.workers=0", "runtime.workers must be >= 1; got 0"),
        ("runtime.timeout_s=0", "runtime.timeout_s must be > 0; got 0.0"),
        ("runtime.network_gbps=-1", "runtime.network_gbps must be >= 0; got -1.0"),
        ("runtime.network_latency_us=-5", "runtime.network_latency_us must be >= 0; got -5.0"),
        ("data.format=csv", "data.format must be one of 'jsonl', 'parquet', 'arrow', 'npy', 'bin'; got 'csv'"),
        ("data.dtype=int8", "data.dtype must be one of 'uint16', 'uint32', 'int32', 'int64'; got 'int8'"),
        ("model.shape=huge", "model.shape must be one of 'tiny', 'tiny-llama', 'small', 'qwen3-0.6b', 'qwen3-1.7b', "
                             "'qwen3-4b', 'qwen3-8b', 'qwen3-14b'; got 'huge'"),
        ("model.vocab_size=-1", "model.vocab_size must be >= 0; got -1"),
        ("run.log_every=0", "run.log_every must be >= 1; got 0"),
        ("store.name='a b'", "store.name: store name 'a b' is not allowed: use 1-64 letters, digits, '_', '-' or "
                             "'.', starting with a letter or digit"),
        ("plan.micro_batch=3", "plan.micro_batch (3) must divide train.global_batch (8)"),
    ],
)
def test_out_of_range(jobdir, override, message):
    p = write(jobdir, BASE)
    assert error(p, [override]) == f"{p}: {message}"


def test_global_batch_not_divisible_by_workers_times_micro_batch(jobdir):
    p = write(jobdir, BASE + "[runtime]\nworkers = 3\n")
    assert error(p) == (
        f"{p}: train.global_batch (8) must be divisible by runtime.workers (3) x plan.micro_batch (2) = 6"
    )


def test_missing_model_path(jobdir):
    p = write(jobdir, BASE + '[model]\nsource = "hf"\n')
    assert error(p) == f"{p}: model.path is required when model.source = 'hf' (a Hugging Face checkpoint folder)"
    p = write(jobdir, BASE + '[model]\nsource = "hf"\npath = "ckpt"\n')
    assert error(p) == f"{p}: model.path: model folder {str(jobdir / 'ckpt')!r} does not exist"
    (jobdir / "ckpt").mkdir()
    assert error(p) == (
        f"{p}: model.path: {str(jobdir / 'ckpt')!r} has no config.json; is it a Hugging Face checkpoint folder?"
    )
    (jobdir / "ckpt" / "config.json").write_text("{}")
    assert load_job(p).model.path == str(jobdir / "ckpt")


def test_missing_data_file(jobdir):
    p = write(jobdir, BASE.replace("tokens.npy", "other.npy"))
    assert error(p) == f"{p}: data.path: data file {str(jobdir / 'other.npy')!r} does not exist"


def test_jsonl_needs_tokenizer(jobdir):
    p = write(jobdir, BASE.replace('format = "npy"', 'format = "jsonl"'))
    assert error(p) == f"{p}: data.tokenizer is required when data.format = 'jsonl' (path to a tokenizer.json)"


def test_bad_overrides(jobdir):
    p = write(jobdir, BASE)
    for bad in ("train.steps", "steps=3", "=3", "train.=3", "train.a.b=3"):
        assert error(p, [bad]) == f"bad override {bad!r}: expected section.key=value, e.g. train.steps=100"
    assert error(p, ["train.stepz=3"]).endswith("unknown key train.stepz; allowed keys in [train]: steps, "
                                                 "global_batch, seq_len, lr, min_lr_ratio, warmup_steps, schedule, "
                                                 "schedule_start, schedule_steps, weight_decay, beta1, beta2, eps, "
                                                 "max_grad_norm, seed, compile, eval_every, router_aux_loss")


def test_overrides_parse_toml_values_else_strings(jobdir, monkeypatch):
    p = write(jobdir, BASE)
    job = load_job(p, ["train.lr=2e-4", "data.shuffle=true", "run.name=exp-2", "train.steps = 7"])
    assert (job.train.lr, job.data.shuffle, job.run.name, job.train.steps) == (2e-4, True, "exp-2", 7)
    # a relative path typed on the command line is relative to the current directory
    sub = jobdir / "sub"
    sub.mkdir()
    (sub / "t.npy").write_bytes(b"")
    monkeypatch.chdir(sub)
    assert load_job(p, ["data.path=t.npy"]).data.path == str(sub / "t.npy")


def test_run_and_checkpoint_dirs(jobdir):
    p = write(jobdir, BASE + '[run]\nname = "r1"\ndir = "out"\n[checkpoint]\nresume = "latest"\n')
    job = load_job(p)
    assert job.run_dir == jobdir / "out" and job.checkpoint_dir == jobdir / "out" / "checkpoints"
    assert job.checkpoint.resume == "latest" and job.store_name == "r1"
    p = write(jobdir, BASE + '[checkpoint]\ndir = "/tmp/ck"\nresume = "ck/step-5"\n')
    assert error(p) == f"{p}: checkpoint.resume: checkpoint {str(jobdir / 'ck' / 'step-5')!r} does not exist"


def test_job_file_stem_must_make_a_store_name(jobdir):
    p = write(jobdir, BASE, name="my job.toml")
    assert error(p) == (
        f"{p}: run.name (default: the job file's stem; it also names the store): store name 'my job' is not "
        "allowed: use 1-64 letters, digits, '_', '-' or '.', starting with a letter or digit"
    )
    job = load_job(p, ["run.name=ok"])
    assert job.store_name == "ok" and job.run_dir.name == "ok"


def test_sections_validate_on_direct_construction():
    with pytest.raises(ConfigError, match=r"^train.global_batch must be >= 1; got 0$"):
        TrainSection(steps=1, global_batch=0, seq_len=4, lr=1.0)


def test_job_from_dict(jobdir):
    job = job_from_dict(
        {"data": {"format": "npy", "path": "tokens.npy"},
         "train": {"steps": 1, "global_batch": 2, "seq_len": 4, "lr": 1.0}, "plan": {"micro_batch": 1}},
        jobdir, "hint",
    )
    assert isinstance(job, JobConfig) and job.run.name == "hint" and job.data.path == str(jobdir / "tokens.npy")
    assert job.run.dir == os.path.join(os.getcwd(), "runs", "hint")


def test_model_config_from_hf_folder(jobdir):
    import json

    from slidedp.model.config import named_shape

    small = named_shape("small")
    (jobdir / "ckpt").mkdir()
    (jobdir / "ckpt" / "config.json").write_text(json.dumps(small.to_hf()))
    job = load_job(write(jobdir, BASE + '[model]\nsource = "hf"\npath = "ckpt"\n'))
    assert model_config(job) == small
    p = write(jobdir, BASE + '[model]\nsource = "hf"\npath = "ckpt"\nvocab_size = 10\n')
    assert error(p) == (
        f"{p}: model.vocab_size applies to source = 'random' only; got 10 with source = 'hf' "
        "(the checkpoint's config.json sets the vocabulary)"
    )


def test_the_bf16_shadow_and_its_delivery(jobdir):
    """store.shadow_bf16 takes true, false or "auto" (the default); plan.delivery = "bf16" needs a bf16
    compute and a store that may have the shadow."""
    path = write(jobdir, BASE)
    job = load_job(path)
    assert (job.store.shadow_bf16, job.plan.delivery) == ("auto", "auto")
    assert load_job(path, ["store.shadow_bf16=true"]).store.shadow_bf16 is True
    assert load_job(path, ["store.shadow_bf16=false"]).store.shadow_bf16 is False
    assert load_job(path, ["plan.delivery=bf16"]).plan.delivery == "bf16"
    assert 'store.shadow_bf16 must be true, false or "auto"; got \'yes\'' in error(path, ["store.shadow_bf16=yes"])
    assert "store.shadow_bf16 must be true, false or a string, got 1 (int)" in error(path, ["store.shadow_bf16=1"])
    assert "plan.delivery must be one of 'auto', 'fp32', 'bf16'; got 'fp16'" in error(path, ["plan.delivery=fp16"])
    msg = error(path, ["plan.delivery=bf16", 'plan.compute_dtype="fp32"'])
    assert 'plan.delivery = "bf16" streams the weights rounded to bf16: it needs plan.compute_dtype = "bf16"' in msg
    msg = error(path, ["plan.delivery=bf16", "store.shadow_bf16=false"])
    assert "store.shadow_bf16 = false makes a store without one: set store.shadow_bf16 = true" in msg
    # a resolved job file keeps each form
    for value in (True, False, "auto"):
        text = job_to_toml(load_job(path, [f"store.shadow_bf16={str(value).lower() if value != 'auto' else 'auto'}"]))
        again = load_job(write(jobdir, text, "resolved.toml"))
        assert again.store.shadow_bf16 == value and type(again.store.shadow_bf16) is type(value)


def test_token_id_files_are_read_one_at_a_time(jobdir):
    """npy/bin data is one file of ids: a list or a folder is refused naming what to do (it used to stop
    the dry run and the launcher with a TypeError from numpy)."""
    (jobdir / "more.npy").write_bytes(b"")
    p = write(jobdir, BASE.replace('path = "tokens.npy"', 'path = ["tokens.npy", "more.npy"]'))
    assert error(p) == (f"{p}: data.format = 'npy' reads one file of token ids; data.path is a list of 2: join the "
                        "ids into one file (numpy.concatenate), or use jsonl, parquet or arrow")
    (jobdir / "shards").mkdir()
    p = write(jobdir, BASE.replace('format = "npy"', 'format = "bin"').replace("tokens.npy", "shards"))
    assert error(p) == (f"{p}: data.format = 'bin' reads one file of token ids; data.path is the folder "
                        f"{str(jobdir / 'shards')!r}: join the ids into one file (numpy.concatenate), or use "
                        "jsonl, parquet or arrow")
    assert load_job(write(jobdir, BASE)).data.paths == (str(jobdir / "tokens.npy"),)
