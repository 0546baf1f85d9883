"""The step-time model: one rank's step as an event simulation over five resources.

The model replays one rank's schedule (docs/pipeline.md, "The step on one rank") as a small event
simulation over five resources: the copy streams and the GPU are FIFO servers, the updaters a queue
that runs the most urgent waiting update first, as the updater does (the next forward's order):

  h2d     the copy-in stream: parameter chunks (prefetched `prefetch_depth` chunks ahead),
          offloaded activations, a host-held embedding: an untied one's batch rows (`embedding_rows_s`),
          a tied one's whole matrix (the head's too)
  gpu     compute: forward, loss, recompute + backward, the device AdamW of a device-held embedding
  d2h     the copy-out stream: fp32 chunk gradients, offloaded activations
  reduce  the aggregator summing the ranks' gradients of a chunk (nothing to do with one rank)
  update  the updater pool: K processes running the fused CPU AdamW, one chunk at a time each

A chunk's H2D in step s+1 waits for its update in step s (the version gate), so whatever the
CPU has not finished when the GPU wants a chunk back is exposed: the tail (layer 0, and a
host-held embedding, whose rows the worker gathers once every block of it is updated). An updater
behind the backward runs the waiting updates in forward order, so the next forward follows the
queue instead of waiting for it to empty. With exact gradient clipping the model predicts two
steps: one whose norm stays under max_grad_norm keeps its speculative updates, overlapped with
the backward as without clipping (device-held units wait for the norm); one after a clipped
step (slidedp/clipping: it does not speculate) has every update wait for the global norm, i.e.
the last gradient the GPU computes (a device-held layer's counts too), then run in forward order as
the updaters run them (`clips`); and a step that
speculated and then clipped (`corrected`) runs its updates during the backward, then corrects
every one of them (costs.CORRECTION_ADAMWS AdamW's of the chunk each, in forward order) once the
norm is known. A few steps are simulated and the steady-state period is the predicted step time.
Ranks are symmetric, so one rank stands for all; `world` enters through the per-rank batch and the
reduction.

The GPU tasks cost what the job's GPU measured for one layer and the loss at the plan's sizes
(measure.py, `device_times`); the updaters' AdamW what the host measured beside copies, or a run of the
model measured (Calibration.update_params_per_s). What the model leaves out (so the measured step
may be a little longer): the aggregator's traffic beside the updaters (until a run measures it);
messages, version polling and the Python between the blocks.
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass
from typing import Callable

from slidedp.jobrecord import sums_on_host
from slidedp.planner import costs
from slidedp.planner.calibration import Calibration
from slidedp.planner.measure import LayerTime, LossTime, normalized, shape_key
from slidedp.planner.workload import Workload
from slidedp.stepplan import StepPlan

RESOURCES = ("device", "h2d", "d2h", "reduce", "update", "host")
HOSTS_RESOURCES = RESOURCES + ("network",)  # several hosts: the network link between them too
_STEPS = 8  # simulated steps; the period is averaged over the last _AVERAGE of them
_AVERAGE = 4


@dataclass(frozen=True)
class _Job:
    """Host work on one chunk's gradient: the aggregator's sum, then the CPU AdamW."""

    name: str
    reduce_s: float
    update_s: float


@dataclass(frozen=True)
class _Task:
    """One GPU step of the schedule: copy in, compute, copy out, then release host jobs."""

    name: str
    h2d_s: float = 0.0
    device_s: float = 0.0
    d2h_s: float = 0.0
    gate: tuple[str, ...] = ()  # jobs of the previous step that must be done before the copy-in
    jobs: tuple[_Job, ...] = ()
    clip_gated: bool = False  # an optimizer step on the GPU: needs the global norm when clipping
    # several hosts: the seconds this task's collectives keep the host's network link busy (their bytes through
    # it at its full rate and their rings' latency), within h2d_s / d2h_s / device_s; reported, not scheduled
    net_s: float = 0.0


def _rates(calib: Calibration, both: bool, ranks: int = 1) -> tuple[float, float]:
    """H2D and D2H bytes/s of one rank; when a phase moves data both ways, they share the
    bidirectional rate in proportion to their solo rates (never above a solo rate). With several
    ranks copying in at once, each gets at most its share of the host's measured total."""
    h, d = calib.h2d_gbps * 1e9, calib.d2h_gbps * 1e9
    if ranks > 1 and calib.h2d_total_gbps:
        h = min(h, calib.h2d_total_gbps * 1e9 / ranks)
    if not both:
        return h, d
    share = calib.bidir_gbps * 1e9
    return min(h, share * h / (h + d)), min(d, share * d / (h + d))


