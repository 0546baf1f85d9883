"""The launcher's side of the ranks' network probe: what they timed, fitted, said beside what the plan charged.

On several hosts local rank 0 writes planner/netfit.PROBE_FILE in the run directory before training (JSON, never
pickle). The launcher removes any earlier run's file before it spawns the workers, reads the new one once it is
there (`read_probe`), fits it again with the GPU links this host's calibration measured (with several GPUs a host
the step model caps a collective by them: a rate at that cap is the network's "at least"), logs it beside the
plan's figures (`words`), and at the end of the run keeps it for the next plan on this host (learn.record_network)
and in the run's record and summary.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slidedp.planner.job import JobPlan
from slidedp.planner.netfit import PROBE_FILE, PROBE_SCHEMA, NetworkFit, NetworkFitError, Timing, network_fit


@dataclass(frozen=True)
class Probe:
    """What the ranks measured of the network between hosts: the fit, or why there is none (`problem`)."""

    fit: NetworkFit | None
    problem: str
    backend: str
    nnodes: int
    ranks: int
    measured_at: str  # ISO 8601, UTC
    probe_s: float

    def to_dict(self) -> dict[str, Any]:
        """For the run's record."""
        out: dict[str, Any] = {"backend": self.backend, "nnodes": self.nnodes, "ranks": self.ranks,
                               "measured_at": self.measured_at, "probe_s": self.probe_s}
        if self.fit is not None:
            out.update(gbps=self.fit.gbps, latency_us=self.fit.latency_us, at_least=self.fit.at_least)
        else:
            out["problem"] = self.problem
        return out

    def words(self) -> str:
        """What was measured, in a line."""
        if self.fit is None:
            return f"the network between hosts was not measured: {self.problem}"
        return (f"the network between hosts measured {self.fit.words()} ({self.backend}, {self.ranks} ranks on "
                f"{self.nnodes} hosts, {self.probe_s:.2f} s)")


def gpu_links_cap(run_plan: JobPlan, workers: int) -> float:
    """The GPU links' rate (GB/s) that bounds a collective on this host where it has several GPUs (the plan's
    calibration, as step_model.collective_s charges it); 0 where none does (one GPU a host, or a CPU run)."""
    plan = run_plan.plan
    if plan is None or workers < 2 or plan.calibration.bus_gpus < 2:
        return 0.0
    return plan.calibration.allreduce_gbps


def read_probe(run_dir: Path, cap_gbps: float = 0.0) -> Probe | None:
    """The probe's file in run_dir, fitted with the GPU links' cap (None: not written yet). A file that is not
    one is a Probe whose problem says why."""
    path = run_dir / PROBE_FILE
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return Probe(None, f"{path} is unreadable: {e}", "", 0, 0, "", 0.0)
    try:
        if doc["schema"] != PROBE_SCHEMA:
            raise ValueError(f"schema {doc['schema']!r}, not {PROBE_SCHEMA}")
        timings = [Timing(str(t["kind"]), int(t["nbytes"]), float(t["seconds"])) for t in doc["timings"]]
        head = (str(doc["backend"]), int(doc["nnodes"]), int(doc["ranks"]), str(doc["measured_at"]),
                float(doc["probe_s"]))
    except (KeyError, TypeError, ValueError) as e:
        return Probe(None, f"{path} is not the ranks' probe: {e}", "", 0, 0, "", 0.0)
    try:
        fit = network_fit(timings, head[2], cap_gbps)
    except NetworkFitError as e:
        return Probe(None, str(e), *head)
    if not (math.isfinite(fit.gbps) and math.isfinite(fit.latency_us)):
        return Probe(None, f"the fit is not finite ({fit})", *head)
    return Probe(fit, "", *head)


def words(probe: Probe, run_plan: JobPlan) -> str:
    """The measurement beside what the plan charged."""
    plan = run_plan.plan
    charged = (f"the plan charged the {plan.calibration.network_words()}" if plan is not None
               else "a CPU run: no plan charged it")
    return f"{probe.words()}; {charged}"
