"""What the user sees while a job runs: one line per step, and metrics.jsonl in the run dir."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import psutil

from slidedp.protocol import StepDone, WorkerStats
from slidedp.store.shm import list_store_segments


class Progress:
    def __init__(self, store: str, tokens_per_step: int, stream=sys.stdout) -> None:
        self.store = store
        self.tokens_per_step = tokens_per_step
        self.stream = stream
        self.metrics = None
        self.t_last = time.perf_counter()
        self.start = self.end_step = 0
        self.predicted_step_s: float | None = None

    def begin(self, start: int, end: int, run_dir: Path) -> None:
        self.start, self.end_step = start, end
        self.metrics = open(run_dir / "metrics.jsonl", "a")
        self.t_begin = self.t_last = time.perf_counter()

    def step(self, step: int, done: StepDone, stats: dict[int, WorkerStats], lr: float) -> None:
        now = time.perf_counter()
        step_s = now - self.t_last
        self.t_last = now
        shm = sum(size for _, size in list_store_segments().get(self.store, []))
        worker_step = max((s.step_s for s in stats.values()), default=step_s)
        record = {
            "step": step, "loss": done.loss, "lr": lr,
            "grad_norm": done.grad_norm if math.isfinite(done.grad_norm) else None,
            "skipped": bool(done.skipped), "tokens": self.tokens_per_step,
            "step_s": step_s, "worker_step_s": worker_step, "predicted_step_s": self.predicted_step_s,
            "tokens_per_s": self.tokens_per_step / step_s if step_s > 0 else None,
            "forward_s": max((s.forward_s for s in stats.values()), default=None),
            "backward_s": max((s.backward_s for s in stats.values()), default=None),
            "wait_version_s": max((s.wait_version_s for s in stats.values()), default=None),
            "wait_slot_s": max((s.wait_slot_s for s in stats.values()), default=None),
            "wait_loss_s": max((s.wait_loss_s for s in stats.values()), default=None),
            "h2d_bytes": sum(s.h2d_bytes for s in stats.values()),
            "gpu_peak_bytes": max((s.gpu_peak_bytes for s in stats.values()), default=0),
            "host_rss_bytes": psutil.Process().memory_info().rss,
            "shm_bytes": shm,
            "update_busy_s": done.update_s,
            "reduce_busy_s": done.reduce_s,
        }
        if self.metrics is not None:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        left = self.end_step - step - 1
        eta = left * (now - self.t_begin) / max(1, step - self.start + 1)
        print(f"step {step + 1}/{self.end_step} loss={done.loss:.4f} grad_norm={done.grad_norm:.3f} lr={lr:.2e} "
              f"tokens/s={record['tokens_per_s']:.0f} step_s={step_s:.3f} eta={eta:.0f}s"
              + (" SKIPPED(non-finite loss)" if done.skipped else ""), file=self.stream, flush=True)

    def end(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
