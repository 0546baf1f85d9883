"""Soak (-m slow): 2,000 steps of the tiny model on CPU with 2 workers; nothing may grow.

Every ~100 steps: the RSS and open file descriptors of every process of the job, and the
store's /dev/shm usage. After a warm-up (allocator pools, lazily imported modules, caches
filled), each process's RSS may grow by at most RSS_SLACK over the remaining ~1,700 steps
(a leak of even 10 KiB a step would add ~17 MiB), its descriptors not at all beyond FD_SLACK,
and the store's shared memory not at all. The figures are printed (run with -s) and, with
SLIDEDP_SOAK_REPORT=path, written as JSON.
"""

from __future__ import annotations

import json
import os
import time

import psutil
import pytest

from slidedp.store.shm import list_store_segments

from . import TINY, RunningJob, drop_store, fast_sets, kind_of, unique_store

STEPS = int(os.environ.get("SLIDEDP_SOAK_STEPS", "2000"))
EVERY = 100
WARMUP = 300
RSS_SLACK = 8 * 2**20
FD_SLACK = 2


def _label(p: psutil.Process) -> str:
    kind = kind_of(p) or "?"
    cmd = p.cmdline()
    for flag in ("--rank", "--member"):
        if flag in cmd:
            return f"{kind}{cmd[cmd.index(flag) + 1]}"
    return kind


def _sample(job: RunningJob, store: str) -> dict:
    procs = {"launcher": psutil.Process(job.proc.pid)}
    for ps in job.processes().values():
        for p in ps:
            procs[_label(p)] = p
    out = {}
    for name, p in procs.items():
        with p.oneshot():
            out[name] = {"rss": p.memory_info().rss, "fds": p.num_fds()}
    return {"procs": out, "shm": sum(size for _, size in list_store_segments().get(store, [])),
            "shm_total_used": psutil.disk_usage("/dev/shm").used}


@pytest.mark.slow
def test_soak(tmp_path):
    store = unique_store("soak")
    run_dir = tmp_path / "run"
    sets = fast_sets(store, run_dir, f"train.steps={STEPS}", "checkpoint.final=false", "checkpoint.every=0",
                     "runtime.workers=2", "run.log_every=100")
    job = RunningJob.start(TINY, sets, tmp_path, store)
    samples: list[tuple[int, float, dict]] = []
    t0 = time.monotonic()
    try:
        for step in range(EVERY, STEPS, EVERY):
            job.wait_step(step, run_dir, timeout=600)
            samples.append((step, time.monotonic() - t0, _sample(job, store)))
        assert job.wait_exit(600) == 0, job.output[-4000:]
    finally:
        job.cleanup()
        drop_store(store)
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == STEPS
    base = next(s for s in samples if s[0] >= WARMUP)
    last = samples[-1]
    figures = {
        "steps": STEPS, "seconds": round(last[1], 1),
        "shm_bytes": sorted({s[2]["shm"] for s in samples}),
        "procs": {
            name: {
                "rss_mib": [round(s[2]["procs"][name]["rss"] / 2**20, 1) for s in samples if name in s[2]["procs"]],
                "fds": [s[2]["procs"][name]["fds"] for s in samples if name in s[2]["procs"]],
            }
            for name in sorted(base[2]["procs"])
        },
        "sample_steps": [s[0] for s in samples],
    }
    print("\nsoak figures " + json.dumps(figures))
    if os.environ.get("SLIDEDP_SOAK_REPORT"):
        with open(os.environ["SLIDEDP_SOAK_REPORT"], "w") as f:
            json.dump(figures, f, indent=1)
    # the store's shared memory: the same bytes at every sample
    assert len(figures["shm_bytes"]) == 1
    for name, then in base[2]["procs"].items():
        now = last[2]["procs"][name]
        assert now["rss"] - then["rss"] <= RSS_SLACK, (name, then["rss"], now["rss"], figures["procs"][name])
        assert now["fds"] - then["fds"] <= FD_SLACK, (name, then["fds"], now["fds"], figures["procs"][name])
