"""One plan and one job on every host of a job on several hosts (docs/multi-host.md, "One plan").

Every rank of every host runs the same collectives in the same order, chunk by chunk: the all-gathers
of each unit (again in backward, unless the layer stays resident), in the delivered dtype, and the
reduce-scatters of its gradient. Two hosts that planned on their own could differ there (a resident
layer, a delivery, a prefetch depth: the planner weighs its host's own calibration, and two
calibrations of like hosts are never equal), and their ranks would hang or mix unlike bytes. So host
0's launcher plans, and every other host plans with host 0's calibration and every choice fixed to
host 0's (`job_with_choices`): it checks that the plan fits its own GPUs and memory, as a job file that
fixed them would be checked, and carries out host 0's step (`SharedPlan`, in the launchers' TCPStore).

What else must agree is compared at the ready barrier (`agreement`, `differences`): the training
settings, the model's chunk table, where the data stands at the first step, the ranks per host and
the plan. A host whose job differs is refused, naming each difference.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from slidedp.config import JobConfig, job_to_dict
from slidedp.planner.calibration import Calibration
from slidedp.planner.measure import MeasuredBlocks
from slidedp.stepplan import CHOICES, StepPlan

# choices a job file may not fix ("auto" only: the store's layout sets them), and the layout's own key,
# which the job file gives every host alike (compared at the barrier as the layout's hash)
_NOT_FIXED = ("chunk_rows", "layer_chunk_numel")


@dataclass(frozen=True)
class SharedPlan:
    """Host 0's plan as the other hosts take it: the step its ranks carry out and the calibration it was
    planned with (None on CPU, where no planner runs)."""

    step: StepPlan
    calibration: Calibration | None = None

    def to_json(self) -> str:
        calib = self.calibration
        return json.dumps({
            "step": self.step.to_dict(),
            "calibration": None if calib is None else calib.to_dict(),
            "blocks": None if calib is None or calib.blocks is None else calib.blocks.to_dict()})

    @classmethod
    def from_json(cls, text: str) -> "SharedPlan":
        d = json.loads(text)
        calib = None
        if d["calibration"] is not None:
            blocks = MeasuredBlocks.from_dict(d["blocks"]) if d["blocks"] is not None else None
            calib = Calibration.from_dict(d["calibration"], blocks)
        return cls(StepPlan.from_dict(d["step"]), calib)


def choices(step: StepPlan) -> dict[str, Any]:
    """The step's choices, the [plan] keys a job file may fix."""
    return {name: getattr(step, name) for name in CHOICES if name not in _NOT_FIXED}


def job_with_choices(job: JobConfig, step: StepPlan) -> JobConfig:
    """The job with every [plan] choice fixed to the step's: what a host other than host 0 plans, so that
    the planner checks host 0's plan against this host's GPUs and memory and changes nothing in it."""
    return replace(job, plan=replace(job.plan, **choices(step)))


def adopted(mine: StepPlan, host0: StepPlan) -> StepPlan:
    """Host 0's step, once this host's plan of it (job_with_choices) is known to carry out the same choices;
    its predictions are host 0's (this host plans its share alike). Raises ValueError naming a choice this
    host's planner could not keep."""
    changed = [f"{k} {getattr(mine, k)!r} (host 0: {v!r})" for k, v in choices(host0).items() if getattr(mine, k) != v]
    if changed:
        raise ValueError(f"this host cannot carry out host 0's plan: its planner changed {', '.join(changed)}")
    return host0


def agreement(job: JobConfig, layout_hash: str, data_state: dict[str, Any], step: StepPlan) -> dict[str, Any]:
    """What every host must have alike, as JSON: the [train] section, the model's chunk table (its hash), where
    the data stands at the first step (its position, and the packed rows' fingerprint), the ranks per host and
    the plan's choices."""
    return {"train": job_to_dict(job)["train"], "layout": layout_hash, "data": data_state,
            "workers": job.runtime.workers, "plan": choices(step)}


_WHAT = {"train": "train.", "layout": "the model's chunk table", "data": "the data at the first step: ",
         "workers": "runtime.workers", "plan": "plan."}


def differences(mine: dict[str, Any], host0: dict[str, Any]) -> list[str]:
    """Where this host's agreement differs from host 0's, in words ("train.lr 2e-05 (host 0: 1e-05)")."""
    out: list[str] = []
    for part in _WHAT:
        a, b = mine.get(part), host0.get(part)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    out.append(f"{_WHAT[part]}{key} {a.get(key)!r} (host 0: {b.get(key)!r})")
        elif part == "layout":
            out.append(f"{_WHAT[part]} (another model, or another plan.layer_chunk_numel)")
        else:
            out.append(f"{_WHAT[part]} {a!r} (host 0: {b!r})")
    return out

