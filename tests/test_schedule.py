from __future__ import annotations

import math

import pytest

from slidedp.config import TrainSection
from slidedp.schedule import lr_at


def train(**kw) -> TrainSection:
    base = dict(steps=11, global_batch=1, seq_len=1, lr=1.0, warmup_steps=2, min_lr_ratio=0.1)
    return TrainSection(**{**base, **kw})


def test_cosine():
    t = train()  # warmup steps 0, 1; decay over steps 2..10 (span 8)
    assert lr_at(t, 0) == 0.5 and lr_at(t, 1) == 1.0
    assert lr_at(t, 2) == 1.0
    assert lr_at(t, 6) == pytest.approx(0.55, abs=1e-15)  # halfway: (1 + 0.1) / 2
    assert lr_at(t, 4) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), abs=1e-15)
    assert lr_at(t, 10) == pytest.approx(0.1, abs=1e-15)
    assert lr_at(t, 25) == pytest.approx(0.1, abs=1e-15)  # past the end: the floor
    lrs = [lr_at(t, s) for s in range(2, 11)]
    assert all(a > b for a, b in zip(lrs, lrs[1:]))


def test_linear_and_constant():
    t = train(schedule="linear", lr=2.0, min_lr_ratio=0.0)
    assert [lr_at(t, s) for s in (0, 1, 2, 6, 10)] == pytest.approx([1.0, 2.0, 2.0, 1.0, 0.0], abs=1e-15)
    t = train(schedule="constant", lr=2.0)
    assert [lr_at(t, s) for s in (0, 1, 2, 10, 50)] == [1.0, 2.0, 2.0, 2.0, 2.0]


def test_example_schedule():
    t = train(steps=60, lr=3e-3, warmup_steps=5)
    assert lr_at(t, 0) == pytest.approx(6e-4) and lr_at(t, 4) == 3e-3 and lr_at(t, 5) == 3e-3
    assert lr_at(t, 59) == pytest.approx(3e-4)


def test_no_warmup_and_edge_cases():
    assert lr_at(train(warmup_steps=0), 0) == 1.0
    assert lr_at(train(warmup_steps=0, steps=1), 0) == 1.0  # nothing to decay over
    assert lr_at(train(warmup_steps=4, steps=3), 2) == 0.75  # warmup longer than the run
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        lr_at(train(), -1)
