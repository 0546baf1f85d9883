"""The planner's result: the `Plan` it returns (what it chose, the step it predicts, the memory
it charges) with the table `--plan` prints, and the micro-batches it weighed (`Weighed`)."""

from __future__ import annotations

from dataclasses import dataclass

from slidedp.planner import costs
from slidedp.planner.calibration import Calibration
from slidedp.planner.costs import GiB
from slidedp.planner.hostbound import host_lines
from slidedp.planner.workload import Workload
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
    """The step plan the planner chose (with its predictions) and what it charged it."""

    step: StepPlan  # what the ranks carry out; planned_device_bytes is device_memory's peak
    device_memory: tuple[tuple[str, int], ...]  # item -> bytes at its largest (costs.LIVE_IN says when it is live)
    busy_s: tuple[tuple[str, float], ...]  # resource -> busy seconds per step
    exposed_s: float  # predicted step minus GPU busy: the time the GPU waits
    workload: Workload
    budget_bytes: int
    calibration: Calibration
    notes: tuple[str, ...] = ()
    weighed: tuple[Weighed, ...] = ()  # the micro-batches weighed, the chosen one first

    @property
    def device_total_bytes(self) -> int:
        """The peak: costs.device_memory_peak of device_memory."""
        return self.step.planned_device_bytes or 0

    @property
    def tokens_per_s(self) -> float:
        """Tokens a second of the whole job: on several hosts, every host's (each plans its share of the batch)."""
        return self.workload.tokens_per_step * self.workload.nnodes / self.step.predicted_step_s

    def _weighed_lines(self) -> list[str]:
        """The micro-batches weighed: each one's best plan (prediction, memory, where its GPU time came
        from) and why it was not taken."""
        if not self.weighed:
            return []
        how = ("plan.micro_batch = \"auto\": the fastest predicted that fits; within 2% of it, the larger"
               if not self.workload.micro_batch else "plan.micro_batch set in the job file")
        if self.workload.clip:
            how += "; a step judged by the slower of its regimes: the norm under max_grad_norm, or after a clipped step"
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
        w, m, s = self.workload, self.workload.model, self.step
        tied = "tied" if m.tie_word_embeddings else "untied"
        lines = [
            f"SlideDP plan: {m.family} {m.num_parameters() / 1e9:.2f} B params ({m.num_layers} layers, hidden "
            f"{m.hidden_size}, vocab {m.vocab_size:,}, {tied}); {w.global_batch} x {w.seq_len} = "
            f"{w.tokens_per_step:,} tokens/step on {w.world} rank(s)"
            + (f" of this host, one of {w.nnodes} hosts ({w.global_batch * w.nnodes} x {w.seq_len} = "
               f"{w.tokens_per_step * w.nnodes:,} tokens/step on {w.ranks} ranks)" if w.nnodes > 1 else "")
            + f"; clip {'on' if w.clip else 'off'}; {w.updaters} updater(s)",
            f"calibration: {self.calibration.summary()}",
            *([f"several hosts: {self.calibration.network_words()}"] if w.nnodes > 1 else []),
            "",
            "choices",
        ]
        mb_note = ("the plan's choice" if not w.micro_batch
                   else "job's value" if s.micro_batch == w.micro_batch else f"job asked {w.micro_batch}")
        rows = [
            ("micro_batch", f"{s.micro_batch} ({mb_note}; {w.local_batch // s.micro_batch} per rank per step)"),
            ("layers", "native (SlideDP's own)" if s.layers == "native" else "transformers (the family's own "
             "layer modules, untiled)"),
            ("activations", s.activations if s.activations == "keep"
             else f"offload the first {s.offload_layers} of {m.num_layers} layers' inputs"),
            ("seq_tile_tokens", f"{s.seq_tile_tokens:,}" if s.seq_tile_tokens else "0 (untiled)"),
            ("embedding", s.embedding),
            ("delivery", s.delivery),
            ("prefetch_depth", str(s.prefetch_depth)),
            ("resident_layers", f"{s.resident_layers} of {m.num_layers}"),
            ("device_layers", f"{s.device_layers} of {m.num_layers}" + (" (AdamW on the GPU)" if s.device_layers else "")),
            ("chunk_rows", f"{s.chunk_rows:,}"),
            ("layer_chunk_numel", f"{s.layer_chunk_numel:,} ({len(costs.layer_chunk_shares(m, s.layer_chunk_numel))} "
             "chunks a layer, experts whole)" if s.layer_chunk_numel else "0 (one chunk a layer)"),
            ("loss_chunk_tokens", f"{s.loss_chunk_tokens:,}"),
            ("routes", f"params {s.param_route}, grads {s.grad_route}"),
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
            f"  {name:<32}{busy:>8.3f}   {100 * busy / s.predicted_step_s:>4.0f}%" for name, busy in self.busy_s
        ]
        lines += [
            "",
            f"predicted step {s.predicted_step_s:.3f} s (GPU busy {dict(self.busy_s)['device']:.3f} s, exposed "
            f"{self.exposed_s:.3f} s): {self.tokens_per_s:,.0f} tokens/s"
            + (f" over the {w.nnodes} hosts" if w.nnodes > 1 else "")
            + (" when the gradient norm stays under max_grad_norm" if w.clip else ""),
        ]
        tokens = w.tokens_per_step * w.nnodes
        if w.clip:
            lines.append(f"a step that clips      {s.predicted_clipped_step_s:.3f} s: "
                         f"{tokens / s.predicted_clipped_step_s:,.0f} tokens/s after a clipped step (its "
                         f"updates wait for the global norm)")
            lines.append(f"  the first that clips {s.predicted_corrected_step_s:.3f} s: "
                         f"{tokens / s.predicted_corrected_step_s:,.0f} tokens/s after one that did not "
                         f"(it speculated: its updates are corrected after the backward)")
        lines += host_lines(w, self.step, self.calibration, dict(self.busy_s))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)
