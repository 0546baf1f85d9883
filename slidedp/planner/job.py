"""From a job to its step plan: `plan_for`, the planner's one entry.

plan_for(job, store facts, host room) turns the job file's [plan] section (slidedp/plan_section.py)
and what is known of the job's store into the `StepPlan` every rank carries out, with its report
(`JobPlan`: the planner's `Plan`, where one ran, and notes). On CUDA the planner chooses what the job
leaves "auto" (plan.make_plan), once this host's calibration and the GPU blocks of the job's shape
are at hand: read from the host's cache, or measured in a process of its own (inputs.py), so that
the launcher never holds a CUDA context on the workers' GPU. On CPU no planner runs and "auto" is
the CPU default. The store decides which deliveries a plan may choose (`deliveries`): the bf16
shadow streams half the bytes, where the store has one. learn.py keeps what a run measured for the
next plan of the model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from slidedp import log
from slidedp.config import ConfigError, JobConfig, model_config
from slidedp.model.config import ModelConfigError, layers_for
from slidedp.plan_section import AUTO, PlanSection
from slidedp.planner import inputs, netcache
from slidedp.planner.calibration import Calibration
from slidedp.planner.costs import GiB
from slidedp.planner.netcache import MeasuredNetwork
from slidedp.planner.plan import device_work_sizes, make_plan
from slidedp.planner.plan_record import Plan
from slidedp.planner.workload import DocumentLoad, HostRoom, Workload
from slidedp.stepplan import StepPlan
from slidedp.store.layout import default_chunk_rows, layer_split

_log = log.get("planner")

# plan.micro_batch = "auto" on CPU (no planner): the whole per-rank batch, up to this many sequences. On
# a CPU a pass over more sequences is one larger GEMM on the worker's threads and the activations live
# in host memory, so fewer passes are faster; the cap bounds one layer's workspace for a large batch.
CPU_MAX_MICRO_BATCH = 8


def cpu_micro_batch(local_batch: int) -> int:
    """The micro-batch of a CPU job that leaves it to the plan: the largest divisor of the per-rank
    batch up to CPU_MAX_MICRO_BATCH."""
    return max(d for d in range(1, min(local_batch, CPU_MAX_MICRO_BATCH) + 1) if local_batch % d == 0)


@dataclass(frozen=True)
class StoreFacts:
    """What the plan needs to know of the job's store. shadow: whether the existing store has the bf16
    shadow (None: the job creates its store, with one as store.shadow_bf16 says: true, or "auto" where
    the plan delivers bf16); shadow_fits: whether the host has room for the shadow in a store this job
    creates (the launcher asks: launch/planning.py:shadow_fits)."""

    shadow: bool | None = None
    shadow_fits: bool = True


@dataclass(frozen=True)
class JobPlan:
    """A job's step plan and its report: `step`, what the ranks carry out; `plan`, the planner's report
    it came from (None where no planner ran: CPU); shadow: whether the store has (or, made by this job,
    gets) the bf16 shadow; notes: what plan_for adds to the plan (why the delivery is what it is)."""

    step: StepPlan
    plan: Plan | None = None
    shadow: bool = False
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        """What `--plan` and the launcher's log print: the planner's table and the notes."""
        text = self.plan.describe() if self.plan is not None else ""
        return "\n".join([text] * bool(text) + [f"note: {n}" for n in self.notes])

    @property
    def keeps_plan(self) -> bool:
        """Whether the workers run the planner's step as it made it: a plan, and no job-file value over
        its tiles, loss chunk, resident or offloaded layers (plan_for marks one: planned_by "planner +
        job file")."""
        return self.plan is not None and self.step == self.plan.step


class DeliveryError(ValueError):
    """The job asks for the bf16 delivery and its store cannot serve it: the message says what to change."""


def deliveries(job: JobConfig, store_shadow: bool | None, shadow_fits: bool = True) -> tuple[tuple[str, ...], str]:
    """The deliveries the plan may choose, and a note where the bf16 one is ruled out (or "").

    store_shadow, shadow_fits: as StoreFacts. The shadow delivers the same bits to a bf16 compute as the
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


def _store_shadow(job: JobConfig, store_shadow: bool | None, delivery: str) -> bool:
    """Whether the job's store has the bf16 shadow: the existing store's, or what one this job creates gets."""
    if store_shadow is not None:
        return store_shadow
    return job.store.shadow_bf16 is True or (job.store.shadow_bf16 == "auto" and delivery == "bf16")


def _routes(p: PlanSection, calib: Calibration) -> dict[str, tuple[str, ...]]:
    """Routes the planner may choose: the job's, or (auto) both where the GPU links were measured,
    else the plain one."""
    measured = calib.bus_gpus > 1

    def options(chosen: str, both: tuple[str, str]) -> tuple[str, ...]:
        if chosen != AUTO:
            return (chosen,)
        return both if measured else both[:1]

    return {"param_route": options(p.param_route, ("replicated", "sharded")),
            "grad_route": options(p.grad_route, ("host", "reduce_scatter"))}


def resolve_layers(job: JobConfig, cfg) -> str:
    """plan.layers resolved (model/config.py:layers_for); a sequence tile asks for SlideDP's layers."""
    try:
        layers = layers_for(cfg, job.plan.chosen("layers"))
    except ModelConfigError as e:
        raise ConfigError(str(e)) from None
    if layers == "transformers" and job.plan.chosen("seq_tile_tokens"):
        raise ConfigError(f"plan.seq_tile_tokens = {job.plan.seq_tile_tokens}: transformers' layers (which run this "
                          f"{cfg.family} model) are not tiled; set it to \"auto\" or 0")
    return layers


def layers_note(layers: str, cfg) -> str:
    return (f"layers: {layers} ("
            + ("SlideDP's own" if layers == "native" else f"transformers' {cfg.family} layer modules, untiled") + ")")


def host_routes(job: JobConfig) -> dict[str, tuple[str, ...]]:
    """Several hosts (docs/multi-host.md) take the sharded and reduce_scatter routes over every host's ranks
    (each host's store keeps its range of every chunk current); a job file that names others is refused."""
    rt, p = job.runtime, job.plan
    if rt.nnodes == 1:
        return {}
    for key, need in (("param_route", "sharded"), ("grad_route", "reduce_scatter"), ("embedding", "host")):
        chosen = getattr(p, key)
        if chosen not in (AUTO, need):
            raise ConfigError(f"plan.{key} = {chosen!r}: a job on several hosts (runtime.nnodes = {rt.nnodes}) "
                              f"takes {need!r} (docs/multi-host.md); set it to \"auto\" or {need!r}")
    if p.chosen("device_layers"):  # each host holds only its range of a unit's master: none to copy whole
        raise ConfigError(f"plan.device_layers = {p.device_layers}: a job on several hosts holds no layer on the "
                          "devices yet (docs/multi-host.md); set it to \"auto\" or 0")
    return {"param_route": ("sharded",), "grad_route": ("reduce_scatter",), "embedding": ("host",)}


def network(job: JobConfig, calib: Calibration, measured: MeasuredNetwork | None = None) -> Calibration:
    """The calibration with the network between hosts the plan charges, each figure from the first that gives
    it: the job (runtime.network_gbps in Gb/s, runtime.network_latency_us), what runs on this host measured
    (`measured`: netcache.measured_network), else the calibration's (the assumed defaults)."""
    rt = job.runtime
    if measured is not None:
        calib = replace(calib, internode_gbps=measured.gbps, internode_latency_us=measured.latency_us,
                        internode_source=measured.source, internode_latency_source=measured.source,
                        internode_at_least=int(measured.at_least))
    if rt.network_gbps:
        calib = replace(calib, internode_gbps=rt.network_gbps / 8, internode_source="job", internode_at_least=0)
    if rt.network_latency_us:
        calib = replace(calib, internode_latency_us=rt.network_latency_us, internode_latency_source="job")
    return calib


def host_network(job: JobConfig) -> MeasuredNetwork | None:
    """What runs on this host measured of the network a CUDA job on several hosts crosses (NCCL's: a plan gives
    every rank its own GPU), None for one host or where no run measured it."""
    return netcache.measured_network("nccl") if job.runtime.nnodes > 1 else None


def _cpu_plan(job: JobConfig, options: tuple[str, ...], store: StoreFacts, notes: tuple[str, ...]) -> JobPlan:
    """No planner: the job's values, and the CPU default where it says "auto"; the bf16 delivery where
    the store has (or gets) the shadow anyway."""
    p, cfg, world = job.plan, model_config(job), job.runtime.world
    nl, one = cfg.num_layers, world == 1  # one rank: nothing to shard
    layers = resolve_layers(job, cfg)
    delivery = options[-1] if len(options) == 1 else "fp32"
    cut = layer_split(cfg, p.chosen("layer_chunk_numel"))  # the store's layout's
    step = StepPlan(
        micro_batch=p.chosen("micro_batch") or cpu_micro_batch(job.train.global_batch // world), delivery=delivery,
        compute_dtype=p.dtype, chunk_rows=default_chunk_rows(cfg, cut), layer_chunk_numel=cut, resident_layers=p.chosen("resident_layers") or 0,
        prefetch_depth=p.chosen("prefetch_depth") or 1, embedding=p.chosen("embedding") or "host",
        seq_tile_tokens=p.chosen("seq_tile_tokens") or 0, layers=layers,
        loss_chunk_tokens=p.chosen("loss_chunk_tokens") or StepPlan.loss_chunk_tokens,
        offload_layers=min(p.chosen("offload_layers") or 0, nl), device_layers=min(p.chosen("device_layers") or 0, nl),
        param_route="sharded" if p.param_route == "sharded" and not one else "replicated",
        grad_route="reduce_scatter" if p.grad_route == "reduce_scatter" and not one else "host")
    hosts = host_routes(job)
    if hosts:
        step = replace(step, param_route=hosts["param_route"][0], grad_route=hosts["grad_route"][0],
                       embedding="host", device_layers=0)
    return JobPlan(step, shadow=_store_shadow(job, store.shadow, delivery), notes=(*notes, layers_note(layers, cfg)))


def plan_for(job: JobConfig, store_facts: StoreFacts = StoreFacts(), host_room: HostRoom | None = None,
             documents: DocumentLoad | None = None, *, calibration: Calibration | None = None) -> JobPlan:
    """The job's step plan and its report. On CUDA the planner's, fitted to memory.device_budget_gib and
    the host's memory, with the job's [plan] values as its constraints: a chosen micro-batch, dtype,
    route, delivery, prefetch depth, embedding or number of device-held layers is planned with; chosen
    tiles, loss chunk, resident or offloaded layers replace the planner's (and its memory table no longer
    describes the run). On CPU the job's values, clamped to the model.

    store_facts: what the store offers (StoreFacts); host_room: what the host's memory leaves for
    offloaded layers and the shadow (launch/host_room.py:room_for_plan; None: no limit); documents: what
    the job's rows of packed documents cost attention (None: plain rows); calibration: this host's (None:
    read from the cache, or measured now, with the GPU blocks of every size the plan weighs)."""
    p, t, rt = job.plan, job.train, job.runtime
    options, note = deliveries(job, store_facts.shadow, store_facts.shadow_fits)
    notes = (note,) if note else ()
    if rt.device != "cuda":
        return _cpu_plan(job, options, store_facts, notes)
    cfg = model_config(job)
    nl, one = cfg.num_layers, rt.workers == 1 and rt.nnodes == 1
    layers = resolve_layers(job, cfg)
    # several hosts: this host's share of the batch over its own ranks, the routes over every host's (the network
    # between them as the job gives it, as runs on this host measured it, or assumed: network())
    work = Workload(model=cfg, global_batch=t.global_batch // rt.nnodes, seq_len=t.seq_len, world=rt.workers,
                    nnodes=rt.nnodes,
                    micro_batch=p.chosen("micro_batch") or 0, compute_dtype=p.dtype, clip=t.max_grad_norm > 0,
                    updaters=max(1, rt.updaters), compiled=t.compile in ("auto", "on"),
                    host_room=host_room,
                    documents=documents, layers=layers, layer_chunk_numel=p.chosen("layer_chunk_numel"))
    budget = int(job.memory.device_budget_gib * GiB)
    allowed = {
        "activations": ("keep",) if p.chosen("offload_layers") == 0 else ("keep", "offload"),
        "delivery": options,
        "embedding": ("device", "host") if p.embedding == AUTO else (p.embedding,),
    }
    if p.chosen("prefetch_depth"):  # the job's depth, planned with its buffers
        allowed["prefetch_depth"] = (p.prefetch_depth,)
    measured = None  # the network as runs on this host measured it: for a plan of this host only
    if calibration is None:  # measured on this host: the calibration and the GPU blocks of every size the plan weighs
        measured = host_network(job)
        calibration = inputs.measured_calibration(rt.workers, work.model.num_parameters(), measure={
            "model": cfg.to_dict(), "layers": layers, "seq_len": t.seq_len, "compute_dtype": p.dtype,
            "compiled": work.compiled, "compile_fallback": t.compile == "auto", "local_batch": work.local_batch,
            "sizes": device_work_sizes(work, budget, allowed),
            **({"documents": documents.to_dict()} if documents is not None else {})})
    calibration = network(job, calibration, measured)
    allowed.update(_routes(p, calibration))
    allowed.update(host_routes(job))
    plan = make_plan(work, budget, calibration, allowed, device_layers=0 if rt.nnodes > 1 else p.chosen("device_layers"))
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
    return JobPlan(step, plan, shadow=_store_shadow(job, store_facts.shadow, step.delivery), notes=notes)
