"""slidedp-report RUN_DIR: what a run did, as a short summary and PNG plots.

    slidedp-report runs/tiny                # summary + runs/tiny/report/*.png
    slidedp-report runs/tiny --step 5       # the timeline of traced step 5
    slidedp-report runs/tiny --no-plots     # the summary alone (no matplotlib needed)

Reads <run dir>/metrics.jsonl (one record per step, schema in launch/progress.py) and, if the
run traced steps (run.trace_steps), <run dir>/trace.json. Plots: loss and tokens/s over the
steps, where each step's time went, and the pipeline timeline of a traced step (one row per
worker stream, the aggregator and each updater). The summary says the median step, tokens/s,
where the time went, and the measured step against the plan's prediction.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from slidedp import old_names
from slidedp.step_records import timed_steps, write_backs
from slidedp.stepplan import PLAN_FILE, StepPlan, StepPlanError

from . import tracefile

WAITS = ("wait_version_s", "wait_slot_s", "wait_loss_s")
# Worker time, in the order a step spends it; the host side (update, reduce) runs beside it.
WORKER_PARTS = (("forward_s", "forward"), ("backward_s", "backward"), ("wait_version_s", "waiting for updates"),
                ("wait_slot_s", "waiting for gradient slots"), ("wait_loss_s", "waiting for the loss"))
HOST_PARTS = (("update_busy_s", "updaters busy (AdamW)"), ("reduce_busy_s", "aggregator busy (sums)"))


class ReportError(RuntimeError):
    pass


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The run's step records in step order; a step recorded twice (a rerun after a resume) keeps its last record."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"{path} not found: is {run_dir} a run directory (runs/<name>, or the job's run.dir)?")
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue  # a launcher killed mid-write leaves a torn last line
        if isinstance(r, dict) and isinstance(r.get("step"), int):
            by_step[r["step"]] = old_names.current(r)  # a run of an older version, too
    if not by_step:
        raise ReportError(f"{path} holds no step records yet")
    return [by_step[s] for s in sorted(by_step)]


def read_trace(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / tracefile.TRACE_FILE
    if not path.is_file() and (run_dir / tracefile.TRACE_DIR).is_dir():
        tracefile.merge(run_dir)  # the launcher did not get to merge (killed): do it now
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ReportError(f"{path} is not valid JSON: {e}") from None


def _median(records: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def steady(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records without the first step (it holds the workers' start-up, unless it is the only one) and
    without the write-back steps while others remain (`slidedp.step_records`)."""
    return timed_steps(records, 1 if len(records) > 1 else 0)


