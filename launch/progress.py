"""What the user sees while a job runs: a progress line per step, and metrics.jsonl in the run dir.

On a terminal, one tqdm progress bar redrawn in place, with the job's log lines written above
it (logging_redirect_tqdm) so that none breaks it; anywhere else (journald, CI, a pipe) plain
`key=value` lines that grep and awk read. Every committed step appends one JSON object to
<run dir>/metrics.jsonl; METRICS below is its schema, the one place that says what each key
holds (a test checks every line of a real run against it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TextIO

import psutil
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from slidedp.protocol import StepDone, WorkerStats
from slidedp.store.shm import list_store_segments

log = logging.getLogger("slidedp.launcher")


@dataclass(frozen=True)
class MetricField:
    type: type  # int, float, bool
    meaning: str
    nullable: bool = False
    over_ranks: str = ""  # a WorkerStats field: how the ranks' values combine ("max" or "sum")


# One record per committed step. Times are seconds; "busy" is time a resource worked for
# the step, "wait_*" is time a worker stood still (exposed, not hidden behind compute).
METRICS: dict[str, MetricField] = {
    "step": MetricField(int, "the optimizer step that committed (0-based)"),
    "time": MetricField(float, "wall clock (Unix seconds) when the launcher saw the step commit"),
    "loss": MetricField(float, "mean loss over the trained target tokens of the global batch; null if not finite",
                        True),
    "eval_loss": MetricField(float, "mean loss over the trained target tokens of data.eval_path on the weights after "
                                    "this step; null where no eval ran (train.eval_every)", True),
    "grad_norm": MetricField(float, "global gradient norm before clipping; null if not finite", True),
    "lr": MetricField(float, "learning rate of the step"),
    "skipped": MetricField(bool, "the step was skipped everywhere (a rank saw a non-finite loss, or the gradient "
                                 "norm was not finite)"),
    "tokens": MetricField(int, "target tokens per step (global_batch x seq_len)"),
    "trained_tokens": MetricField(int, "target tokens of the step the loss is on (not masked, not padding)"),
    "step_s": MetricField(float, "time between this commit and the previous one (the first includes start-up)"),
    "tokens_per_s": MetricField(float, "tokens / step_s", True),
    "worker_step_s": MetricField(float, "the slowest rank's own step time (forward to last gradient sent)"),
    "predicted_step_s": MetricField(float, "the plan's predicted step time (of a step that clips, for one that did); "
                                           "null on CPU (no plan)", True),
    "ranks": MetricField(int, "ranks whose stats arrived for the step"),
    "forward_s": MetricField(float, "forward time, slowest rank", True, "max"),
    "backward_s": MetricField(float, "backward time (recompute included), slowest rank", True, "max"),
    "wait_version_s": MetricField(float, "time blocked until a chunk's update landed (updaters behind)", True, "max"),
    "wait_slot_s": MetricField(float, "time blocked for a free gradient slot (aggregator/updaters behind)", True, "max"),
    "wait_loss_s": MetricField(float, "time blocked on the other ranks' loss (non-finite check)", True, "max"),
    "write_back_s": MetricField(float, "time the workers spent writing device-held units back to the store after "
                                       "the step (at a checkpoint and at the end; inside step_s), slowest rank", True,
                                "max"),
    "h2d_bytes": MetricField(int, "bytes copied host to device, all ranks", True, "sum"),
    "device_peak_bytes": MetricField(int, "peak GPU memory allocated by one rank (0 on CPU)", True, "max"),
    "device_reserved_peak_bytes": MetricField(int, "peak GPU memory the caching allocator reserved for one rank, what "
                                                "memory.device_budget_gib caps (0 on CPU)", True, "max"),
    "device_alloc_retries": MetricField(int, "times the GPU's caching allocator reached memory.device_budget_gib in "
                                             "the step and freed its cache to retry, most of one rank: each "
                                             "synchronizes the device, so no copy overlaps compute across it (0 on "
                                             "CPU)", True, "max"),
    "planned_device_bytes": MetricField(int, "the plan's GPU memory peak per rank, CUDA context included; null on CPU "
                                          "(no plan)", True),
    "update_busy_s": MetricField(float, "updater busy time of the step's chunks, summed over processes"),
    "clipped": MetricField(bool, "the global gradient norm was over train.max_grad_norm: the update was clipped"),
    "speculated": MetricField(bool, "the step was allowed to update chunks before its gradient norm was known (exact "
                                    "clipping: the last committed step did not clip; false: every update waited)"),
    "speculated_chunks": MetricField(int, "host chunks updated before the step's gradient norm was known (exact "
                                          "clipping: speculated, then validated against the norm)"),
    "corrected_chunks": MetricField(int, "of the speculated chunks, those redone with the clipped gradient (or undone: "
                                         "a non-finite gradient skipped the step)"),
    "correction_s": MetricField(float, "updater busy time of those corrections, summed over processes (inside "
                                       "update_busy_s)"),
    "reduce_busy_s": MetricField(float, "aggregator busy time summing the step's gradients"),
    "d2h_bytes": MetricField(int, "bytes of gradients copied device to host, all ranks", True, "sum"),
    "host_bytes_per_param": MetricField(float, "host memory read and written in the step per parameter of the model: "
                                               "the ranks' parameter copies in (h2d_bytes) and gradients out "
                                               "(d2h_bytes), the updaters' AdamW passes and shadow refresh and the "
                                               "aggregator's sums (slidedp/hosttraffic.py); null where the parameter "
                                               "count is not known", True),
    "host_rss_bytes": MetricField(int, "private resident memory of the launcher and all its child processes "
                                       "(the shared store is counted once, in shm_bytes)"),
    "shm_bytes": MetricField(int, "bytes of the store's shared-memory segments (state, manifest, gradient rings)"),
}


def check_record(record: dict[str, Any]) -> list[str]:
    """What is wrong with one metrics.jsonl record against METRICS ([] when nothing)."""
    problems = [f"unknown key {k!r}" for k in record if k not in METRICS]
    for key, f in METRICS.items():
        if key not in record:
            problems.append(f"missing key {key!r}")
            continue
        v = record[key]
        if v is None:
            if not f.nullable:
                problems.append(f"{key} is null")
            continue
        ok = isinstance(v, bool) if f.type is bool else (
            isinstance(v, (int, float) if f.type is float else f.type) and not isinstance(v, bool))
        if not ok:
            problems.append(f"{key} = {v!r} is not {f.type.__name__}")
        elif f.type is float and not math.isfinite(v):
            problems.append(f"{key} = {v!r} is not finite")
    return problems


def process_tree_private_bytes(pid: int | None = None) -> int:
    """Private resident memory (RSS minus file-backed and shared pages) of a process and its descendants.

    RSS alone would count the store once per process that maps it; shm_bytes counts it once.
    """
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            m = p.memory_info()
        except psutil.Error:  # exited between the listing and the read
            continue
        total += max(0, m.rss - getattr(m, "shared", 0))
    return total


def device_side(stats: WorkerStats) -> float:
    """A rank's own step less its own waits for the host (updates, gradient slots, the loss) and its
    write-back of device-held units (a checkpoint's or the job end's work, not the step's)."""
    return stats.step_s - stats.wait_version_s - stats.wait_slot_s - stats.wait_loss_s - stats.write_back_s


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def make_record(step: int, done: StepDone, stats: dict[int, WorkerStats], lr: float, tokens: int, step_s: float,
                predicted_step_s: float | None, host_private: int, shm: int,
                planned_device_bytes: int | None = None, eval_loss: float | None = None,
                trained_tokens: int | None = None, params: int = 0) -> dict[str, Any]:
    """params: the model's parameter count (0: not known, host_bytes_per_param is null)."""
    worker_fields = {f.name for f in fields(WorkerStats)}
    record: dict[str, Any] = {
        "step": step, "time": time.time(), "loss": _finite(done.loss), "grad_norm": _finite(done.grad_norm),
        "eval_loss": None if eval_loss is None else _finite(eval_loss),
        "lr": lr, "skipped": bool(done.skipped), "tokens": tokens, "step_s": step_s,
        "trained_tokens": tokens if trained_tokens is None else trained_tokens,
        "tokens_per_s": tokens / step_s if step_s > 0 else None,
        "worker_step_s": max((s.step_s for s in stats.values()), default=step_s),
        "predicted_step_s": predicted_step_s, "planned_device_bytes": planned_device_bytes, "ranks": len(stats),
        "update_busy_s": done.update_s, "reduce_busy_s": done.reduce_s, "clipped": bool(done.clipped),
        "speculated": bool(done.speculate), "speculated_chunks": done.speculated, "corrected_chunks": done.corrected, "correction_s": done.correct_s,
        "host_rss_bytes": host_private, "shm_bytes": shm,
    }
    for key, f in METRICS.items():
        if f.over_ranks and key in worker_fields:
            values = [getattr(s, key) for s in stats.values()]
            record[key] = (sum(values) if f.over_ranks == "sum" else max(values)) if values else None
    moved = done.host_bytes + sum(s.h2d_bytes + s.d2h_bytes for s in stats.values())
    record["host_bytes_per_param"] = moved / params if params else None
    return record


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _rate(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e4 else f"{x:.0f}"


class Progress:
    """Follows the committed steps: metrics.jsonl, a progress bar (terminal) or key=value lines (anything else)."""

    def __init__(self, store: str, tokens_per_step: int, stream: TextIO | None = None, log_every: int = 1,
                 tensorboard: bool = False) -> None:
        self.store = store
        self.tensorboard = tensorboard
        self.events = None  # the TensorBoard writer, from begin()
        self.tokens_per_step = tokens_per_step
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.log_every = max(1, log_every)
        self.metrics: TextIO | None = None
        self.run_dir: Path | None = None
        self.t_launch = self.t_last = time.perf_counter()
        self.start = self.end_step = 0
        self.first: list[float] = []
        self.recent: list[float] = []
        self.predicted_step_s: float | None = None
        self.predicted_clipped_step_s: float | None = None  # exact clipping: of a step after a clipped one
        self.predicted_corrected_step_s: float | None = None  # exact clipping: of one that speculated, then clipped
        self.planned_device_bytes: int | None = None
        self.params = 0  # the model's parameters: host_bytes_per_param is per parameter (0: not known)
        self.update_busy_s: list[float] = []  # per committed step: the updaters' summed AdamW time
        self.reduce_busy_s: list[float] = []  # per committed step: the aggregator's time summing gradients
        self.device_side_s: list[float] = []  # per committed step: the slowest rank's step less its waits for the host
        self.records: list[dict[str, Any]] = []  # this run's metrics records, for the summary at the end
        self._bar: tqdm | None = None
        self._redirect = contextlib.ExitStack()

    def begin(self, start: int, end: int, run_dir: Path) -> None:
        self.start, self.end_step, self.run_dir = start, end, run_dir
        self.metrics = open(run_dir / "metrics.jsonl", "a")
        if self.tensorboard:
            from .tensorboard import EventWriter

            self.events = EventWriter(run_dir)
        self.t_last = time.perf_counter()
        if self.tty and end > start:
            self._bar = tqdm(total=end, initial=start, file=self.stream, dynamic_ncols=True, leave=True,
                             bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}{postfix}", desc="steps")
            self._redirect.enter_context(logging_redirect_tqdm())  # log lines above the bar, never through it

    def eta_s(self, step: int) -> float:
        """Seconds left at the mean of the last ten step times (the first, which holds start-up, once others exist)."""
        recent = self.recent[-10:] or self.first
        per = sum(recent) / len(recent) if recent else 0.0
        return max(0, self.end_step - step - 1) * per

    def step(self, step: int, done: StepDone, stats: dict[int, WorkerStats], lr: float, eval_loss: float | None = None,
             trained_tokens: int | None = None) -> None:
        now = time.perf_counter()
        step_s = now - self.t_last
        self.t_last = now
        if step == self.start:
            log.info("first step committed %.2f s after launch (start-up, worker start and step %d)",
                     now - self.t_launch, step)
            self.first = [step_s]
        else:
            self.recent = (self.recent + [step_s])[-10:]
        shm = sum(size for _, size in list_store_segments().get(self.store, []))
        predicted = self.predicted_step_s  # exact clipping: the schedule the step ran (slidedp/clipping)
        if not done.speculate and self.predicted_clipped_step_s:
            predicted = self.predicted_clipped_step_s  # after a clipped step: every update deferred
        elif done.speculate and done.clipped and self.predicted_corrected_step_s:
            predicted = self.predicted_corrected_step_s  # speculated, then corrected
        record = make_record(step, done, stats, lr, self.tokens_per_step, step_s, predicted,
                             process_tree_private_bytes(), shm, self.planned_device_bytes, eval_loss, trained_tokens,
                             self.params)
        if not done.skipped:
            self.update_busy_s.append(done.update_s - done.correct_s)  # the AdamW rate a plan may learn
            self.reduce_busy_s.append(done.reduce_s)
            if stats:
                self.device_side_s.append(max(device_side(s) for s in stats.values()))
        if self.metrics is not None:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        self.records.append(record)
        if self.events is not None:
            self.events.record(record)
        eta = self.eta_s(step)
        last = step + 1 >= self.end_step
        if self._bar is not None:
            self._draw(step, record, eta)
        elif done.skipped or last or eval_loss is not None or (step + 1 - self.start) % self.log_every == 0:
            self._line(step, record, eta)

    def _line(self, step: int, r: dict[str, Any], eta: float) -> None:
        def num(x: float | None, fmt: str) -> str:
            return "nan" if x is None else format(x, fmt)

        print(f"step={step + 1} steps={self.end_step} loss={num(r['loss'], '.4f')} "
              f"grad_norm={num(r['grad_norm'], '.4f')} lr={r['lr']:.3e} tokens_per_s={num(r['tokens_per_s'], '.0f')} "
              f"step_s={r['step_s']:.3f} eta_s={eta:.1f}" + (" skipped=1" if r["skipped"] else "")
              + (f" eval_loss={num(r['eval_loss'], '.4f')}" if r["eval_loss"] is not None else ""),
              file=self.stream, flush=True)

    def _draw(self, step: int, r: dict[str, Any], eta: float) -> None:
        assert self._bar is not None
        if r["skipped"]:  # a permanent line above the bar
            self._bar.write(f"step {step + 1} skipped: a non-finite loss or gradient norm", file=self.stream)
        loss = "nan" if r["loss"] is None else f"{r['loss']:.4f}"
        ev = "" if r["eval_loss"] is None else f" eval {r['eval_loss']:.4f}"
        self._bar.set_postfix_str(f"loss {loss}{ev} {_rate(r['tokens_per_s'])} tok/s {r['step_s']:.2f} s/step "
                                  f"ETA {_clock(eta)}", refresh=False)
        self._bar.update(step + 1 - self._bar.n)

    def end(self) -> None:
        if self._bar is not None:  # the bar stays as the last line; what follows starts below it
            self._bar.close()
            self._bar = None
        self._redirect.close()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.events is not None:
            self.events.close()
            self.events = None
        if self.run_dir is not None and (self.run_dir / "trace").is_dir():
            from .tracefile import merge_and_check

            merge_and_check(self.run_dir)
