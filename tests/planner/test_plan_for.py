"""plan_for, the planner's one entry: the job's [plan] values, the store's facts and the host's room in,
the StepPlan and its report out; launch/planning.py:plan_job is the launcher's call of it."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from slidedp.config import load_job, model_config
from slidedp.launch.planning import plan_job
from slidedp.plan_section import AUTO
from slidedp.planner import REFERENCE_CALIBRATION, HostRoom, JobPlan, StoreFacts, plan_for
from slidedp.planner.job import DeliveryError, cpu_micro_batch
from slidedp.stepplan import CHOICES, StepPlan
from slidedp.store.layout import default_chunk_rows

from pipeline.harness import ROOT, TINY

CUDA = ['runtime.device="cuda"', "runtime.workers=2", "train.global_batch=8", "plan.compute_dtype=bf16"]


def test_plan_job_is_plan_for_with_the_launchers_arguments():
    for sets in ([], CUDA, CUDA + ["plan.micro_batch=auto", "plan.seq_tile_tokens=16"]):
        job = load_job(TINY, sets)
        room = HostRoom(free_bytes=1 << 40, shadow_bytes=1 << 20)
        via_launcher = plan_job(job, REFERENCE_CALIBRATION, store_shadow=None, shadow_fits=False, host_room=room)
        direct = plan_for(job, StoreFacts(shadow=None, shadow_fits=False), room, calibration=REFERENCE_CALIBRATION)
        assert isinstance(direct, JobPlan) and direct == via_launcher


def test_on_cpu_auto_is_the_cpu_default_and_a_value_is_carried_out():
    job = load_job(TINY, ["plan.micro_batch=auto", "plan.compute_dtype=auto"])
    assert all(getattr(job.plan, k) == AUTO for k in CHOICES)
    cfg = model_config(job)
    got = plan_for(job)
    assert got.plan is None and got.step == StepPlan(
        micro_batch=cpu_micro_batch(job.train.global_batch // job.runtime.workers), compute_dtype="bf16",
        chunk_rows=default_chunk_rows(cfg), loss_chunk_tokens=StepPlan().loss_chunk_tokens)
    values = {"micro_batch": 2, "compute_dtype": "fp32", "param_route": "sharded", "delivery": "fp32",
              "prefetch_depth": 4, "resident_layers": 1, "offload_layers": 1, "seq_tile_tokens": 32,
              "loss_chunk_tokens": 64, "device_layers": 1, "embedding": "device", "grad_route": "reduce_scatter"}
    step = plan_for(load_job(TINY, [f"plan.{k}={v}" for k, v in values.items()])).step
    assert {k: getattr(step, k) for k in values} == values and step.planned_by == "job file"


def test_on_cuda_auto_is_the_planners_choice_and_a_tile_or_loss_chunk_value_replaces_it():
    job = load_job(TINY, CUDA)
    auto = plan_for(job, calibration=REFERENCE_CALIBRATION)
    assert auto.plan is not None and auto.step == auto.plan.step and auto.keeps_plan
    assert auto.step.planned_by == "planner" and auto.step.chunk_rows == default_chunk_rows(model_config(job))
    forced = plan_for(load_job(TINY, CUDA + ["plan.loss_chunk_tokens=64"]), calibration=REFERENCE_CALIBRATION)
    assert forced.step.loss_chunk_tokens == 64 and forced.plan.step.loss_chunk_tokens == auto.step.loss_chunk_tokens
    assert forced.step.planned_by == "planner + job file" and forced.step.planned_device_bytes is None
    assert not forced.keeps_plan
    assert dataclasses.replace(forced.step, loss_chunk_tokens=auto.step.loss_chunk_tokens, planned_by="planner",
                               planned_device_bytes=auto.step.planned_device_bytes) == auto.step


def test_the_old_keys_plan_as_the_new_ones():
    old = ['runtime.device="cuda"', "runtime.workers=2", "train.global_batch=8", 'train.compute_dtype="bf16"',
           "train.micro_batch=0", "memory.resident_layers=-1", "memory.seq_tile_tokens=16", "memory.offload_layers=0",
           "memory.device_layers=1", "memory.prefetch_depth=2", 'memory.embedding="host"', 'runtime.delivery="fp32"',
           'runtime.param_route="sharded"', 'runtime.grad_route="host"']
    new = CUDA + ["plan.micro_batch=auto", "plan.resident_layers=auto", "plan.seq_tile_tokens=16",
                  "plan.offload_layers=0", "plan.device_layers=1", "plan.prefetch_depth=2", 'plan.embedding="host"',
                  'plan.delivery="fp32"', 'plan.param_route="sharded"', 'plan.grad_route="host"']
    assert load_job(TINY, old).plan == load_job(TINY, new).plan
    assert plan_for(load_job(TINY, old), calibration=REFERENCE_CALIBRATION) == plan_for(
        load_job(TINY, new), calibration=REFERENCE_CALIBRATION)


def test_the_store_facts_decide_the_delivery():
    job = load_job(TINY, CUDA)
    assert plan_for(job, StoreFacts(shadow=True), calibration=REFERENCE_CALIBRATION).step.delivery == "bf16"
    without = plan_for(job, StoreFacts(shadow=False), calibration=REFERENCE_CALIBRATION)
    assert without.step.delivery == "fp32" and not without.shadow
    assert "was created without the bf16 shadow" in without.describe()
    with pytest.raises(DeliveryError, match=r'plan.delivery = "bf16" streams the store\'s bf16 shadow'):
        plan_for(load_job(TINY, CUDA + ["plan.delivery=bf16"]), StoreFacts(shadow=False),
                 calibration=REFERENCE_CALIBRATION)


def test_the_planner_imports_no_worker_internals_nor_the_launcher():
    """The planner reads the model's math from slidedp/model/ and the store's helpers from slidedp/store/;
    the engine's modules are the worker's own, and the launcher calls the planner, not the other way."""
    found = []
    for path in sorted((ROOT / "slidedp" / "planner").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{Path(path).name}: {n}" for n in names
                      if n.startswith(("slidedp.worker", "slidedp.sft", "slidedp.launch", "slidedp.daemons"))]
    assert found == []