def _tasks(work: Workload, ch: StepPlan, calib: Calibration) -> list[_Task]:
    m, nl, h, v = work.model, work.model.num_layers, work.model.hidden_size, work.model.vocab_size
    db = costs.delivery_bytes(ch.delivery)
    gb = costs.GRAD_BYTES
    p_layer = costs.layer_params(m)
    tokens = work.local_tokens
    act = costs.activation_bytes(m, tokens, work.compute_dtype)
    off = ch.offloaded(nl)
    offload = off > 0
    k = ch.resident_layers
    n, bus = work.world, calib.allreduce_gbps * 1e9
    fwd_in, fwd_out = _rates(calib, both=offload, ranks=n)
    held = min(ch.device_layers, nl)  # layers 0..held-1 never leave the GPU: no copies, no host update
    refetch = k + held < nl  # backward re-fetches, if any
    bwd_in, bwd_out = _rates(calib, both=offload or refetch, ranks=n)
    cb = costs.dtype_bytes(work.compute_dtype)
    hosts = work.nnodes
    # several hosts: a collective over every host's ranks is a ring through each host's network link; in a
    # backward that re-fetches, the all-gather of the next layer and the reduce-scatter of this one's gradient
    # run at once and share the link (each way) in proportion to their bytes, as the copy streams share PCIe
    # both ways (`_rates`): each then takes as long as the two together would one after the other
    net_fwd = 1.0
    net_bwd_in = network_share(work, refetch, cb, costs.GRAD_BYTES)
    net_bwd = network_share(work, refetch, costs.GRAD_BYTES, cb)

    def params_in(params: float, rate: float, share: float = 1.0) -> float:
        """Copy-stream time of `params` parameters: whole over PCIe, or 1/N over PCIe then the all-gather."""
        if ch.param_route == "replicated" or (n == 1 and hosts == 1):
            return params * db / rate
        if hosts == 1:
            return params * db / n / rate + params * cb * (n - 1) / n / bus
        return params * db / work.ranks / rate + collective_s(work, calib, params * cb, share)

    def grads_out(params: float, rate: float, share: float = 1.0) -> float:
        """Copy-out time of `params` fp32 gradients: whole, or the reduce-scatter then 1/N over PCIe."""
        if ch.grad_route == "host" or (n == 1 and hosts == 1):
            return params * gb / rate
        if hosts == 1:
            return params * gb / n / rate + params * gb * (n - 1) / n / bus
        return params * gb / work.ranks / rate + collective_s(work, calib, params * gb, share)

    def net(*collectives: tuple[float, int]) -> float:
        """The network link's busy seconds of collectives of (parameters, bytes each) (0 on one host)."""
        return sum(network_busy_s(work, calib, p * b) for p, b in collectives) if hosts > 1 else 0.0

    sharded_in = ch.param_route == "sharded" and hosts > 1

    g_fwd, g_bwd, g_loss = device_times(work, ch, calib)
    summed = sums_on_host(work.world, ch.grad_route)
    # several hosts: this host's updaters update its 1/nnodes of every chunk
    upd_scale = costs.update_bytes_per_param(ch.delivery) / 28.0 / calib.update_params_per_s(m.num_parameters(), summed)
    upd_scale /= hosts
    red_scale = gb * costs.reduce_traffic_factor(work.world, ch.grad_route, work.clip) / (
        calib.reduce_rate_gbps(m.num_parameters(), summed) * 1e9)

    def job(name: str, params: float) -> _Job:
        return _Job(name, params * red_scale, params * upd_scale)

    host_emb = ch.embedding == "host"
    rows = costs.row_blocks(v, ch.chunk_rows or costs.default_chunk_rows(m, ch.layer_chunk_numel))
    # a layer's chunks (one, or where the store's layout cuts layers, several): each leaves the GPU and is
    # summed and updated on its own; the next forward's copy of the layer waits for all of them
    shares = costs.layer_chunk_shares(m, ch.layer_chunk_numel)

    def layer_jobs(c: int) -> tuple[str, ...]:
        return (f"layer {c}",) if len(shares) == 1 else tuple(f"layer {c}:{j}" for j in range(len(shares)))
    embedding_blocks = tuple(f"embedding:{j}" for j in range(len(rows)))
    tasks: list[_Task] = []
    untied_host = costs.gathers_rows(m, ch.embedding)  # an untied embedding on the host, and its head
    pin = cb if sharded_in else 0  # bytes a parameter takes in an all-gather across hosts (0: none)
    gout = gb if ch.grad_route == "reduce_scatter" and hosts > 1 else 0  # ... in a reduce-scatter across hosts
    # ---- forward
    if untied_host and hosts == 1:
        # the worker gathers the rows once every block of the embedding is updated (Engine.host_embedding)
        tasks.append(_Task("embedding rows", h2d_s=embedding_rows_s(work, ch, calib), gate=embedding_blocks))
    elif host_emb:  # tied (or several hosts, where no store holds every row): the engine fetches the whole
        # matrix once all of it is updated
        tasks.append(_Task("embedding in", h2d_s=params_in(v * h, fwd_in, net_fwd), gate=embedding_blocks,
                           net_s=net((v * h, pin))))
    for c in range(nl):
        tasks.append(_Task(
            f"layer {c} fwd", h2d_s=params_in(p_layer, fwd_in, net_fwd) if c >= held else 0.0, device_s=g_fwd,
            d2h_s=act / fwd_out if c < off else 0.0, gate=layer_jobs(c) if c >= held else (),
            net_s=net((p_layer, pin)) if c >= held else 0.0,
        ))
    # ---- loss: the final norm and the head (an untied host-held head: fetched as one unit, once all of
    # its row blocks are updated, as the engine fetches it)
    norm_in, norm_job = params_in(h, fwd_in, net_fwd), job("norm", h)
    if untied_host:
        head_gate = ("norm",) + tuple(f"head:{j}" for j in range(len(rows)))
        tasks.append(_Task("norm and head in", h2d_s=norm_in + params_in(v * h, fwd_in, net_fwd), gate=head_gate,
                           net_s=net((h, pin), (v * h, pin))))
        tasks.append(_Task("loss", device_s=g_loss, d2h_s=grads_out(h, bwd_out, net_bwd), jobs=(norm_job,),
                           net_s=net((h, gout))))
        # the untied head's gradient is complete now: out it goes
        tasks += [
            _Task(f"head block {j} grad", d2h_s=grads_out(r * h, bwd_out, net_bwd), jobs=(job(f"head:{j}", r * h),),
                  net_s=net((r * h, gout)))
            for j, r in enumerate(rows)
        ]
    else:
        tasks.append(_Task("loss", h2d_s=norm_in, device_s=g_loss, d2h_s=grads_out(h, bwd_out, net_bwd), gate=("norm",),
                           jobs=(norm_job,), net_s=net((h, pin), (h, gout))))
    # ---- backward
    for c in reversed(range(nl)):
        refetched = not (c >= nl - k or c < held)
        fetch = (params_in(p_layer, bwd_in, net_bwd_in) if refetched else 0.0) + (act / bwd_in if c < off else 0.0)
        names = layer_jobs(c)
        tasks.append(_Task(
            f"layer {c} bwd", h2d_s=fetch, device_s=g_bwd,
            d2h_s=grads_out(p_layer * shares[0], bwd_out, net_bwd) if c >= held else 0.0,
            jobs=(job(names[0], p_layer * shares[0]),) if c >= held else (),
            net_s=net((p_layer, pin if refetched else 0), (p_layer * shares[0], gout if c >= held else 0)),
        ))
        if c >= held:  # the layer's later chunks copy out behind its first, the updaters already on it
            tasks += [_Task(f"{names[j]} grad", d2h_s=grads_out(p_layer * shares[j], bwd_out, net_bwd),
                            jobs=(job(names[j], p_layer * shares[j]),), net_s=net((p_layer * shares[j], gout)))
                      for j in range(1, len(shares))]
    if host_emb:  # the whole embedding gradient leaves the GPU, then the updaters update it block by block
        emb_jobs = tuple(job(f"embedding:{j}", r * h) for j, r in enumerate(rows))
        tasks += [
            _Task(f"embedding block {j} grad", d2h_s=grads_out(r * h, bwd_out, net_bwd),
                  jobs=emb_jobs if j == len(rows) - 1 else (), net_s=net((r * h, gout)))
            for j, r in enumerate(rows)
        ]
    if hosts > 1:  # the loss's and the gradient norm's small all-reduces over every host's ranks: latency only
        small = 2 * SMALL_ALLREDUCE_RING_STEPS * (work.ranks - 1) * calib.internode_latency_s
        tasks.append(_Task("loss and norm all-reduces", device_s=small, net_s=small))
    device_held = held * p_layer + (0 if host_emb else costs.embedding_params(m) + costs.head_params(m))
    if device_held:  # the device-held units: gradients all-reduced among ranks, AdamW on the GPU, after backward
        allreduce = 2 * (work.world - 1) / work.world * device_held * gb / (calib.allreduce_gbps * 1e9)
        tasks.append(_Task("device-held AdamW (GPU)", device_s=device_held / calib.device_adamw_params_per_s + allreduce,
                           clip_gated=True))
    return tasks


