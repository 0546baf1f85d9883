"""From a job to its step plan: the planner's choices (on CUDA) or the job file's values (CPU).

Calibration and the GPU blocks of the job's shape (planner/measure.py) are measured in a subprocess
(cached per host and GPU in cache.cache_root(), by default ~/.cache/slidedp), so the launcher
itself never holds a CUDA context on the workers' GPU.
"""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import sys
from dataclasses import dataclass, replace

from slidedp.config import JobConfig, model_config
from slidedp.plan_section import AUTO
from slidedp.jobrecord import sums_on_host
from slidedp.planner import Calibration, HostRoom, Plan, Workload, costs, make_plan
from slidedp.planner.workload import DocumentLoad
from slidedp.planner.cache import RECENT_RUNS
from slidedp.planner.cache import record_training as record_training_measured
from slidedp.planner.measure import MeasuredBlocks
from slidedp.planner.sizes import device_work_sizes
from slidedp.planner.step_model import device_time_source
from slidedp.planner.costs import GiB
from slidedp.stepplan import StepPlan
from slidedp.store.layout import Layout, default_chunk_rows
from slidedp.store.shm import shm_free_bytes

from .host_room import host_need

log = logging.getLogger("slidedp.launcher")

# plan.micro_batch = "auto" on CPU (no planner): the whole per-rank batch, up to this many sequences. On a
# CPU a pass over more sequences is one larger GEMM on the worker's threads and the activations live
# in host memory, so fewer passes are faster; the cap bounds one layer's workspace for a large batch.
CPU_MAX_MICRO_BATCH = 8


def cpu_micro_batch(local_batch: int) -> int:
    """The micro-batch of a CPU job that leaves it to the plan: the largest divisor of the per-rank
    batch up to CPU_MAX_MICRO_BATCH."""
    return max(d for d in range(1, min(local_batch, CPU_MAX_MICRO_BATCH) + 1) if local_batch % d == 0)


@dataclass(frozen=True)
class JobPlan:
    """A job's step plan and the planner's report it came from (None where no planner ran: CPU).
    shadow: whether the store has (or, made by this job, gets) the bf16 shadow; notes: what the
    launcher adds to the plan (why the delivery is what it is)."""

    step: StepPlan
    plan: Plan | None = None
    shadow: bool = False
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        """What `--plan` and the launcher's log print: the planner's table and the launcher's notes."""
        text = self.plan.describe() if self.plan is not None else ""
        return "\n".join([text] * bool(text) + [f"note: {n}" for n in self.notes])

    @property
    def keeps_plan(self) -> bool:
        """Whether the workers run the planner's step as it made it: a plan, and no job-file value over its
        tiles, loss chunk, resident or offloaded layers (plan_job marks one: planned_by "planner + job file")."""
        return self.plan is not None and self.step == self.plan.step


def calibration(gpus: int = 1, model_params: int | None = None, timeout_s: float = 1800.0,
                measure: dict | None = None) -> Calibration:
    """This host's calibration, with what training runs of the model of `model_params` parameters
    measured on it (None: nothing learned); with gpus > 1 it includes the NCCL bus bandwidth among
    that many GPUs. measure: the job's shape and sizes (`planner.inputs`), whose GPU blocks
    come with it (read from the host's cache, or measured now: the first plan of a shape)."""
    spec = {"gpus": gpus, "model_params": model_params, **(measure or {})}
    if measure:
        log.info("calibration and GPU blocks at this shape (%d size(s)): read from this host's cache, or measured "
                 "on the GPU now where this is the first plan of the shape here", len(measure.get("sizes", ())))
    out = subprocess.run([sys.executable, "-m", "slidedp.planner.inputs"], input=json.dumps(spec),
                         capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"calibrating this host's GPU failed: {out.stderr.strip()[-2000:]}")
    sys.stderr.write(out.stderr)  # its log lines (what it measured) belong in the job's log
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    blocks = MeasuredBlocks.from_dict(doc["blocks"]) if doc.get("blocks") else None
    if blocks is not None and blocks.measured_s:
        log.info("measuring one decoder layer and the loss on the %s for this shape (first plan of it on this "
                 "host): %.1f s", blocks.device_name, blocks.measured_s)
    return Calibration.from_dict(doc["calibration"], blocks=blocks)


class DeliveryError(ValueError):
    """The job asks for the bf16 delivery and its store cannot serve it: the message says what to change."""


