"""From the job file to what the workers run: overrides, clamping and the routes the plan may take."""

from __future__ import annotations

import dataclasses

import pytest

from slidedp.config import load_job
from slidedp.launch.planning import plan_job
from slidedp.planner import REFERENCE_CALIBRATION, PlanError

from pipeline.harness import TINY

CUDA = ['runtime.device="cuda"', "runtime.workers=2", "train.global_batch=8", "plan.micro_batch=2"]


def test_cpu_runs_take_the_job_files_values_clamped_to_the_model():
    plan = plan_job(load_job(TINY, ["plan.seq_tile_tokens=24", "plan.offload_layers=99", "runtime.workers=2",
                                    'plan.param_route="sharded"', 'plan.grad_route="reduce_scatter"']))
    assert (plan.step.seq_tile_tokens, plan.step.offload_layers) == (24, 2)  # tiny has 2 layers: "more means all"
    assert (plan.step.param_route, plan.step.grad_route) == ("sharded", "reduce_scatter")
    one = plan_job(load_job(TINY, ['plan.param_route="sharded"', "runtime.workers=1"]))
    assert (one.step.param_route, one.step.grad_route, one.step.seq_tile_tokens, one.step.offload_layers) == ("replicated", "host", 0, 0)


def test_routes_need_measured_links_unless_the_job_names_them():
    unmeasured = plan_job(load_job(TINY, CUDA), REFERENCE_CALIBRATION)
    assert (unmeasured.step.param_route, unmeasured.step.grad_route) == ("replicated", "host")
    forced = plan_job(load_job(TINY, CUDA + ['plan.param_route="sharded"']), REFERENCE_CALIBRATION)
    assert (forced.step.param_route, forced.step.grad_route) == ("sharded", "host")
    assert forced.plan is not None and forced.plan.step.param_route == "sharded"  # the prediction is of that route
    nvlink = dataclasses.replace(REFERENCE_CALIBRATION, allreduce_gbps=300.0, bus_gpus=2)  # links measured, and fast
    big = CUDA + ['model.shape="qwen3-4b"', "train.seq_len=2048"]
    measured = plan_job(load_job(TINY, big), nvlink)
    assert (measured.step.param_route, measured.step.grad_route) == ("sharded", "reduce_scatter")
    slow = plan_job(load_job(TINY, big), dataclasses.replace(nvlink, allreduce_gbps=2.0))
    assert (slow.step.param_route, slow.step.grad_route) == ("replicated", "host")


def test_cuda_overrides_are_carried_and_offload_clamped():
    plan = plan_job(load_job(TINY, CUDA + ["plan.seq_tile_tokens=16", "plan.offload_layers=7"]), REFERENCE_CALIBRATION)
    assert (plan.step.seq_tile_tokens, plan.step.offload_layers) == (16, 2)
    auto = plan_job(load_job(TINY, CUDA), REFERENCE_CALIBRATION)
    assert auto.plan is not None
    assert (auto.step.seq_tile_tokens, auto.step.offload_layers) == (auto.plan.step.seq_tile_tokens, auto.plan.step.offload_layers)
    # the metrics carry the plan's GPU peak only where the run keeps the plan's memory choices
    assert auto.step.planned_device_bytes == auto.plan.device_total_bytes > 0
    assert plan.step.planned_device_bytes is None
    assert plan_job(load_job(TINY, ["plan.seq_tile_tokens=16"])).step.planned_device_bytes is None  # CPU: no plan


def test_device_layers_are_the_jobs_value_or_the_plans():
    """plan.device_layers: on CPU the job's value (clamped to the model, "auto" = none); on CUDA a value
    >= 0 is planned with (resident layers dropped to make room; its memory in the plan's table), or
    refused when it cannot fit; -1 takes the plan's."""
    assert plan_job(load_job(TINY, ["plan.device_layers=5"])).step.device_layers == 2  # tiny has 2 layers
    assert plan_job(load_job(TINY, [])).step.device_layers == 0
    forced = plan_job(load_job(TINY, CUDA + ["plan.device_layers=1"]), REFERENCE_CALIBRATION)
    assert forced.step.device_layers == 1 and forced.plan is not None and forced.plan.step.device_layers == 1
    assert "device-held layers" in dict(forced.plan.device_memory)
    big = ['model.shape="qwen3-4b"', "train.seq_len=2048", "memory.device_budget_gib=24"]
    with pytest.raises(PlanError, match=r"plan.device_layers = 20 does not fit the GPU memory budget of 24.00 GiB"):
        plan_job(load_job(TINY, CUDA + big + ["plan.device_layers=20"]), REFERENCE_CALIBRATION)
    auto = plan_job(load_job(TINY, CUDA), REFERENCE_CALIBRATION)
    assert auto.plan is not None and auto.step.device_layers == auto.plan.step.device_layers