# a ring all-reduce is a reduce-scatter and an all-gather: twice a ring's steps
SMALL_ALLREDUCE_RING_STEPS = 2


def network_share(work: Workload, both: bool, mine: float, other: float) -> float:
    """The share of a host's network link a collective of `mine` bytes a parameter gets: all of it, or where
    an all-gather and a reduce-scatter run at once (both), its bytes' share of the two's."""
    return mine / (mine + other) if both and work.nnodes > 1 else 1.0


def network_bytes(work: Workload, nbytes: float) -> float:
    """Bytes of a collective over every host's ranks (an all-gather of a chunk of `nbytes`, or a reduce-scatter
    of one) through one host's network link, each way. NCCL runs both as a ring over the nnodes x world ranks
    (one network hop per host and ring), which carries (R - 1) / R of the chunk over every hop, a host's link
    included: more than the (H - 1) / H a host lacks, which NCCL's rings do not reach."""
    r = work.ranks
    return nbytes * (r - 1) / r


def collective_s(work: Workload, calib: Calibration, nbytes: float, share: float = 1.0) -> float:
    """Seconds of an all-gather (or reduce-scatter) of a chunk of `nbytes` over every host's ranks: its ring's
    bytes at the slower of the GPU links within a host (the calibration's all-gather bus bandwidth among its
    GPUs, as nccl-tests reports it; none with one GPU a host) and the host's network link (its `share` of
    it), plus the ring's steps' latency (R - 1 network hops' worth)."""
    rate = calib.internode_rate_gbps * 1e9 * share
    if work.world > 1:
        rate = min(rate, calib.allreduce_gbps * 1e9)
    return network_bytes(work, nbytes) / rate + (work.ranks - 1) * calib.internode_latency_s