def deliveries(job: JobConfig, store_shadow: bool | None, shadow_fits: bool = True) -> tuple[tuple[str, ...], str]:
    """The deliveries the plan may choose, and a note where the bf16 one is ruled out (or "").

    store_shadow: whether the existing store has the bf16 shadow (None: the job creates its store, with
    one as store.shadow_bf16 says: true, or "auto" where the plan delivers bf16); shadow_fits: whether
    the host has room for it in a store this job creates. The shadow delivers the same bits to a bf16 compute as the
    cast of the master, so where the store has one anyway (the updaters refresh it whatever the
    delivery) it is the only choice: half the bytes of every copy, for nothing."""
    p, shadow = job.plan, job.store.shadow_bf16
    if p.dtype != "bf16" or p.delivery == "fp32":
        return ("fp32",), ""
    if store_shadow is False:
        if p.delivery == "bf16":
            raise DeliveryError(f"plan.delivery = \"bf16\" streams the store's bf16 shadow, but store "
                                f"{job.store_name!r} was created without one: set plan.delivery = \"auto\" or "
                                f"\"fp32\", or make the store again with store.shadow_bf16 = true (`slidedp-store "
                                f"checkpoint`, `slidedp-store destroy {job.store_name}`, then run with "
                                f"checkpoint.resume)")
        return ("fp32",), (f"delivery fp32: store {job.store_name!r} was created without the bf16 shadow "
                           f"(store.shadow_bf16); one would halve the bytes of every copy in, exactly")
    if store_shadow is None and shadow is False:
        return ("fp32",), ""
    if store_shadow or shadow is True or p.delivery == "bf16":
        return ("bf16",), ""
    if not shadow_fits:
        return ("fp32",), ("delivery fp32: the host has no room for the bf16 shadow (2 B/param more host memory) "
                           "beside the store; store.shadow_bf16 = true asks for it")
    return ("fp32", "bf16"), ""


def _routes(job: JobConfig, calib: Calibration) -> dict[str, tuple[str, ...]]:
    """Routes the planner may choose: the job's, or (auto) both where the GPU links were measured,
    else the plain one."""
    measured = calib.bus_gpus > 1

    def options(chosen: str, both: tuple[str, str]) -> tuple[str, ...]:
        if chosen != AUTO:
            return (chosen,)
        return both if measured else both[:1]

    p = job.plan
    return {"param_route": options(p.param_route, ("replicated", "sharded")),
            "grad_route": options(p.grad_route, ("host", "reduce_scatter"))}



def shadow_fits(job: JobConfig, layout: Layout) -> bool:
    """Whether the host has room for a store this job creates with the bf16 shadow (14 B/param) and the
    job's gradient rings (on the host route: the larger), in /dev/shm and in the memory available."""
    import psutil

    need = host_need(job, layout, StepPlan(grad_route="host"), store_exists=False, shadow=True).shm_bytes
    return need <= min(shm_free_bytes(), psutil.virtual_memory().available)


def _store_shadow(job: JobConfig, store_shadow: bool | None, delivery: str) -> bool:
    """Whether the job's store has the bf16 shadow: the existing store's, or what one this job creates gets."""
    if store_shadow is not None:
        return store_shadow
    return job.store.shadow_bf16 is True or (job.store.shadow_bf16 == "auto" and delivery == "bf16")


def document_load(batches) -> DocumentLoad | None:
    """What the job's rows of documents cost attention (None: token windows, each row one sequence, or rows
    of one document each, which attend as plain causal rows)."""
    from slidedp.sft.packing import DocBatches

    if not isinstance(batches, DocBatches):
        return None
    lengths, row_offsets = batches.stream.document_lengths()
    if len(lengths) == len(row_offsets) - 1:  # one document per row: plain causal attention
        return None
    return DocumentLoad.of(lengths.tolist(), row_offsets.tolist())


