"""The planner: the fastest choices that fit a GPU memory budget, and the plan it reports.

`make_plan` searches the choices (micro-batch, activations, embedding placement, prefetch depth,
routes, tiles, resident and device-held layers), charges each with the step-time model
(step_model.predict_step) and the memory model (costs), and returns the `Plan`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from slidedp.jobrecord import sums_on_host
from slidedp.stepplan import StepPlan
from slidedp.planner import costs
from slidedp.planner.calibration import Calibration
from slidedp.planner.costs import GiB
from slidedp.planner.step_model import RESOURCES, predict_step
from slidedp.planner.workload import Choices, Workload

_LOSS_CHUNKS = (1024, 512, 256, 128)  # tokens per logits chunk, largest that fits first
_TIE = 1e-9  # relative: resident layers that change a prediction by less than this buy nothing
# Plans predicted within this share of the fastest count as equally fast (the model's own error is
# larger; docs/tuning.md, "The planner's constants").
_EQUAL = 0.02


class PlanError(ValueError):
    """No plan fits: the message names the smallest budget that would and the knob to turn."""



@dataclass(frozen=True)
class Plan:
    chunk_rows: int
    prefetch_depth: int
    micro_batch: int
    activations: str
    embedding: str
    delivery: str
    resident_layers: int
    loss_chunk_tokens: int
    gpu_memory: tuple[tuple[str, int], ...]  # item -> bytes at its largest (costs.LIVE_IN says when it is live)
    gpu_total_bytes: int  # the peak: costs.gpu_memory_peak of gpu_memory
    busy_s: tuple[tuple[str, float], ...]  # resource -> busy seconds per step
    exposed_s: float  # predicted step minus GPU busy: the time the GPU waits
    predicted_step_s: float
    tokens_per_s: float
    workload: Workload
    budget_bytes: int
    calibration: Calibration
    notes: tuple[str, ...] = ()
    param_route: str = "replicated"
    grad_route: str = "host"
    offload_layers: int = 0
    seq_tile_tokens: int = 0
    device_layers: int = 0
    predicted_clipped_step_s: float = 0.0  # exact clipping: a step after a clipped one, deferred (0: clipping off)
    predicted_corrected_step_s: float = 0.0  # exact clipping: a step that speculated, then clipped (0: off)

    @property
    def choices(self) -> Choices:
        return Choices(
            activations=self.activations, embedding=self.embedding, delivery=self.delivery,
            prefetch_depth=self.prefetch_depth, resident_layers=self.resident_layers,
            micro_batch=self.micro_batch, chunk_rows=self.chunk_rows, loss_chunk_tokens=self.loss_chunk_tokens,
            offload_layers=self.offload_layers, seq_tile_tokens=self.seq_tile_tokens, param_route=self.param_route,
            grad_route=self.grad_route, device_layers=self.device_layers,
        )

    def step_plan(self) -> StepPlan:
        """What the ranks carry out of this plan, with its prediction."""
        return StepPlan(
            micro_batch=self.micro_batch, compute_dtype=self.workload.compute_dtype, param_route=self.param_route,
            delivery=self.delivery, prefetch_depth=self.prefetch_depth, chunk_rows=self.chunk_rows,
            resident_layers=self.resident_layers, offload_layers=self.offload_layers,
            seq_tile_tokens=self.seq_tile_tokens, loss_chunk_tokens=self.loss_chunk_tokens,
            device_layers=self.device_layers, embedding=self.embedding,
            grad_route=self.grad_route, predicted_step_s=self.predicted_step_s,
            predicted_clipped_step_s=self.predicted_clipped_step_s or None,
            predicted_corrected_step_s=self.predicted_corrected_step_s or None,
            planned_device_bytes=self.gpu_total_bytes, planned_by="planner",
        )

    @staticmethod
    def _live_text(item: str) -> str:
        return ", ".join(costs.LIVE_IN[item]) if item in costs.LIVE_IN else "whole step"

    def describe(self) -> str:
        """The table `slidedp-launch --plan` prints."""
        w, m = self.workload, self.workload.model
        tied = "tied" if m.tie_word_embeddings else "untied"
        lines = [
            f"SlideDP plan: {m.family} {m.num_parameters() / 1e9:.2f} B params ({m.num_layers} layers, hidden "
            f"{m.hidden_size}, vocab {m.vocab_size:,}, {tied}); {w.global_batch} x {w.seq_len} = "
            f"{w.tokens_per_step:,} tokens/step on {w.world} rank(s); clip {'on' if w.clip else 'off'}; "
            f"{w.updaters} updater(s)",
            f"calibration: {self.calibration.summary()}",
            "",
            "choices",
        ]
        mb_note = "job's value" if self.micro_batch == w.micro_batch else f"job asked {w.micro_batch}"
        rows = [
            ("micro_batch", f"{self.micro_batch} ({mb_note}; {w.local_batch // self.micro_batch} per rank per step)"),
            ("activations", self.activations if self.activations == "keep"
             else f"offload the first {self.offload_layers} of {m.num_layers} layers' inputs"),
            ("seq_tile_tokens", f"{self.seq_tile_tokens:,}" if self.seq_tile_tokens else "0 (untiled)"),
            ("embedding", self.embedding),
            ("delivery", self.delivery),
            ("prefetch_depth", str(self.prefetch_depth)),
            ("resident_layers", f"{self.resident_layers} of {m.num_layers}"),
            ("device_layers", f"{self.device_layers} of {m.num_layers}" + (" (AdamW on the GPU)" if self.device_layers else "")),
            ("chunk_rows", f"{self.chunk_rows:,}"),
            ("loss_chunk_tokens", f"{self.loss_chunk_tokens:,}"),
            ("routes", f"params {self.param_route}, grads {self.grad_route}"),
        ]
        lines += [f"  {k:<22}{v}" for k, v in rows]
        peak = costs.gpu_memory_peak(self.gpu_memory, self.workload.world)
        lines += ["", f"GPU memory per rank{'':<23}GiB   live"]
        lines += [f"  {name:<36}{b / GiB:>8.3f}   {self._live_text(name)}" for name, b in self.gpu_memory]
        reserve = costs.allocator_reserve(self.workload.world)
        lines += [f"  {f'allocator reserve ({reserve:.0%})':<36}{peak.reserve_bytes / GiB:>8.3f}"]
        lines += [f"  {'peak, in the ' + peak.phase:<36}{self.gpu_total_bytes / GiB:>8.3f}  "
                  f"(budget {self.budget_bytes / GiB:.3f})"]
        lines += ["", f"busy per step{'':<25}s   share of step"]
        lines += [
            f"  {name:<32}{s:>8.3f}   {100 * s / self.predicted_step_s:>4.0f}%" for name, s in self.busy_s
        ]
        lines += [
            "",
            f"predicted step {self.predicted_step_s:.3f} s (GPU busy {dict(self.busy_s)['gpu']:.3f} s, exposed "
            f"{self.exposed_s:.3f} s): {self.tokens_per_s:,.0f} tokens/s"
            + (" when the gradient norm stays under max_grad_norm" if w.clip else ""),
        ]
        if w.clip:
            lines.append(f"a step that clips      {self.predicted_clipped_step_s:.3f} s: "
                         f"{w.tokens_per_step / self.predicted_clipped_step_s:,.0f} tokens/s after a clipped step (its "
                         f"updates wait for the global norm)")
            lines.append(f"  the first that clips {self.predicted_corrected_step_s:.3f} s: "
                         f"{w.tokens_per_step / self.predicted_corrected_step_s:,.0f} tokens/s after one that did not "
                         f"(it speculated: its updates are corrected after the backward)")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _update_rate_note(work: Workload, ch: Choices, calib: Calibration) -> str:
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
    low = calib.at_lowest_share(n)
    guard = "" if low is None else (
        f"; at {low.adamw_train_fraction:g} x, the lowest share measured in training, this plan predicts "
        f"{predict_step(work, ch, low)[2]:.3f} s")
    return (f"update charged at {rate:.2f} G params/s per updater: {calib.adamw_train_fraction:g} x the bare kernel "
            f"until a run of this model on this host measures its rate in training" + guard)


# --------------------------------------------------------------------------------------
# the planner


def _memory(work: Workload, ch: Choices) -> list[tuple[str, int]]:
    return costs.gpu_memory_items(
        work.model, tokens=work.local_tokens, seq_len=work.seq_len, micro_batch=ch.micro_batch or work.micro_batch,
        world=work.world, delivery=ch.delivery, activations=ch.activations, embedding=ch.embedding,
        prefetch_depth=ch.prefetch_depth, resident_layers=ch.resident_layers,
        chunk_rows=ch.chunk_rows or costs.default_chunk_rows(work.model), loss_chunk_tokens=ch.loss_chunk_tokens,
        compute_dtype=work.compute_dtype, offload_layers=ch.offload_layers, seq_tile_tokens=ch.seq_tile_tokens,
        device_layers=ch.device_layers,
    )


def _total(work: Workload, ch: Choices) -> int:
    return costs.gpu_memory_peak(_memory(work, ch), work.world).total_bytes


def _micro_batches(work: Workload) -> list[int]:
    """The job's micro-batch first, then the other divisors of the per-rank batch, largest first."""
    divisors = [d for d in range(work.local_batch, 0, -1) if work.local_batch % d == 0]
    return [work.micro_batch] + [d for d in divisors if d != work.micro_batch]


