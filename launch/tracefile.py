"""trace.json: the traced steps of a run as one Chrome trace (open it in https://ui.perfetto.dev).

Each process of a job (workers, aggregator, updaters) appends complete events to
<run dir>/trace/<process>.jsonl for the steps in run.trace_steps, one JSON object a line:
{"name", "ph": "X", "ts", "dur" (wall-clock microseconds, so processes line up), "pid" (the
process label), "tid" (the track label), "args": {"step"}}. `merge` gathers them into
<run dir>/trace.json with numeric pids/tids and process_name / thread_name metadata, so
Perfetto shows one row per worker stream, the aggregator and each updater, and marks each
traced step's commit (from metrics.jsonl). `validate` checks what a viewer would silently
get wrong: JSON shape, negative durations, and events outside their step's window.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("slidedp.launcher")

TRACE_DIR = "trace"
TRACE_FILE = "trace.json"
LAUNCHER = "launcher"
_ROLE_ORDER = ("worker", "aggregator", "updater")


@dataclass(frozen=True)
class Span:
    """One complete event, with its process and track resolved to their labels."""

    process: str
    track: str
    name: str
    step: int
    start_us: float
    dur_us: float


def _natural(label: str) -> tuple:
    """Sort key: workers, then the aggregator, then updaters, each by number (worker10 after worker2)."""
    role = next((i for i, r in enumerate(_ROLE_ORDER) if label.startswith(r)), len(_ROLE_ORDER))
    return (role, [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", label)])


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_raw(ev: Any) -> str | None:
    """Why a line of a process file is not a usable event (None if it is one)."""
    if not isinstance(ev, dict):
        return "not a JSON object"
    for key, ok in (("name", lambda v: isinstance(v, str)), ("ph", lambda v: v == "X"), ("ts", _number),
                    ("dur", _number), ("pid", lambda v: isinstance(v, str) and v), ("tid", lambda v: isinstance(v, str) and v)):
        if not ok(ev.get(key)):
            return f"{key} = {ev.get(key)!r} is not valid"
    step = (ev.get("args") or {}).get("step") if isinstance(ev.get("args"), dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"args.step = {step!r} is not a step number"
    return None


def read_process_files(trace_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Every event of every <process>.jsonl (sorted by name), and a problem per line that is not one."""
    events: list[dict[str, Any]] = []
    problems: list[str] = []
    for path in sorted(Path(trace_dir).glob("*.jsonl")):
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    ev = json.loads(line)
                except ValueError:  # a process killed mid-write leaves a torn last line
                    problems.append(f"{path.name}:{n}: not JSON")
                    continue
                why = _check_raw(ev)
                if why:
                    problems.append(f"{path.name}:{n}: {why}")
                else:
                    events.append(ev)
    return events, problems


def commit_times(run_dir: Path) -> dict[int, float]:
    """step -> wall-clock seconds of its commit, from metrics.jsonl (the latest record of a step wins)."""
    out: dict[int, float] = {}
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and isinstance(r.get("step"), int) and _number(r.get("time")):
            out[r["step"]] = float(r["time"])
    return out