def network_busy_s(work: Workload, calib: Calibration, nbytes: float) -> float:
    """Seconds a collective of a chunk of `nbytes` keeps one host's network link busy: its bytes at the link's
    full rate, and its ring's latency."""
    return (network_bytes(work, nbytes) / (calib.internode_rate_gbps * 1e9)
            + (work.ranks - 1) * calib.internode_latency_s)


def embedding_rows_bytes(work: Workload, ch: StepPlan) -> int:
    """One rank's batch rows of an untied host-held embedding per step, in the delivered dtype."""
    return work.local_tokens * work.model.hidden_size * costs.delivery_bytes(ch.delivery)


def embedding_rows_s(work: Workload, ch: StepPlan, calib: Calibration) -> float:
    """Seconds per step of the batch's rows of an untied host-held embedding reaching the GPU, at the
    rate the calibration measured gathering them as a worker does (Calibration.embedding_rows_gbps; per
    byte of the table as delivered), or, not measured, at the copy-in rate. Charged on the copy-in
    stream ahead of layer 0's copy: the GPU's reads of the mapped store share PCIe with it, and the
    CPU's gather (no mapping) ends before the worker issues it; the forward waits for the rows."""
    rate = calib.embedding_rows_gbps * 1e9 or _rates(calib, both=False, ranks=work.world)[0]
    return embedding_rows_bytes(work, ch) / rate


