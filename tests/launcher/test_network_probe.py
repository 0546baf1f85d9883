"""The launcher's reading of the ranks' network probe (launch/network.py): the file fitted again with this host's
GPU links, a file that is not one named, and the measurement said beside what the plan charged."""

from __future__ import annotations

import dataclasses
import json

import pytest

from slidedp.config import load_job
from slidedp.launch.network import gpu_links_cap, read_probe, words
from slidedp.launch.planning import plan_job
from slidedp.launch.summary import summary
from slidedp.planner import REFERENCE_CALIBRATION
from slidedp.planner.netfit import Timing
from slidedp.worker.netprobe import probe_doc, write_private

from pipeline.harness import TINY

LINKS = dataclasses.replace(REFERENCE_CALIBRATION, bus_gpus=2, allreduce_gbps=100.0)
HOSTS = ["runtime.workers=2", "runtime.nnodes=2", 'runtime.master_addr="h0"', "train.global_batch=8"]


def timings(gbps: float, latency_us: float, ranks: int = 4) -> list[Timing]:
    return [Timing(k, n, n * (ranks - 1) / ranks / (gbps * 1e9) + (ranks - 1) * latency_us * 1e-6)
            for n in (1 << 20, 64 << 20) for k in ("all_gather", "reduce_scatter")]


def test_the_probe_file_is_fitted_with_the_gpu_links_cap(tmp_path):
    assert read_probe(tmp_path) is None  # not written yet
    write_private(tmp_path / "network.json", probe_doc(timings(99.0, 4.0), 4, 2, "nccl", 0.4))
    alone = read_probe(tmp_path)
    assert alone.fit.gbps == pytest.approx(99.0) and not alone.fit.at_least  # one GPU a host: nothing bounds it
    capped = read_probe(tmp_path, cap_gbps=100.0)  # 99 of the GPU links' 100: they bounded it
    assert capped.fit.at_least and (capped.backend, capped.nnodes, capped.ranks) == ("nccl", 2, 4)
    assert capped.words().startswith("the network between hosts measured at least 792 Gb/s (99 GB/s) each way per "
                                     "host, 4 us per ring step (nccl, 4 ranks on 2 hosts, 0.40 s)")
    assert capped.to_dict()["at_least"] is True


def test_a_file_that_is_not_the_probes_is_named(tmp_path):
    (tmp_path / "network.json").write_text("{")
    assert "is unreadable" in read_probe(tmp_path).problem
    (tmp_path / "network.json").write_text(json.dumps({"schema": 1}))
    assert "is not the ranks' probe" in read_probe(tmp_path).problem
    noise = [dataclasses.replace(t, seconds=1e-3) for t in timings(1.0, 1.0)]
    write_private(tmp_path / "network.json", probe_doc(noise, 4, 2, "gloo", 0.1))
    got = read_probe(tmp_path)
    assert got.fit is None and "did not take longer" in got.problem and "problem" in got.to_dict()
    assert got.words().startswith("the network between hosts was not measured: ")


def test_the_measurement_is_said_beside_what_the_plan_charged(tmp_path):
    write_private(tmp_path / "network.json", probe_doc(timings(3.0, 40.0), 4, 2, "nccl", 0.3))
    cuda = plan_job(load_job(TINY, HOSTS + ['runtime.device="cuda"', "plan.compute_dtype=bf16"]), LINKS)
    assert gpu_links_cap(cuda, 2) == 100.0 and gpu_links_cap(cuda, 1) == 0.0
    probe = read_probe(tmp_path, gpu_links_cap(cuda, 2))
    assert words(probe, cuda) == (
        "the network between hosts measured 24 Gb/s (3 GB/s) each way per host, 40 us per ring step (nccl, 4 ranks on 2 "
        "hosts, 0.30 s); the plan charged the network between hosts: 12.5 GB/s (100 Gb/s) each way per host, "
        "assumed; latency 20 us per ring step, assumed")
    cpu = plan_job(load_job(TINY, HOSTS))
    assert gpu_links_cap(cpu, 2) == 0.0
    assert words(probe, cpu).endswith("; a CPU run: no plan charged it")
    record = {"step": 0, "loss": 1.0, "tokens_per_s": 10.0, "step_s": 1.0}
    assert "\nnetwork    the network between hosts measured 24 Gb/s" in summary([record], 1.0, None,
                                                                           network=probe.words())
    assert (probe.fit.gbps, probe.fit.latency_us) == (pytest.approx(3.0), pytest.approx(40.0))