def summary(records: list[dict[str, Any]]) -> list[str]:
    rs = steady(records)
    first, last = records[0], records[-1]
    skipped = sum(1 for r in records if r.get("skipped"))
    step_s = _median(rs, "step_s") or 0.0
    tokens = last.get("tokens") or 0
    lines = [f"steps        {first['step']}..{last['step']} ({len(records)} recorded"
             f"{f', {skipped} skipped (non-finite loss or gradient)' if skipped else ''})"]
    if first.get("loss") is not None and last.get("loss") is not None:
        lines.append(f"loss         {first['loss']:.4f} -> {last['loss']:.4f}")
    evals = [r for r in records if r.get("eval_loss") is not None]
    if evals:
        lines.append(f"eval loss    {evals[0]['eval_loss']:.4f} -> {evals[-1]['eval_loss']:.4f} "
                     f"({len(evals)} eval(s), the last after step {evals[-1]['step'] + 1})")
    backs = write_backs(records, 1)
    left_out = (["the first, with start-up"] if len(records) > 1 else []) + (
        [f"{len(backs)} with a write-back of device-held units (median {statistics.median(backs):.3f} s)"]
        if backs and len(rs) < len(records) - 1 else [])
    lines.append(f"step         median {step_s:.3f} s over {len(rs)} step(s)"
                 + (f" ({' and '.join(left_out)}, left out)" if left_out else ""))
    if step_s > 0:
        lines.append(f"throughput   {tokens / step_s:,.0f} tokens/s ({tokens:,} tokens per step)")
    worker = _median(rs, "worker_step_s") or step_s
    lines.append(f"where the time went (median per step; workers: the slowest rank of {worker:.3f} s)")
    for key, what in WORKER_PARTS:
        v = _median(rs, key)
        if v is not None:
            lines.append(f"  {what:<30}{v:>9.3f} s  {100 * v / worker if worker else 0:>4.0f}%")
    for key, what in HOST_PARTS:
        v = _median(rs, key)
        if v is not None:
            lines.append(f"  {what:<30}{v:>9.3f} s  {100 * v / step_s if step_s else 0:>4.0f}% of the step, "
                         f"beside the workers")
    host = _median(rs, "host_bytes_per_param")  # a run from before it has none
    if host is not None:
        h2d, d2h = _median(rs, "h2d_bytes"), _median(rs, "d2h_bytes")
        lines.append(f"host memory  {host:.1f} B/param read and written per step (median): the ranks' copies in "
                     f"{(h2d or 0) / 2**30:.2f} GiB and gradients out {(d2h or 0) / 2**30:.2f} GiB, the rest the "
                     f"updaters' AdamW and the aggregator's sums")
    lines += clipping_summary(rs)
    predicted = _median(rs, "predicted_step_s")
    if predicted:
        lines.append(f"plan         predicted {predicted:.3f} s per step, measured {step_s:.3f} s "
                     f"({step_s / predicted:.2f}x the prediction)")
    else:
        lines.append("plan         no prediction (a CPU run has no plan)")
    peak = {k: max((r.get(k) or 0) for r in records)
            for k in ("device_peak_bytes", "device_reserved_peak_bytes", "planned_device_bytes", "host_rss_bytes", "shm_bytes")}
    gpu = f"GPU peak {peak['device_peak_bytes'] / 2**30:.2f} GiB"
    if peak["device_reserved_peak_bytes"]:
        gpu += f" ({peak['device_reserved_peak_bytes'] / 2**30:.2f} reserved"
        gpu += f", plan {peak['planned_device_bytes'] / 2**30:.2f} with the CUDA context)" if peak["planned_device_bytes"] else ")"
    lines.append(f"memory       {gpu}, host private peak {peak['host_rss_bytes'] / 2**30:.2f} GiB, "
                 f"shared (store + rings) {peak['shm_bytes'] / 2**30:.2f} GiB")
    retries = _median(rs, "device_alloc_retries")
    if retries:
        lines.append(f"             the caching allocator reached the budget {retries:.0f} time(s) a step (median): "
                     "each freed its cache and synchronized the device")
    return lines


def plan_lines(run_dir: Path) -> list[str]:
    """What the ranks carried out: the run's plan.json, one line per choice (none in an older run dir)."""
    path = run_dir / PLAN_FILE
    if not path.exists():
        return []
    try:
        plan = StepPlan.read(path)
    except (OSError, StepPlanError) as e:
        return [f"step plan    unreadable: {e}"]
    shown = {k: v for k, v in plan.to_dict().items() if k not in ("predicted_step_s", "planned_device_bytes", "planned_by")}
    return [f"step plan    {path} (chosen by the {plan.planned_by})"] + [f"  {k:<22}{v}" for k, v in shown.items()]


def clipping_summary(records: list[dict[str, Any]]) -> list[str]:
    """How exact clipping went: of the steps that speculated, how many clipped and what their corrections cost
    beside those that did not (they keep every speculative update); the steps after a clipped one (deferred). Nothing for a run without clipping (or from before it)."""
    rs = [r for r in records if "clipped" in r and not r.get("skipped")]
    if not rs or not any(r["clipped"] or r.get("speculated_chunks") for r in rs):
        return []
    deferred = [r for r in rs if r.get("speculated") is False]  # after a clipped step (None: from before the rule)
    rs = [r for r in rs if r.get("speculated") is not False]
    clipped = [r for r in rs if r["clipped"]]
    kept = [r for r in rs if not r["clipped"]]
    lines = [f"clipping     {len(clipped)} of {len(rs)} step(s) that speculated clipped; median "
             f"{statistics.median(r['speculated_chunks'] for r in rs):g} chunk(s) updated before the norm was known"
             if rs else "clipping     no step speculated"]
    if kept:
        lines.append(f"  {'steps that did not clip':<30}{statistics.median(r['step_s'] for r in kept):>9.3f} s "
                     f"median (every speculative update kept)")
    if clipped:
        lines.append(f"  {'steps that clipped':<30}{statistics.median(r['step_s'] for r in clipped):>9.3f} s median, "
                     f"{statistics.median(r['corrected_chunks'] for r in clipped):g} chunk(s) corrected in "
                     f"{statistics.median(r['correction_s'] for r in clipped):.3f} s of updater time")
    if deferred:
        lines.append(f"  {'steps after a clipped step':<30}{statistics.median(r['step_s'] for r in deferred):>9.3f} s "
                     f"median, {len(deferred)} step(s), {sum(r['clipped'] for r in deferred)} clipped (every update "
                     f"waited for the norm)")
    return lines


