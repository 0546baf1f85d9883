"""How fast a batch's embedding rows reach the GPU from a host-held fp32 embedding.

    python3 -m benchmarks.host_rows --out FILE.json [--vocab 151936] [--hidden 4096] [--tokens 16384,65536]
                                    [--reps 5] [--threads 2]

Two ways, each the median of `--reps` gathers of `--tokens` random token ids (cast to bf16 on the GPU):
- `device`: slidedp.store.host_rows, the GPU reading the rows in place from the table registered
  and mapped as a worker registers the store (the worker's path on CUDA);
- `cpu`: F.embedding on the CPU with `--threads` threads (a worker's), then `.to(cuda, bf16)` from
  pageable memory (the worker's path before host_rows.py, and its fallback).
The host is otherwise idle here; in training the updaters' AdamW runs beside the CPU gather.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from slidedp.store.host_rows import HostRows
from slidedp.store.hostmem import Registration


def _timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", default="16384,65536")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_rows: needs CUDA (the rows' way to the GPU is what it measures)")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.set_num_threads(args.threads)
    table = torch.randn(args.vocab, args.hidden)
    reg = Registration()
    reg.register(table, "the benchmark's embedding")
    rows = HostRows(table, device, torch.bfloat16)
    result = {"device": torch.cuda.get_device_name(device), "vocab": args.vocab, "hidden": args.hidden,
              "threads": args.threads, "mapped": rows.on_device, "rows": []}
    try:
        for tokens in map(int, args.tokens.split(",")):
            ids = torch.randint(0, args.vocab, (tokens,))
            ids_dev = ids.to(device)
            nbytes = tokens * args.hidden * 4
            on_device = _timed(lambda ids=ids, ids_dev=ids_dev: rows.rows(ids, ids_dev), args.reps) if rows.on_device else None
            on_cpu = _timed(lambda ids=ids: F.embedding(ids, table).to(device, torch.bfloat16), args.reps)
            assert not rows.on_device or torch.equal(rows.rows(ids, ids_dev).view(torch.int16),
                                                     F.embedding(ids, table).to(device, torch.bfloat16).view(torch.int16))
            row = {"tokens": tokens, "fp32_bytes": nbytes, "device_s": on_device, "cpu_s": on_cpu,
                   "device_gbps": nbytes / on_device / 1e9 if on_device else None, "cpu_gbps": nbytes / on_cpu / 1e9}
            result["rows"].append(row)
            print(json.dumps(row))
    finally:
        torch.cuda.synchronize()
        reg.unregister()
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
