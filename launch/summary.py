"""The one-screen summary printed at the end of a run: what was trained, how fast, where the time went."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

# Where a step's time went, as metrics.jsonl names it: the slowest rank's parts, then the daemons' busy time.
_PARTS = (("forward_s", "forward"), ("backward_s", "backward"), ("wait_version_s", "waiting for updates"),
          ("wait_slot_s", "waiting for gradient slots"), ("wait_loss_s", "waiting for the loss"),
          ("write_back_s", "writing held layers back"))
_BESIDE = (("update_busy_s", "updaters busy"), ("reduce_busy_s", "aggregator busy"))


def _median(records: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def _rate(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e4 else f"{x:.0f}"


def summary(records: list[dict[str, Any]], wall_s: float, checkpoint: Path | None, stopped: str = "",
            network: str = "") -> str:
    """The summary of this run's records (as written to metrics.jsonl); `stopped` says why it ended early;
    `network`: on several hosts, what the ranks measured of the network between hosts, in words."""
    if not records:
        return ""
    first, last = records[0], records[-1]
    steady = records[1:] or records  # the first step holds the start-up
    lines = [f"summary    steps {first['step']}..{last['step']} ({len(records)} committed) in {wall_s:.1f} s"
             + (f"; {stopped}" if stopped else "")]
    rate = _median(steady, "tokens_per_s")
    step_s = _median(steady, "step_s")
    if rate is not None and step_s is not None:
        lines.append(f"           {_rate(rate)} tokens/s median, {step_s:.3f} s/step"
                     + (" (the first step, with the start-up, left out)" if len(records) > 1 else ""))
    losses = [r["loss"] for r in records if r.get("loss") is not None]
    if losses:
        lines.append(f"loss       {losses[0]:.4f} first, {losses[-1]:.4f} last"
                     + (f"; {sum(1 for r in records if r.get('skipped'))} step(s) skipped"
                        if any(r.get("skipped") for r in records) else ""))
    parts = [(name, _median(steady, key)) for key, name in _PARTS]
    parts = [(n, v) for n, v in parts if v]
    if parts:  # parts overlap (a wait for an update happens inside the forward): seconds, not shares
        lines.append("time       per step (median, slowest rank): " + ", ".join(f"{n} {v:.3f} s" for n, v in parts))
    beside = [(name, _median(steady, key)) for key, name in _BESIDE]
    beside = [(n, v) for n, v in beside if v]
    if beside:
        lines.append("           beside them: " + ", ".join(f"{n} {v:.3f} s" for n, v in beside))
    retries = _median(steady, "device_alloc_retries")
    if retries:
        lines.append(f"memory     the GPU's caching allocator reached memory.device_budget_gib {retries:.0f} time(s) a step "
                     "(median, one rank): each time it freed its cache, which synchronizes the device, so no copy "
                     "overlapped compute across it; a larger budget, or a plan that fits in less, avoids it")
    if network:
        lines.append(f"network    {network}")
    lines.append(f"checkpoint {checkpoint if checkpoint is not None else 'none written'}")
    return "\n".join(lines)
