"""Plan a job again off the GPU machine, from the calibration and blocks a device call brought back.

    python -m benchmarks.replay_plan CAL.json BLOCKS.json --shape qwen3-4b --batch 8 [--micro 0,1,2,4,8]
        [--budget-gib 24] [--seq 2048] [--clip 1.0] [--learned]

CAL.json and BLOCKS.json are the launcher's cache files (`calibration-HOST-GPU.json`,
`measured-HOST-GPU.json`; `benchmarks/sessions/plan_choice.sh` returns them as `cache-*.json`).
For each micro-batch (0: the plan's choice) it prints what the plan holds, offloads and predicts
in both clipping regimes, with the step model of this checkout: what a change to the model would
have predicted for runs already measured. --learned charges the AdamW rate the cache learned
from runs of this model (the forced runs of a call had it); without it, the first plan's.

What the launcher would take from the job file is fixed here as the plan_choice.sh runs had it: one
rank and one updater, bf16 compute with the pointwise kernels compiled, fp32 delivery (those runs'
plans chose it; a store without the bf16 shadow allows nothing else), offloading and the embedding's
place left to the plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from slidedp.model.config import named_shape
from slidedp.planner import cache, measure
from slidedp.planner.calibration import Calibration
from slidedp.planner.plan import make_plan
from slidedp.planner.workload import Workload

GiB = 1 << 30


def load(cal_path: Path, blocks_path: Path, model_params: int,
         learned: bool) -> tuple[Calibration, dict[str, measure.MeasuredBlocks]]:
    """The cache's calibration (with what runs of this model measured, if `learned`), and its blocks by shape
    (of either schema: a replay uses the blocks a run was planned with)."""
    return cache.load(cal_path, model_params if learned else None), cache.read_blocks(blocks_path, cache.READABLE_SCHEMAS)


def replay(calib: Calibration, shapes: dict[str, measure.MeasuredBlocks], shape: str, batch: int, micro_batches: list[int], seq: int = 2048,
           budget_gib: float = 24.0, clip: bool = True, compute_dtype: str = "bf16", compiled: bool = True) -> list[dict]:
    """One row per micro-batch asked: the plan's choices and its predicted step in both regimes."""
    cfg = named_shape(shape)
    key = measure.shape_key(cfg, seq, compute_dtype, compiled)
    if key not in shapes:
        raise SystemExit(f"the blocks file has no entry for {key!r}; it has {sorted(shapes)}")
    calib = dataclasses.replace(calib, blocks=shapes[key])
    rows = []
    for mb in micro_batches:
        work = Workload(model=cfg, global_batch=batch, seq_len=seq, world=1, micro_batch=mb, compute_dtype=compute_dtype,
                        clip=clip, compiled=compiled)
        plan = make_plan(work, int(budget_gib * GiB), calib,
                         {"activations": ("keep", "offload"), "delivery": ("fp32",), "embedding": ("device", "host")})
        s = plan.step  # it carries the predictions the plan made: both regimes where clipping is on
        free = s.predicted_step_s
        clipped = s.predicted_clipped_step_s if clip else free
        rows.append({"asked": mb, "micro_batch": s.micro_batch, "device_layers": s.device_layers,
                     "offload_layers": s.offload_layers, "embedding": s.embedding, "unclipped_s": free,
                     "clipped_s": clipped, "judged_s": max(free, clipped)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("calibration", type=Path)
    p.add_argument("blocks", type=Path)
    p.add_argument("--shape", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--micro", default="0,1,2,4,8", help="comma-separated micro-batches; 0: the plan's choice")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--budget-gib", type=float, default=24.0)
    p.add_argument("--clip", type=float, default=1.0, help="max_grad_norm; 0: no clipping")
    p.add_argument("--learned", action="store_true", help="charge the AdamW rate runs of this model measured")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    micro = [int(x) for x in a.micro.split(",") if x.strip()]
    params = named_shape(a.shape).num_parameters()
    calib, shapes = load(a.calibration, a.blocks, params, a.learned)
    rows = replay(calib, shapes, a.shape, a.batch, [m for m in micro if m == 0 or a.batch % m == 0], a.seq,
                  a.budget_gib, a.clip > 0)
    if a.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    print(f"{a.shape}, {a.batch} x {a.seq} tokens, {a.budget_gib:g} GiB, clip {a.clip:g}; AdamW at "
          f"{calib.update_params_per_s(params, False) / 1e9:.2f} G params/s ({'learned' if a.learned else 'first plan'})")
    print("asked  micro_batch  held  offloaded  embedding  unclipped s  clipped s")
    for r in rows:
        print(f"{r['asked'] or 'plan':>5}  {r['micro_batch']:>11}  {r['device_layers']:>4}  {r['offload_layers']:>9}  "
              f"{r['embedding']:>9}  {r['unclipped_s']:>11.3f}  {r['clipped_s']:>9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