def _loss_chunks(work: Workload) -> list[int]:
    return sorted({min(c, work.local_tokens) for c in _LOSS_CHUNKS}, reverse=True)


ALL_OPTIONS: dict[str, tuple] = {
    "activations": ("keep", "offload"), "embedding": ("device", "host"), "delivery": ("fp32", "bf16"),
    "param_route": ("replicated", "sharded"), "grad_route": ("host", "reduce_scatter"), "prefetch_depth": (1, 2, 3)}
_SEQ_TILES = (0, 8192, 4096, 2048, 1024)  # tokens per MLP/norm/head tile; untiled first


def _base_choices(work: Workload, allowed: dict[str, tuple] | None = None) -> list[Choices]:
    """Every combination of the options, restricted to `allowed` (what the engine and store offer).
    One rank has no routes to choose."""
    opts = dict(ALL_OPTIONS, **(allowed or {}))
    deliveries = opts["delivery"] if work.compute_dtype == "bf16" else ("fp32",)
    param_routes = opts["param_route"] if work.world > 1 else ("replicated",)
    grad_routes = opts["grad_route"] if work.world > 1 else ("host",)
    return [
        Choices(activations=a, embedding=e, delivery=d, prefetch_depth=p, param_route=pr, grad_route=gr,
                chunk_rows=costs.default_chunk_rows(work.model))
        for e in opts["embedding"] for a in opts["activations"] for d in deliveries for p in opts["prefetch_depth"]
        for pr in param_routes for gr in grad_routes
    ]


