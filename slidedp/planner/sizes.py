"""The GPU work sizes a plan may weigh: what to measure on the GPU before planning (measure.py).

Memory alone decides them (no times), so the launcher lists them before the blocks are measured and
the plan made (launch/planning.py).
"""

from __future__ import annotations

from slidedp.planner.plan import _base_choices, _fit, _fit_at, _micro_batches
from slidedp.planner.workload import Workload


def device_work_sizes(work: Workload, budget: int, allowed: dict[str, tuple] | None = None) -> list[tuple[int, int, int]]:
    """The (micro_batch, seq_tile_tokens, loss_chunk_tokens) of every plan make_plan may weigh for this
    budget (memory alone decides them): the GPU blocks to measure before planning."""
    sizes = set()
    for base in _base_choices(work, allowed):
        fits = ([_fit(work, base, budget)] if work.micro_batch else
                [_fit_at(work, base, mb, budget, grow=False) for mb in _micro_batches(work)])
        sizes |= {(ch.micro_batch, ch.seq_tile_tokens, ch.loss_chunk_tokens) for ch in fits if ch is not None}
    return sorted(sizes)
