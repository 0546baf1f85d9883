"""Host memory in the plan: the bytes a step moves, the bound host bandwidth sets, the bf16 delivery's choice
and the advice `--plan` prints where the host bounds the step. Injected calibrations, no timing."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from slidedp import hosttraffic
from slidedp.config import load_job
from slidedp.launch.planning import plan_job
from slidedp.planner.job import DeliveryError, deliveries
from slidedp.model.config import named_shape
from slidedp.planner import REFERENCE_CALIBRATION, Workload, costs
from slidedp.planner.host_bandwidth import measure_host_memory
from slidedp.planner.step_model import host_bound_s, host_traffic, predict_step
from slidedp.stepplan import StepPlan

from pipeline.harness import TINY

Q8 = named_shape("qwen3-8b")
# Qwen3-8B at 8 x 2,048 tokens, micro-batch 2, one GPU, 24 GiB: the regime of issue 26
JOB = ['model.shape="qwen3-8b"', "model.vocab_size=0", "train.seq_len=2048", "train.global_batch=8",
       "plan.micro_batch=2", 'plan.compute_dtype="bf16"', 'runtime.device="cuda"', "runtime.workers=1",
       "memory.device_budget_gib=24"]
# a host whose memory is slow for every workload timed: reading 70 GB/s, copying 60, the bare AdamW 67.2 (2.4 G
# params/s x 28 B), and 2.3 G params/s beside the GPU's copies (the updaters alone would take less than the traffic)
HOST_BOUND = dataclasses.replace(REFERENCE_CALIBRATION, host_read_gbps=70.0, host_write_gbps=40.0, host_copy_gbps=60.0,
                                 adamw_params_per_s=2.4e9, adamw_beside_copies_params_per_s=2.3e9,
                                 adamw_beside_copies_gpus=1)
# PCIe slow, host memory and the updaters plentiful: the copies in bound the step
PCIE_BOUND = dataclasses.replace(REFERENCE_CALIBRATION, h2d_gbps=6.0, d2h_gbps=6.0, bidir_gbps=12.0,
                                 host_copy_gbps=2000.0, adamw_params_per_s=1e12)
# everything but the GPU plentiful
DEVICE_BOUND = dataclasses.replace(PCIE_BOUND, h2d_gbps=1000.0, d2h_gbps=1000.0, bidir_gbps=2000.0)


def test_host_bytes_per_step_by_hand():
    p, nl, h = costs.layer_params(Q8), Q8.num_layers, Q8.hidden_size
    vh = costs.embedding_params(Q8)
    work = Workload(Q8, global_batch=8, seq_len=2048, world=1, micro_batch=2)
    t = host_traffic(work, StepPlan(embedding="device"))
    # every layer in twice (forward, backward) in fp32, its gradient out, its AdamW; the final norm once each
    assert t == {"fetch": (2 * nl * p + h) * 4, "grads": (nl * p + h) * 4, "offload": 0,
                 "update": (nl * p + h) * 28, "sum": 0}
    # held layers leave the host; resident ones are fetched once; bf16 halves the copies, the shadow is refreshed
    t = host_traffic(work, StepPlan(embedding="device", device_layers=2, resident_layers=3, delivery="bf16"))
    assert t["fetch"] == ((2 * (nl - 2) - 3) * p + h) * 2 and t["grads"] == ((nl - 2) * p + h) * 4
    assert t["update"] == ((nl - 2) * p + h) * (28 + hosttraffic.SHADOW_REFRESH_BYTES)
    # the embedding on the host: the batch's rows and the head's matrix in, the (untied: both) gradients out
    t = host_traffic(work, StepPlan(embedding="host"))
    assert t["fetch"] == (2 * nl * p + h) * 4 + 8 * 2048 * h * 4 + vh * 4
    assert t["grads"] == (nl * p + h + 2 * vh) * 4  # qwen3-8b's head is untied
    # two ranks: each reads its own copy (replicated) or its 1/N (sharded); the host route sums them
    two = Workload(Q8, global_batch=8, seq_len=2048, world=2, micro_batch=2)
    rep, shard = host_traffic(two, StepPlan(embedding="device")), host_traffic(
        two, StepPlan(embedding="device", param_route="sharded", grad_route="reduce_scatter"))
    assert rep["fetch"] == 2 * shard["fetch"] and rep["grads"] == 2 * shard["grads"]
    assert rep["sum"] == (nl * p + h) * (3 * 4 + 4) and shard["sum"] == 0  # reads 2, writes 1, reads it for the norm


def test_the_host_bound_floors_the_step_where_it_was_measured():
    work = Workload(Q8, global_batch=8, seq_len=2048, world=1, micro_batch=2)
    ch = StepPlan(embedding="device")
    total = sum(host_traffic(work, ch).values())
    busy, _, step = predict_step(work, ch, HOST_BOUND)
    # the largest of the read (70), copy (60) and bare AdamW (67.2) rates: the most the host's memory was seen to move
    assert HOST_BOUND.host_rates_gbps == pytest.approx({"read": 70.0, "copy": 60.0, "AdamW": 67.2}, rel=1e-12)
    assert busy["host"] == pytest.approx(total / 70e9, rel=1e-12) and step == pytest.approx(busy["host"], rel=1e-12)
    copy_faster = dataclasses.replace(HOST_BOUND, host_copy_gbps=80.0)
    assert host_bound_s(work, ch, copy_faster) == pytest.approx(total / 80e9, rel=1e-12)
    # the kernel moved more than the read probe (4 G params/s x 28 B = 112 GB/s): it bounds the traffic
    adamw_faster = dataclasses.replace(HOST_BOUND, adamw_params_per_s=4.0e9)
    assert host_bound_s(work, ch, adamw_faster) == pytest.approx(total / 112e9, rel=1e-12)
    assert "at the host's measured AdamW rate of 112.0 GB/s" in plan_job(load_job(TINY, JOB), adamw_faster).describe()
    busy, _, step = predict_step(work, ch, REFERENCE_CALIBRATION)  # not measured (an old cache): no bound
    assert busy["host"] == 0.0 == host_bound_s(work, ch, REFERENCE_CALIBRATION) and step > 0


def test_the_deliveries_a_plan_may_choose():
    def job(*sets):
        return load_job(TINY, JOB + list(sets))

    assert deliveries(job(), store_shadow=None) == (("fp32", "bf16"), "")  # auto: the plan weighs both
    assert deliveries(job(), store_shadow=True) == (("bf16",), "")  # the shadow is kept anyway: stream it
    options, note = deliveries(job(), store_shadow=False)
    assert options == ("fp32",) and "was created without the bf16 shadow (store.shadow_bf16)" in note
    options, note = deliveries(job(), store_shadow=None, shadow_fits=False)
    assert options == ("fp32",) and "the host has no room for the bf16 shadow" in note
    assert deliveries(job("store.shadow_bf16=false"), store_shadow=None) == (("fp32",), "")
    assert deliveries(job("store.shadow_bf16=true"), store_shadow=None) == (("bf16",), "")
    assert deliveries(job('plan.delivery="fp32"'), store_shadow=True) == (("fp32",), "")
    assert deliveries(job('plan.compute_dtype="fp32"'), store_shadow=True) == (("fp32",), "")
    with pytest.raises(DeliveryError, match=r'plan.delivery = "bf16" streams the store\'s bf16 shadow, but store '
                                            r".* was created without one: .* store.shadow_bf16 = true"):
        deliveries(job('plan.delivery="bf16"'), store_shadow=False)


def test_the_planner_takes_the_bf16_delivery_where_it_pays_and_the_store_follows():
    job = load_job(TINY, JOB)
    pcie = plan_job(job, PCIE_BOUND)
    assert (pcie.step.delivery, pcie.shadow) == ("bf16", True)  # the store this job creates gets the shadow
    assert pcie.plan is not None and "bf16 delivery: the store's bf16 shadow streams" in pcie.describe()
    fp32 = plan_job(load_job(TINY, JOB + ['plan.delivery="fp32"']), PCIE_BOUND)
    assert fp32.step.delivery == "fp32" and fp32.step.predicted_step_s > pcie.step.predicted_step_s
    # an existing store without the shadow: fp32, and the plan says why
    old = plan_job(job, PCIE_BOUND, store_shadow=False)
    assert (old.step.delivery, old.shadow) == ("fp32", False)
    assert "note: delivery fp32: store" in old.describe() and "was created without the bf16 shadow" in old.describe()
    # where the shadow's refresh costs the host more than the halved copies save, fp32
    host = plan_job(job, HOST_BOUND)
    assert (host.step.delivery, host.shadow) == ("fp32", False)
    # store.shadow_bf16 = false: a store without it, whatever the plan would have liked
    assert plan_job(load_job(TINY, JOB + ["store.shadow_bf16=false"]), PCIE_BOUND).shadow is False
    # CPU: no planner; the bf16 delivery where the store has the shadow (or gets it: store.shadow_bf16 = true)
    cpu = ['plan.compute_dtype="bf16"']
    assert plan_job(load_job(TINY, cpu)).step.delivery == "fp32"
    assert (plan_job(load_job(TINY, cpu + ["store.shadow_bf16=true"])).step.delivery,
            plan_job(load_job(TINY, cpu), store_shadow=True).step.delivery) == ("bf16", "bf16")


def test_the_plan_prints_host_bytes_and_says_what_helps_when_the_host_bounds_the_step(monkeypatch):
    # torch's kernel: the shadow is a pass of its own (6 B/param)
    monkeypatch.setattr(hosttraffic, "SHADOW_REFRESH_BYTES", hosttraffic.SHADOW_PASS_BYTES)
    job = load_job(TINY, JOB)
    text = plan_job(job, HOST_BOUND).describe()
    line = next(x for x in text.splitlines() if x.startswith("host memory per step:"))
    assert " B/param (copies in " in line and "at the host's measured read rate of 70.0 GB/s" in line
    assert "the host bounds the step: host memory traffic takes" in text
    assert "train.global_batch = " in text and "(now 8) would give the GPU about as long as the host" in text
    assert "a larger memory.device_budget_gib: each layer more held on the device" in text
    assert "plan.delivery = \"bf16\"" not in text  # here it would add to the host's traffic (the shadow refresh)
    assert "busy per step" in text and "\n  host " in text
    # with the shadow written inside the AdamW pass (2 B/param, not a pass of its own) the halved copies save more
    # than it costs: the advice names the bf16 delivery where the job keeps fp32
    monkeypatch.setattr(hosttraffic, "SHADOW_REFRESH_BYTES", hosttraffic.SHADOW_IN_PASS_BYTES)
    # host memory slow (copy 20 GB/s, the bare AdamW 19.6) and PCIe slow, so the DMA hardly loads host memory and
    # the updaters run near their bare rate: the traffic, not the updaters, bounds the step
    slow_host = dataclasses.replace(PCIE_BOUND, host_copy_gbps=20.0, adamw_params_per_s=0.7e9,
                                    adamw_beside_copies_params_per_s=0.69e9, adamw_beside_copies_gpus=1)
    fp32 = plan_job(load_job(TINY, JOB + ['plan.delivery="fp32"']), slow_host).describe()
    assert "the host bounds the step" in fp32 and 'the bf16 delivery (plan.delivery = "bf16"' in fp32
    # the GPU bounds it: the bytes and the bound, no advice
    gpu = plan_job(job, DEVICE_BOUND).describe()
    assert "host memory per step:" in gpu and "the host bounds the step" not in gpu
    # a calibration from before host memory was measured
    old = plan_job(job, REFERENCE_CALIBRATION).describe()
    assert "the host's memory bandwidth was not measured (an old calibration): no bound" in old


def test_host_memory_is_measured_per_numa_node_and_added_up():
    """The mechanism, not the speed: each node (here two made-up nodes of this host's CPUs) measured in its
    own pinned process, the host's figure their sum."""
    import os

    cpus = sorted(os.sched_getaffinity(0))
    hm = measure_host_memory([cpus[:1], cpus[-1:]], quick=True)
    assert len(hm.node_copy_gbps) == 2 and hm.copy_gbps == pytest.approx(sum(hm.node_copy_gbps))
    assert min(hm.read_gbps, hm.write_gbps, *hm.node_copy_gbps) > 0
    one = measure_host_memory([cpus], quick=True)
    assert one.node_copy_gbps == () and one.copy_gbps > 0 and "NUMA" not in one.summary()


def test_the_shadow_costs_its_write_where_the_compiled_kernel_runs():
    """The updaters' kernel decides what the shadow costs: numba's (SLIDEDP_ADAMW_KERNEL=all) writes it inside
    the AdamW pass, after torch's kernel it is a pass of its own."""
    numba = importlib.util.find_spec("numba") is not None
    assert hosttraffic.adamw_kernel({}) == ("correction" if numba else "torch")
    assert hosttraffic.adamw_kernel({"SLIDEDP_ADAMW_KERNEL": "all"}) == ("all" if numba else "torch")
    assert hosttraffic.adamw_kernel({"SLIDEDP_ADAMW_KERNEL": "torch"}) == "torch"
    with pytest.raises(ValueError, match="SLIDEDP_ADAMW_KERNEL must be one of correction, all, torch, got 'fast'"):
        hosttraffic.adamw_kernel({"SLIDEDP_ADAMW_KERNEL": "fast"})
    # by default the shadow is a pass of its own after torch's kernel
    assert hosttraffic.SHADOW_REFRESH_BYTES == hosttraffic.SHADOW_PASS_BYTES
    assert hosttraffic.update_bytes(True) - hosttraffic.update_bytes(False) == hosttraffic.SHADOW_REFRESH_BYTES
    assert (hosttraffic.SHADOW_IN_PASS_BYTES, hosttraffic.SHADOW_PASS_BYTES) == (2, 6)
