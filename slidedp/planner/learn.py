"""What a planned run teaches the next plan of its model on this host, and how far it was from its plan.

After a CUDA run the launcher hands `record_training` the busy times the run measured: the updaters'
AdamW rate (and, where the aggregator summed the ranks' gradients, that sum's rate) is kept with the
host's calibration in its cache (cache.record_training), per model, and the next plan of the model
charges it; the workers' GPU time against the plan's is reported, not kept (the next plan measures
its GPU blocks). After a run on several hosts (CUDA or CPU) the launcher hands `record_network` what the
ranks' probe measured of the network between hosts: kept per backend in the host's cache (netcache.py), the
next plan on several hosts on this host charges it.
"""

from __future__ import annotations

import statistics

from slidedp import log
from slidedp.jobrecord import sums_on_host
from slidedp.planner import cache, costs, netcache
from slidedp.planner.calibration import Calibration
from slidedp.planner.job import JobPlan
from slidedp.planner.netfit import NetworkFit
from slidedp.planner.step_model import device_time_source

_log = log.get("planner")


def learned_update_rate(run_plan: JobPlan, update_busy_s: list[float]) -> float | None:
    """The AdamW rate the updaters reached per process in a planned (CUDA) run of 3 steps or more
    (median step after the first), in the units the planner charges (fp32 master traffic); None
    when there is nothing to learn.

    A run whose aggregator summed the ranks' gradients (`sums_on_host`) measures the rate beside
    those sums, which compete with the updaters for host memory (docs/tuning.md, in git history): it is kept
    apart, for plans with such a sum only. A run of a clipped job teaches the plain rate: its
    corrections of speculative updates are left out of the busy time it is given (Progress), and
    where nothing is summed nothing is copied."""
    plan = run_plan.plan
    if plan is None or len(update_busy_s) < 3:
        return None
    w = plan.workload
    busy = statistics.median(update_busy_s[1:])
    if busy <= 0:
        return None
    # several hosts: this host's updaters update its 1/nnodes of every chunk
    params = costs.host_updated_params(w.model, plan.step.embedding, run_plan.step.device_layers) / w.nnodes
    return params / busy * costs.update_bytes_per_param(plan.step.delivery) / 28.0


def device_time_against_plan(run_plan: JobPlan, device_side_s: list[float]) -> float | None:
    """The workers' GPU-side step time (each rank's step less its waits for the host; the slowest rank;
    median step after the first) over the plan's GPU time: how far the measured blocks (or, without
    them, the FLOPs) were from the run. Reported, not learned: the next plan measures its blocks.

    None where it says nothing: too few steps or no plan; a job that overrode the plan's tiles,
    resident, offloaded or device-held layers; a plan that expected copies to show (exposed time over
    a quarter of the GPU time), where the workers' time holds copy stalls that are not GPU work."""
    plan = run_plan.plan
    if plan is None or len(device_side_s) < 3 or not run_plan.keeps_plan:
        return None
    gpu = dict(plan.busy_s)["device"]
    if plan.exposed_s > 0.25 * gpu:
        return None
    measured = statistics.median(device_side_s[1:])
    return measured / gpu if measured > 0 and gpu > 0 else None


def learned_sum_rate(run_plan: JobPlan, reduce_busy_s: list[float]) -> float | None:
    """The rate (GB/s, as reduce_gbps) the aggregator summed ranks' gradients at beside the updaters in
    a planned run of 3 steps or more: the bytes the plan charged over the busy time measured
    (median step after the first). None when it summed nothing or there is too little to learn."""
    plan = run_plan.plan
    if plan is None or len(reduce_busy_s) < 3 or not sums_on_host(plan.workload.world, run_plan.step.grad_route):
        return None
    planned = dict(plan.busy_s)["reduce"]
    measured = statistics.median(reduce_busy_s[1:])
    if planned <= 0 or measured <= 0:
        return None
    n = plan.workload.model.num_parameters()
    return planned * plan.calibration.reduce_rate_gbps(n, summed=True) / measured


