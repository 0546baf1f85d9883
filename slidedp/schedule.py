"""The learning rate of each step: one function, shared by the reference and the real updater."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slidedp.config import TrainSection


def lr_at(train: "TrainSection", step: int) -> float:
    """LR for 0-based `step`: linear warmup, then decay to lr * min_lr_ratio at step == steps - 1.

    Warmup: lr * (step + 1) / warmup_steps, so the first step already moves. After warmup,
    "cosine" and "linear" decay from lr (at step == warmup_steps) to the floor (at steps - 1)
    and stay there beyond; "constant" keeps lr. With no step left to decay over
    (warmup_steps >= steps - 1) the lr after warmup is lr.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    lr, warmup = train.lr, train.warmup_steps
    if step < warmup:
        return lr * (step + 1) / warmup
    span = train.steps - 1 - warmup
    if train.schedule == "constant" or span <= 0:
        return lr
    progress = min((step - warmup) / span, 1.0)
    floor = lr * train.min_lr_ratio
    if train.schedule == "linear":
        return lr - (lr - floor) * progress
    return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
