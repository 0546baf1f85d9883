"""The step plan: one plain JSON record from the planner to every rank (plan.json)."""

from __future__ import annotations

import json

import pytest

from slidedp.config import load_job
from slidedp.launch.planning import plan_job
from slidedp.planner import REFERENCE_CALIBRATION
from slidedp.stepplan import StepPlan, StepPlanError

from pipeline.harness import TINY


def test_round_trip_through_the_file(tmp_path):
    plan = StepPlan(micro_batch=2, param_route="sharded", device_layers=1, embedding="device", seq_tile_tokens=512,
                    predicted_step_s=1.5, planned_device_bytes=3 << 30, planned_by="planner")
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    assert StepPlan.read(path) == plan
    text = path.read_text()
    assert json.loads(text)["embedding"] == "device" and text.count("\n") > 10  # one field a line: readable


def test_a_file_of_another_version_or_a_bad_value_is_refused_by_name(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"micro_batch": 1, "clip_regime": "x"}))
    with pytest.raises(StepPlanError, match=r"plan.json: plan: unknown field\(s\) clip_regime \(written by another"):
        StepPlan.read(path)
    with pytest.raises(StepPlanError, match="plan: embedding must be one of 'host', 'device', got 'gpu'"):
        StepPlan(embedding="gpu")
    with pytest.raises(StepPlanError, match="prefetch_depth must be between 1 and 8, got 9"):
        StepPlan.from_dict({"prefetch_depth": 9})


def test_the_planners_plan_is_the_step_plan_the_ranks_run():
    job = load_job(TINY, ['runtime.device="cuda"', "runtime.workers=2", "train.global_batch=8", "plan.micro_batch=2"])
    jp = plan_job(job, REFERENCE_CALIBRATION)
    assert jp.plan is not None and jp.step == jp.plan.step and jp.step.planned_by == "planner"
    assert jp.step.planned_device_bytes == jp.plan.device_total_bytes and jp.keeps_plan
    forced = plan_job(load_job(TINY, ['runtime.device="cuda"', "runtime.workers=2", "train.global_batch=8",
                                      "plan.seq_tile_tokens=16"]), REFERENCE_CALIBRATION)
    assert forced.step.seq_tile_tokens == 16 and forced.step.planned_by == "planner + job file"
    assert forced.step.planned_device_bytes is None and not forced.keeps_plan


def test_the_bf16_delivery_needs_a_bf16_compute():
    assert StepPlan(delivery="bf16").delivery == "bf16"  # compute_dtype bf16 is the default
    with pytest.raises(StepPlanError, match="plan: delivery 'bf16' .* needs compute_dtype 'bf16': a fp32 compute"):
        StepPlan(delivery="bf16", compute_dtype="fp32")