def micro_batch_of(work: Workload, ch: StepPlan) -> int:
    m = ch.micro_batch or work.micro_batch
    if not m:
        raise ValueError("no micro-batch: the workload leaves it to the plan (micro_batch = 0) and the choices name none")
    return m


def device_times(work: Workload, ch: StepPlan, calib: Calibration) -> tuple[float, float, float]:
    """One rank's GPU seconds per step of one layer's forward, of its recompute + backward, and of the
    loss: the blocks measured on the job's GPU at this shape and size (calib.blocks) times the passes
    per step; a size not measured takes the measured one nearest to it, per sequence (the planner may
    weigh one the launcher did not measure); with no blocks of this shape, the matmul FLOPs at the
    calibrated effective rate (a compiled layer costs.COMPILED_LAYER_SPEEDUP faster, the backward 3x
    the forward)."""
    layer, loss = measured(work, ch, calib, nearest=True)
    flops = calib.device_tflops * 1e12
    if layer is not None:
        per_seq = work.local_batch / layer.micro_batch  # passes, or as many of the nearest size's
        fwd, bwd = layer.forward_s * per_seq, layer.backward_s * per_seq
    else:
        fwd = work.local_tokens * costs.layer_forward_flops_per_token(work.model, work.attended_len) / flops
        fwd /= costs.COMPILED_LAYER_SPEEDUP if work.compiled else 1.0
        bwd = 3.0 * fwd
    g_loss = loss.seconds * work.local_batch / loss.micro_batch if loss is not None else (
        work.local_tokens * costs.head_step_flops_per_token(work.model) / flops)
    return fwd, bwd, g_loss


def measured(work: Workload, ch: StepPlan, calib: Calibration,
             nearest: bool = False) -> tuple[LayerTime | None, LossTime | None]:
    """The layer and the loss measured on the GPU at this plan's sizes (None: not measured; blocks of
    another job's shape are not this one's, nor blocks of the other layers: transformers' layer modules
    and SlideDP's own are timed under keys of their own); nearest: else the measured sizes nearest to
    them (the closest micro-batch, then the same tile and loss chunk)."""
    blocks = calib.blocks
    if blocks is None or blocks.shape != shape_key(work.model, work.seq_len, work.compute_dtype, work.compiled,
                                                   work.documents, work.layers):
        return None, None
    m = micro_batch_of(work, ch)
    tile = normalized(m, work.seq_len, ch.seq_tile_tokens)
    layer, loss = blocks.layer(m, tile), blocks.loss(m, tile, ch.loss_chunk_tokens)
    if nearest:
        def distance(t: LayerTime | LossTime) -> tuple:
            return (abs(math.log2(t.micro_batch / m)), t.seq_tile_tokens != tile,
                    getattr(t, "loss_chunk_tokens", ch.loss_chunk_tokens) != ch.loss_chunk_tokens)

        layer = layer or min(blocks.layers, key=distance, default=None)
        loss = loss or min(blocks.losses, key=distance, default=None)
    return layer, loss


