"""Host memory traffic: bytes of host memory each piece of the pipeline reads and writes per element.

One table for the two that count it: the planner (planner/costs.py, the step model's host bytes
per parameter and the bound host bandwidth sets) and the aggregator (what the updaters and its own
sums moved in a step, for metrics.jsonl). No torch here.

Per element of a chunk:
- a fetch reads the delivered copy once: 4 B (fp32 master) or 2 B (the bf16 shadow); the DMA
  writes nothing on the host;
- a gradient out writes 4 B (fp32) into a ring slot;
- the fused AdamW reads master, exp_avg, exp_avg_sq and the gradient (16 B) and writes the three
  states (12 B): 28 B;
- the shadow: after torch's kernel (the default) a second pass (store.refresh_shadow) reads the new
  master (4 B) and writes the shadow (2 B); with SLIDEDP_ADAMW_KERNEL=all the compiled kernel
  (slidedp/adamw.py, numba) casts each block while it is in cache and writes only the shadow (2 B);
- a correction of a speculative update (undo, then the clipped redo, block by block in cache,
  clipping/rollback.py) touches the chunk's state about once: one AdamW's bytes, and the refresh again;
- the aggregator's sum of N ranks' gradients reads N and writes 1 (4 B each); a copy reads 1 and
  writes 1.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Mapping


KERNELS = ("correction", "all", "torch")


def adamw_kernel(environ: Mapping[str, str] | None = None) -> str:
    """Which AdamW kernels the updaters run, from SLIDEDP_ADAMW_KERNEL (told without importing numba):
    "correction" (the default): torch's fused kernel for every update, slidedp/adamw.py's compiled
    one-pass kernel for the corrections of speculated chunks; "all": the compiled kernel also for
    clipped and shadow updates (the shadow cast inside the pass); "torch": torch's for everything.
    Without numba, "torch" whatever is asked."""
    env = os.environ if environ is None else environ
    kind = env.get("SLIDEDP_ADAMW_KERNEL", "correction")
    if kind not in KERNELS:
        raise ValueError(f"SLIDEDP_ADAMW_KERNEL must be one of {', '.join(KERNELS)}, got {kind!r}")
    return kind if importlib.util.find_spec("numba") is not None else "torch"


FP32 = 4
ADAMW_BYTES = 16 + 12  # reads p, m, v, g; writes p, m, v
SHADOW_IN_PASS_BYTES = 2  # the compiled kernel writes the shadow from cache, inside the AdamW pass
SHADOW_PASS_BYTES = 4 + 2  # torch's kernel: a pass of its own reads the new master, writes its bf16 copy
SHADOW_REFRESH_BYTES = SHADOW_IN_PASS_BYTES if adamw_kernel() == "all" else SHADOW_PASS_BYTES


def fetch_bytes(delivery: str) -> int:
    """Host bytes read per parameter of a fetch: the fp32 master or the bf16 shadow."""
    if delivery not in ("fp32", "bf16"):
        raise ValueError(f"delivery must be 'fp32' or 'bf16', got {delivery!r}")
    return 4 if delivery == "fp32" else 2


def update_bytes(shadow: bool) -> int:
    """Host bytes of one CPU AdamW of a parameter, with the shadow refresh where the store has a shadow
    (the updater refreshes it whatever the delivery)."""
    return ADAMW_BYTES + (SHADOW_REFRESH_BYTES if shadow else 0)


def sum_bytes(inputs: int) -> int:
    """Host bytes per element of the aggregator's fp32 sum of `inputs` gradients (1: a copy)."""
    return (inputs + 1) * FP32