def build(events: list[dict[str, Any]], commits: dict[int, float] | None = None) -> dict[str, Any]:
    """The Chrome trace of raw events: numeric ids, names as metadata, one commit marker per traced step."""
    commits = commits or {}
    steps = sorted({e["args"]["step"] for e in events})
    marks = [{"name": f"commit step {s}", "ph": "i", "s": "g", "ts": commits[s] * 1e6, "pid": LAUNCHER,
              "tid": "commits", "args": {"step": s}} for s in steps if s in commits]
    labelled = events + marks
    processes = sorted({e["pid"] for e in labelled}, key=_natural)
    pid = {p: i + 1 for i, p in enumerate(processes)}
    tracks: dict[str, list[str]] = {p: [] for p in processes}
    for e in sorted(labelled, key=lambda e: e["ts"]):  # a process's tracks in order of first use
        if e["tid"] not in tracks[e["pid"]]:
            tracks[e["pid"]].append(e["tid"])
    meta: list[dict[str, Any]] = []
    for p in processes:
        meta.append({"name": "process_name", "ph": "M", "pid": pid[p], "tid": 0, "args": {"name": p}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": pid[p], "tid": 0, "args": {"sort_index": pid[p]}})
        for j, t in enumerate(tracks[p]):
            meta.append({"name": "thread_name", "ph": "M", "pid": pid[p], "tid": j + 1, "args": {"name": t}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid[p], "tid": j + 1, "args": {"sort_index": j}})
    body = [dict(e, pid=pid[e["pid"]], tid=tracks[e["pid"]].index(e["tid"]) + 1)
            for e in sorted(labelled, key=lambda e: (e["ts"], e["pid"], e["tid"]))]
    return {"traceEvents": meta + body, "displayTimeUnit": "ms", "otherData": {"steps": steps}}


def merge(run_dir: Path) -> tuple[Path | None, list[str]]:
    """Write <run dir>/trace.json from <run dir>/trace/*.jsonl; (its path or None if no events, problems)."""
    run_dir = Path(run_dir)
    events, problems = read_process_files(run_dir / TRACE_DIR)
    if not events:
        return None, problems
    trace = build(events, commit_times(run_dir))
    out = run_dir / TRACE_FILE
    tmp = out.with_name(f".{TRACE_FILE}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(trace, separators=(",", ":")))
    os.replace(tmp, out)
    return out, problems


def spans(trace: dict[str, Any]) -> list[Span]:
    """The complete events of a trace built by `build`, with labels instead of numeric ids."""
    pname: dict[int, str] = {}
    tname: dict[tuple[int, int], str] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pname[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            tname[(e["pid"], e["tid"])] = e["args"]["name"]
    return [Span(pname.get(e["pid"], str(e["pid"])), tname.get((e["pid"], e["tid"]), str(e["tid"])), e["name"],
                 e["args"]["step"], float(e["ts"]), float(e["dur"]))
            for e in trace.get("traceEvents", []) if e.get("ph") == "X"]


def step_windows(events: list[Span], commits: dict[int, float]) -> dict[int, tuple[float | None, float | None]]:
    """step -> (earliest, latest) allowed microsecond.

    A step begins on the workers: nothing of step s (a reduction, an update) can start before
    the first worker event of s. It ends when the launcher sees it commit (metrics.jsonl
    `time`), which is after every rank sent its stats and every update of s finished.
    """
    out: dict[int, tuple[float | None, float | None]] = {}
    for s in {e.step for e in events}:
        starts = [e.start_us for e in events if e.step == s and e.process.startswith("worker")]
        out[s] = (min(starts) if starts else None, commits[s] * 1e6 if s in commits else None)
    return out


def validate(trace: Any, commits: dict[int, float] | None = None) -> list[str]:
    """Problems of a trace.json (already parsed): shape, ids, durations, events outside their step's window."""
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["not a Chrome trace: expected an object with a traceEvents list"]
    problems: list[str] = []
    named_p = {e.get("pid") for e in trace["traceEvents"] if isinstance(e, dict) and e.get("name") == "process_name"}
    named_t = {(e.get("pid"), e.get("tid")) for e in trace["traceEvents"]
               if isinstance(e, dict) and e.get("name") == "thread_name"}
    for i, e in enumerate(trace["traceEvents"]):
        if not isinstance(e, dict) or e.get("ph") not in ("X", "M", "i"):
            problems.append(f"event {i}: not an object with ph X, M or i: {str(e)[:120]}")
            continue
        if e["ph"] == "M":
            continue
        if not _number(e.get("ts")):
            problems.append(f"event {i} ({e.get('name')!r}): ts {e.get('ts')!r} is not a number")
        if e["ph"] == "X" and not (_number(e.get("dur")) and e["dur"] >= 0):
            problems.append(f"event {i} ({e.get('name')!r}): duration {e.get('dur')!r} is not a number >= 0")
        if e.get("pid") not in named_p or (e.get("pid"), e.get("tid")) not in named_t:
            problems.append(f"event {i} ({e.get('name')!r}): pid/tid {e.get('pid')}/{e.get('tid')} has no name")
        step = (e.get("args") or {}).get("step") if isinstance(e.get("args"), dict) else None
        if not isinstance(step, int):
            problems.append(f"event {i} ({e.get('name')!r}): args.step {step!r} is not an integer")
    if problems:
        return problems
    events = spans(trace)
    commits = commits or {}
    for s, (lo, hi) in sorted(step_windows(events, commits).items()):
        if commits and hi is None:
            problems.append(f"step {s} has events but metrics.jsonl records no commit of it")
        for e in events:
            if e.step != s:
                continue
            if lo is not None and e.start_us < lo:
                problems.append(f"{e.process}/{e.track} {e.name!r} of step {s} starts {(lo - e.start_us) / 1e3:.3f} ms "
                                f"before the step's first worker event")
            if hi is not None and e.start_us + e.dur_us > hi + 1.0:  # 1 us: float rounding of wall-clock us
                problems.append(f"{e.process}/{e.track} {e.name!r} of step {s} ends {(e.start_us + e.dur_us - hi) / 1e3:.3f} "
                                f"ms after the step committed")
    return problems


def merge_and_check(run_dir: Path) -> list[str]:
    """What the launcher does at the end of a traced run: merge, validate, say where the file is."""
    try:
        out, problems = merge(run_dir)
        if out is not None:
            problems += validate(json.loads(out.read_text()), commit_times(run_dir))
    except OSError as e:
        log.warning("could not write %s: %s", Path(run_dir) / TRACE_FILE, e)
        return [str(e)]
    if out is not None:
        log.info("trace of the traced steps written to %s (open it in https://ui.perfetto.dev)", out)
    for p in problems[:10]:
        log.warning("trace: %s", p)
    if len(problems) > 10:
        log.warning("trace: %d more problem(s)", len(problems) - 10)
    return problems
