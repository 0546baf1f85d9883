"""The step-time model and the planner.

The model replays one rank's schedule (ARCHITECTURE.md, "The step") as a small event
simulation over five resources, each a FIFO server:

  h2d     the copy-in stream: parameter chunks (prefetched `prefetch_depth` chunks ahead),
          embedding rows, offloaded activations
  gpu     compute: forward, loss, recompute + backward, the GPU AdamW of a GPU-resident embedding
  d2h     the copy-out stream: fp32 chunk gradients, offloaded activations
  reduce  the aggregator summing the ranks' gradients of a chunk (nothing to do with one rank)
  update  the updater pool: K processes running the fused CPU AdamW, one chunk at a time each

A chunk's H2D in step s+1 waits for its update in step s (the version gate), so whatever the
CPU has not finished when the GPU wants a chunk back is exposed: the tail (layer 0 and the
embedding rows the next batch needs). With exact gradient clipping the model predicts two
steps: one whose norm stays under max_grad_norm keeps its speculative updates, overlapped with
the backward as without clipping (but every gradient is copied into the reduction space, and
device-held units wait for the norm); one that clips has every update wait for the global
norm, i.e. the last gradient (charged as if the norm crossed the threshold at the first chunk:
no speculated chunk to correct). A few steps are
simulated and the steady-state period is the predicted step time. Ranks are symmetric, so
one rank stands for all; `world` enters through the per-rank batch and the reduction.

What the model leaves out (so the measured step may be a little longer): host memory
bandwidth shared by DMA, aggregator and updaters (charged as a fixed share of the bare AdamW
rate, Calibration.adamw_train_fraction, until a run on the host has measured the updaters' rate
in training, which the next plan charges instead);
kernel-launch and Python overheads; the efficiency loss of small micro-batches; messages
and version polling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from slidedp.jobrecord import sums_on_host
from slidedp.model.config import ModelConfig
from slidedp.planner import costs
from slidedp.planner.calibration import Calibration, gpu_shape
from slidedp.planner.costs import GiB

RESOURCES = ("gpu", "h2d", "d2h", "reduce", "update")
_STEPS = 8  # simulated steps; the period is averaged over the last _AVERAGE of them
_AVERAGE = 4
_LOSS_CHUNKS = (1024, 512, 256, 128)  # tokens per logits chunk, largest that fits first
_TIE = 1e-9  # relative: resident layers that change a prediction by less than this buy nothing
# Plans predicted within 2% of the fastest count as equally fast when choosing among them: the
# model's own error is larger, and what it leaves out (smaller matmuls, launches, host traffic)
# decides instead. At 65,536 tokens on one H200 (24 GiB), the strictly fastest plan, 1 ms ahead,
# ran 128-token loss chunks at 23.96 of 24 GiB; its step took 8.17 s against 5.58 predicted.
_EQUAL = 0.02


class PlanError(ValueError):
    """No plan fits: the message names the smallest budget that would and the knob to turn."""


@dataclass(frozen=True)
class Workload:
    model: ModelConfig
    global_batch: int  # sequences per optimizer step, all ranks together
    seq_len: int
    world: int
    micro_batch: int  # sequences per forward/backward pass on one rank
    compute_dtype: str = "bf16"
    clip: bool = True  # exact global-norm gradient clipping (max_grad_norm > 0)
    updaters: int = 1  # CPU updater processes (K)
    compiled: bool = False  # the worker runs the layers' pointwise kernels compiled (train.compile)

    def __post_init__(self) -> None:
        for name in ("global_batch", "seq_len", "world", "micro_batch", "updaters"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"workload {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.global_batch % self.world:
            raise ValueError(f"global_batch ({self.global_batch}) must be a multiple of world ({self.world})")
        if self.local_batch % self.micro_batch:
            raise ValueError(
                f"micro_batch ({self.micro_batch}) must divide the sequences per rank "
                f"(global_batch / world = {self.local_batch})"
            )
        costs.dtype_bytes(self.compute_dtype)

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.world

    @property
    def local_tokens(self) -> int:
        return self.local_batch * self.seq_len

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


@dataclass(frozen=True)
class Choices:
    """What the planner decides; everything `predict_step` needs besides the workload."""

    activations: str = "keep"  # "keep" on the GPU | "offload" to pinned host memory
    embedding: str = "host"  # "host" (rows gathered, CPU update) | "gpu" (resident, GPU AdamW)
    delivery: str = "fp32"  # what crosses PCIe to the GPU: fp32 master | bf16 shadow
    prefetch_depth: int = 1
    resident_layers: int = 0  # last layers kept on the GPU from forward to backward
    device_layers: int = 0  # first layers held on the GPU with their AdamW state (no copies, GPU AdamW)
    micro_batch: int | None = None  # None: the workload's
    chunk_rows: int | None = None  # None: as many rows as one decoder layer has parameters
    loss_chunk_tokens: int = 1024
    offload_layers: int | None = None  # with activations = "offload": the first layers offloaded (None: all)
    seq_tile_tokens: int = 0  # MLP/norm/head tile along the sequence; 0: untiled
    param_route: str = "replicated"  # | "sharded": 1/N per rank over PCIe, all-gathered over the GPU links
    grad_route: str = "host"  # | "reduce_scatter": summed on the GPUs, 1/N per rank over PCIe

    def __post_init__(self) -> None:
        if self.activations not in ("keep", "offload"):
            raise ValueError(f"activations must be 'keep' or 'offload', got {self.activations!r}")
        if self.param_route not in ("replicated", "sharded"):
            raise ValueError(f"param_route must be 'replicated' or 'sharded', got {self.param_route!r}")
        if self.grad_route not in ("host", "reduce_scatter"):
            raise ValueError(f"grad_route must be 'host' or 'reduce_scatter', got {self.grad_route!r}")
        if self.embedding not in ("host", "gpu"):
            raise ValueError(f"embedding must be 'host' or 'gpu', got {self.embedding!r}")
        costs.delivery_bytes(self.delivery)
        if not 1 <= self.prefetch_depth <= 8:
            raise ValueError(f"prefetch_depth must be between 1 and 8, got {self.prefetch_depth}")
        if self.seq_tile_tokens < 0:
            raise ValueError(f"seq_tile_tokens must be >= 0, got {self.seq_tile_tokens}")
        if self.device_layers < 0:
            raise ValueError(f"device_layers must be >= 0, got {self.device_layers}")

    def offloaded(self, num_layers: int) -> int:
        """How many layers' inputs wait in host memory."""
        if self.activations == "keep":
            return 0
        return num_layers if self.offload_layers is None else min(self.offload_layers, num_layers)


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
    predicted_clipped_step_s: float = 0.0  # exact clipping: a step that clips (0: clipping off)

    @property
    def choices(self) -> Choices:
        return Choices(
            activations=self.activations, embedding=self.embedding, delivery=self.delivery,
            prefetch_depth=self.prefetch_depth, resident_layers=self.resident_layers,
            micro_batch=self.micro_batch, chunk_rows=self.chunk_rows, loss_chunk_tokens=self.loss_chunk_tokens,
            offload_layers=self.offload_layers, seq_tile_tokens=self.seq_tile_tokens, param_route=self.param_route,
            grad_route=self.grad_route, device_layers=self.device_layers,
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
                         f"{w.tokens_per_step / self.predicted_clipped_step_s:,.0f} tokens/s (its updates wait for the "
                         f"global norm)")
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
# the schedule as tasks


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
    gpu_s: float = 0.0
    d2h_s: float = 0.0
    gate: tuple[str, ...] = ()  # jobs of the previous step that must be done before the copy-in
    jobs: tuple[_Job, ...] = ()
    clip_gated: bool = False  # an optimizer step on the GPU: needs the global norm when clipping


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


