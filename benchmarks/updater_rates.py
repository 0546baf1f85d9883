"""The updater's AdamW rates on store-like shared memory: which kernel, thread count and pages pay.

    python3 -m benchmarks.updater_rates --out FILE.json [--params 256] [--chunk 64] [--threads 1,2,4,8]
                                        [--reps 3] [--no-copy] [--no-huge]

Rows (G params/s, median of `--reps` passes over every chunk, the kernels taking turns; a pass is
what one step's update of `--params` M parameters in chunks of `--chunk` M costs):
- `fused_whole`: torch's fused AdamW on each whole chunk (the updater before slidedp/adamw.py),
  `+shadow` (then the shadow's cast, a second pass) and `clipped` (coef 0.5: the kernel writes the
  clipped gradient back);
- `compiled`: slidedp.adamw's compiled kernel (numba; the updater's default), alone, `+shadow` (cast
  from cache in the same pass) and `clipped` (the gradient divided in registers);
- `correction` (the one-pass correction of slidedp/clipping/rollback.py) and `undo_redo` (what it
  replaced), each with and without the shadow;
- every row at each thread count of `--threads` (default 1, 2, 4, ... up to the CPUs of this
  process's first NUMA node), on the store's segments (POSIX shared memory, as `Segment.create`
  makes them) with and without MADV_HUGEPAGE, and beside a copy stream (`--no-copy` leaves it out):
  on CUDA a pinned host->device copy from another segment without pause, else a thread copying
  host memory (memcpy) on a CPU of its own, as the workers' DMA does beside the updaters.
The JSON says what the kernel allows: /sys/kernel/mm/transparent_hugepage/{enabled,shmem_enabled},
how many of the segments' pages were huge, whether CUDA and numba were there.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import threading
import time
import uuid
from pathlib import Path

import torch

from benchmarks.updater_bound import _thp
from slidedp import numa
from slidedp.adamw import step_
from slidedp.clipping.rollback import COMPILED, correct_, fused_adamw_
from slidedp.store.shm import Segment

HYPER = dict(lr=1e-5, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3)


def _segments(n: int, huge: bool) -> tuple[list[Segment], list[torch.Tensor]]:
    """master, grad, exp_avg, exp_avg_sq (fp32) and the shadow (bf16) in segments like the store's."""
    segs = []
    for kind, size in (("master", 4), ("grad", 4), ("exp_avg", 4), ("exp_avg_sq", 4), ("shadow", 2)):
        name = f"/slidedp-rates-{uuid.uuid4().hex[:8]}.{kind}"
        seg = Segment.create(name, n * size, touch=False)
        if not huge:  # Segment.create asked for huge pages; take it back before the first touch
            try:
                seg.mm.madvise(mmap.MADV_NOHUGEPAGE)
            except (AttributeError, OSError, ValueError):
                pass
        seg.touch()
        segs.append(seg)
    views = [s.tensor(torch.float32) for s in segs[:4]] + [segs[4].tensor(torch.bfloat16)]
    gen = torch.Generator().manual_seed(0)
    views[0].normal_(0, 0.02, generator=gen)
    views[1].normal_(0, 1e-3, generator=gen)
    views[2].normal_(0, 1e-3, generator=gen)
    views[3].uniform_(0, 1e-6, generator=gen)
    return segs, views


def _huge_pages(segs: list[Segment]) -> int:
    """Bytes of the segments mapped with huge pages (ShmemPmdMapped of this process's mappings)."""
    names = {s.name.lstrip("/") for s in segs}
    total, current = 0, False
    try:
        for line in Path("/proc/self/smaps").read_text().splitlines():
            if not line[:1].isupper():
                current = any(n in line for n in names)
            elif current and line.startswith(("ShmemPmdMapped:", "FilePmdMapped:")):
                total += int(line.split()[1]) * 1024
    except OSError:
        return -1
    return total


def _kernels(views: list[torch.Tensor], chunk: int) -> dict[str, object]:
    p, g, m, v, sh = views
    n = p.numel()
    spans = [(lo, min(n, lo + chunk)) for lo in range(0, n, chunk)]

    def piece(lo, hi, shadow):
        return (p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], sh[lo:hi] if shadow else None)

    def whole(shadow: bool, coef: float = 1.0):
        def run():
            for lo, hi in spans:
                # clipped, the kernel writes the gradient back (what it costs is the point of the row)
                fused_adamw_([p[lo:hi]], [g[lo:hi]], [m[lo:hi]], [v[lo:hi]], coef=coef, **HYPER)
                if shadow:
                    sh[lo:hi].copy_(p[lo:hi])
        return run

    def compiled(shadow: bool, coef: float = 1.0):
        return lambda: [step_([piece(lo, hi, shadow)], coef=coef, compiled=True, **HYPER) for lo, hi in spans]

    def corrected(shadow: bool, compiled: bool):
        return lambda: [correct_([piece(lo, hi, shadow)], coef=0.5, compiled=compiled, **HYPER) for lo, hi in spans]

    out: dict[str, object] = {"fused_whole": whole(False), "fused_whole+shadow": whole(True),
                              "fused_whole clipped": whole(False, 0.5)}
    if COMPILED:
        out["compiled"] = compiled(False)
        out["compiled+shadow"] = compiled(True)
        out["compiled clipped"] = compiled(False, 0.5)
        out["correction"] = corrected(False, True)
        out["correction+shadow"] = corrected(True, True)
    out["undo_redo"] = corrected(False, False)
    out["undo_redo+shadow"] = corrected(True, False)
    return out