def trace_summary(trace: dict[str, Any], step: int | None) -> tuple[int | None, list[str]]:
    events = tracefile.spans(trace)
    steps = sorted({e.step for e in events})
    if not steps:
        return None, ["trace        trace.json holds no events"]
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ReportError(f"step {step} is not traced; traced steps: {', '.join(map(str, steps))} (run.trace_steps)")
    mine = [e for e in events if e.step == step]
    t0 = min(e.start_us for e in mine)
    t1 = max(e.start_us + e.dur_us for e in mine)
    busy: dict[str, float] = {}
    for e in mine:
        busy[f"{e.process}/{e.track}"] = busy.get(f"{e.process}/{e.track}", 0.0) + e.dur_us
    lines = [f"trace        step {step}: {len(mine)} events over {(t1 - t0) / 1e3:.1f} ms on {len(busy)} tracks "
             f"(traced: {', '.join(map(str, steps))})"]
    lines += [f"  {track:<30}{us / 1e3:>9.1f} ms busy" for track, us in busy.items()]
    return step, lines


# ---- plots ---------------------------------------------------------------------------------------
def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ReportError("slidedp-report draws with matplotlib, which is not installed: "
                          "pip install 'slidedp[report]' (or --no-plots for the summary alone)") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _palette(names: list[str]) -> dict:
    """A distinct color per name (tab20, in the given order)."""
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    return {n: cmap(i % 20) for i, n in enumerate(names)}


def event_kind(name: str) -> str:
    """An event's kind, its name without numbers: "adamw chunk 3" -> "adamw chunk", "fetch layer.1" -> "fetch layer"."""
    return re.sub(r"\s+", " ", re.sub(r"\b\d+\b", "", name)).strip(" .") or name