def _tasks(work: Workload, ch: Choices, calib: Calibration) -> list[_Task]:
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
    bwd_in, bwd_out = _rates(calib, both=offload or k + held < nl, ranks=n)  # backward re-fetches, if any
    cb = costs.dtype_bytes(work.compute_dtype)

    def params_in(params: float, rate: float) -> float:
        """Copy-stream time of `params` parameters: whole over PCIe, or 1/N over PCIe then the all-gather."""
        if ch.param_route == "replicated" or n == 1:
            return params * db / rate
        return params * db / n / rate + params * cb * (n - 1) / n / bus

    def grads_out(params: float, rate: float) -> float:
        """Copy-out time of `params` fp32 gradients: whole, or the reduce-scatter then 1/N over PCIe."""
        if ch.grad_route == "host" or n == 1:
            return params * gb / rate
        return params * gb / n / rate + params * gb * (n - 1) / n / bus

    flops = calib.gpu_tflops * 1e12
    g_fwd = tokens * costs.layer_forward_flops_per_token(m, work.seq_len) / flops
    if work.compiled:
        g_fwd /= costs.COMPILED_LAYER_SPEEDUP
    g_loss = tokens * costs.head_step_flops_per_token(m) / flops
    summed = sums_on_host(work.world, ch.grad_route)
    upd_scale = costs.update_bytes_per_param(ch.delivery) / 28.0 / calib.update_params_per_s(m.num_parameters(), summed)
    red_scale = gb * costs.reduce_traffic_factor(work.world, ch.grad_route, work.clip) / (
        calib.reduce_rate_gbps(m.num_parameters(), summed) * 1e9)

    def job(name: str, params: float) -> _Job:
        return _Job(name, params * red_scale, params * upd_scale)

    host_emb = ch.embedding == "host"
    rows = costs.row_blocks(v, ch.chunk_rows or costs.default_chunk_rows(m))
    tasks: list[_Task] = []
    # ---- forward
    if host_emb:
        tasks.append(_Task("embedding rows", h2d_s=tokens * h * db / fwd_in, gate=("embedding:next",)))
    for c in range(nl):
        tasks.append(_Task(
            f"layer {c} fwd", h2d_s=params_in(p_layer, fwd_in) if c >= held else 0.0, gpu_s=g_fwd,
            d2h_s=act / fwd_out if c < off else 0.0, gate=(f"layer {c}",) if c >= held else (),
        ))
    # ---- loss: the final norm and the head (fetched in row blocks when it lives on the host)
    norm_in, norm_job = params_in(h, fwd_in), job("norm", h)
    if host_emb:
        for j, r in enumerate(rows):
            gate = ("embedding:next", f"embedding:{j}") if m.tie_word_embeddings else (f"head:{j}",)
            tasks.append(_Task(
                f"head block {j} in", h2d_s=params_in(r * h, fwd_in) + (norm_in if j == 0 else 0.0),
                gate=gate + (("norm",) if j == 0 else ()),
            ))
        tasks.append(_Task("loss", gpu_s=g_loss, d2h_s=grads_out(h, bwd_out), jobs=(norm_job,)))
        if not m.tie_word_embeddings:  # an untied head's gradient is complete now: out it goes
            tasks += [
                _Task(f"head block {j} grad", d2h_s=grads_out(r * h, bwd_out), jobs=(job(f"head:{j}", r * h),))
                for j, r in enumerate(rows)
            ]
    else:
        tasks.append(_Task("loss", h2d_s=norm_in, gpu_s=g_loss, d2h_s=grads_out(h, bwd_out), gate=("norm",), jobs=(norm_job,)))
    # ---- backward
    for c in reversed(range(nl)):
        fetch = (0.0 if c >= nl - k or c < held else params_in(p_layer, bwd_in)) + (act / bwd_in if c < off else 0.0)
        tasks.append(_Task(
            f"layer {c} bwd", h2d_s=fetch, gpu_s=3.0 * g_fwd, d2h_s=grads_out(p_layer, bwd_out) if c >= held else 0.0,
            jobs=(job(f"layer {c}", p_layer),) if c >= held else (),
        ))
    if host_emb:
        # the whole embedding gradient leaves the GPU; the updater first updates the rows the
        # next batch needs (at most one per token of the global batch), then the rest by block
        need = min(v, work.tokens_per_step)
        emb_jobs = (job("embedding:next", need * h),) + tuple(
            job(f"embedding:{j}", r * h * (1 - need / v)) for j, r in enumerate(rows)
        )
        tasks += [
            _Task(f"embedding block {j} grad", d2h_s=grads_out(r * h, bwd_out), jobs=emb_jobs if j == len(rows) - 1 else ())
            for j, r in enumerate(rows)
        ]
    gpu_held = held * p_layer + (0 if host_emb else costs.embedding_params(m) + costs.head_params(m))
    if gpu_held:  # the device-held units: gradients all-reduced among ranks, AdamW on the GPU, after backward
        allreduce = 2 * (work.world - 1) / work.world * gpu_held * gb / (calib.allreduce_gbps * 1e9)
        tasks.append(_Task("device-held AdamW (GPU)", gpu_s=gpu_held / calib.gpu_adamw_params_per_s + allreduce,
                           clip_gated=True))
    # what a run of this model with GPU work of this shape measured of it, against the rates above
    scale = calib.gpu_scale(m.num_parameters(), gpu_work_shape(work, ch))
    return [replace(t, gpu_s=t.gpu_s * scale) for t in tasks] if scale != 1.0 else tasks


