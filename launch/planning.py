"""From a job to what the workers do: the planner's choices (on CUDA) or the CPU defaults.

Calibration runs in a subprocess (cached per host and GPU under ~/.cache/slidedp), so the
launcher itself never holds a CUDA context on the workers' GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

from slidedp.config import JobConfig, model_config
from slidedp.planner import Calibration, Plan, Workload, make_plan
from slidedp.planner.costs import GiB

_CALIBRATE = ("import json; from slidedp.planner import load_or_calibrate; "
              "print(json.dumps(load_or_calibrate('cuda').to_dict()))")


@dataclass(frozen=True)
class RunPlan:
    resident_layers: int = 0
    prefetch_depth: int = 1
    loss_chunk_tokens: int = 4096
    embedding: str = "host"  # "host" | "device"
    micro_batch: int = 1
    plan: Plan | None = None

    @property
    def predicted_step_s(self) -> float | None:
        return self.plan.predicted_step_s if self.plan is not None else None


def calibration(timeout_s: float = 300.0) -> Calibration:
    out = subprocess.run([sys.executable, "-c", _CALIBRATE], capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"calibrating this host's GPU failed: {out.stderr.strip()[-2000:]}")
    return Calibration.from_dict(json.loads(out.stdout.strip().splitlines()[-1]))


def plan_job(job: JobConfig, calib: Calibration | None = None) -> RunPlan:
    mem, t = job.memory, job.train
    forced_embedding = {"auto": None, "host": "host", "device": "device"}[mem.embedding]
    if job.runtime.device != "cuda":
        return RunPlan(resident_layers=max(0, mem.resident_layers), embedding=forced_embedding or "host",
                       micro_batch=t.micro_batch)
    work = Workload(model=model_config(job), global_batch=t.global_batch, seq_len=t.seq_len, world=job.runtime.workers,
                    micro_batch=t.micro_batch, compute_dtype=t.compute_dtype, clip=t.max_grad_norm > 0,
                    updaters=max(1, job.runtime.updaters))
    allowed = {
        "activations": ("keep",),
        "delivery": ("fp32",),  # the bf16 shadow delivery needs a store made with store.shadow_bf16
        "embedding": {None: ("gpu", "host"), "host": ("host",), "device": ("gpu",)}[forced_embedding],
    }
    plan = make_plan(work, int(mem.gpu_budget_gib * GiB), calib or calibration(), allowed)
    resident = plan.resident_layers if mem.resident_layers < 0 else min(mem.resident_layers, work.model.num_layers)
    return RunPlan(resident_layers=resident, prefetch_depth=plan.prefetch_depth,
                   loss_chunk_tokens=plan.loss_chunk_tokens, embedding="device" if plan.embedding == "gpu" else "host",
                   micro_batch=plan.micro_batch, plan=plan)