def _finish(plt, fig, path: Path) -> Path:
    """Lay out, write and close one figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_training(plt, records: list[dict[str, Any]], out: Path) -> list[Path]:
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(steps, [r.get("loss") if r.get("loss") is not None else float("nan") for r in records], lw=1.5,
            label="train")
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    if evals:
        ax.plot(*zip(*evals), marker="o", lw=1.5, label="eval (data.eval_path)")
    bad = [r["step"] for r in records if r.get("skipped")]
    if bad:
        ax.scatter(bad, [0] * len(bad), marker="x", color="red", label="skipped step")
    if evals or bad:
        ax.legend()
    ax.set(xlabel="step", ylabel="loss", title="loss")
    ax.grid(alpha=0.3)
    loss = _finish(plt, fig, out / "loss.png")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(steps, [r.get("tokens_per_s") or float("nan") for r in records], lw=1.5, label="measured")
    predicted = [(r["step"], r["tokens"] / r["predicted_step_s"]) for r in records if r.get("predicted_step_s")]
    if predicted:
        ax.plot(*zip(*predicted), ls="--", label="predicted by the plan")
        ax.legend()
    ax.set(xlabel="step", ylabel="tokens/s", title="throughput")
    ax.grid(alpha=0.3)
    tps = _finish(plt, fig, out / "tokens_per_s.png")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottom = [0.0] * len(records)
    colors = _palette([what for _, what in WORKER_PARTS])
    for key, what in WORKER_PARTS:
        v = [r.get(key) or 0.0 for r in records]
        ax.bar(steps, v, bottom=bottom, label=what, color=colors[what], width=0.9)
        bottom = [b + x for b, x in zip(bottom, v)]
    ax.plot(steps, [r["step_s"] for r in records], color="black", lw=1, label="step (launcher)")
    ax.set(xlabel="step", ylabel="seconds", title="where each step's time went (slowest rank)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return [loss, tps, _finish(plt, fig, out / "step_breakdown.png")]


def plot_timeline(plt, trace: dict[str, Any], step: int, commits: dict[int, float], out: Path) -> Path:
    events = [e for e in tracefile.spans(trace) if e.step == step]
    rows: list[tuple[str, str]] = []
    for e in sorted(events, key=lambda e: (tracefile._natural(e.process), e.start_us)):
        if (e.process, e.track) not in rows:
            rows.append((e.process, e.track))
    t0 = min(e.start_us for e in events)
    span = max((e.start_us + e.dur_us - t0) / 1e3 for e in events)
    if step in commits:
        span = max(span, (commits[step] * 1e6 - t0) / 1e3)
    kinds = sorted({event_kind(e.name) for e in events})
    colors = _palette(kinds)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.45 * len(rows)))
    for i, row in enumerate(rows):
        for e in (e for e in events if (e.process, e.track) == row):
            x, w = (e.start_us - t0) / 1e3, max(e.dur_us / 1e3, span / 1000)  # the shortest still visible
            ax.broken_barh([(x, w)], (i - 0.4, 0.8), color=colors[event_kind(e.name)], edgecolor="none")
            if w / span * 850 > 5 * len(e.name) + 6:  # room for its name (~850 px of axis, ~5 px a character)
                ax.text(x + w / 2, i, e.name, ha="center", va="center", fontsize=7, clip_on=True)
    if step in commits:
        c = (commits[step] * 1e6 - t0) / 1e3
        ax.axvline(c, color="black", ls="--", lw=1)
        ax.text(c, len(rows) - 0.4, " commit", va="bottom", fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[k]) for k in kinds]
    ax.legend(handles, kinds, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    ax.set_yticks(range(len(rows)), [f"{p} / {t}" for p, t in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # the first worker on top
    ax.set_xlim(0, span * 1.02)
    ax.set(xlabel="ms since the step's first event", title=f"pipeline timeline of step {step}")
    ax.grid(alpha=0.3, axis="x")
    return _finish(plt, fig, out / f"timeline_step{step}.png")


def report(run_dir: Path, out_dir: Path | None = None, step: int | None = None, plots: bool = True) -> tuple[list[str], list[Path]]:
    """(summary lines, PNGs written)."""
    run_dir = Path(run_dir)
    plt = pyplot() if plots else None  # fail before any work when matplotlib is missing
    records = read_metrics(run_dir)
    lines = summary(records) + plan_lines(run_dir)
    trace = read_trace(run_dir)
    traced_step = None
    if trace is not None:
        traced_step, more = trace_summary(trace, step)
        lines += more
    elif step is not None:
        raise ReportError(f"{run_dir} has no trace.json; set run.trace_steps (e.g. \"{step}\") and run again")
    pngs: list[Path] = []
    if plt is not None:
        out = Path(out_dir) if out_dir else run_dir / "report"
        out.mkdir(parents=True, exist_ok=True)
        pngs += plot_training(plt, records, out)
        if trace is not None and traced_step is not None:
            pngs.append(plot_timeline(plt, trace, traced_step, tracefile.commit_times(run_dir), out))
    return lines, pngs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="slidedp-report", description="Summarize a SlideDP run and plot it (PNG).")
    p.add_argument("run_dir", type=Path, help="the run directory (runs/<name>, or the job's run.dir)")
    p.add_argument("--out", type=Path, help="where the PNGs go (default: RUN_DIR/report)")
    p.add_argument("--step", type=int, help="the traced step whose timeline to draw (default: the last traced)")
    p.add_argument("--no-plots", action="store_true", help="print the summary only (no matplotlib needed)")
    args = p.parse_args(argv)
    try:
        lines, pngs = report(args.run_dir, args.out, args.step, plots=not args.no_plots)
    except ReportError as e:
        print(f"slidedp-report: error: {e}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    for path in pngs:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