def gpu_work_shape(work: Workload, ch: Choices) -> str:
    """The shape of a plan's GPU work, as a calibration keeps the GPU time a run of it measured."""
    return gpu_shape((ch.micro_batch or work.micro_batch) * work.seq_len, ch.loss_chunk_tokens, ch.seq_tile_tokens,
                     work.world, f"params {ch.param_route}, grads {ch.grad_route}")


def _period(tasks: list[_Task], depth: int, updaters: int, clip: bool, clips: bool) -> float:
    """Steady-state step time of the schedule: simulate a few steps, average the last ones.
    clip: exact clipping (device-held units wait for the norm); clips: every step clips (the host
    updates wait for the norm too)."""
    h2d_free = gpu_free = d2h_free = reduce_free = 0.0
    servers = [0.0] * updaters
    fetch_starts: list[float] = []  # compute start of each task that copies in, in order
    done: dict[str, float] = {}  # job -> time its update finished in the previous step
    ends: list[float] = []
    for _ in range(_STEPS):
        released: list[tuple[_Job, float]] = []
        for t in tasks:
            ready = max([done.get(g, 0.0) for g in t.gate], default=0.0)
            # depth + 1 slots: this copy may start once the fetch `depth` back has begun computing
            slot = fetch_starts[-depth] if len(fetch_starts) >= depth else 0.0
            h2d_end = max(h2d_free, ready, slot) + t.h2d_s
            if t.h2d_s > 0:
                h2d_free = h2d_end
            start = max(gpu_free, h2d_end)
            if t.clip_gated and clip and released:
                start = max(start, max(r for _, r in released))
            if t.h2d_s > 0:
                fetch_starts.append(start)
            gpu_free = start + t.gpu_s
            out = gpu_free
            if t.d2h_s > 0:
                d2h_free = max(d2h_free, gpu_free) + t.d2h_s
                out = d2h_free
            for j in t.jobs:
                if j.reduce_s > 0:
                    reduce_free = max(reduce_free, out) + j.reduce_s
                    released.append((j, reduce_free))
                else:
                    released.append((j, out))
        norm_known = max((r for _, r in released), default=0.0) if clip and clips else 0.0
        done = {}
        for j, r in released:
            s = min(range(updaters), key=servers.__getitem__)
            servers[s] = max(servers[s], r, norm_known) + j.update_s
            done[j.name] = servers[s]
        ends.append(gpu_free)
    return (ends[-1] - ends[-1 - _AVERAGE]) / _AVERAGE