def device_time_source(work: Workload, ch: StepPlan, calib: Calibration) -> str:
    """Where the plan's layer and loss times come from: "measured" at its sizes, "nearby" (measured at
    other sizes of this shape), or "FLOPs" (at the calibrated rate)."""
    if None not in measured(work, ch, calib):
        return "measured"
    return "nearby" if None not in measured(work, ch, calib, nearest=True) else "FLOPs"


@functools.lru_cache(maxsize=4096)  # a plan weighs many candidates whose schedules are the same tasks
def _period(tasks: tuple[_Task, ...], depth: int, updaters: int, clip: bool, clips: bool, corrected: bool = False) -> float:
    """Steady-state step time of the schedule: simulate a few steps, average the last ones.
    clip: exact clipping (device-held units wait for the norm); clips: every step clips, the host
    updates deferred until the norm; corrected: every step clips after speculating, each host update
    redone after the norm."""
    h2d_free = device_free = d2h_free = reduce_free = 0.0
    servers = [0.0] * updaters
    fetch_starts: list[float] = []  # compute start of each task that copies in, in order
    done: dict[str, float] = {}  # job -> time its update finished in the previous step
    ends: list[float] = []
    # where the next step's schedule first needs each job's update: the updaters run the waiting work
    # that is needed first (daemons/updater/core.py: the oldest step, then forward order)
    deferred = clip and clips and not corrected
    needed = {g: i for i, t in reversed(list(enumerate(tasks))) for g in t.gate}
    # the tasks' fields read once (this loop is most of a plan's time): the arithmetic is the same as
    # with max(), which keeps the first of equal values
    rows = [(t.clip_gated, t.gate, t.h2d_s, t.device_s, t.d2h_s, t.jobs) for t in tasks]
    for _ in range(_STEPS):
        released: list[tuple[_Job, float]] = []
        released_last = 0.0  # the latest of released's times, kept as they come (a held unit waits for it)
        grads_end = 0.0  # the GPU's last gradient: device-held units' norms count in the global norm
        for clip_gated, gate, h2d_s, device_s, d2h_s, jobs in rows:
            if clip_gated and device_free > grads_end:
                grads_end = device_free
            # the copy starts once the gate's updates are done, the copy stream is free, and (depth + 1
            # slots) the fetch `depth` back has begun computing
            begin = h2d_free
            for g in gate:
                ready = done.get(g, 0.0)
                if ready > begin:
                    begin = ready
            if len(fetch_starts) >= depth and fetch_starts[-depth] > begin:
                begin = fetch_starts[-depth]
            h2d_end = begin + h2d_s
            if h2d_s > 0:
                h2d_free = h2d_end
            start = h2d_end if h2d_end > device_free else device_free
            if clip_gated and clip and released and released_last > start:
                start = released_last
            if h2d_s > 0:
                fetch_starts.append(start)
            device_free = start + device_s
            out = device_free
            if d2h_s > 0:
                d2h_free = (d2h_free if d2h_free > device_free else device_free) + d2h_s
                out = d2h_free
            for j in jobs:
                if j.reduce_s > 0:
                    reduce_free = (reduce_free if reduce_free > out else out) + j.reduce_s
                    at = reduce_free
                else:
                    at = out
                released.append((j, at))
                if at > released_last:
                    released_last = at
        norm = max(released_last, grads_end or device_free)
        norm_known = norm if deferred else 0.0
        # every update of a clipped step waits for the norm; otherwise each may run once its gradient is in
        done = _serve(released, servers, norm_known, lambda j: needed.get(j.name, len(tasks)))
        if clip and corrected:  # the corrections, in forward order: the next forward wants layer 0 first
            for j, _ in reversed(released):
                s = min(range(updaters), key=servers.__getitem__)
                servers[s] = max(servers[s], norm) + j.update_s * costs.CORRECTION_ADAMWS
                done[j.name] = servers[s]
        ends.append(device_free)
    return (ends[-1] - ends[-1 - _AVERAGE]) / _AVERAGE