def plan_job(job: JobConfig, calib: Calibration | None = None, store_shadow: bool | None = None,
             shadow_fits: bool = True, host_room: HostRoom | None = None,
             documents: DocumentLoad | None = None) -> JobPlan:
    """The job's step plan: on CUDA the planner's, with the job file's [plan] values as its constraints
    (a chosen micro-batch, dtype, route, delivery, prefetch depth, embedding or number of device-held
    layers is planned with; chosen tiles, loss chunk, resident or offloaded layers replace the planner's);
    on CPU the job file's values, clamped to the model, and the CPU defaults for "auto". store_shadow,
    shadow_fits: what `deliveries` needs to know of the store (None: the job creates it); host_room: what
    the host's memory leaves for offloaded layers and the shadow (host_room.room_for_plan; None: no
    limit); documents: what the job's rows of packed documents cost attention (document_load; None:
    plain rows)."""
    p, t, rt = job.plan, job.train, job.runtime
    options, note = deliveries(job, store_shadow, shadow_fits)
    notes = (note,) if note else ()
    one = rt.workers == 1  # one rank: nothing to shard
    cfg = model_config(job)
    nl = cfg.num_layers
    if rt.device != "cuda":  # no planner: the bf16 delivery where the store has (or gets) the shadow anyway
        delivery = options[-1] if len(options) == 1 else "fp32"
        return JobPlan(StepPlan(
            micro_batch=p.chosen("micro_batch") or cpu_micro_batch(t.global_batch // rt.workers), delivery=delivery,
            compute_dtype=p.dtype, chunk_rows=default_chunk_rows(cfg),
            resident_layers=p.chosen("resident_layers") or 0, prefetch_depth=p.chosen("prefetch_depth") or 1,
            embedding=p.chosen("embedding") or "host", seq_tile_tokens=p.chosen("seq_tile_tokens") or 0,
            loss_chunk_tokens=p.chosen("loss_chunk_tokens") or StepPlan.loss_chunk_tokens,
            offload_layers=min(p.chosen("offload_layers") or 0, nl), device_layers=min(p.chosen("device_layers") or 0, nl),
            param_route="sharded" if p.param_route == "sharded" and not one else "replicated",
            grad_route="reduce_scatter" if p.grad_route == "reduce_scatter" and not one else "host"),
            shadow=_store_shadow(job, store_shadow, delivery), notes=notes)
    work = Workload(model=cfg, global_batch=t.global_batch, seq_len=t.seq_len, world=rt.workers,
                    micro_batch=p.chosen("micro_batch") or 0, compute_dtype=p.dtype, clip=t.max_grad_norm > 0,
                    updaters=max(1, rt.updaters), compiled=t.compile in ("auto", "on"), host_room=host_room,
                    documents=documents)
    budget = int(job.memory.device_budget_gib * GiB)
    allowed = {
        "activations": ("keep",) if p.chosen("offload_layers") == 0 else ("keep", "offload"),
        "delivery": options,
        "embedding": ("device", "host") if p.embedding == AUTO else (p.embedding,),
    }
    if p.chosen("prefetch_depth"):  # the job's depth, planned with its buffers
        allowed["prefetch_depth"] = (p.prefetch_depth,)
    if calib is None:  # measured on this host: the calibration and the GPU blocks of every size the plan weighs
        calib = calibration(rt.workers, work.model.num_parameters(), measure={
            "model": cfg.to_dict(), "seq_len": t.seq_len, "compute_dtype": p.dtype,
            "compiled": work.compiled, "compile_fallback": t.compile == "auto", "local_batch": work.local_batch,
            "sizes": device_work_sizes(work, budget, allowed),
            **({"documents": documents.to_dict()} if documents is not None else {})})
    allowed.update(_routes(job, calib))
    plan = make_plan(work, budget, calib, allowed, device_layers=p.chosen("device_layers"))
    planned = plan.step

    def given(name: str) -> int:
        """The job's value of a choice the planner made too, or the planner's where the job says "auto"."""
        value = p.chosen(name)
        return getattr(planned, name) if value is None else value

    step = replace(planned, resident_layers=min(given("resident_layers"), nl), seq_tile_tokens=given("seq_tile_tokens"),
                   offload_layers=min(given("offload_layers"), nl), loss_chunk_tokens=given("loss_chunk_tokens"),
                   param_route=planned.param_route if not one else "replicated",
                   grad_route=planned.grad_route if not one else "host")
    if step != planned:  # the job file overrode a choice: the plan's memory peak is not this run's
        step = replace(step, planned_device_bytes=None, planned_by="planner + job file")
    return JobPlan(step, plan, shadow=_store_shadow(job, store_shadow, step.delivery), notes=notes)


def learned_update_rate(run_plan: JobPlan, update_busy_s: list[float]) -> float | None:
    """The AdamW rate the updaters reached per process in a planned (CUDA) run of 3 steps or more
    (median step after the first), in the units the planner charges (fp32 master traffic); None
    when there is nothing to learn.

    A run whose aggregator summed the ranks' gradients (`sums_on_host`) measures the rate beside
    those sums, which compete with the updaters for host memory (docs/tuning.md): it is kept
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
    params = costs.host_updated_params(w.model, plan.step.embedding, run_plan.step.device_layers)
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
        log.info("beside the aggregator's sum of the ranks' gradients, the updaters ran AdamW at %.2f G params/s per "
                 "process (bare kernel: %.2f) and the sum ran at %s", rate / 1e9, plan.calibration.adamw_params_per_s / 1e9,
                 f"{sum_rate:.1f} GB/s (bare: {plan.calibration.reduce_gbps:.1f})" if sum_rate else "its bare rate")
    elif rate is not None:
        measured.update(adamw_train_params_per_s=rate, adamw_train_model_params=params)
        log.info("updaters ran AdamW at %.2f G params/s per process in this run (bare kernel: %.2f)", rate / 1e9,
                 plan.calibration.adamw_params_per_s / 1e9)
    ratio = device_time_against_plan(run_plan, device_side_s)
    if ratio is not None:
        source = device_time_source(plan.workload, plan.step, plan.calibration)
        log.info("the GPU work took %.2fx the plan's GPU time (%s)", ratio, {
            "measured": "blocks measured on this GPU at this shape", "nearby": "blocks measured at nearby sizes",
            "FLOPs": "matmul FLOPs at the calibrated rate"}[source])
    if not measured:
        return None
    try:
        kept = record_training_measured(plan.calibration, cache_dir, **measured)
    except OSError as e:  # the job trained; only what it taught the planner is lost
        log.warning("could not keep what this run measured with the calibration: %s", e)
        return None
    summed = "adamw_train_summed_params_per_s" in measured
    log.info("the next plan of this model on this host%s charges the updaters %.2f G params/s, the median "
             "of the rates its last runs here measured (up to %d)", " with a host sum" if summed else "",
             kept.update_params_per_s(params, summed=summed) / 1e9, RECENT_RUNS)
    return kept
