"""The launcher's end-of-run summary (launch/summary.py): what it says of a run's records."""

from __future__ import annotations

from slidedp.launch.summary import summary


def rec(step: int, step_s: float, **kw) -> dict:
    return {"step": step, "loss": 2.0 - step / 10, "tokens_per_s": 1000 / step_s, "step_s": step_s, "forward_s": 0.4,
            "backward_s": 0.5, "wait_version_s": 0.1, "update_busy_s": 0.8} | kw


def test_the_summary_says_the_steady_median_and_where_the_time_went():
    text = summary([rec(0, 30.0), rec(1, 2.0), rec(2, 1.0), rec(3, 3.0)], 36.0, None)
    assert text.splitlines() == [
        "summary    steps 0..3 (4 committed) in 36.0 s",
        "           500 tokens/s median, 2.000 s/step (the first step, with the start-up, left out)",
        "loss       2.0000 first, 1.7000 last",
        "time       per step (median, slowest rank): forward 0.400 s, backward 0.500 s, waiting for updates 0.100 s",
        "           beside them: updaters busy 0.800 s",
        "checkpoint none written",
    ]


def test_the_summary_says_when_the_allocator_reached_the_budget():
    records = [rec(0, 30.0, device_alloc_retries=7)] + [rec(s, 2.0, device_alloc_retries=r)
                                                       for s, r in ((1, 2), (2, 5), (3, 0))]
    line = [x for x in summary(records, 36.0, None).splitlines() if x.startswith("memory")]
    assert line == ["memory     the GPU's caching allocator reached memory.device_budget_gib 2 time(s) a step (median, "
                    "one rank): each time it freed its cache, which synchronizes the device, so no copy overlapped "
                    "compute across it; a larger budget, or a plan that fits in less, avoids it"]
    assert "allocator" not in summary([rec(0, 30.0, device_alloc_retries=7), rec(1, 2.0, device_alloc_retries=0)],
                                      32.0, None)