def test_prefetch_depth_is_the_jobs_value_planned_with_its_buffers_or_the_plans():
    assert plan_job(load_job(TINY, [])).step.prefetch_depth == 1  # CPU: one copy ahead unless the job says
    assert plan_job(load_job(TINY, ["plan.prefetch_depth=3"])).step.prefetch_depth == 3
    big = CUDA + ['model.shape="qwen3-4b"', "train.seq_len=2048", "memory.device_budget_gib=40"]
    auto = plan_job(load_job(TINY, big), REFERENCE_CALIBRATION)
    assert auto.plan is not None and auto.step.prefetch_depth == auto.plan.step.prefetch_depth == 1
    slots = {}
    for depth in (2, 5):
        forced = plan_job(load_job(TINY, big + [f"plan.prefetch_depth={depth}"]), REFERENCE_CALIBRATION)
        assert forced.plan is not None and forced.step.prefetch_depth == forced.plan.step.prefetch_depth == depth
        assert forced.plan.device_total_bytes <= 40 * 2**30
        slots[depth] = dict(forced.plan.device_memory)["parameter slots"]
    slots[1] = dict(auto.plan.device_memory)["parameter slots"]
    per_copy = slots[2] - slots[1]  # one more layer buffer for each copy ahead
    assert per_copy > 0 and slots[5] - slots[1] == 4 * per_copy


def _smallest_need_gib(sets: list[str]) -> float:
    with pytest.raises(PlanError) as e:
        plan_job(load_job(TINY, sets + ["memory.device_budget_gib=1"]), REFERENCE_CALIBRATION)
    return float(str(e.value).split("the smallest plan needs ")[1].split(" GiB")[0])


def test_a_forced_prefetch_depth_that_does_not_fit_is_refused_with_its_own_need():
    """The refusal names the smallest plan at the job's depth, not one at depth 1 that would fit."""
    big = CUDA + ['model.shape="qwen3-4b"', "train.seq_len=2048"]
    need_1, need_8 = _smallest_need_gib(big), _smallest_need_gib(big + ["plan.prefetch_depth=8"])
    assert need_8 > need_1
    budget = round((need_1 + need_8) / 2, 2)
    assert plan_job(load_job(TINY, big + [f"memory.device_budget_gib={budget}"]), REFERENCE_CALIBRATION).plan is not None
    with pytest.raises(PlanError, match=rf"^no plan fits the GPU memory budget of {budget:.2f} GiB: the smallest "
                                        rf"plan needs {need_8:.2f} GiB \(.*prefetch_depth=8, micro_batch=1"):
        plan_job(load_job(TINY, big + [f"memory.device_budget_gib={budget}", "plan.prefetch_depth=8"]), REFERENCE_CALIBRATION)


def test_the_launchers_calibration_carries_the_jobs_model_and_sizes(monkeypatch):
    """The launcher calibrates and measures in a subprocess (no CUDA context of its own); it asks for the
    figures of the job's model (by its parameter count) and the GPU blocks of its shape at every size
    the plan may weigh."""
    from slidedp.config import model_config  # noqa: PLC0415
    from slidedp.launch import planning  # noqa: PLC0415
    from slidedp.planner import inputs  # noqa: PLC0415
    from slidedp.planner.plan import device_work_sizes  # noqa: PLC0415

    seen = {}
    monkeypatch.setattr(inputs, "measured_calibration", lambda gpus, model_params, measure: seen.update(
        gpus=gpus, n=model_params, measure=measure) or REFERENCE_CALIBRATION)
    job = load_job(TINY, ['runtime.device="cuda"', "runtime.workers=2", "train.global_batch=4", "plan.micro_batch=auto"])
    planned = planning.plan_job(job)
    cfg = model_config(job)
    assert (seen["gpus"], seen["n"]) == (2, cfg.num_parameters())
    m = seen["measure"]
    assert (m["model"], m["seq_len"], m["local_batch"], m["compiled"]) == (cfg.to_dict(), job.train.seq_len, 2, True)
    p = planned.plan
    assert (p.step.micro_batch, p.step.seq_tile_tokens, p.step.loss_chunk_tokens) in m["sizes"]  # what it chose was measured
    assert set(m["sizes"]) <= set(device_work_sizes(p.workload, int(job.memory.device_budget_gib * 2**30)))
    assert {mb for mb, _, _ in m["sizes"]} == {1, 2}  # the divisors of the 2 sequences per rank
    assert planned.step.micro_batch in (1, 2) and planned.step.micro_batch == planned.plan.step.micro_batch
