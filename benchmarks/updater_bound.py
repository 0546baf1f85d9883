"""What slows the updaters' AdamW in training: the fused CPU AdamW's rate over store-like memory,
alone and beside GPU copies, as the updater runs it (chunks of `--chunk` parameters).

    python -m benchmarks.updater_bound --params 1000 --chunk 100 [--threads 29,13] [--gpus 2] --json OUT

Rows (G params/s, median of `--reps` passes over all chunks):
- `anon`: private memory from torch (what the calibration measures);
- `shm`: a POSIX shared-memory segment like the store's (MADV_HUGEPAGE asked for);
- `shm+copies`: the same while one process per GPU copies H2D and D2H without pause from
  page-locked shared memory (the workers' DMA), each pinned to its own CPU;
- each at every thread count of `--threads` (default: all CPUs).
Also prints the transparent huge page settings and how many of the segment's pages are huge.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch

from slidedp.store.shm import Segment

GIB = 1 << 30


def _thp() -> dict[str, str]:
    out = {}
    for name in ("enabled", "shmem_enabled", "defrag"):
        try:
            out[name] = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
        except OSError as e:
            out[name] = f"unreadable: {e}"
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    out.update({ln.split(":")[0]: ln.split(":")[1].strip() for ln in meminfo
                if ln.startswith(("AnonHugePages", "ShmemHugePages", "ShmemPmdMapped", "MemTotal", "MemAvailable"))})
    return out


def _shm_segment(nbytes: int) -> Segment:
    """A POSIX shared-memory segment made as the store makes its own (0600, huge pages asked for, touched)."""
    return Segment.create(f"/slidedp-bound-{uuid.uuid4().hex[:8]}", nbytes)


def _rate(state: list[torch.Tensor], chunk: int, reps: int) -> float:
    p, g, m, v = state
    n = p.numel()
    step = torch.ones(())
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            torch._fused_adamw_([p[s:e]], [g[s:e]], [m[s:e]], [v[s:e]], [], [step], lr=1e-5, beta1=0.9, beta2=0.95,
                                weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
        times.append(time.perf_counter() - t0)
    return n / statistics.median(times[1:]) / 1e9


def _copier(gpu: int, name: str, nbytes: int, cpu: int) -> None:
    """One GPU's DMA: H2D and D2H of `nbytes` each, back to back, from registered shared memory."""
    os.sched_setaffinity(0, [cpu])
    host = Segment.open(name).tensor(torch.uint8, 0, nbytes * 2)
    torch.cuda.set_device(gpu)
    rc = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)
    assert int(rc) == 0, f"cudaHostRegister: {rc}"
    dev_in = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s_in, s_out = torch.cuda.Stream(), torch.cuda.Stream()
    print("ready", flush=True)
    moved, t0 = 0, time.perf_counter()
    while True:
        with torch.cuda.stream(s_in):
            dev_in.copy_(host[:nbytes], non_blocking=True)
        with torch.cuda.stream(s_out):
            host[nbytes:].copy_(dev_out, non_blocking=True)
        torch.cuda.synchronize()
        moved += 2 * nbytes
        if time.perf_counter() - t0 > 2.0:
            print(f"gpu {gpu}: {moved / (time.perf_counter() - t0) / 1e9:.1f} GB/s H2D+D2H", flush=True)
            moved, t0 = 0, time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.updater_bound", description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=1000, help="millions of parameters")
    p.add_argument("--chunk", type=int, default=100, help="millions of parameters per AdamW call")
    p.add_argument("--threads", default="", help="comma-separated thread counts (default: all CPUs)")
    p.add_argument("--gpus", type=int, default=0, help="GPUs copying beside the AdamW (0 = none)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default="")
    p.add_argument("--copier", nargs=4, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.copier:
        _copier(int(a.copier[0]), a.copier[1], int(a.copier[2]), int(a.copier[3]))
        return 0
    cpus = sorted(os.sched_getaffinity(0))
    threads = [int(t) for t in a.threads.split(",") if t] or [len(cpus)]
    n, chunk = a.params * 1_000_000, a.chunk * 1_000_000
    result: dict = {"thp": _thp(), "cpus": len(cpus), "params": n, "chunk": chunk, "rows": []}
    print(json.dumps(result["thp"]))

    def run(kind: str, state: list[torch.Tensor], worker_cpus: list[int]) -> None:
        for t in threads:
            use = [c for c in cpus if c not in worker_cpus][:t]
            os.sched_setaffinity(0, use)
            torch.set_num_threads(len(use))
            r = _rate(state, chunk, a.reps)
            result["rows"].append({"memory": kind, "threads": len(use), "g_params_per_s": r})
            print(f"{kind:12s} {len(use):3d} threads: {r:.2f} G params/s", flush=True)
        os.sched_setaffinity(0, cpus)

    anon = [torch.rand(n), torch.rand(n), torch.zeros(n), torch.zeros(n)]
    run("anon", anon, [])
    del anon
    shm = [_shm_segment(n * 4) for _ in range(4)]
    state = [seg.tensor(torch.float32) for seg in shm]
    state[0].uniform_(), state[1].uniform_()
    result["thp_after_shm"] = _thp()
    print(json.dumps(result["thp_after_shm"]))
    run("shm", state, [])
    if a.gpus:
        nbytes = 1 << 30
        buffers, procs = [], []
        for gpu in range(a.gpus):
            seg = _shm_segment(nbytes)  # halves: the H2D source and the D2H target
            buffers.append(seg)
            procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.updater_bound", "--copier", str(gpu),
                                           seg.name, str(nbytes // 2), str(cpus[-1 - gpu])], stdout=subprocess.PIPE,
                                          text=True))
        for pr in procs:
            assert pr.stdout is not None and pr.stdout.readline().strip() == "ready"
        try:
            run("shm+copies", state, cpus[-a.gpus:])
        finally:
            for pr in procs:
                pr.kill()
                out = pr.communicate()[0].strip().splitlines()
                print(out[-1] if out else "copier said nothing")
                result.setdefault("copies", []).append(out[-3:])
        for seg in buffers:
            seg.unlink()
    for seg in shm:
        seg.unlink()
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
