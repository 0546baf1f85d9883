"""The network between hosts as runs on this host measured it, kept for the next plan on several hosts.

A run on several hosts times its collectives before training (worker/netprobe.py); its launcher keeps the fit
here (`record_network`), and the next plan of a job on several hosts on this host charges it (`measured_network`,
applied by planner.job.network) unless the job sets its own figures (runtime.network_gbps, network_latency_us).

JSON (never pickle), one file per host, `network-HOST.json` under cache.cache_root(), beside the calibration:
the network is the host's link and the fabric behind it, not its GPU's, so it is not in the per-device
calibration file. What it is kept under, and why:

- per **backend** ("nccl", "gloo"): a CUDA plan charges NCCL's figures, and a Gloo run (CPU workers, or ranks
  sharing a GPU) moves its collectives through host memory and TCP at other rates: neither stands for the other;
- **not** per master address or number of hosts: a scheduler hands a job whichever hosts are free, so the
  master changes from job to job and a key of it would rarely be found again, while what the model charges is
  per host (its link each way, one ring step's latency) and does not depend on how many hosts the ring crosses;
- the **last RECENT_RUNS runs**, each figure charged as their median: as the updaters' rate in training
  (cache.RECENT_RUNS), one run's figure may be off (a busy fabric), and a changed fabric takes over within a few
  runs. Each run's record keeps its date, hosts, ranks and whether the GPU links bounded it.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slidedp import log
from slidedp.planner.cache import RECENT_RUNS, cache_root, locked, slug
from slidedp.planner.netfit import NetworkFit

_log = log.get("planner")

SCHEMA = 1
BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class MeasuredNetwork:
    """What the plan charges of this host's network, from its last runs of one backend: the median rate and
    latency, whether the network reached at least that rate (the median run, or both middle ones, were bounded
    by the GPU links), the latest run's date and how many runs there were."""

    backend: str
    gbps: float
    latency_us: float
    at_least: bool
    latest: str  # the date of the latest run, YYYY-MM-DD
    runs: int

    @property
    def source(self) -> str:
        """Where the figures came from, in the plan's words (Calibration.internode_source)."""
        if self.runs == 1:
            return f"measured by the run of {self.latest}"
        return f"measured: the median of this host's last {self.runs} runs, the latest of {self.latest}"


def network_file(cache_dir: str | os.PathLike | None = None, host: str | None = None) -> Path:
    """This host's file of measured networks."""
    root = Path(cache_dir).expanduser() if cache_dir else cache_root()
    return root / f"network-{slug(host or socket.gethostname())}.json"


def _run_ok(run: Any) -> bool:
    """A kept run's record: positive finite figures, a date."""
    return (isinstance(run, dict) and all(isinstance(run.get(k), (int, float)) and not isinstance(run.get(k), bool)
                                          and math.isfinite(run[k]) and run[k] > 0 for k in ("gbps", "latency_us"))
            and isinstance(run.get("measured_at"), str) and isinstance(run.get("at_least", False), bool))


def _read(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The kept runs per backend; an unreadable file, or a run that is not one, is left out with a warning."""
    if not path.exists():
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        _log.warning("%s is unreadable (%s): the network between hosts is assumed until a run measures it", path, e)
        return {}
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("backends"), dict):
        _log.warning("%s is not a schema-%d file of measured networks: left out", path, SCHEMA)
        return {}
    out = {}
    for backend, runs in doc["backends"].items():
        kept = [r for r in runs if _run_ok(r)] if backend in BACKENDS and isinstance(runs, list) else []
        if not kept or len(kept) != len(runs):
            _log.warning("%s: runs of %r that are not measured networks are left out", path, backend)
        if kept:
            out[backend] = kept[-RECENT_RUNS:]
    return out


def _summary(backend: str, runs: list[dict[str, Any]]) -> MeasuredNetwork:
    ranked = sorted(runs, key=lambda r: r["gbps"])
    middle = ranked[(len(ranked) - 1) // 2:len(ranked) // 2 + 1]  # the run (or two) the median rate is of
    return MeasuredNetwork(backend, statistics.median(r["gbps"] for r in runs),
                           statistics.median(r["latency_us"] for r in runs),
                           all(r.get("at_least") for r in middle),  # the median run was bounded by the GPU links
                           runs[-1]["measured_at"][:10], len(runs))


def measured_network(backend: str, cache_dir: str | os.PathLike | None = None,
                     host: str | None = None) -> MeasuredNetwork | None:
    """What runs of `backend` on this host measured of the network between hosts (None: none did)."""
    runs = _read(network_file(cache_dir, host)).get(backend)
    return _summary(backend, runs) if runs else None


def record_network(fit: NetworkFit, backend: str, measured_at: str, nnodes: int, ranks: int,
                   cache_dir: str | os.PathLike | None = None, host: str | None = None) -> MeasuredNetwork:
    """Keep a run's fit with this host's last runs of its backend; returns what the next plan charges. Raises
    OSError where the cache cannot be written."""
    if backend not in BACKENDS:
        raise ValueError(f"record_network: backend {backend!r} is not one of {BACKENDS}")
    path = network_file(cache_dir, host)
    with locked(path):
        kept = _read(path)
        run = {"gbps": fit.gbps, "latency_us": fit.latency_us, "at_least": fit.at_least, "measured_at": measured_at,
               "nnodes": nnodes, "ranks": ranks}
        kept[backend] = [*kept.get(backend, []), run][-RECENT_RUNS:]
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"schema": SCHEMA, "backends": kept}, indent=1) + "\n")
        os.replace(tmp, path)  # atomic: a reader never sees half a file
    return _summary(backend, kept[backend])
