"""The planner's AdamW probe at the updaters' own chunk sizes and thread counts.

    python3 -m benchmarks.updater_probe --out FILE.json [--params 50,67,101,193] [--threads 13,16]
                                        [--repeat 5] [--device cuda]

The calibration measures the updaters' rate beside the GPU's copies once per host, on 67 M parameters
(64 x 2^20) and every thread (`measure.adamw_beside_copies`). In training an updater updates a layer's chunk (50 M
parameters for Qwen3-1.7B, 101 M for Qwen3-4B, 193 M for Qwen3-8B) on the threads the launcher leaves
it (13 on the 16-core H200 host), and in every recorded first run its rate over the probe's grew with
the chunk (docs/tuning.md, "Qwen3-8B's first plans at 9b9464a"). One row per (parameters, threads): the
bare fused AdamW and the probe itself, each the median of `--repeat` timed runs, in params/s; on a CPU
device the probe's copies are a memcpy thread.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from slidedp.planner import measure
from slidedp.planner.calibration import _adamw_rate


def probe(params: int, threads: int, device: str, repeat: int) -> dict[str, float | int]:
    """The bare kernel and the calibration's probe, both on `threads` threads over `params` parameters."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        bare = _adamw_rate(params, "cpu", lambda: None, repeat)
    finally:
        torch.set_num_threads(before)
    beside = measure.adamw_beside_copies(threads, device, 1, params=params, repeat=repeat)
    return {"params": params, "threads": threads, "bare_params_per_s": bare, "beside_copies_params_per_s": beside,
            "beside_over_bare": beside / bare}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the JSON to write")
    p.add_argument("--params", default="50,67,101,193", help="comma-separated millions of parameters")
    p.add_argument("--threads", default="13,16", help="comma-separated thread counts")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    result = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.machine(),
              "cpus": torch.get_num_threads(), "rows": []}
    for millions in map(int, args.params.split(",")):
        for threads in map(int, args.threads.split(",")):
            row = probe(millions * 1_000_000, threads, args.device, max(1, args.repeat))
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
