"""The planner: the fastest choices that fit a GPU memory budget, and the plan it reports.

`make_plan` searches step plans (`StepPlan`: micro-batch, offloaded layers, embedding placement,
prefetch depth, routes, tiles, resident and device-held layers), charges each with the step-time model
(step_model.predict_step) and the memory model (costs), and returns the `Plan`. `device_work_sizes`
lists the GPU work sizes it may weigh, which are measured before it plans (inputs.py).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from slidedp.jobrecord import ring_slots, sums_on_host
from slidedp.protocol import REDUCE_SLOTS
from slidedp.model import moe_shape
from slidedp.planner import costs
from slidedp.planner.calibration import Calibration
from slidedp.planner.costs import GiB
from slidedp.planner.step_model import (HOSTS_RESOURCES, collective_s, device_time_source, embedding_rows_bytes,
                                        embedding_rows_s, measured, micro_batch_of, network_bytes, predict_step)
from slidedp.planner.plan_record import Plan, Weighed
from slidedp.planner.workload import Workload
from slidedp.stepplan import StepPlan

_LOSS_CHUNKS = (1024, 512, 256, 128)  # tokens per logits chunk, largest that fits first
_TIE = 1e-9  # relative: resident layers that change a prediction by less than this buy nothing
# Plans predicted within this share of the fastest count as equally fast (the model's own error is
# larger; docs/planner.md, "The constants").
_EQUAL = 0.02


class PlanError(ValueError):
    """No plan fits: the message names the smallest budget that would and the knob to turn."""



def _update_rate_note(work: Workload, ch: StepPlan, calib: Calibration) -> str:
    """Which AdamW rate the update is charged at: the rate a run of this model measured on this host
    (beside a host sum of ranks' gradients where this plan has one), or the bare kernel's discounted
    (the figure a first plan is most often wrong by)."""
    n, summed = work.model.num_parameters(), sums_on_host(work.world, ch.grad_route)
    rate = calib.update_params_per_s(n, summed) / 1e9
    if summed and calib.update_rate_learned(n, summed=True):
        sum_rate = f"{calib.reduce_rate_gbps(n, True):.1f} GB/s" + ("" if calib.reduce_train_summed_gbps else " (its bare rate)")
        return (f"update charged at {rate:.2f} G params/s per updater and the host sum at {sum_rate}, "
                "measured training this model on this host beside such a sum")
    if calib.update_rate_learned(n):
        return (f"update charged at {rate:.2f} G params/s per updater, measured training this model on this host"
                + ("; the host sum of ranks' gradients beside it is not measured yet" if summed else ""))
    if calib.adamw_beside_copies_params_per_s:
        beside, share = calib.adamw_beside_copies_params_per_s / 1e9, calib.adamw_train_fraction
        which = (f"the kernel measured beside {calib.adamw_beside_copies_gpus or 1} GPU(s) copying without pause "
                 f"(above {share:g} x the bare kernel's {calib.adamw_params_per_s / 1e9:.2f})" if rate == beside else
                 f"{share:g} x the bare kernel's {calib.adamw_params_per_s / 1e9:.2f} (above the {beside:.2f} measured "
                 f"beside {calib.adamw_beside_copies_gpus or 1} GPU(s) copying without pause)")
        return (f"update charged at {rate:.2f} G params/s per updater: {which}, until a run of this model on this "
                "host measures its rate in training")
    low = calib.at_lowest_share(n)
    guard = "" if low is None else (
        f"; at {low.adamw_train_fraction:g} x, the lowest share measured in training, this plan predicts "
        f"{predict_step(work, ch, low)[2]:.3f} s")
    return (f"update charged at {rate:.2f} G params/s per updater: {calib.adamw_train_fraction:g} x the bare kernel "
            f"until a run of this model on this host measures its rate in training" + guard)


# --------------------------------------------------------------------------------------
# the planner


def _memory(work: Workload, ch: StepPlan) -> list[tuple[str, int]]:
    return costs.device_memory_items(
        work.model, tokens=work.local_tokens, seq_len=work.seq_len, micro_batch=micro_batch_of(work, ch),
        world=work.world, delivery=ch.delivery, activations=ch.activations, embedding=ch.embedding,
        prefetch_depth=ch.prefetch_depth, resident_layers=ch.resident_layers,
        chunk_rows=ch.chunk_rows or costs.default_chunk_rows(work.model, ch.layer_chunk_numel),
        loss_chunk_tokens=ch.loss_chunk_tokens,
        compute_dtype=work.compute_dtype, offload_layers=ch.offload_layers, seq_tile_tokens=ch.seq_tile_tokens,
        device_layers=ch.device_layers, nnodes=work.nnodes,
    )


def _bounded_memory(work: Workload, ch: StepPlan, calib: Calibration) -> list[tuple[str, int]]:
    """_memory, with the layer workspace at least what the GPU measured of one backward at this size
    (the allocator's peak above its inputs, less the layer's compute-dtype gradients and the incoming
    gradient, which "chunk gradients" and "hidden states" count)."""
    items = _memory(work, ch)
    layer = measured(work, ch, calib)[0]
    if layer is None or not layer.workspace_bytes:
        return items
    cb = costs.dtype_bytes(work.compute_dtype)
    seen = layer.workspace_bytes - (costs.layer_params(work.model) + micro_batch_of(work, ch) * work.seq_len
                                    * work.model.hidden_size) * cb
    return [(name, max(b, seen) if name == "layer workspace" else b) for name, b in items]


def _workspace_note(work: Workload, ch: StepPlan, calib: Calibration, counted: int) -> str | None:
    """The layer workspace the GPU measured at this size beside the formula's, and what the plan counts
    (`counted`: its _bounded_memory item)."""
    layer = measured(work, ch, calib)[0]
    if layer is None or not layer.workspace_bytes:
        return None
    formula = dict(_memory(work, ch))["layer workspace"]
    return (f"layer workspace at micro-batch {micro_batch_of(work, ch)}: the formula's {formula / GiB:.3f} GiB, the "
            f"GPU's backward {layer.workspace_bytes / GiB:.3f} GiB above its inputs; the plan counts "
            f"{counted / GiB:.3f} GiB (the larger of the formula's and the GPU's less the gradients other items "
            "count)")


def _total(work: Workload, ch: StepPlan) -> int:
    return costs.device_memory_peak(_memory(work, ch), work.world).total_bytes


# plan.micro_batch = "auto" weighs micro-batches of at most this many tokens (and always one sequence): the
# layer's GEMMs gained 10% from 4,096 to 16,384 tokens on an H200 (benchmarks/RESULTS.md, "Kernels"), and
# every size weighed is measured on the GPU at the first plan of a shape.
AUTO_MICRO_TOKENS = 16_384


def _micro_batches(work: Workload) -> list[int]:
    """The divisors of the per-rank batch, largest first: where the plan chooses, those of at most
    AUTO_MICRO_TOKENS tokens; where the job sets its micro-batch, that one first (the others are what
    it shrinks to where it does not fit)."""
    divisors = [d for d in range(work.local_batch, 0, -1) if work.local_batch % d == 0]
    if not work.micro_batch:
        return [d for d in divisors if d == 1 or d * work.seq_len <= AUTO_MICRO_TOKENS]
    return [work.micro_batch] + [d for d in divisors if d != work.micro_batch]


def _loss_chunks(work: Workload) -> list[int]:
    return sorted({min(c, work.local_tokens) for c in _LOSS_CHUNKS}, reverse=True)


ALL_OPTIONS: dict[str, tuple] = {
    "activations": ("keep", "offload"), "embedding": ("device", "host"), "delivery": ("fp32", "bf16"),
    "param_route": ("replicated", "sharded"), "grad_route": ("host", "reduce_scatter"), "prefetch_depth": (1, 2, 3)}
_SEQ_TILES = (0, 8192, 4096, 2048, 1024)  # tokens per MLP/norm/head tile; untiled first


def _base_choices(work: Workload, allowed: dict[str, tuple] | None = None) -> list[StepPlan]:
    """Every combination of the options, restricted to `allowed` (what the engine and store offer).
    One rank has no routes to choose."""
    opts = dict(ALL_OPTIONS, **(allowed or {}))
    deliveries = opts["delivery"] if work.compute_dtype == "bf16" else ("fp32",)
    param_routes = opts["param_route"] if work.ranks > 1 else ("replicated",)
    grad_routes = opts["grad_route"] if work.ranks > 1 else ("host",)
    offloaded = {"keep": 0, "offload": work.model.num_layers}  # "offload": all, until fitted (_fewest_offloaded)
    return [
        StepPlan(micro_batch=work.micro_batch or 1, compute_dtype=work.compute_dtype, offload_layers=offloaded[a],
                 embedding=e, delivery=d, prefetch_depth=p, param_route=pr, grad_route=gr,
                 chunk_rows=costs.default_chunk_rows(work.model, work.layer_cut), layer_chunk_numel=work.layer_cut,
                 loss_chunk_tokens=_LOSS_CHUNKS[0], layers=work.layers)
        for e in opts["embedding"] for a in opts["activations"] for d in deliveries for p in opts["prefetch_depth"]
        for pr in param_routes for gr in grad_routes
    ]


def _seq_tiles(work: Workload, micro_batch: int) -> list[int]:
    """Untiled, then the tiles smaller than a micro-batch of that size (tiles run over its m x T tokens);
    transformers' layers run untiled."""
    return [t for t in _SEQ_TILES if t < micro_batch * work.seq_len and (not t or work.layers == "native")]


def _smallest(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The smallest k in [lo, hi] with ok(k), for ok monotone (false, ..., false, true, ...); ok(hi) must hold."""
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _fewest_offloaded(work: Workload, ch: StepPlan, budget: int) -> StepPlan | None:
    """`ch` if it fits; with activations = "offload", the fewest offloaded layers (>= 1) that fit the
    budget, and no more than the host has room to keep (Workload.host_room)."""
    cap = work.host_offload_cap(ch.delivery)
    if cap < 0:
        return None
    if not ch.offload_layers:
        return ch if _total(work, ch) <= budget else None
    if cap < 1 or _total(work, replace(ch, offload_layers=cap)) > budget:
        return None
    return replace(ch, offload_layers=_smallest(1, cap, lambda k: _total(work, replace(ch, offload_layers=k)) <= budget))


def _fit_at(work: Workload, base: StepPlan, mb: int, budget: int, grow: bool) -> StepPlan | None:
    """At micro-batch mb: untiled if that fits (else the largest sequence tile that does), the largest
    loss chunk that fits and the fewest offloaded layers; then, where `grow` and nothing had to shrink,
    as many resident layers as the rest of the budget holds."""
    first = grow
    for tile in _seq_tiles(work, mb):
        for lc in _loss_chunks(work):
            ch = _fewest_offloaded(
                work, replace(base, micro_batch=mb, loss_chunk_tokens=lc, seq_tile_tokens=tile, resident_layers=0),
                budget)
            if ch is not None:
                k = 0
                while first and k < work.model.num_layers and _total(work, replace(ch, resident_layers=k + 1)) <= budget:
                    k += 1
                return replace(ch, resident_layers=k)
            first = False
    return None


def _fit(work: Workload, base: StepPlan, budget: int) -> StepPlan | None:
    """The job's micro-batch if it fits (else the largest divisor that does), fitted by `_fit_at`;
    resident layers only at the job's own micro-batch. (Spending memory freed by shrinking on resident
    layers would let a larger budget, where the job's micro-batch fits again, predict a slower step.)"""
    for i, mb in enumerate(_micro_batches(work)):
        ch = _fit_at(work, base, mb, budget, grow=i == 0)
        if ch is not None:
            return ch
    return None


def _fewest_resident(work: Workload, ch: StepPlan, calib: Calibration) -> StepPlan:
    """Fewest resident layers that predict the same step as the most that fit (memory left free)."""
    best = predict_step(work, ch, calib)[2]
    lo = _smallest(0, ch.resident_layers,
                   lambda k: predict_step(work, replace(ch, resident_layers=k), calib)[2] <= best * (1 + _TIE))
    return replace(ch, resident_layers=lo)


def _least_memory(work: Workload, mb: int, allowed: dict[str, tuple] | None) -> StepPlan:
    """The plan of least GPU memory at micro-batch mb among the options `allowed`."""
    return min(
        (replace(b, micro_batch=mb, loss_chunk_tokens=min(_loss_chunks(work)),
                 seq_tile_tokens=_seq_tiles(work, mb)[-1]) for b in _base_choices(work, allowed)),
        key=lambda ch: _total(work, ch),
    )


def _no_fit_error(work: Workload, budget: int, allowed: dict[str, tuple] | None = None) -> PlanError:
    """The smallest plan among the options `allowed` (a job's forced prefetch depth or embedding
    stays forced), its memory and what to change. Where the host's memory has no room for what every
    plan takes (the store, the rings, the processes), the GPU is not what to change: that is said instead."""
    if work.host_room is not None and work.host_room.free_bytes < 0:
        return PlanError(
            f"no plan fits this host's memory: the store's state, the gradient rings and the job's processes take "
            f"{-work.host_room.free_bytes / GiB:.1f} GiB more than the host has available, whatever the GPU budget "
            "(`slidedp-launch --dry-run` lists what the job needs and what would help)")
    smallest = _least_memory(work, 1, allowed)
    items = _memory(work, smallest)
    peak = costs.device_memory_peak(items, work.world)
    need = peak.total_bytes
    # the largest of the items that make the peak (not the CUDA context, nor an item of another phase)
    name, size = max(((n, b) for n, b in items if n != "CUDA context" and peak.phase in costs.live_in(n)),
                     key=lambda it: it[1])
    if name in ("hidden states", "saved layer inputs", "offload staging"):
        knob = (f"or lower the tokens per rank (global_batch / world x seq_len = {work.local_tokens:,}): "
                f"raise world, or lower global_batch or seq_len")
    elif name == "layer workspace":
        knob = "or lower seq_len (attention spans the whole sequence; only its MLP half is tiled)"
    else:
        knob = "or use a GPU with more memory (this item scales with the model, not the batch)"
    need_gib = math.ceil(need / GiB * 100) / 100
    return PlanError(
        f"no plan fits the GPU memory budget of {budget / GiB:.2f} GiB: the smallest plan needs {need_gib:.2f} GiB "
        f"(embedding={smallest.embedding}, activations={smallest.activations}, delivery={smallest.delivery}, "
        f"prefetch_depth={smallest.prefetch_depth}, micro_batch=1, seq_tile_tokens={smallest.seq_tile_tokens}, "
        f"loss_chunk_tokens={smallest.loss_chunk_tokens}) and its largest item is "
        f"{name} ({size / GiB:.2f} GiB). Raise the budget to at least {need_gib:.2f} GiB, {knob}"
        + _host_room_note(work)
    )


def _host_limits_offload(work: Workload) -> bool:
    """Whether the host's memory holds fewer offloaded layers' inputs than the model has layers."""
    return work.host_room is not None and work.host_offload_cap("fp32") < work.model.num_layers


def _host_room_words(work: Workload) -> str:
    assert work.host_room is not None
    return (f"{max(work.host_room.free_bytes, 0) / GiB:.1f} GiB of host memory beside the store, the gradient "
            "rings and the job's processes")


def _host_room_note(work: Workload) -> str:
    """Where the host's memory limited the offloaded layers: how many it has room for, and what frees more."""
    if not _host_limits_offload(work):
        return ""
    return (f". The host has room to keep the inputs of {max(work.host_offload_cap('fp32'), 0)} of "
            f"{work.model.num_layers} offloaded layers ({_host_room_words(work)}): more free host memory "
            "(other stores destroyed) lets the plan offload more")


def _holding(work: Workload, ch: StepPlan, d: int, budget: int) -> StepPlan | None:
    """ch with its first d layers held on the GPU, resident layers dropped (last first) until it fits; None if it cannot."""
    k = min(ch.resident_layers, work.model.num_layers - d)
    while k > 0 and _total(work, replace(ch, device_layers=d, resident_layers=k)) > budget:
        k -= 1
    cand = replace(ch, device_layers=d, resident_layers=k)
    return cand if _total(work, cand) <= budget else None


def judged_step(work: Workload, ch: StepPlan, calib: Calibration) -> float:
    """The step a plan is judged by. With exact clipping, the slower of its two regimes: a step whose
    norm stays under the threshold (its updates overlap the backward) and a step after a clipped one
    (its updates wait for the norm). Which one a job's steps run is not known before its norms are:
    the plans differ most in the second (a micro-batch of 1 overlaps the deferred updates with the
    shortest first forward), and a fine-tuning job's first steps often clip."""
    step = predict_step(work, ch, calib)[2]
    return max(step, predict_step(work, ch, calib, clips=True)[2]) if work.clip else step


def _guarded_step(work: Workload, ch: StepPlan, calib: Calibration, low: Calibration | None) -> float:
    """The judged step, or, while the updaters' rate is a guess (`low`: Calibration.at_lowest_share),
    the slower of it and the step at the lowest share of the bare kernel measured in training."""
    step = judged_step(work, ch, calib)
    return step if low is None else max(step, judged_step(work, ch, low))


def _with_device_layers(work: Workload, ch: StepPlan, budget: int, calib: Calibration) -> StepPlan:
    """The chosen plan with its first layers held on the GPU where that predicts a faster step.

    A held layer takes its AdamW state onto the GPU (16 B per parameter more than a resident
    layer) and gives the host its copies and its update, and the next forward its wait for the
    host (layer 0 is the tail). Room is made by dropping resident layers (their cost is a re-fetch
    in backward); more held layers are tried while they fit, and the fewest that predict the
    fastest step are kept, with the fewest resident layers that predict the same. Until a run of
    the model has measured its updaters' rate, a step is judged by the slower of its predictions
    at the charged share of the bare AdamW and at the lowest share measured: the share is what a
    first plan is most often wrong by (0.46 to 1.01 measured), and a held layer too few leaves the
    step bound by the host where one too many costs a little GPU memory."""
    low = calib.at_lowest_share(work.model.num_parameters())
    best, best_step = ch, _guarded_step(work, ch, calib, low)
    for d in range(1, work.model.num_layers + 1):
        cand = _holding(work, ch, d, budget)
        if cand is None:
            break  # each held layer needs more memory than the last: none beyond fits either
        cand = _fewest_resident(work, cand, calib)
        step = _guarded_step(work, cand, calib, low)
        if step < best_step * (1 - _TIE):
            best, best_step = cand, step
    return best


def _forced_device_layers(work: Workload, ch: StepPlan, d: int, budget: int, calib: Calibration) -> StepPlan:
    """The job's plan.device_layers, made to fit by dropping resident layers, or a PlanError."""
    d = min(d, work.model.num_layers)
    cand = _holding(work, ch, d, budget)
    if cand is None:
        need = _total(work, replace(ch, device_layers=d, resident_layers=0))
        items = dict(_memory(work, replace(ch, device_layers=d)))
        held = items["device-held layers"] + items["held layers' gradients"]
        raise PlanError(
            f"plan.device_layers = {d} does not fit the GPU memory budget of {budget / GiB:.2f} GiB: the plan "
            f"with them needs {need / GiB:.2f} GiB (the held layers {held / GiB:.2f} GiB); lower plan.device_layers "
            f"(\"auto\" lets the plan choose) or raise memory.device_budget_gib"
        )
    return _fewest_resident(work, cand, calib)


def _fitted(work: Workload, calib: Calibration, fits: list[StepPlan | None]) -> list[tuple[float, int, StepPlan]]:
    """(prediction, memory, choices) of each plan that fits, with its fewest resident layers."""
    out = []
    for ch in fits:
        if ch is not None:
            ch = _fewest_resident(work, ch, calib)
            out.append((judged_step(work, ch, calib), _total(work, ch), ch))
    return out


def _least_compromise(work: Workload, candidates: list[tuple[float, int, StepPlan]]) -> StepPlan:
    """Among the plans predicted within _EQUAL of the fastest: the largest micro-batch, the largest loss
    chunk, the largest tile, the fewest offloaded layers (costs the model leaves out: smaller matmuls,
    more launches, host traffic), then the faster prediction, then the least memory."""
    fastest = min(step for step, _, _ in candidates)
    nl = work.model.num_layers

    def key(c: tuple[float, int, StepPlan]) -> tuple:
        ch = c[2]
        return (-micro_batch_of(work, ch), -ch.loss_chunk_tokens, -(ch.seq_tile_tokens or 1 << 62),
                ch.offloaded(nl), c[0], c[1])

    return min((c for c in candidates if c[0] <= fastest * (1 + _EQUAL)), key=key)[2]


def _held(work: Workload, ch: StepPlan, budget: int, calib: Calibration, device_layers: int | None) -> StepPlan:
    """ch with its device-held layers: the plan's choice (None), or the job's number (0: none)."""
    if device_layers is None:
        return _with_device_layers(work, ch, budget, calib)
    if device_layers > 0:
        return _forced_device_layers(work, ch, device_layers, budget, calib)
    return ch


def _choose_micro_batch(work: Workload, budget: int, calib: Calibration, allowed: dict[str, tuple] | None,
                        device_layers: int | None) -> tuple[StepPlan, list[tuple[float, int, StepPlan]], tuple[Weighed, ...]]:
    """plan.micro_batch = "auto": the best plan at every divisor of the per-rank batch (tiles, loss chunk,
    offloaded, resident and device-held layers fitted to it), judged as `_with_device_layers` judges
    held layers; the fastest wins, and among those within _EQUAL of it the largest micro-batch (the
    model's own error is larger than that). Returns (the choices, every fitted plan, what was weighed)."""
    low = calib.at_lowest_share(work.model.num_parameters())
    bases = _base_choices(work, allowed)
    every: list[tuple[float, int, StepPlan]] = []
    best_at: dict[int, tuple[float, StepPlan]] = {}
    rejected: dict[int, tuple[int, str]] = {}
    refusal: PlanError | None = None
    for mb in _micro_batches(work):
        fitted = _fitted(work, calib, [_fit_at(work, base, mb, budget, grow=True) for base in bases])
        if not fitted:
            need = _total(work, _least_memory(work, mb, allowed))
            rejected[mb] = (need, f"does not fit: its smallest plan needs {need / GiB:.2f} GiB")
            continue
        every += fitted
        try:
            ch = _held(work, _least_compromise(work, fitted), budget, calib, device_layers)
        except PlanError as e:  # the job's plan.device_layers do not fit beside this micro-batch
            refusal = e
            rejected[mb] = (_total(work, fitted[0][2]), f"does not fit with plan.device_layers = {device_layers}")
            continue
        best_at[mb] = (_guarded_step(work, ch, calib, low), ch)
    if not best_at:
        raise refusal or _no_fit_error(work, budget, allowed)
    fastest = min(step for step, _ in best_at.values())
    chosen = max(mb for mb, (step, _) in best_at.items() if step <= fastest * (1 + _EQUAL))
    chosen_step, best = best_at[chosen]
    weighed = []
    for mb in sorted(best_at, key=lambda m: (m != chosen, best_at[m][0])):
        step, ch = best_at[mb]
        change = 100 * (step / chosen_step - 1)
        verdict = ("chosen" if mb == chosen else f"{change:.1f}% slower" if change >= 0.05 else
                   f"{-change:.1f}% faster, within {_EQUAL:.0%}: the larger micro-batch wins" if change <= -0.05
                   else "as fast: the larger micro-batch wins")
        weighed.append(Weighed(mb, step, _total(work, ch), device_time_source(work, ch, calib), verdict))
    weighed += [Weighed(mb, None, need, "-", why) for mb, (need, why) in sorted(rejected.items())]
    return best, every, tuple(weighed)


def _moe_note(work: Workload) -> str | None:
    """A Mixture-of-Experts model: the GPU computes with its active parameters, the host moves all of them."""
    m = work.model
    experts = moe_shape.num_experts(m)
    if not experts or not moe_shape.is_moe(m):
        return None
    nl, active = m.num_layers, costs.active_layer_params(m)
    return (f"Mixture-of-Experts: {experts} experts, {moe_shape.experts_per_token(m)} a token: the GPU's layer time is "
            f"charged for {active * nl / 1e9:.2f} B active layer parameters ({active / costs.layer_params(m):.0%} of "
            f"{costs.layer_params(m) * nl / 1e9:.2f} B; measured blocks route as the model does), the copies, sums "
            "and AdamW for all of them")


def _cut_note(work: Workload, ch: StepPlan, calib: Calibration, step: float) -> str | None:
    """Layers cut into chunks: what the cut buys against whole layers, in gradient slot memory and in the step."""
    if not ch.layer_chunk_numel:
        return None
    m = work.model
    shares = costs.layer_chunk_shares(m, ch.layer_chunk_numel)
    whole = replace(ch, layer_chunk_numel=0, chunk_rows=costs.default_chunk_rows(m))
    slot, whole_slot = (costs.largest_chunk(m, c.layer_chunk_numel, c.chunk_rows) * costs.GRAD_BYTES for c in (ch, whole))
    slots, summed = ring_slots(0, m.num_layers), sums_on_host(work.world, ch.grad_route)
    shard = work.world if ch.grad_route == "reduce_scatter" and work.world > 1 else 1  # slots of one rank's shard

    def rings(b: int) -> float:  # the ranks' rings of the default slot count, and the aggregator's slots
        return (work.world * slots * b / shard + (REDUCE_SLOTS * b if summed else 0)) / GiB

    ring = (f"a gradient slot {slot / shard / 2**20:,.0f} MiB instead of {whole_slot / shard / 2**20:,.0f} MiB: "
            f"{rings(slot):.2f} GiB of gradient rings ({work.world} rank(s) x {slots} slots"
            + (f" and the aggregator's {REDUCE_SLOTS}" if summed else "") + f") instead of {rings(whole_slot):.2f} GiB")
    if work.clip and not sums_on_host(work.world, ch.grad_route):
        ring = (f"a gradient slot {slot / shard / 2**20:,.0f} MiB instead of {whole_slot / shard / 2**20:,.0f} MiB (with "
                "exact clipping the rings hold a slot per chunk: the whole model either way)")
    return (f"layers cut into {len(shares)} chunks of at most {ch.layer_chunk_numel / 1e6:,.1f} M parameters "
            f"(plan.layer_chunk_numel; experts whole): {ring}; the last layer's gradient leaves, is summed and updated "
            f"chunk by chunk: {step:.3f} s a step, {predict_step(work, whole, calib)[2]:.3f} s with whole layers")


def hosts_bound(busy: dict[str, float], step: float) -> str:
    """What bounds a step on several hosts, in words: the busiest resource, and the network where it is the
    busiest but for the copy streams that carry its collectives (they hold the PCIe copies besides)."""
    bound = max(busy, key=busy.__getitem__)
    names = {"device": "the GPU", "h2d": "the copy-in stream (PCIe copies and the all-gathers)",
             "d2h": "the copy-out stream (the reduce-scatters and PCIe copies)", "reduce": "the aggregator's sums",
             "update": "the updaters' AdamW", "host": "host memory traffic", "network": "the network between hosts"}
    rest = {k: v for k, v in busy.items() if k not in ("h2d", "d2h")}
    if bound in ("h2d", "d2h") and max(rest, key=rest.__getitem__) == "network" and busy["network"] > 0.5 * busy[bound]:
        bound = "network"
    return f"{names[bound]}, {busy[bound]:.3f} s of the {step:.3f} s step"


def _hosts_note(work: Workload, ch: StepPlan, calib: Calibration, busy: dict[str, float], step: float) -> str:
    """Several hosts: what the network between them carries per step and what it takes, and what bounds the step."""
    m, hosts = work.model, work.nnodes
    cb, gb = costs.dtype_bytes(work.compute_dtype), costs.GRAD_BYTES
    nl, h, vh = m.num_layers, m.hidden_size, costs.embedding_params(m)
    p_layer = costs.layer_params(m)
    refetched = nl - ch.resident_layers
    gathered = (nl + refetched) * p_layer + h + (vh if ch.embedding == "host" else 0) + costs.head_params(m)
    scattered = nl * p_layer + h + ((vh + costs.head_params(m)) if ch.embedding == "host" else 0)
    ag, rs = network_bytes(work, gathered * cb), network_bytes(work, scattered * gb)
    intra = (f"the GPU links among this host's {work.world} ({calib.allreduce_gbps:.0f} GB/s all-gather bus bandwidth"
             + (")" if calib.bus_gpus > 1 else ", not measured)") if work.world > 1 else "no GPU links (one GPU a host)")
    layer_ag = collective_s(work, calib, p_layer * cb)
    return (f"{hosts} hosts x {work.world} ranks, one group of {work.ranks}; this host plans its {work.global_batch} of the "
            f"{work.global_batch * hosts} sequences, its store holds 1/{hosts} of the state and its updaters update 1/{hosts} "
            f"of the parameters. Per step each host's network link carries, each way, {ag / 1e9:.1f} GB of all-gathers "
            f"(every streamed unit's weights in {work.compute_dtype}, twice but for resident layers) and {rs / 1e9:.1f} GB of "
            f"reduce-scatters (fp32 gradients): {busy.get('network', 0.0):.3f} s of the link a step (the "
            f"{calib.network_words()}); each collective at the slower of {intra} and the link (a layer's all-gather "
            f"{layer_ag * 1e3:.1f} ms alone; in a backward that re-fetches, the all-gather and the reduce-scatter share the link by their bytes). The step is bound by "
            + hosts_bound(busy, step))


def _device_time_note(work: Workload, ch: StepPlan, calib: Calibration) -> str:
    """Where the plan's GPU time comes from: the blocks measured on this GPU, or the FLOPs."""
    b, source = calib.blocks, device_time_source(work, ch, calib)
    if source != "FLOPs" and b is not None:
        when = (f"measured for this plan in {b.measured_s:.1f} s (the first plan of this shape on this host)"
                if b.measured_s else "from this host's cache")
        sizes = "" if source == "measured" else " (at the measured sizes nearest this plan's, per sequence)"
        return f"GPU time: one decoder layer and the loss timed on the {b.device_name} at this shape{sizes}, {when}"
    return (f"GPU time: the matmul FLOPs at {calib.device_tflops:.0f} TFLOP/s effective"
            + (f" (compiled layers {costs.COMPILED_LAYER_SPEEDUP:.2f}x faster)" if work.compiled else "")
            + ": no GPU blocks measured for this shape")


def _embedding_rows_note(work: Workload, ch: StepPlan, calib: Calibration) -> str:
    """What the batch's rows of an untied host-held embedding cost the step, and how they reach the GPU."""
    nbytes = embedding_rows_bytes(work, ch)
    how = (f"{calib.embedding_rows_how}, at the measured {calib.embedding_rows_gbps:.1f} GB/s" if calib.embedding_rows_gbps
           else "at the copy-in rate: how this host gathers them was not measured")
    note = f"embedding rows: {nbytes / 1e6:,.0f} MB per step ({how}): {embedding_rows_s(work, ch, calib):.3f} s before layer 0"
    if calib.embedding_rows_gather == "cpu":
        note += ("; the GPU waits while the CPU gathers them: plan.embedding = \"device\" holds the embedding "
                 "on the GPU instead, where the budget allows")
    return note


def make_plan(work: Workload, budget_bytes: int, calib: Calibration,
              allowed: dict[str, tuple] | None = None, device_layers: int | None = None) -> Plan:
    """The fastest predicted plan whose GPU memory fits budget_bytes (ties: the least compromise, then the smaller memory).

    The micro-batch: the workload's (shrunk to a divisor that fits only where it does not), or, where
    the workload leaves it to the plan (micro_batch = 0), the fastest of every divisor of the per-rank
    batch (`_choose_micro_batch`); Plan.weighed lists what was weighed.

    allowed restricts options (e.g. {"delivery": ("fp32",)} for a store without a bf16 shadow,
    {"prefetch_depth": (2,)} for a job that sets it);
    device_layers: None lets the plan hold its first layers on the GPU where that is faster, a number
    holds exactly that many (the job's plan.device_layers; 0 keeps every layer's AdamW on the host).

    The plan's memory is bounded by the layer workspace measured on the GPU (`_bounded_memory`): where
    that is larger than the model's item and the plan no longer fits, it is planned again in less."""
    search = budget_bytes
    for _ in range(4):
        try:
            plan = _plan(work, search, calib, allowed, device_layers, budget_bytes)
        except PlanError:
            if search == budget_bytes:
                raise
            break  # nothing fits in what the measurement leaves
        over = plan.device_total_bytes - budget_bytes
        if over <= 0:
            return plan
        search = min(search, _total(work, plan.step)) - over  # what the model's items may take beside it
    raise PlanError(f"no plan fits the GPU memory budget of {budget_bytes / GiB:.2f} GiB with the layer workspace "
                    f"the GPU measured at this shape ({dict(plan.device_memory)['layer workspace'] / GiB:.2f} GiB in "
                    f"the last plan tried): raise the budget, or set plan.micro_batch lower")


def _plan(work: Workload, budget_bytes: int, calib: Calibration, allowed: dict[str, tuple] | None,
          device_layers: int | None, shown_budget: int) -> Plan:
    """make_plan's search at one budget; the Plan reports `shown_budget` (the job's)."""
    low = calib.at_lowest_share(work.model.num_parameters())
    if budget_bytes > calib.device_mem_bytes:
        raise PlanError(
            f"the GPU memory budget ({budget_bytes / GiB:.2f} GiB) exceeds the memory of {calib.device_name} "
            f"({calib.device_mem_bytes / GiB:.2f} GiB): lower the budget"
        )
    if work.micro_batch:
        candidates = _fitted(work, calib, [_fit(work, base, budget_bytes) for base in _base_choices(work, allowed)])
        if not candidates:
            raise _no_fit_error(work, budget_bytes, allowed)
        best = _held(work, _least_compromise(work, candidates), budget_bytes, calib, device_layers)
        weighed = (Weighed(best.micro_batch, _guarded_step(work, best, calib, low), _total(work, best),
                           device_time_source(work, best, calib),
                           "chosen" if best.micro_batch == work.micro_batch else "chosen: the job's does not fit"),)
    else:
        best, candidates, weighed = _choose_micro_batch(work, budget_bytes, calib, allowed, device_layers)
    busy, exposed, step = predict_step(work, best, calib)
    items = _bounded_memory(work, best, calib)
    notes = []
    if work.micro_batch and best.micro_batch != work.micro_batch:
        notes.append(
            f"micro_batch {work.micro_batch} does not fit the budget; using {best.micro_batch} "
            f"(a divisor of the {work.local_batch} sequences per rank)"
        )
    clipped_step = predict_step(work, best, calib, clips=True)[2] if work.clip else 0.0
    corrected_step = predict_step(work, best, calib, clips=True, corrected=True)[2] if work.clip else 0.0
    if work.clip:
        unclipped = predict_step(replace(work, clip=False), best, calib)[2]
        notes.append(
            f"exact gradient clipping: a step whose norm stays under max_grad_norm keeps the updates it ran "
            f"during the backward ({step:.3f} s; without clipping {unclipped:.3f} s); a step after a clipped one "
            f"does not speculate: its update ({busy['update']:.3f} s) waits for the global norm, then runs in forward "
            f"order beside the next forward: {clipped_step:.3f} s; the first step that clips after one that did not "
            f"corrects its speculated updates: {corrected_step:.3f} s"
        )
    if best.delivery == "bf16":
        fp32 = min((c[0] for c in candidates if c[2].delivery == "fp32"), default=None)
        weighed_fp32 = "fp32" in dict(ALL_OPTIONS, **(allowed or {}))["delivery"]
        notes.append(
            "bf16 delivery: the store's bf16 shadow streams instead of the fp32 master (the same bits for a bf16 "
            "compute, half the bytes; 2 B/param of host memory, refreshed by the updater)"
            + (f"; the fastest fp32 plan predicts {fp32:.3f} s" if fp32 is not None else
               "; no fp32 plan fits" if weighed_fp32 else "")
        )
    if _host_limits_offload(work):
        notes.append(f"offloaded layers: at most {max(work.host_offload_cap(best.delivery), 0)}, what the host has "
                     f"room for ({_host_room_words(work)})")
    notes.append(_update_rate_note(work, best, calib))
    notes.append(_device_time_note(work, best, calib))
    notes += [n for n in (_moe_note(work), _cut_note(work, best, calib, step)) if n]
    if costs.gathers_rows(work.model, best.embedding) and work.nnodes == 1:  # several hosts: fetched whole
        notes.append(_embedding_rows_note(work, best, calib))
    workspace = _workspace_note(work, best, calib, dict(items)["layer workspace"])
    if workspace:
        notes.append(workspace)
    if work.nnodes > 1:
        notes.append(_hosts_note(work, best, calib, busy, step))
    bound = max(busy, key=busy.__getitem__)
    notes.append(f"busiest resource: {bound}")
    total = costs.device_memory_peak(items, work.world).total_bytes
    chosen = replace(best, predicted_step_s=step, predicted_clipped_step_s=clipped_step if work.clip else None,
                     predicted_corrected_step_s=corrected_step if work.clip else None, planned_device_bytes=total,
                     planned_by="planner")
    return Plan(
        step=chosen, device_memory=tuple(items), busy_s=tuple((r, busy[r]) for r in HOSTS_RESOURCES if r in busy),
        exposed_s=exposed,
        workload=work, budget_bytes=shown_budget, calibration=calib, notes=tuple(notes), weighed=weighed,
    )


def device_work_sizes(work: Workload, budget: int, allowed: dict[str, tuple] | None = None) -> list[tuple[int, int, int]]:
    """The (micro_batch, seq_tile_tokens, loss_chunk_tokens) of every plan make_plan may weigh for this
    budget: the GPU blocks to measure before planning. Memory alone decides them (no times), so they are
    known before the blocks are measured and the plan made (job.plan_for)."""
    sizes = set()
    for base in _base_choices(work, allowed):
        fits = ([_fit(work, base, budget)] if work.micro_batch else
                [_fit_at(work, base, mb, budget, grow=False) for mb in _micro_batches(work)])
        sizes |= {(ch.micro_batch, ch.seq_tile_tokens, ch.loss_chunk_tokens) for ch in fits if ch is not None}
    return sorted(sizes)
