"""The job file's [plan] section: StepPlan's choices key for key, each "auto" or a value, and the old keys.

The plan's knobs used to sit in [train] (micro_batch, compute_dtype), [memory] and [runtime], with -1 or 0
meaning "the plan decides"; those keys still work through slidedp/old_names.py, each with one warning line
naming its new key, and a key set under both names is refused.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from slidedp import old_names
from slidedp.config import ConfigError, job_to_toml, load_job
from slidedp.plan_section import AUTO, PlanSection
from slidedp.stepplan import CHOICES

BASE = """\
[data]
format = "npy"
path = "tokens.npy"

[train]
steps = 10
global_batch = 8
seq_len = 16
lr = 1e-3
"""

# every old key that moved to [plan], with a value it takes, and its "the plan decides" where it had one
MOVED = [("train.micro_batch", "2", 2), ("train.compute_dtype", '"fp32"', "fp32"),
         ("memory.embedding", '"device"', "device"), ("memory.resident_layers", "3", 3),
         ("memory.seq_tile_tokens", "0", 0), ("memory.offload_layers", "1", 1), ("memory.device_layers", "2", 2),
         ("memory.prefetch_depth", "2", 2), ("runtime.param_route", '"sharded"', "sharded"),
         ("runtime.grad_route", '"reduce_scatter"', "reduce_scatter"), ("runtime.delivery", '"fp32"', "fp32")]
SENTINELS = [("train.micro_batch", "0"), ("memory.resident_layers", "-1"), ("memory.seq_tile_tokens", "-1"),
             ("memory.offload_layers", "-1"), ("memory.device_layers", "-1"), ("memory.prefetch_depth", "-1")]


@pytest.fixture
def jobdir(tmp_path: Path) -> Path:
    (tmp_path / "tokens.npy").write_bytes(b"")
    return tmp_path


def write(jobdir: Path, text: str, name: str = "job.toml") -> Path:
    (jobdir / name).write_text(text)
    return jobdir / name


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "slidedp.config"]


def test_the_plan_section_mirrors_the_step_plans_choices_field_for_field():
    assert tuple(f.name for f in dataclasses.fields(PlanSection)) == CHOICES
    assert all(f.default == AUTO for f in dataclasses.fields(PlanSection))


def test_every_key_is_auto_unless_set_and_a_set_value_round_trips(jobdir, monkeypatch, caplog):
    with caplog.at_level("WARNING"):
        job = load_job(write(jobdir, BASE))
    assert warnings(caplog) == []
    assert all(getattr(job.plan, k) == AUTO and job.plan.chosen(k) is None for k in CHOICES)
    assert job.plan.dtype == "bf16"  # "auto" computes in bf16
    values = {"micro_batch": 2, "compute_dtype": "fp32", "param_route": "sharded", "delivery": "fp32",
              "prefetch_depth": 3, "resident_layers": 0, "offload_layers": 1, "seq_tile_tokens": 0,
              "loss_chunk_tokens": 512, "device_layers": 1, "embedding": "host", "grad_route": "reduce_scatter"}
    text = BASE + "[plan]\n" + "".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in values.items())
    job = load_job(write(jobdir, text))
    assert {k: getattr(job.plan, k) for k in values} == values and job.plan.chunk_rows == AUTO
    assert job.plan.chosen("seq_tile_tokens") == 0 and job.plan.dtype == "fp32"
    monkeypatch.chdir(jobdir.parent)
    assert load_job(write(jobdir, job_to_toml(job), "resolved.toml")) == job
    assert "[plan]" in job_to_toml(job) and "\n[memory]\ndevice_budget_gib = 24.0\n\n" in job_to_toml(job)
    assert load_job(write(jobdir, BASE), ["plan.seq_tile_tokens=auto"]).plan.seq_tile_tokens == AUTO


@pytest.mark.parametrize("override, message", [
    ("plan.micro_batch=0", 'plan.micro_batch must be "auto" or an integer >= 1; got 0'),
    ("plan.micro_batch=some", "plan.micro_batch must be \"auto\" or an integer >= 1; got 'some'"),
    ("plan.micro_batch=2.0", 'plan.micro_batch must be "auto" or an integer, got 2.0 (float)'),
    ("plan.resident_layers=true", 'plan.resident_layers must be "auto" or an integer, got true (bool)'),
    ("plan.offload_layers=-1", 'plan.offload_layers must be "auto" or an integer >= 0; got -1'),
    ("plan.prefetch_depth=9", 'plan.prefetch_depth must be "auto" or an integer in [1, 8]; got 9'),
    ("plan.loss_chunk_tokens=0", 'plan.loss_chunk_tokens must be "auto" or an integer >= 1; got 0'),
    ("plan.chunk_rows=4096", 'plan.chunk_rows must be "auto": the store\'s layout sets the rows of an embedding or '
                             "head chunk (one decoder layer's parameters' worth); got 4096"),
    ("plan.embedding=gpu", "plan.embedding must be one of 'auto', 'host', 'device'; got 'gpu'"),
    ("plan.param_route=ring", "plan.param_route must be one of 'auto', 'replicated', 'sharded'; got 'ring'"),
    ("plan.grad_route=device", "plan.grad_route must be one of 'auto', 'host', 'reduce_scatter'; got 'device'"),
    ("plan.compute_dtype=fp16", "plan.compute_dtype must be one of 'auto', 'bf16', 'fp32'; got 'fp16'"),
    ("plan.shard=2", "unknown key plan.shard; allowed keys in [plan]: " + ", ".join(CHOICES)),
])
def test_bad_values_are_refused_naming_the_key_and_what_it_takes(jobdir, override, message):
    p = write(jobdir, BASE)
    with pytest.raises(ConfigError) as e:
        load_job(p, [override])
    assert str(e.value) == f"{p}: {message}"


def test_every_bad_key_of_the_section_is_named_at_once(jobdir):
    p = write(jobdir, BASE + "[plan]\nprefetch_depth = 0\nembedding = \"gpu\"\nseq_tile_tokens = -2\n")
    with pytest.raises(ConfigError) as e:
        load_job(p)
    assert [m.partition(": ")[2].partition(" ")[0] for m in e.value.problems] == [
        "plan.prefetch_depth", "plan.seq_tile_tokens", "plan.embedding"]


@pytest.mark.parametrize("old, raw, value", MOVED)
def test_an_old_key_still_works_with_one_warning_naming_the_new_one(jobdir, caplog, old, raw, value):
    section, _, key = old.partition(".")
    new = old_names.JOB_KEYS[old]
    text = BASE + (f"{key} = {raw}\n" if section == "train" else f"[{section}]\n{key} = {raw}\n")
    with caplog.at_level("WARNING"):
        from_file = load_job(write(jobdir, text))
        from_override = load_job(write(jobdir, BASE, "plain.toml"), [f"{old}={raw}"])
    assert getattr(from_file.plan, new.partition(".")[2]) == value
    assert from_override.plan == from_file.plan
    assert warnings(caplog) == [f"{old} is deprecated: call it {new}"] * 2
    assert job_to_toml(from_file).count(f"\n{key} = ") == 1  # written once, under its new name


@pytest.mark.parametrize("old, raw", SENTINELS)
def test_an_old_keys_the_plan_decides_is_auto(jobdir, caplog, old, raw):
    with caplog.at_level("WARNING"):
        job = load_job(write(jobdir, BASE), [f"{old}={raw}"])
    new = old_names.JOB_KEYS[old]
    assert getattr(job.plan, new.partition(".")[2]) == AUTO
    assert warnings(caplog) == [f'{old} = {raw} is deprecated: call it {new} = "auto"']


def test_a_key_under_both_names_is_refused(jobdir):
    p = write(jobdir, BASE.replace("lr = 1e-3\n", "lr = 1e-3\nmicro_batch = 2\n") + "[plan]\nmicro_batch = 4\n"
              + "[memory]\noffload_layers = -1\n[runtime]\ndelivery = \"fp32\"\n")
    with pytest.raises(ConfigError) as e:
        load_job(p, ["plan.offload_layers=1"])  # an override is no second name: it replaces the file's
    assert str(e.value) == (f"{p}: train.micro_batch and plan.micro_batch are both set: train.micro_batch is the old "
                            f"name of plan.micro_batch; keep only plan.micro_batch")


def test_an_override_by_either_name_wins_over_the_file_by_either(jobdir, caplog):
    old_file = write(jobdir, BASE + "[memory]\nseq_tile_tokens = 8\n", "old.toml")
    new_file = write(jobdir, BASE + "[plan]\nseq_tile_tokens = 8\n", "new.toml")
    with caplog.at_level("WARNING"):
        assert load_job(old_file, ["plan.seq_tile_tokens=16"]).plan.seq_tile_tokens == 16
        assert load_job(new_file, ["memory.seq_tile_tokens=-1"]).plan.seq_tile_tokens == AUTO
    assert warnings(caplog) == ['memory.seq_tile_tokens = -1 is deprecated: call it plan.seq_tile_tokens = "auto"']


def test_a_stored_train_record_of_an_older_version_still_reads():
    """The store keeps the last job's [train]; one written before [plan] holds micro_batch and compute_dtype."""
    from slidedp.config import TrainSection
    from slidedp.launch.schedule_note import schedule_note

    old = {"steps": 60, "global_batch": 8, "micro_batch": 2, "seq_len": 64, "lr": 3e-3, "compute_dtype": "fp32"}
    assert old_names.train_record(old) == {"steps": 60, "global_batch": 8, "seq_len": 64, "lr": 3e-3}
    now = TrainSection(steps=120, global_batch=8, seq_len=64, lr=3e-3)
    assert "stretches the schedule" in schedule_note(old, now, 60)
