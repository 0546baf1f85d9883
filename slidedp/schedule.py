"""The learning rate of each step: one function, shared by the reference and the real updater."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slidedp.config import TrainSection


def schedule_span(train: "TrainSection") -> tuple[int, int]:
    """(first, end) of the steps the schedule spans: train.schedule_start .. (train.schedule_steps or train.steps) - 1."""
    return train.schedule_start, train.schedule_steps or train.steps


def lr_at(train: "TrainSection", step: int) -> float:
    """LR for 0-based `step`: linear warmup, then decay to lr * min_lr_ratio at the schedule's last step.

    The schedule spans steps schedule_start .. end - 1 (end = schedule_steps, default train.steps;
    schedule_start default 0): a store trained further can continue its old schedule (schedule_steps
    = the old train.steps) or start a new one (schedule_start = its committed step). Counting s =
    step - schedule_start: warmup lr * (s + 1) / warmup_steps, so the first step already moves; after
    warmup, "cosine" and "linear" decay from lr (at s == warmup_steps) to the floor (at end - 1) and
    stay there beyond; "constant" keeps lr. With no step left to decay over the lr after warmup is lr.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    first, end = schedule_span(train)
    step = max(0, step - first)
    lr, warmup = train.lr, train.warmup_steps
    if step < warmup:
        return lr * (step + 1) / warmup
    span = end - first - 1 - warmup
    if train.schedule == "constant" or span <= 0:
        return lr
    progress = min((step - warmup) / span, 1.0)
    floor = lr * train.min_lr_ratio
    if train.schedule == "linear":
        return lr - (lr - floor) * progress
    return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
