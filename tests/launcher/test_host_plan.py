"""One plan and one job on every host (launch/host_plan.py): a host other than host 0 plans with host 0's
calibration and choices and carries out host 0's step; the ready barrier names every difference of the jobs."""

from __future__ import annotations

import dataclasses

import pytest

from slidedp.config import load_job
from slidedp.launch.host_plan import SharedPlan, adopted, agreement, choices, differences, job_with_choices
from slidedp.launch.hosts import HostFault, JobsDiffer
from slidedp.planner import REFERENCE_CALIBRATION, PlanError, plan_for
from slidedp.planner.measure import LayerTime, LossTime, MeasuredBlocks
from slidedp.stepplan import StepPlan

from launcher.test_host_link import links, on_both
from pipeline.harness import TINY

LINKS = dataclasses.replace(REFERENCE_CALIBRATION, bus_gpus=4, allreduce_gbps=240.0, h2d_total_gbps=220.0)
SETS = ['runtime.device="cuda"', "runtime.workers=2", "train.global_batch=16", "plan.compute_dtype=bf16",
        "runtime.nnodes=2", 'runtime.master_addr="h0"']


def host_job(rank: int, *more: str):
    return load_job(TINY, SETS + [f"runtime.node_rank={rank}", *more])


def test_hosts_planning_alone_can_differ_and_host_0s_plan_makes_them_one():
    host0 = plan_for(host_job(0), calibration=LINKS)
    # host 1's PCIe measured slower: alone, its planner delivers bf16 where host 0's delivers fp32, and their
    # all-gathers would carry unlike bytes
    slow_pcie = dataclasses.replace(LINKS, h2d_gbps=2.0)
    alone = plan_for(host_job(1), calibration=slow_pcie)
    assert (host0.step.delivery, alone.step.delivery) == ("fp32", "bf16")
    # with host 0's calibration and choices it plans host 0's step, field for field
    shared = SharedPlan.from_json(SharedPlan(host0.step, host0.plan.calibration).to_json())
    mine = plan_for(job_with_choices(host_job(1), shared.step), calibration=shared.calibration)
    assert mine.step == host0.step
    assert adopted(mine.step, shared.step) == host0.step
    assert choices(host0.step)["resident_layers"] == 2 and choices(host0.step)["micro_batch"] == 2


def test_a_host_whose_gpu_cannot_hold_host_0s_plan_is_refused_by_its_planner():
    host0 = plan_for(host_job(0), calibration=LINKS)
    small = job_with_choices(host_job(1, "memory.device_budget_gib=0.001"), host0.step)
    with pytest.raises(PlanError):
        plan_for(small, calibration=LINKS)


def test_a_changed_choice_is_named():
    host0 = StepPlan(micro_batch=2, delivery="bf16", param_route="sharded", grad_route="reduce_scatter")
    with pytest.raises(ValueError, match=r"this host cannot carry out host 0's plan: its planner changed "
                                         r"micro_batch 1 \(host 0: 2\), delivery 'fp32' \(host 0: 'bf16'\)"):
        adopted(dataclasses.replace(host0, micro_batch=1, delivery="fp32"), host0)


def test_the_shared_plan_carries_the_calibration_and_its_blocks():
    blocks = MeasuredBlocks("key", "GPU T", (LayerTime(2, 0, 0.011, 0.033, 1 << 20),), (LossTime(2, 0, 1024, 0.004),))
    calib = dataclasses.replace(LINKS, blocks=blocks, internode_gbps=50.0, internode_source="job")
    step = StepPlan(micro_batch=4, resident_layers=3, predicted_step_s=1.25, planned_by="planner")
    back = SharedPlan.from_json(SharedPlan(step, calib).to_json())
    assert back == SharedPlan(step, calib)
    assert SharedPlan.from_json(SharedPlan(step).to_json()) == SharedPlan(step, None)  # CPU: no planner ran


def test_differences_name_each_setting_with_both_values():
    step = StepPlan(micro_batch=2)
    base = agreement(host_job(0), "abc", {"epoch": 0, "position": 0, "seed": 0, "rows": "f00d"}, step)
    assert differences(base, base) == []
    other = agreement(host_job(1, "train.lr=0.5", "runtime.workers=1"), "abd",
                      {"epoch": 0, "position": 0, "seed": 0, "rows": "beef"}, dataclasses.replace(step, micro_batch=4))
    assert differences(other, base) == [
        f"train.lr 0.5 (host 0: {host_job(0).train.lr!r})",
        "the model's chunk table (another model, or another plan.layer_chunk_numel)",
        "the data at the first step: rows 'beef' (host 0: 'f00d')",
        "runtime.workers 1 (host 0: 2)",
        "plan.micro_batch 4 (host 0: 2)"]


def test_host_1_takes_host_0s_plan_and_a_job_that_differs_is_refused_at_the_barrier():
    zero, one = links()
    try:
        zero.share_plan(SharedPlan(StepPlan(micro_batch=3)).to_json())
        assert SharedPlan.from_json(one.host0_plan(lambda: None)).step == StepPlan(micro_batch=3)
        same = {"train": {"lr": 1e-3}, "layout": "abc", "data": {"position": 0}, "workers": 2, "plan": {"micro_batch": 3}}
        apart = {**same, "train": {"lr": 2e-3}}
        out = on_both(zero, one, lambda i, link: link.ready(3, lambda: None, (same, apart)[i]) or "ready")
        for e in out:
            assert isinstance(e, JobsDiffer), out
            assert str(e) == ("host 1 (node rank 1)'s job differs from host 0's: train.lr 0.002 (host 0: 0.001). Every "
                              "host must run the same job file (its [train], model and data) with the same "
                              "runtime.workers")
    finally:
        one.close(ok=True)
        zero.close(ok=True)


def test_host_0_failing_before_its_plan_is_named_while_host_1_waits_for_it():
    zero, one = links()
    try:
        zero.failed("the store needs 80.0 GiB of /dev/shm; 12.0 GiB are free")
        with pytest.raises(HostFault, match=r"^host 0 \(node rank 0\) failed: the store needs 80.0 GiB of /dev/shm"):
            one.host0_plan(lambda: None)
        one.failed("host 0 (node rank 0) failed: ...")  # as its launcher would: host 0 then closes the store at once
    finally:
        one.close(ok=False)
        zero.close(ok=False)
