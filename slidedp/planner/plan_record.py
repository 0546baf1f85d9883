"""The planner's result: the `Plan` it returns (what it chose, the step it predicts, the memory
it charges) with the table `--plan` prints, and the micro-batches it weighed (`Weighed`)."""

from __future__ import annotations

from dataclasses import dataclass

from slidedp.planner import costs
from slidedp.planner.calibration import Calibration
from slidedp.planner.costs import GiB
from slidedp.planner.hostbound import host_lines
from slidedp.planner.workload import Choices, Workload
from slidedp.stepplan import StepPlan


@dataclass(frozen=True)
class Weighed:
    """One micro-batch the planner weighed: the best plan at it, or why there is none."""

    micro_batch: int
    predicted_step_s: float | None  # None: no plan fits at this micro-batch
    device_bytes: int  # that plan's GPU memory peak, or the smallest plan's need where none fits
    device_time: str  # "measured" on the GPU at its sizes, "nearby" (at other sizes of the shape), or "FLOPs"
    verdict: str  # "chosen", how much slower, or why it was rejected


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
    device_memory: tuple[tuple[str, int], ...]  # item -> bytes at its largest (costs.LIVE_IN says when it is live)
    device_total_bytes: int  # the peak: costs.device_memory_peak of device_memory
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
    weighed: tuple[Weighed, ...] = ()  # the micro-batches weighed, the chosen one first

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
            planned_device_bytes=self.device_total_bytes, planned_by="planner",
        )

    def _weighed_lines(self) -> list[str]:
        """The micro-batches weighed: each one's best plan (prediction, memory, where its GPU time came
        from) and why it was not taken."""
        if not self.weighed:
            return []
        how = ("train.micro_batch = 0: the fastest predicted that fits; within 2% of it, the larger"
               if not self.workload.micro_batch else "train.micro_batch set in the job file")
        lines = ["", f"micro-batches weighed ({how})",
                 f"  {'micro_batch':<13}{'predicted step':>15}{'GPU memory':>13}   {'GPU time':<10}verdict"]
        for c in self.weighed:
            step = f"{c.predicted_step_s:.3f} s" if c.predicted_step_s is not None else "-"
            lines.append(f"  {c.micro_batch:<13}{step:>15}{c.device_bytes / GiB:>9.2f} GiB   "
                         f"{c.device_time:<10}{c.verdict}")
        return lines

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
        mb_note = ("the plan's choice" if not w.micro_batch
                   else "job's value" if self.micro_batch == w.micro_batch else f"job asked {w.micro_batch}")
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
        lines += self._weighed_lines()
        peak = costs.device_memory_peak(self.device_memory, self.workload.world)
        lines += ["", f"GPU memory per rank{'':<23}GiB   live"]
        lines += [f"  {name:<36}{b / GiB:>8.3f}   {self._live_text(name)}" for name, b in self.device_memory]
        reserve = costs.allocator_reserve(self.workload.world)
        lines += [f"  {f'allocator reserve ({reserve:.0%})':<36}{peak.reserve_bytes / GiB:>8.3f}"]
        lines += [f"  {'peak, in the ' + peak.phase:<36}{self.device_total_bytes / GiB:>8.3f}  "
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
        lines += host_lines(w, self.choices, self.calibration, dict(self.busy_s))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)
