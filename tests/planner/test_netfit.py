"""The network between hosts fitted from timed collectives (slidedp/planner/netfit.py): synthetic timings made
by the step model's own formula give back the rate and latency they were made with."""

from __future__ import annotations

import dataclasses

import pytest

from slidedp.model.config import named_shape
from slidedp.planner import REFERENCE_CALIBRATION, Workload
from slidedp.planner.netfit import MIN_LATENCY_US, NetworkFitError, Timing, network_fit
from slidedp.planner.step_model import collective_s

MiB = 1 << 20


def timed(ranks: int, gbps: float, latency_us: float, sizes=(MiB, 16 * MiB, 64 * MiB)) -> list[Timing]:
    """What each collective would take by the step model's formula."""
    return [Timing(kind, n, n * (ranks - 1) / ranks / (gbps * 1e9) + (ranks - 1) * latency_us * 1e-6)
            for n in sizes for kind in ("all_gather", "reduce_scatter")]


@pytest.mark.parametrize("ranks,gbps,latency_us", [(2, 12.5, 20.0), (8, 3.1, 41.0), (16, 50.0, 5.0)])
def test_timings_of_the_step_models_formula_give_back_its_rate_and_latency(ranks, gbps, latency_us):
    fit = network_fit(timed(ranks, gbps, latency_us), ranks)
    assert fit.gbps == pytest.approx(gbps, rel=1e-9)
    assert fit.latency_us == pytest.approx(latency_us, rel=1e-9)
    assert not fit.at_least


def test_the_fit_inverts_collective_s_itself():
    """2 hosts x 4 ranks, a network slower than the GPU links: collective_s's seconds fit back to its figures."""
    calib = dataclasses.replace(REFERENCE_CALIBRATION, bus_gpus=4, allreduce_gbps=240.0, internode_gbps=6.0,
                                internode_latency_us=33.0)
    work = Workload(named_shape("qwen3-4b"), global_batch=8, seq_len=2048, world=4, micro_batch=2, nnodes=2)
    timings = [Timing("all_gather", n, collective_s(work, calib, n)) for n in (4 * MiB, 256 * MiB)]
    fit = network_fit(timings, work.ranks, cap_gbps=calib.allreduce_gbps)
    assert (fit.gbps, fit.latency_us, fit.at_least) == (pytest.approx(6.0), pytest.approx(33.0), False)


def test_noise_is_fitted_by_least_squares():
    clean = timed(4, 10.0, 25.0)
    noisy = [dataclasses.replace(t, seconds=t.seconds * (1.02 if i % 2 else 0.98)) for i, t in enumerate(clean)]
    fit = network_fit(noisy, 4)
    assert fit.gbps == pytest.approx(10.0, rel=0.05)
    assert fit.latency_us == pytest.approx(25.0, rel=0.3)


def test_a_rate_at_the_gpu_links_is_the_networks_at_least():
    """With several GPUs a host the collectives run at the slower of the network and the GPU links: timed at the
    links' 240 GB/s, the network reached at least that."""
    fit = network_fit(timed(8, 240.0, 3.0), 8, cap_gbps=240.0)
    assert fit.at_least and fit.gbps == pytest.approx(240.0)
    assert fit.words().startswith("at least 1.92e+03 Gb/s (240 GB/s) each way per host, 3 us per ring step")
    assert network_fit(timed(8, 220.0, 3.0), 8, cap_gbps=240.0).at_least  # within 10%: the links, not the network
    assert not network_fit(timed(8, 100.0, 3.0), 8, cap_gbps=240.0).at_least
    assert not network_fit(timed(8, 240.0, 3.0), 8).at_least  # one GPU a host: no links to bound it


def test_a_latency_the_noise_puts_below_zero_is_the_floor():
    fit = network_fit([Timing("all_gather", MiB, 0.5 * MiB / 1e9), Timing("all_gather", 9 * MiB, 4.6 * MiB / 1e9)], 2)
    assert fit.latency_us == MIN_LATENCY_US and fit.gbps > 0


@pytest.mark.parametrize("timings,ranks,says", [
    (timed(4, 10.0, 20.0), 1, "crosses no network"),
    (timed(4, 10.0, 20.0, sizes=(MiB,)), 4, "two sizes or more"),
    ([Timing("all_gather", MiB, 2e-3), Timing("all_gather", 8 * MiB, 1e-3)], 4, "did not take longer"),
    ([Timing("all_gather", MiB, 0.0), Timing("all_gather", 8 * MiB, 1e-3)], 4, "positive finite"),
])
def test_timings_that_fit_no_network_are_refused_saying_why(timings, ranks, says):
    with pytest.raises(NetworkFitError, match=says):
        network_fit(timings, ranks)