def _rates(kernels: dict[str, object], n: int, reps: int) -> dict[str, float]:
    """G params/s of each kernel: the median of `reps` timed passes after one untimed, the kernels taking
    turns (a loaded machine slows them alike). The correction rows keep correcting the same state: the
    rate does not depend on the values."""
    times: dict[str, list[float]] = {k: [] for k in kernels}
    for i in range(reps + 1):
        for name, run in kernels.items():
            t0 = time.perf_counter()
            run()  # type: ignore[operator]
            if i:
                times[name].append(time.perf_counter() - t0)
    return {k: n / statistics.median(ts) / 1e9 for k, ts in times.items()}


class CopyStream:
    """What the workers' DMA does beside the updaters: on CUDA a pinned H2D copy without pause; else a
    thread copying host memory on its own CPU (torch's copy releases the GIL)."""

    def __init__(self, nbytes: int, cpu: int | None) -> None:
        self.kind = "cuda_h2d" if torch.cuda.is_available() else "memcpy_thread"
        self.seg = Segment.create(f"/slidedp-rates-{uuid.uuid4().hex[:8]}.copy", nbytes)
        self.src = self.seg.tensor(torch.uint8)
        self.cpu, self.stop, self.moved, self.elapsed = cpu, threading.Event(), 0, 0.0
        self.error = ""
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self._copy()
        except Exception as e:  # say so in the rows rather than time the kernels without a copy unawares
            self.error = f"{type(e).__name__}: {e}"

    def _copy(self) -> None:
        if self.cpu is not None:
            os.sched_setaffinity(0, [self.cpu])  # this thread only (Linux: per-thread affinity)
        t0 = time.perf_counter()
        if self.kind == "cuda_h2d":
            torch.cuda.cudart().cudaHostRegister(self.src.data_ptr(), self.src.numel(), 0)
            dst = torch.empty_like(self.src, device="cuda")
            stream = torch.cuda.Stream()
            while not self.stop.is_set():
                with torch.cuda.stream(stream):
                    dst.copy_(self.src, non_blocking=True)
                stream.synchronize()
                self.moved += self.src.numel()
        else:
            half = self.src.numel() // 2
            a, b = self.src[:half], self.src[half:2 * half]
            while not self.stop.is_set():
                b.copy_(a)
                self.moved += 2 * half
        self.elapsed = time.perf_counter() - t0

    def __enter__(self) -> "CopyStream":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.seg.close()
        self.seg.unlink()

    def gbps(self) -> float:
        return self.moved / max(self.elapsed, 1e-9) / 1e9


def _thread_counts(cpus: list[int], asked: str) -> list[int]:
    if asked:
        return [int(t) for t in asked.split(",") if t]
    out, t = [], 1
    while t < len(cpus):
        out.append(t)
        t *= 2
    return out + [len(cpus)]


def _first_node(cpus: list[int]) -> list[int]:
    try:
        nodes = [sorted(set(n) & set(cpus)) for n in numa.nodes()]
        nodes = [n for n in nodes if n]
        return nodes[0] if nodes else cpus
    except Exception:  # no NUMA information: every CPU of this process
        return cpus


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.updater_rates", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the JSON to write")
    p.add_argument("--params", type=int, default=256, help="millions of parameters per pass (default 256)")
    p.add_argument("--chunk", type=int, default=64, help="millions of parameters per chunk (default 64)")
    p.add_argument("--threads", default="", help="comma-separated thread counts (default 1, 2, 4, ... a node)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-copy", action="store_true", help="leave out the rows beside a copy stream")
    p.add_argument("--no-huge", action="store_true", help="leave out the rows with MADV_HUGEPAGE")
    a = p.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    node = _first_node(cpus)
    n, chunk = a.params * 1_000_000, a.chunk * 1_000_000
    result: dict = {"params": n, "chunk": chunk, "cpus": len(cpus), "node_cpus": node,
                    "thp": _thp(), "madv_hugepage": hasattr(mmap, "MADV_HUGEPAGE"), "numba": COMPILED,
                    "cuda": torch.cuda.is_available(), "torch": torch.__version__, "rows": []}
    if not COMPILED:
        result["note"] = "numba is not installed: no compiled-kernel or one-pass correction rows"
    else:
        from slidedp.clipping.rollback import warm_up
        warm_up()  # compile (or load) the kernels before timing them
    print(json.dumps({k: result[k] for k in ("thp", "numba", "cuda", "node_cpus")}), flush=True)
    threads = [t for t in _thread_counts(node, a.threads) if t <= len(node)]
    copy_cpu = cpus[-1] if len(cpus) > max(threads) else None
    for huge in ([False] if a.no_huge else [False, True]):
        segs, views = _segments(n, huge)
        try:
            result.setdefault("huge_page_bytes", {})[str(huge)] = _huge_pages(segs)
            kernels = _kernels(views, chunk)
            for copying in ([False] if a.no_copy else [False, True]):
                for t in threads:
                    use = [c for c in node if c != copy_cpu][:t] if copying else node[:t]
                    os.sched_setaffinity(0, use or node[:t])
                    torch.set_num_threads(t)
                    if copying:
                        with CopyStream(1 << 28, copy_cpu) as cs:
                            rates = _rates(kernels, n, a.reps)
                        copy = {"copy": cs.kind, "copy_gbps": round(cs.gbps(), 2)}
                        if cs.error:
                            copy["copy_error"] = cs.error
                    else:
                        rates, copy = _rates(kernels, n, a.reps), {}
                    for name, rate in rates.items():
                        row = {"kernel": name, "threads": t, "madv_hugepage": huge,
                               "g_params_per_s": round(rate, 3), **copy}
                        result["rows"].append(row)
                        print(json.dumps(row), flush=True)
                    os.sched_setaffinity(0, cpus)
        finally:
            for s in segs:
                s.close()
                s.unlink()
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
