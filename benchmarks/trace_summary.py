"""Where a profiled step's GPU time went, from a torch.profiler Chrome trace.

    python -m benchmarks.trace_summary TRACE.json [--json OUT]

Prints, per CUDA stream, the span from the first kernel to the last, the time some kernel
ran (the union of kernel intervals) and so the idle time within the span; and kernel time
by kind (GEMM, attention, elementwise/reduction, copy/cast, optimizer, NCCL), with the
top kernels by total time. The worker writes such a trace for step N when run with
SLIDEDP_PROFILE_STEP=N.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

KINDS = (  # first match wins; lower-case substrings of kernel names
    ("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul")),
    ("attention", ("flash", "fmha", "attention")),
    ("optimizer", ("adam", "multi_tensor")),
    ("nccl", ("nccl",)),
    ("copy/cast", ("copy", "memcpy", "memset", "cast", "fill")),
    ("reduction", ("reduce", "logsumexp", "norm", "sum", "mean", "softmax", "scatter", "gather", "index")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "pointwise", "triton")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(trace: dict) -> dict:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_stream: dict[int, list[tuple[float, float]]] = defaultdict(list)
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        start, dur = float(e["ts"]), float(e.get("dur", 0.0))
        by_stream[int(e.get("tid", 0))].append((start, start + dur))
        kind = "copy/cast" if e["cat"] != "kernel" and "memcpy" in e["cat"] else kind_of(e["name"])
        if e["cat"] == "kernel":
            by_kind[kind] += dur
        else:
            by_kind["memcpy/memset (copy engines)"] += dur
        by_name[e["name"]][0] += dur
        by_name[e["name"]][1] += 1
    streams = {}
    for sid, iv in by_stream.items():
        span = max(b for _, b in iv) - min(a for a, _ in iv)
        busy = union_length(iv)
        streams[str(sid)] = {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3, "events": len(iv)}
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    return {"streams": streams, "kinds_ms": {k: v / 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"name": n[:140], "ms": t / 1e3, "count": c, "kind": kind_of(n)} for n, (t, c) in top],
            "compute_gaps": _gaps(events)}


GAP_BUCKETS_MS = (0.05, 1.0)  # idle stretches of the compute stream: launch-sized, short waits, long waits


def _gaps(events: list[dict]) -> dict:
    """The compute stream's idle stretches (the stream busiest with kernels other than NCCL's), by length, and
    the longest with the kernel after each (what the stream waited to run): idle compute is where a step
    loses to its copies, collectives or launches."""
    compute = defaultdict(list)  # kernels other than NCCL's: not the copy engines, not the collectives' stream
    for e in events:
        if e["cat"] == "kernel" and kind_of(e["name"]) != "nccl":
            compute[int(e.get("tid", 0))].append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))))
    if not compute:
        return {}
    sid = max(compute, key=lambda k: union_length(compute[k]))
    mine = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e["name"]) for e in events
                  if int(e.get("tid", 0)) == sid)
    gaps, end = [], mine[0][1]
    for a, b, name in mine[1:]:
        if a > end:
            gaps.append((a - end, name))
        end = max(end, b)
    edges = (0.0,) + GAP_BUCKETS_MS + (float("inf"),)
    buckets = {f"{lo:g}-{hi:g} ms": [0, 0.0] for lo, hi in zip(edges, edges[1:])}
    for us, _ in gaps:
        for lo, hi in zip(edges, edges[1:]):
            if lo <= us / 1e3 < hi:
                buckets[f"{lo:g}-{hi:g} ms"][0] += 1
                buckets[f"{lo:g}-{hi:g} ms"][1] += us / 1e3
    longest = sorted(gaps, key=lambda g: -g[0])[:10]
    return {"stream": str(sid), "buckets": {k: {"count": c, "ms": ms} for k, (c, ms) in buckets.items()},
            "longest": [{"ms": us / 1e3, "next_kernel": name[:100]} for us, name in longest]}


def print_summary(s: dict) -> None:
    print("stream       span ms    busy ms    idle ms   events")
    for sid, v in sorted(s["streams"].items(), key=lambda kv: -kv[1]["busy_ms"]):
        print(f"{sid:>8} {v['span_ms']:10.1f} {v['busy_ms']:10.1f} {v['idle_ms']:10.1f} {v['events']:8d}")
    print("\nkernel time by kind (ms)")
    for k, v in s["kinds_ms"].items():
        print(f"  {k:32s} {v:9.1f}")
    gaps = s.get("compute_gaps") or {}
    if gaps:
        print(f"\ncompute stream {gaps['stream']}: idle stretches")
        for k, v in gaps["buckets"].items():
            print(f"  {k:>14} {v['count']:6d}x {v['ms']:9.1f} ms")
        for g in gaps["longest"]:
            print(f"  {g['ms']:8.2f} ms before {g['next_kernel']}")
    print("\ntop kernels")
    for t in s["top_kernels"]:
        print(f"  {t['ms']:8.1f} ms {t['count']:6d}x  {t['kind']:12s} {t['name'][:100]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    with open(args.trace) as f:
        s = summarize(json.load(f))
    print_summary(s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
