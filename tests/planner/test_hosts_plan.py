"""The step on several hosts (docs/multi-host.md, "The step model"): the network between hosts charged per
collective, the host's copies and AdamW of its 1/H, and one host's plans unchanged."""

from __future__ import annotations

import dataclasses

import pytest

from slidedp.config import load_job
from slidedp.model.config import named_shape
from slidedp.planner import REFERENCE_CALIBRATION, Workload, costs, make_plan, plan_for
from slidedp.planner.step_model import collective_s, network_busy_s, predict_step
from slidedp.stepplan import StepPlan

from pipeline.harness import TINY

LINKS = dataclasses.replace(REFERENCE_CALIBRATION, bus_gpus=4, allreduce_gbps=240.0, h2d_total_gbps=220.0)
ROUTES = {"param_route": ("sharded",), "grad_route": ("reduce_scatter",), "embedding": ("host",)}
MODEL = named_shape("qwen3-4b")  # tied: its embedding comes whole, as the head's


def work(hosts: int, batch: int = 32, **kw) -> Workload:
    """A host's share of a batch of `batch` x 2,048 over `hosts` hosts of 4 ranks."""
    return Workload(MODEL, global_batch=batch // hosts, seq_len=2048, world=4, micro_batch=2, nnodes=hosts, **kw)


STEP = StepPlan(micro_batch=2, embedding="host", delivery="bf16", param_route="sharded", grad_route="reduce_scatter",
                chunk_rows=costs.default_chunk_rows(MODEL))


def test_a_collective_runs_at_the_slower_of_the_gpu_links_and_the_network_plus_its_rings_latency():
    gb = 1e9
    # 2 hosts x 4: a ring of 8 carries 7/8 of the chunk over every host's link, at 12.5 GB/s (< 240 among the GPUs)
    assert collective_s(work(2), LINKS, gb) == pytest.approx(7 / 8 * gb / 12.5e9 + 7 * 20e-6)
    assert collective_s(work(4), LINKS, gb) == pytest.approx(15 / 16 * gb / 12.5e9 + 15 * 20e-6)
    # sharing the link with the other collective: its share of the rate
    assert collective_s(work(2), LINKS, gb, share=1 / 3) == pytest.approx(7 / 8 * gb / (12.5e9 / 3) + 7 * 20e-6)
    # a network faster than the GPU links: the GPU links bound it (a job's 4,000 Gb/s, 2 us)
    fast = dataclasses.replace(LINKS, internode_gbps=500.0, internode_latency_us=2.0)
    assert collective_s(work(2), fast, gb) == pytest.approx(7 / 8 * gb / 240e9 + 7 * 2e-6)
    # the link's busy time is its bytes at its full rate, whatever the GPU links
    assert network_busy_s(work(4), fast, gb) == pytest.approx(15 / 16 * gb / 500e9 + 15 * 2e-6)


@pytest.mark.parametrize("hosts", [2, 4])
def test_the_network_is_charged_every_chunks_all_gathers_and_reduce_scatters(hosts):
    w = work(hosts)
    busy, _, step = predict_step(w, STEP, LINKS)
    nl, p, h, vh = MODEL.num_layers, costs.layer_params(MODEL), MODEL.hidden_size, costs.embedding_params(MODEL)
    rows = costs.row_blocks(MODEL.vocab_size, STEP.chunk_rows)
    r = 4 * hosts
    gathered = (2 * nl * p + h + vh) * 2  # bf16: every layer twice (none resident), the norm, the tied embedding
    scattered = (nl * p + h + vh) * 4  # fp32 gradients
    collectives = (2 * nl + 2) + (nl + 1 + len(rows))
    small = 2 * 2 * (r - 1) * 20e-6  # the loss's and the norm's all-reduces
    want = (gathered + scattered) * (r - 1) / r / 12.5e9 + collectives * (r - 1) * 20e-6 + small
    assert busy["network"] == pytest.approx(want)
    # 4.02 B params: 8 B/param, (R - 1) / R of it through the link a step: 2.2 s at 2 hosts, 2.4 at 4
    assert busy["network"] == pytest.approx(4.02e9 * 8 * (r - 1) / r / 12.5e9, rel=0.02)
    # the network bounds this step: its copy streams carry the collectives at the link's rate
    assert step >= busy["network"] and step > busy["device"]


def test_each_host_copies_and_updates_its_1_over_h_of_every_chunk():
    one, two, four = (predict_step(work(h, batch=32 * h), STEP, LINKS)[0] for h in (1, 2, 4))
    # the same batch per host: each host's updaters run AdamW on half, a quarter of the parameters
    assert two["update"] == pytest.approx(one["update"] / 2)
    assert four["update"] == pytest.approx(one["update"] / 4)
    # host memory traffic: the copies in and gradients out of its range, its AdamW
    t1, t2 = (costs.host_traffic(MODEL, tokens=16 * 2048, delivery="bf16", embedding="host", resident_layers=0,
                                 device_layers=0, offloaded=0, world=4, param_route="sharded",
                                 grad_route="reduce_scatter", compute_dtype="bf16", summed=False, nnodes=h)
              for h in (1, 2))
    assert t2["update"] == t1["update"] // 2 and t2["grads"] == t1["grads"] // 2 and t2["fetch"] == t1["fetch"] // 2


def test_one_host_is_charged_no_network_whatever_the_calibration_says():
    slow = dataclasses.replace(LINKS, internode_gbps=0.1, internode_latency_us=1e4, internode_source="job")
    for w in (work(1), dataclasses.replace(work(1), world=1, global_batch=8)):
        ch = STEP if w.world > 1 else dataclasses.replace(STEP, param_route="replicated", grad_route="host")
        busy, exposed, step = predict_step(w, ch, LINKS)
        assert "network" not in busy
        assert predict_step(w, ch, slow) == (busy, exposed, step)
    plan = make_plan(work(1), 24 << 30, LINKS, ROUTES)
    assert plan.describe() == make_plan(work(1), 24 << 30, slow, ROUTES).describe()
    assert "network" not in plan.describe()


def test_an_untied_embedding_is_all_gathered_whole_on_several_hosts_not_gathered_by_rows():
    m = named_shape("qwen3-8b")
    ch = dataclasses.replace(STEP, chunk_rows=costs.default_chunk_rows(m))
    kw = dict(seq_len=2048, world=4, micro_batch=2)
    busy1 = predict_step(Workload(m, global_batch=16, **kw), ch, LINKS)[0]
    busy2 = predict_step(Workload(m, global_batch=16, nnodes=2, **kw), ch, LINKS)[0]
    items = dict(costs.device_memory_items(
        m, tokens=4 * 2048, seq_len=2048, micro_batch=2, world=4, delivery="bf16", activations="keep",
        embedding="host", prefetch_depth=1, resident_layers=0, chunk_rows=ch.chunk_rows, loss_chunk_tokens=1024,
        nnodes=2))
    assert items["embedding weights (fetched whole)"] == costs.embedding_params(m) * 2
    assert busy2["h2d"] > busy1["h2d"]  # the embedding's all-gather over the network, the layers' too


def test_the_plan_shows_the_step_on_h_hosts_with_its_network_and_bound():
    text = make_plan(work(2), 24 << 30, LINKS, ROUTES, device_layers=0).describe()
    assert "on 4 rank(s) of this host, one of 2 hosts (32 x 2048 = 65,536 tokens/step on 8 ranks)" in text
    assert "several hosts: network between hosts: 12.5 GB/s (100 Gb/s) each way per host, assumed; latency 20 us" in text
    assert "\n  network " in text and "tokens/s over the 2 hosts" in text
    assert "its store holds 1/2 of the state and its updaters update 1/2 of the parameters" in text
    assert "The step is bound by the network between hosts" in text


def test_the_job_sets_the_network_and_the_plan_says_so():
    sets = ['runtime.device="cuda"', "runtime.workers=2", "train.global_batch=8", "plan.compute_dtype=bf16",
            "runtime.nnodes=2", 'runtime.master_addr="h0"']
    assumed = plan_for(load_job(TINY, sets), calibration=LINKS)
    given = plan_for(load_job(TINY, sets + ["runtime.network_gbps=400", "runtime.network_latency_us=5"]),
                     calibration=LINKS)
    assert "12.5 GB/s (100 Gb/s) each way per host, assumed; latency 20 us per ring step, assumed" in assumed.describe()
    assert given.plan.calibration.internode_gbps == 50.0 and given.plan.calibration.internode_latency_us == 5.0
    assert "50.0 GB/s (400 Gb/s) each way per host, set by the job; latency 5 us per ring step, set by the job" \
        in given.describe()
    assert given.plan.workload.nnodes == 2 and given.plan.workload.global_batch == 4
    net = dict(assumed.plan.busy_s)["network"]
    assert dict(given.plan.busy_s)["network"] < net


def test_plan_on_several_hosts_prints_each_hosts_memory_with_its_part():
    from slidedp.launch.cli import hosts_memory_line

    sets = ['runtime.device="cuda"', "runtime.workers=2", "train.global_batch=16", "plan.compute_dtype=bf16",
            'runtime.master_addr="h0"']
    lines = {h: hosts_memory_line(job, plan_for(job, calibration=LINKS))
             for h in (2, 4) for job in [load_job(TINY, sets + [f"runtime.nnodes={h}"])]}
    assert lines[2].startswith("host memory per host (host 0 of 2: its part, 1/2 of the state): ")
    assert "the store's state (12 B/param)" in lines[2] or "the store's state (14 B/param)" in lines[2]
    assert "gradient rings" in lines[4] and "the job's processes (2 rank(s))" in lines[4]
