"""The network between hosts as runs measured it, kept with the host (slidedp/planner/netcache.py) and charged by
the next plan on several hosts on this host (planner/job.py: network, host_network): kept and read back, the
job's figures win, and a host with no measurement plans with the assumption."""

from __future__ import annotations

import dataclasses
import json
import stat

import pytest

from slidedp.config import load_job
from slidedp.planner import REFERENCE_CALIBRATION, inputs, plan_for
from slidedp.planner.job import host_network, network
from slidedp.planner.netcache import RECENT_RUNS, measured_network, network_file, record_network
from slidedp.planner.netfit import NetworkFit

from pipeline.harness import TINY

LINKS = dataclasses.replace(REFERENCE_CALIBRATION, bus_gpus=4, allreduce_gbps=240.0, h2d_total_gbps=220.0)
HOSTS = ['runtime.device="cuda"', "runtime.workers=2", "train.global_batch=8", "plan.compute_dtype=bf16",
         "runtime.nnodes=2", 'runtime.master_addr="h0"']


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIDEDP_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_a_run_is_kept_per_backend_and_read_back(cache):
    assert measured_network("nccl") is None  # nothing measured yet
    kept = record_network(NetworkFit(3.1, 41.0), "nccl", "2026-12-05T10:00:00+00:00", nnodes=2, ranks=16)
    assert (kept.gbps, kept.latency_us, kept.at_least, kept.latest, kept.runs) == (3.1, 41.0, False, "2026-12-05", 1)
    assert kept.source == "measured by the run of 2026-12-05"
    assert measured_network("nccl") == kept
    assert measured_network("gloo") is None  # a Gloo run stands for no NCCL plan, nor the other way
    path = network_file()
    assert path.parent == cache and stat.S_IMODE(path.stat().st_mode) == 0o600
    run = json.loads(path.read_text())["backends"]["nccl"][0]
    assert (run["nnodes"], run["ranks"], run["measured_at"]) == (2, 16, "2026-12-05T10:00:00+00:00")


def test_the_median_of_the_last_runs_is_charged(cache):
    for day, (rate, lat) in enumerate([(1.0, 90.0), (3.0, 30.0), (2.0, 50.0), (9.0, 10.0), (2.5, 40.0), (2.2, 45.0)]):
        kept = record_network(NetworkFit(rate, lat), "nccl", f"2026-12-0{day + 1}T00:00:00+00:00", 2, 8)
    # the first of six runs has left the last RECENT_RUNS = 5: rates 3, 2, 9, 2.5, 2.2 and latencies 30..50
    assert RECENT_RUNS == 5 and (kept.gbps, kept.latency_us, kept.runs) == (2.5, 40.0, 5)
    assert kept.source == "measured: the median of this host's last 5 runs, the latest of 2026-12-06"


def test_the_median_run_bounded_by_the_gpu_links_says_at_least(cache):
    record_network(NetworkFit(200.0, 3.0, at_least=True), "nccl", "2026-12-05", 2, 16)
    assert measured_network("nccl").at_least
    record_network(NetworkFit(100.0, 3.0), "nccl", "2026-12-06", 2, 16)
    assert not measured_network("nccl").at_least  # the median of 100 and 200: one of the two was not bounded
    record_network(NetworkFit(190.0, 3.0, at_least=True), "nccl", "2026-12-07", 2, 16)
    assert measured_network("nccl").at_least  # the median run, 190, was


def test_a_cache_without_the_network_or_a_broken_one_plans_with_the_assumption(cache, monkeypatch):
    job = load_job(TINY, HOSTS)
    assert host_network(job) is None
    network_file().write_text("{not json")
    assert host_network(job) is None
    network_file().write_text(json.dumps({"schema": 1, "backends": {"nccl": [{"gbps": -1, "latency_us": 3,
                                                                              "measured_at": "x"}]}}))
    assert host_network(job) is None
    monkeypatch.setattr(inputs, "measured_calibration", lambda *a, **k: LINKS)  # this host's calibration
    text = plan_for(job).describe()
    assert "12.5 GB/s (100 Gb/s) each way per host, assumed; latency 20 us per ring step, assumed" in text


def test_the_next_plan_on_several_hosts_charges_what_a_run_measured_unless_the_job_sets_it(cache, monkeypatch):
    record_network(NetworkFit(3.0, 40.0), "nccl", "2026-12-05T10:00:00+00:00", 2, 4)
    monkeypatch.setattr(inputs, "measured_calibration", lambda *a, **k: LINKS)  # this host's calibration
    measured = plan_for(load_job(TINY, HOSTS))
    calib = measured.plan.calibration
    assert (calib.internode_gbps, calib.internode_latency_us) == (3.0, 40.0)
    assert ("network between hosts: 3.0 GB/s (24 Gb/s) each way per host, measured by the run of 2026-12-05; "
            "latency 40 us per ring step, measured by the run of 2026-12-05") in measured.describe()
    assumed = plan_for(load_job(TINY, HOSTS), calibration=LINKS)  # a calibration given (another host's): assumed
    assert dict(measured.plan.busy_s)["network"] > dict(assumed.plan.busy_s)["network"]  # 24 Gb/s, not 100
    # the job's figures win, each on its own: its rate with the measured latency, then both
    rate = plan_for(load_job(TINY, HOSTS + ["runtime.network_gbps=400"])).describe()
    assert ("50.0 GB/s (400 Gb/s) each way per host, set by the job; latency 40 us per ring step, measured by the "
            "run of 2026-12-05") in rate
    both = plan_for(load_job(TINY, HOSTS + ["runtime.network_gbps=400", "runtime.network_latency_us=5"]))
    assert "set by the job; latency 5 us per ring step, set by the job" in both.describe()
    # one host: no network, nothing read
    assert host_network(load_job(TINY, [h for h in HOSTS if "nnodes" not in h])) is None


def test_a_rate_at_the_gpu_links_is_charged_as_at_least():
    job = load_job(TINY, HOSTS)
    from slidedp.planner.netcache import MeasuredNetwork

    calib = network(job, LINKS, MeasuredNetwork("nccl", 240.0, 3.0, True, "2026-12-05", 1))
    assert calib.network_words().startswith(
        "network between hosts: at least 240.0 GB/s (1920 Gb/s) each way per host, measured by the run of 2026-12-05 "
        "(the GPU links within the host bounded the collectives measured); latency 3 us per ring step")
    job_rate = network(load_job(TINY, HOSTS + ["runtime.network_gbps=800"]), calib)
    assert "at least" not in job_rate.network_words()
