"""The updaters' share of the bare AdamW kernel in training, from first runs' cache files, with a fixed
cost per chunk update taken out.

    python3 -m benchmarks.updater_share benchmarks/results/updater-share/*-calibration.json [--per-chunk-ms 5.5]

Each CAL.json is a first run's calibration cache (`plan_choice.sh` / `first_runs.sh` return it as
`cache-calibration-*.json`; `benchmarks/results/updater-share/plan-choice-SHAPE-bBATCH-*-calibration.json`), its
blocks file beside it (`-measured.json`). The cache holds the bare kernel's rate and the rate the
updaters ran at in that run (`learned`). Until the manifest fix (the `before-fix` files) every chunk
update also paid ~5-6 ms of manifest reads: the kernel's own rate is the chunks' parameters over the
busy time less that cost per chunk. Which chunks the host updated (the
layers not held on the device, the embedding where it stays on the host) is the plan the cache replays
to (`benchmarks.replay_plan`, this checkout's step model). `--per-chunk-ms 0` for runs after the fix.
Shapes are read from the file name (Qwen3 named shapes; others are left out, with a line saying so).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks import replay_plan
from slidedp.model.config import named_shape
from slidedp.store.layout import make_layout, unit_name

_NAME = re.compile(r"plan-choice-(?P<shape>.+?)-b(?P<batch>\d+)-")


def host_chunks(shape: str, device_layers: int, embedding: str) -> list[int]:
    """The parameters of each chunk the host's updaters update under a plan."""
    out = []
    for chunk in make_layout(named_shape(shape)).chunks:
        unit = unit_name(chunk)
        if unit.startswith("layer.") and int(unit.split(".")[1]) < device_layers:
            continue
        if unit == "embed" and embedding == "device":
            continue
        out.append(chunk.numel)
    return out


def share(cal_path: Path, per_chunk_s: float, clip: bool = False) -> dict[str, Any] | None:
    """One run's figures, or None where its shape is not a named one or its cache learned no rate."""
    m = _NAME.search(cal_path.name)
    if m is None:
        return None
    learned = json.loads(cal_path.read_text()).get("learned") or {}
    if len(learned) != 1:
        return None
    shape, batch = m["shape"], int(m["batch"])
    try:
        cfg = named_shape(shape)
    except (KeyError, ValueError):
        return None
    (fields,) = learned.values()
    observed = float(fields["adamw_train_params_per_s"])
    blocks = cal_path.with_name(cal_path.name.replace("-calibration", "-measured"))
    calib, shapes = replay_plan.load(cal_path, blocks, cfg.num_parameters(), False)
    plan = replay_plan.replay(calib, shapes, shape, batch, [0], clip=clip)[0]
    chunks = host_chunks(shape, plan["device_layers"], plan["embedding"])
    params = sum(chunks)
    kernel_busy = params / observed - len(chunks) * per_chunk_s
    kernel = params / kernel_busy
    bare = calib.adamw_params_per_s
    return {"file": cal_path.name, "shape": shape, "batch": batch, "bare": bare, "observed": observed,
            "kernel": kernel, "observed_share": observed / bare, "kernel_share": kernel / bare,
            "chunks": len(chunks), "device_layers": plan["device_layers"], "embedding": plan["embedding"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("calibrations", nargs="+", type=Path)
    p.add_argument("--per-chunk-ms", type=float, default=5.5, help="the fixed cost of a chunk update to take out")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    rows = []
    for path in a.calibrations:
        row = share(path, a.per_chunk_ms / 1e3)
        if row is None:
            print(f"left out {path.name}: not a named shape, or no rate learned", file=sys.stderr)
        else:
            rows.append(row)
    if a.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    print("file                                               bare  in training  kernel  share  kernel share  chunks")
    for r in rows:
        print(f"{r['file'][:50]:50} {r['bare'] / 1e9:5.2f} {r['observed'] / 1e9:12.2f} {r['kernel'] / 1e9:7.2f} "
              f"{r['observed_share']:6.2f} {r['kernel_share']:13.2f} {r['chunks']:7d}")
    if rows:
        shares = [r["kernel_share"] for r in rows]
        print(f"{len(rows)} runs: kernel share median {statistics.median(shares):.2f}, mean "
              f"{statistics.fmean(shares):.2f}, {min(shares):.2f}-{max(shares):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
