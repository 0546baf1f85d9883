"""What the learning-rate schedule does when a job trains a store further: said at start-up, with the choice.

`train.steps` is the total, so a larger one on a trained store stretches the schedule over the new
total, and the LR of the next step jumps back up the curve (3.0e-4 to 1.7e-3 at step 60 of the demo
at 120 steps). Some want that; most want the old schedule continued (its floor) or a new one from
here (warmup and decay over the steps left). The job file says which (train.schedule_steps,
train.schedule_start); this says what the job will do, and how to choose otherwise.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from slidedp import old_names
from slidedp.config import ConfigError, TrainSection
from slidedp.schedule import lr_at, schedule_span

_SCHEDULE_KEYS = ("steps", "lr", "warmup_steps", "schedule", "min_lr_ratio", "schedule_start", "schedule_steps")


def _previous(train: dict[str, Any] | None) -> TrainSection | None:
    if not train:
        return None
    try:
        return TrainSection(**old_names.train_record(train))
    except (ConfigError, TypeError):  # a record of another SlideDP version
        return None


def schedule_note(previous_train: dict[str, Any] | None, train: TrainSection, start: int) -> str | None:
    """The start-up line for a job that starts at `start` on a store whose last job trained with
    `previous_train` (its [train] section); None when the job starts at 0 or nothing is known."""
    old = _previous(previous_train)
    if start <= 0 or start >= train.steps or old is None:
        return None
    first, end = schedule_span(train)
    old_lr, new_lr = lr_at(old, start - 1), lr_at(train, start)
    same = all(getattr(old, k) == getattr(train, k) for k in _SCHEDULE_KEYS)
    text = (f"learning rate: step {start} trains at {new_lr:.3e} on a {train.schedule} schedule over steps "
            f"{first}..{end - 1}; the store's last job trained step {start - 1} at {old_lr:.3e}")
    if same or train.schedule_start or train.schedule_steps:
        return text  # the same schedule going on, or one the job file chose
    old_end = old.schedule_steps or old.steps
    return (f"{text} (train.steps {old.steps} -> {train.steps} stretches the schedule). To continue the old "
            f"schedule instead (steps {start}..{train.steps - 1} at {lr_at(replace(train, schedule_steps=old_end), start):.3e}), "
            f"set train.schedule_steps = {old_end}; to start a new one over steps {start}..{train.steps - 1} "
            f"(warmup {train.warmup_steps}, then {train.schedule}), set train.schedule_start = {start}")

