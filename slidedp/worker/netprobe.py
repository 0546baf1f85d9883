"""The network between hosts, timed by the ranks once they have joined: the collectives the step runs.

On several hosts (docs/multi-host.md) every rank runs, right after joining the process group and before any
training, the step's two collectives over every host's ranks (Group.all_gather and Group.reduce_scatter, on
the job's backend and device, as the sharded routes call them) at a few chunk sizes, a few repetitions each,
the device synchronized around each. A repetition's time is the slowest rank's; each size's figure the median
of its repetitions. planner/netfit.py fits the step model's rate and latency to them, and local rank 0 of each
host writes what was timed and the fit to PROBE_FILE in its run directory (JSON, 0600), where the launcher
reads it (launch/network.py). The probe moves no training data and touches nothing of the store: a few dozen
collectives on scratch buffers, freed before training (well under a second at the sizes below).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..planner.netfit import PROBE_FILE, PROBE_SCHEMA, NetworkFitError, Timing, network_fit
from .collectives import Group

KINDS = ("all_gather", "reduce_scatter")
# chunk sizes (bytes): on GPUs from a latency-bound 1 MiB to 64 MiB (5 ms at 100 Gb/s), where the rate shows;
# on CPU (Gloo through host memory, tests on loopback) small enough that the whole probe stays well under 1 s
CUDA_SIZES = (1 << 20, 8 << 20, 64 << 20)
CPU_SIZES = (16 << 10, 4 << 20)
REPS = 5


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _padded_bytes(nbytes: int, world: int) -> int:
    """A chunk of `nbytes` in fp32, padded to whole shards as the routes pad a chunk."""
    return -(-nbytes // 4 // world) * world * 4


def _time_size(group: Group, device: torch.device, nbytes: int, reps: int) -> list[float]:
    """This rank's seconds of each collective's `reps` repetitions at one size, after a warm-up of each."""
    buf = torch.ones(_padded_bytes(nbytes, group.world) // 4, device=device)
    mark = torch.zeros(1, device=device)
    runs = {"all_gather": lambda: group.all_gather(buf), "reduce_scatter": lambda: group.reduce_scatter(buf)}
    out = []
    for kind in KINDS:
        runs[kind]()  # warm up: the communicator's buffers for this size
        for _ in range(reps):
            group.all_reduce(mark)  # start together
            _sync(device)
            t0 = time.perf_counter()
            runs[kind]()
            _sync(device)
            out.append(time.perf_counter() - t0)
    return out


def time_collectives(group: Group, device: torch.device, sizes: tuple[int, ...], reps: int = REPS) -> list[Timing]:
    """Each collective at each size over the group: the median over `reps` of the slowest rank's seconds (every
    rank returns the same). fp32 buffers: the model charges bytes, whatever their dtype."""
    times = [t for nbytes in sizes for t in _time_size(group, device, nbytes, reps)]
    slowest = torch.tensor(times, dtype=torch.float64, device=device if group.backend == "nccl" else "cpu")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    got = slowest.view(len(sizes), len(KINDS), reps).tolist()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the scratch buffers' memory goes back before the engine plans its own
    return [Timing(kind, _padded_bytes(n, group.world), statistics.median(got[i][k]))
            for i, n in enumerate(sizes) for k, kind in enumerate(KINDS)]


def probe_doc(timings: list[Timing], ranks: int, nnodes: int, backend: str, probe_s: float) -> dict[str, Any]:
    """What PROBE_FILE holds: the timings, where and when, and the fit (uncapped: the launcher knows the GPU
    links' rate, and fits again with it) or why there is none."""
    doc: dict[str, Any] = {
        "schema": PROBE_SCHEMA, "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "nnodes": nnodes, "ranks": ranks, "backend": backend, "probe_s": probe_s,
        "timings": [{"kind": t.kind, "nbytes": t.nbytes, "seconds": t.seconds} for t in timings]}
    try:
        fit = network_fit(timings, ranks)
        doc.update(gbps=fit.gbps, latency_us=fit.latency_us)
    except NetworkFitError as e:
        doc["problem"] = str(e)
    return doc


def network_words(doc: dict[str, Any]) -> str:
    """The probe's fit (or why there is none), for a rank's log."""
    if "problem" in doc:
        return f"not measured: {doc['problem']}"
    return f"{doc['gbps'] * 8:.3g} Gb/s each way per host, {doc['latency_us']:.3g} us per ring step"


def write_private(path: Path, doc: dict[str, Any]) -> None:
    """The document as JSON, atomically, readable by this user only."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def probe_network(group: Group, device: torch.device, nnodes: int, run_dir: Path | None) -> dict[str, Any]:
    """Time the step's collectives over every host's ranks (every rank calls it, together) and, where run_dir is
    given (local rank 0), write PROBE_FILE there. Returns the probe's document."""
    t0 = time.perf_counter()
    timings = time_collectives(group, device, CUDA_SIZES if device.type == "cuda" else CPU_SIZES)
    doc = probe_doc(timings, group.world, nnodes, group.backend, time.perf_counter() - t0)
    if run_dir is not None:
        write_private(run_dir / PROBE_FILE, doc)
    return doc