def record_training(run_plan: JobPlan, update_busy_s: list[float], device_side_s: list[float],
                    cache_dir: str | None = None, reduce_busy_s: list[float] | None = None) -> Calibration | None:
    """After a planned (CUDA) run: keep the updaters' AdamW rate the run measured with this host's
    calibration, for the next plan of that model, and report its GPU time against the plan's. Returns
    the calibration kept, or None when there was nothing to learn."""
    plan = run_plan.plan
    if plan is None:
        return None
    params = plan.workload.model.num_parameters()
    measured: dict[str, float] = {}
    rate = learned_update_rate(run_plan, update_busy_s)
    sum_rate = learned_sum_rate(run_plan, reduce_busy_s or [])
    if rate is not None and sums_on_host(plan.workload.world, run_plan.step.grad_route):
        measured.update(adamw_train_summed_params_per_s=rate, adamw_train_summed_model_params=params)
        if sum_rate:  # not measured: an earlier run's figure is kept
            measured.update(reduce_train_summed_gbps=sum_rate)
        _log.info("beside the aggregator's sum of the ranks' gradients, the updaters ran AdamW at %.2f G params/s per "
                 "process (bare kernel: %.2f) and the sum ran at %s", rate / 1e9, plan.calibration.adamw_params_per_s / 1e9,
                 f"{sum_rate:.1f} GB/s (bare: {plan.calibration.reduce_gbps:.1f})" if sum_rate else "its bare rate")
    elif rate is not None:
        measured.update(adamw_train_params_per_s=rate, adamw_train_model_params=params)
        _log.info("updaters ran AdamW at %.2f G params/s per process in this run (bare kernel: %.2f)", rate / 1e9,
                 plan.calibration.adamw_params_per_s / 1e9)
    ratio = device_time_against_plan(run_plan, device_side_s)
    if ratio is not None:
        source = device_time_source(plan.workload, plan.step, plan.calibration)
        _log.info("the GPU work took %.2fx the plan's GPU time (%s)", ratio, {
            "measured": "blocks measured on this GPU at this shape", "nearby": "blocks measured at nearby sizes",
            "FLOPs": "matmul FLOPs at the calibrated rate"}[source])
    if not measured:
        return None
    try:
        kept = cache.record_training(plan.calibration, cache_dir, **measured)
    except OSError as e:  # the job trained; only what it taught the planner is lost
        _log.warning("could not keep what this run measured with the calibration: %s", e)
        return None
    summed = "adamw_train_summed_params_per_s" in measured
    _log.info("the next plan of this model on this host%s charges the updaters %.2f G params/s, the median "
             "of the rates its last runs here measured (up to %d)", " with a host sum" if summed else "",
             kept.update_params_per_s(params, summed=summed) / 1e9, cache.RECENT_RUNS)
    return kept


def record_network(fit: NetworkFit, backend: str, measured_at: str, nnodes: int, ranks: int,
                   cache_dir: str | None = None) -> netcache.MeasuredNetwork | None:
    """After a run on several hosts: keep what its ranks measured of the network between hosts with this host's
    last runs of the backend, for the next plan on several hosts here. CPU runs record too (under "gloo", which
    no CUDA plan reads). Returns what the next plan charges, or None where the cache could not be written."""
    try:
        kept = netcache.record_network(fit, backend, measured_at, nnodes, ranks, cache_dir)
    except OSError as e:  # the job trained; only what it taught the planner is lost
        _log.warning("could not keep what this run measured of the network: %s", e)
        return None
    _log.info("the next plan on several hosts on this host (%s) charges the network between hosts %.3g Gb/s each "
              "way per host%s and %.3g us per ring step (%s)", backend, kept.gbps * 8,
              " at least" if kept.at_least else "", kept.latency_us, kept.source)
    return kept
