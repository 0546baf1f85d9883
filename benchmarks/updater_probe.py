"""The planner's AdamW probe at the updaters' own chunk sizes and thread counts.

    python3 -m benchmarks.updater_probe --out FILE.json [--params 50,67,101,193] [--threads 13,16]
                                        [--memory anon,shm] [--repeat 5] [--device cuda]

The calibration measures the updaters' rate beside the GPU's copies once per host, on 67 M parameters
(64 x 2^20) and every thread (`measure.adamw_beside_copies`). In training an updater updates a layer's chunk (50 M
parameters for Qwen3-1.7B, 101 M for Qwen3-4B, 193 M for Qwen3-8B) on the threads the launcher leaves
it (13 on the 16-core H200 host), and in every recorded first run its rate over the probe's grew with
the chunk. One row per (parameters, threads): the
bare fused AdamW and the probe itself, each the median of `--repeat` timed runs, in params/s; on a CPU
device the probe's copies are a memcpy thread. `--memory`: where the four tensors live: `anon`, the
process's own memory (the calibration's probe), or `shm`, one POSIX shared-memory segment made as the
store makes its segments (`Segment.create`, huge pages asked for). The JSON also records the host's
transparent huge page settings and how many huge pages each kind of memory got.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from slidedp.planner import measure
from slidedp.planner.calibrate import _adamw_rate


def probe(params: int, threads: int, device: str, repeat: int, memory: str = "anon") -> dict[str, Any]:
    """The bare kernel and the calibration's probe, both on `threads` threads over `params` parameters
    held in `memory` ("anon" or "shm")."""
    with _state(params, memory) as state:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            bare = _adamw_rate(params, "cpu", lambda: None, repeat, state)
            huge = _huge_pages_kib()
        finally:
            torch.set_num_threads(before)
        beside = measure.adamw_beside_copies(threads, device, 1, params=params, repeat=repeat, state=state)
    return {"params": params, "threads": threads, "memory": memory, "bare_params_per_s": bare,
            "beside_copies_params_per_s": beside, "beside_over_bare": beside / bare, "huge_pages_kib": huge}


@contextlib.contextmanager
def _state(params: int, memory: str) -> Iterator[tuple[torch.Tensor, ...] | None]:
    """None for the process's own memory (the calibration makes its tensors); for "shm", param, grad
    and both moments in one shared-memory segment, removed afterwards."""
    if memory == "anon":
        yield None
        return
    if memory != "shm":
        raise ValueError(f"--memory takes anon or shm, not {memory!r}")
    from slidedp.store.shm import Segment

    seg = Segment.create(f"/slidedp.updater-probe-{os.getpid()}", 4 * params * 4)
    try:
        p, g, m, v = (seg.tensor(torch.float32, offset=i * params, count=params) for i in range(4))
        p.uniform_()
        g.uniform_()
        yield p, g, m, v
        del p, g, m, v
    finally:
        seg.close()
        seg.unlink()


def _huge_pages_kib() -> dict[str, int]:
    """The host's huge pages in use now, by kind (/proc/meminfo), in KiB; {} where it cannot be read."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    keys = ("AnonHugePages", "ShmemHugePages")
    return {k: int(ln.split()[1]) for ln in lines for k in keys if ln.startswith(k + ":")}


def _thp_settings() -> dict[str, str]:
    base = Path("/sys/kernel/mm/transparent_hugepage")
    found = {}
    for name in ("enabled", "shmem_enabled", "defrag"):
        try:
            found[name] = (base / name).read_text().strip()
        except OSError:
            pass
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the JSON to write")
    p.add_argument("--params", default="50,67,101,193", help="comma-separated millions of parameters")
    p.add_argument("--threads", default="13,16", help="comma-separated thread counts")
    p.add_argument("--memory", default="anon", help="comma-separated: anon (the process's own), shm (as the store's)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    result = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.machine(),
              "cpus": torch.get_num_threads(), "transparent_hugepage": _thp_settings(), "rows": []}
    for millions in map(int, args.params.split(",")):
        for threads in map(int, args.threads.split(",")):
            for memory in args.memory.split(","):
                row = probe(millions * 1_000_000, threads, args.device, max(1, args.repeat), memory)
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