def _seq_tiles(work: Workload) -> list[int]:
    """Untiled, then the tiles smaller than a micro-batch of the job's size (tiles run over its m x T tokens)."""
    return [t for t in _SEQ_TILES if t < work.micro_batch * work.seq_len]


def _smallest(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The smallest k in [lo, hi] with ok(k), for ok monotone (false, ..., false, true, ...); ok(hi) must hold."""
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _fewest_offloaded(work: Workload, ch: Choices, budget: int) -> Choices | None:
    """`ch` if it fits; with activations = "offload", the fewest offloaded layers (>= 1) that fit."""
    if ch.activations == "keep":
        return ch if _total(work, ch) <= budget else None
    nl = work.model.num_layers
    if _total(work, replace(ch, offload_layers=nl)) > budget:
        return None
    return replace(ch, offload_layers=_smallest(1, nl, lambda k: _total(work, replace(ch, offload_layers=k)) <= budget))


def _fit(work: Workload, base: Choices, budget: int) -> Choices | None:
    """The job's micro-batch if it fits (else the largest divisor that does), untiled if that fits
    (else the largest sequence tile that does), the largest loss chunk that fits and the fewest
    offloaded layers; then, only if nothing had to shrink, as many resident layers as the rest of
    the budget holds. (Spending memory freed by shrinking on resident layers would let a larger
    budget, where the job's micro-batch fits again, predict a slower step.)"""
    first = True
    for mb in _micro_batches(work):
        for tile in _seq_tiles(work):
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


def _fewest_resident(work: Workload, ch: Choices, calib: Calibration) -> Choices:
    """Fewest resident layers that predict the same step as the most that fit (memory left free)."""
    best = predict_step(work, ch, calib)[2]
    lo = _smallest(0, ch.resident_layers,
                   lambda k: predict_step(work, replace(ch, resident_layers=k), calib)[2] <= best * (1 + _TIE))
    return replace(ch, resident_layers=lo)


def _no_fit_error(work: Workload, budget: int, allowed: dict[str, tuple] | None = None) -> PlanError:
    """The smallest plan among the options `allowed` (a job's forced prefetch depth or embedding
    stays forced), its memory and what to change."""
    smallest = min(
        (replace(b, micro_batch=1, loss_chunk_tokens=min(_loss_chunks(work)),
                 seq_tile_tokens=_seq_tiles(work)[-1]) for b in _base_choices(work, allowed)),
        key=lambda ch: _total(work, ch),
    )
    items = _memory(work, smallest)
    peak = costs.gpu_memory_peak(items, work.world)
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
    )


def _holding(work: Workload, ch: Choices, d: int, budget: int) -> Choices | None:
    """ch with its first d layers held on the GPU, resident layers dropped (last first) until it fits; None if it cannot."""
    k = min(ch.resident_layers, work.model.num_layers - d)
    while k > 0 and _total(work, replace(ch, device_layers=d, resident_layers=k)) > budget:
        k -= 1
    cand = replace(ch, device_layers=d, resident_layers=k)
    return cand if _total(work, cand) <= budget else None


def _guarded_step(work: Workload, ch: Choices, calib: Calibration, low: Calibration | None) -> float:
    """The predicted step, or, while the updaters' rate is a guess (`low`: Calibration.at_lowest_share),
    the slower of it and the step at the lowest share of the bare kernel measured in training."""
    step = predict_step(work, ch, calib)[2]
    return step if low is None else max(step, predict_step(work, ch, low)[2])


def _with_device_layers(work: Workload, ch: Choices, budget: int, calib: Calibration) -> Choices:
    """The chosen plan with its first layers held on the GPU where that predicts a faster step.

    A held layer takes its AdamW state onto the GPU (16 B per parameter more than a resident
    layer) and gives the host its copies and its update, and the next forward its wait for the
    host (layer 0 is the tail). Room is made by dropping resident layers (their cost is a re-fetch
    in backward); more held layers are tried while they fit, and the fewest that predict the
    fastest step are kept, with the fewest resident layers that predict the same. Until a run of
    the model has measured its updaters' rate, a step is judged by the slower of its predictions
    at the charged share of the bare AdamW and at the lowest share measured: the share is what a
    first plan is most often wrong by (0.38 to 0.69 measured), and a held layer too few leaves the
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


def _forced_device_layers(work: Workload, ch: Choices, d: int, budget: int, calib: Calibration) -> Choices:
    """The job's memory.device_layers, made to fit by dropping resident layers, or a PlanError."""
    d = min(d, work.model.num_layers)
    cand = _holding(work, ch, d, budget)
    if cand is None:
        need = _total(work, replace(ch, device_layers=d, resident_layers=0))
        items = dict(_memory(work, replace(ch, device_layers=d)))
        held = items["device-held layers"] + items["held layers' gradients"]
        raise PlanError(
            f"memory.device_layers = {d} does not fit the GPU memory budget of {budget / GiB:.2f} GiB: the plan "
            f"with them needs {need / GiB:.2f} GiB (the held layers {held / GiB:.2f} GiB); lower memory.device_layers "
            f"(-1 lets the plan choose) or raise memory.gpu_budget_gib"
        )
    return _fewest_resident(work, cand, calib)


def make_plan(work: Workload, budget_bytes: int, calib: Calibration,
              allowed: dict[str, tuple] | None = None, device_layers: int | None = None) -> Plan:
    """The fastest predicted plan whose GPU memory fits budget_bytes (ties: the least compromise, then the smaller memory).

    allowed restricts options (e.g. {"delivery": ("fp32",)} for a store without a bf16 shadow,
    {"prefetch_depth": (2,)} for a job that sets it);
    device_layers: None lets the plan hold its first layers on the GPU where that is faster, a number
    holds exactly that many (the job's memory.device_layers; 0 keeps every layer's AdamW on the host)."""
    if budget_bytes > calib.gpu_mem_bytes:
        raise PlanError(
            f"the GPU memory budget ({budget_bytes / GiB:.2f} GiB) exceeds the memory of {calib.device_name} "
            f"({calib.gpu_mem_bytes / GiB:.2f} GiB): lower the budget"
        )
    candidates: list[tuple[float, int, Choices]] = []
    for base in _base_choices(work, allowed):
        ch = _fit(work, base, budget_bytes)
        if ch is not None:
            ch = _fewest_resident(work, ch, calib)
            candidates.append((predict_step(work, ch, calib)[2], _total(work, ch), ch))
    if not candidates:
        raise _no_fit_error(work, budget_bytes, allowed)
    fastest = min(step for step, _, _ in candidates)
    nl = work.model.num_layers

    def least_compromise(c: tuple[float, int, Choices]) -> tuple:
        """Among equally fast plans: the largest micro-batch, the largest loss chunk, the largest tile,
        the fewest offloaded layers (costs the model leaves out: smaller matmuls, more launches, host
        traffic), then the faster prediction, then the least memory."""
        ch = c[2]
        return (-(ch.micro_batch or work.micro_batch), -ch.loss_chunk_tokens, -(ch.seq_tile_tokens or 1 << 62),
                ch.offloaded(nl), c[0], c[1])

    _, _, best = min((c for c in candidates if c[0] <= fastest * (1 + _EQUAL)), key=least_compromise)
    if device_layers is None:
        best = _with_device_layers(work, best, budget_bytes, calib)
    elif device_layers > 0:
        best = _forced_device_layers(work, best, device_layers, budget_bytes, calib)
    busy, exposed, step = predict_step(work, best, calib)
    items = _memory(work, best)
    notes = []
    if best.micro_batch != work.micro_batch:
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
            f"does not speculate: it waits for the global norm, so its update ({busy['update']:.3f} s) is exposed: "
            f"{clipped_step:.3f} s; the first step that clips after one that did not corrects its speculated "
            f"updates: {corrected_step:.3f} s"
        )
    if best.delivery == "bf16":
        fp32 = min((c[0] for c in candidates if c[2].delivery == "fp32"), default=None)
        notes.append(
            "bf16 delivery needs the store's bf16 shadow (2 B/param of host memory, written by the updater)"
            + (f"; the fastest fp32 plan predicts {fp32:.3f} s" if fp32 is not None else "; no fp32 plan fits")
        )
    notes.append(_update_rate_note(work, best, calib))
    bound = max(busy, key=busy.__getitem__)
    notes.append(f"busiest resource: {bound}")
    return Plan(
        chunk_rows=best.chunk_rows or costs.default_chunk_rows(work.model), prefetch_depth=best.prefetch_depth,
        micro_batch=best.micro_batch or work.micro_batch, activations=best.activations, embedding=best.embedding,
        delivery=best.delivery, resident_layers=best.resident_layers, loss_chunk_tokens=best.loss_chunk_tokens,
        offload_layers=best.offloaded(work.model.num_layers), seq_tile_tokens=best.seq_tile_tokens,
        param_route=best.param_route, grad_route=best.grad_route, device_layers=best.device_layers,
        gpu_memory=tuple(items), gpu_total_bytes=costs.gpu_memory_peak(items, work.world).total_bytes,
        busy_s=tuple((r, busy[r]) for r in RESOURCES), exposed_s=exposed, predicted_step_s=step,
        tokens_per_s=work.tokens_per_step / step, workload=work, budget_bytes=budget_bytes, calibration=calib,
        notes=tuple(notes), predicted_clipped_step_s=clipped_step, predicted_corrected_step_s=corrected_step,
    )