def _serve(released: list[tuple[_Job, float]], servers: list[float], floor: float,
           urgency: Callable[[_Job], int]) -> dict[str, float]:
    """Run one step's host updates on the updaters (`servers`: when each is next free, advanced in place),
    as the updater does: whenever one is free, the most urgent (lowest `urgency`) of the jobs whose
    gradient is in by then and not before `floor`, else the next to come in. Returns job -> its end."""
    coming = sorted(range(len(released)), key=lambda i: released[i][1])
    arrivals = [released[i][1] for i in coming]
    last = len(coming)
    waiting: list[tuple[int, int]] = []  # (urgency, index) of the released jobs not yet run
    # (free at, index): the earliest free updater first, the lowest index among equals (as min() picks)
    free = [(t, s) for s, t in enumerate(servers)]
    heapq.heapify(free)
    done: dict[str, float] = {}
    nxt = 0
    while nxt < last or waiting:
        at, s = heapq.heappop(free)
        now = at if at > floor else floor
        if not waiting and arrivals[nxt] > now:
            now = arrivals[nxt]
        while nxt < last and arrivals[nxt] <= now:
            i = coming[nxt]
            heapq.heappush(waiting, (urgency(released[i][0]), i))
            nxt += 1
        job = released[heapq.heappop(waiting)[1]][0]
        end = now + job.update_s
        heapq.heappush(free, (end, s))
        done[job.name] = end
    for at, s in free:
        servers[s] = at
    return done


def host_traffic(work: Workload, ch: StepPlan) -> dict[str, int]:
    """Host memory bytes of one step, all ranks, by what moves them (costs.host_traffic)."""
    one = work.ranks == 1
    return costs.host_traffic(
        work.model, tokens=work.local_tokens, delivery=ch.delivery, embedding=ch.embedding,
        resident_layers=ch.resident_layers, device_layers=ch.device_layers, offloaded=ch.offloaded(work.model.num_layers),
        world=work.world, param_route=ch.param_route if not one else "replicated",
        grad_route=ch.grad_route if not one else "host", compute_dtype=work.compute_dtype,
        summed=sums_on_host(work.world, ch.grad_route), nnodes=work.nnodes)


def host_bound_s(work: Workload, ch: StepPlan, calib: Calibration) -> float:
    """The shortest step host memory allows: the step's host bytes (reads and writes together, every NUMA node's)
    at the most the host's memory moved when measured (Calibration.host_peak_gbps). 0 where it was not measured."""
    if not calib.host_peak_gbps:
        return 0.0
    return sum(host_traffic(work, ch).values()) / (calib.host_peak_gbps * 1e9)


def predict_step(work: Workload, choices: StepPlan, calib: Calibration, clips: bool = False,
                 corrected: bool = False) -> tuple[dict[str, float], float, float]:
    """The model: (busy seconds per resource per step, exposed seconds, predicted step seconds).
    clips: a step after a clipped one (every update deferred); corrected: a step that speculated and clipped."""
    if not 0 <= choices.resident_layers <= work.model.num_layers:
        raise ValueError(f"resident_layers must be between 0 and {work.model.num_layers}, got {choices.resident_layers}")
    micro_batch_of(work, choices)
    if choices.micro_batch is not None and work.local_batch % choices.micro_batch:
        raise ValueError(f"micro_batch ({choices.micro_batch}) must divide the sequences per rank ({work.local_batch})")
    tasks = _tasks(work, choices, calib)
    jobs = [j for t in tasks for j in t.jobs]
    busy = {
        "device": sum(t.device_s for t in tasks),
        "h2d": sum(t.h2d_s for t in tasks),
        "d2h": sum(t.d2h_s for t in tasks),
        "reduce": sum(j.reduce_s for j in jobs),
        "update": sum(j.update_s for j in jobs) / work.updaters,
        "host": host_bound_s(work, choices, calib),
    }
    if work.nnodes > 1:  # the network link between hosts: its collectives' bytes and latency (within h2d and d2h)
        busy["network"] = sum(t.net_s for t in tasks)
    # the schedule's period, and never less than host memory needs to move the step's bytes
    step = max(_period(tuple(tasks), choices.prefetch_depth, work.updaters, work.clip, clips, corrected), busy["host"])
    return busy, step - busy["device"], step