def predict_step(work: Workload, choices: Choices, calib: Calibration,
                 clips: bool = False) -> tuple[dict[str, float], float, float]:
    """The model: (busy seconds per resource per step, exposed seconds, predicted step seconds).
    With exact clipping (work.clip): of a step whose norm stays under the threshold, or (clips) of one
    that clips."""
    if not 0 <= choices.resident_layers <= work.model.num_layers:
        raise ValueError(f"resident_layers must be between 0 and {work.model.num_layers}, got {choices.resident_layers}")
    if choices.micro_batch is not None and work.local_batch % choices.micro_batch:
        raise ValueError(f"micro_batch ({choices.micro_batch}) must divide the sequences per rank ({work.local_batch})")
    tasks = _tasks(work, choices, calib)
    jobs = [j for t in tasks for j in t.jobs]
    busy = {
        "gpu": sum(t.gpu_s for t in tasks),
        "h2d": sum(t.h2d_s for t in tasks),
        "d2h": sum(t.d2h_s for t in tasks),
        "reduce": sum(j.reduce_s for j in jobs),
        "update": sum(j.update_s for j in jobs) / work.updaters,
    }
    step = _period(tasks, choices.prefetch_depth, work.updaters, work.clip, clips)
    return busy, step - busy["gpu"], step


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
    "activations": ("keep", "offload"), "embedding": ("gpu", "host"), "delivery": ("fp32", "bf16"),
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
    if work.clip:
        unclipped = predict_step(replace(work, clip=False), best, calib)[2]
        notes.append(
            f"exact gradient clipping: a step whose norm stays under max_grad_norm keeps the updates it ran "
            f"during the backward ({step:.3f} s; without clipping {unclipped:.3f} s); a step that clips waits "
            f"for the global norm, so its update ({busy['update']:.3f} s) is exposed: {clipped_step:.3f} s"
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
        notes=tuple(notes), predicted_clipped_step_s=clipped_step,
    )
