"""trace.json: merging the processes' event files, metadata for Perfetto, and the checks on a trace."""

from __future__ import annotations

import json
from pathlib import Path

from slidedp.launch import tracefile

from .conftest import TRACED

T0 = 1_700_000_000.0  # seconds


def event(pid: str, tid: str, name: str, step: int, start_ms: float, dur_ms: float) -> dict:
    return {"name": name, "ph": "X", "ts": (T0 + start_ms / 1e3) * 1e6, "dur": dur_ms * 1e3, "pid": pid, "tid": tid,
            "args": {"step": step}}


def write_run(run_dir: Path, files: dict[str, list], commits: dict[int, float]) -> None:
    (run_dir / "trace").mkdir(parents=True)
    for name, events in files.items():
        (run_dir / "trace" / f"{name}.jsonl").write_text("".join(
            (e if isinstance(e, str) else json.dumps(e)) + "\n" for e in events))
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "time": T0 + ms / 1e3}) + "\n" for s, ms in commits.items()))


def good_files() -> dict[str, list]:
    return {
        "worker0": [event("worker0", "compute", "forward layer 0", 5, 0, 10), event("worker0", "h2d", "fetch layer.1", 5, 2, 1),
                    event("worker0", "compute", "backward layer 0", 5, 10, 20)],
        "worker10": [event("worker10", "compute", "forward layer 0", 5, 1, 10)],
        "worker2": [event("worker2", "compute", "forward layer 0", 5, 1, 10)],
        "aggregator": [event("aggregator", "reduce", "sum chunk 0", 5, 31, 2)],
        "updater1": [event("updater1", "adamw", "adamw chunk 1", 5, 34, 3)],
        "updater0": [event("updater0", "adamw", "adamw chunk 0", 5, 33, 4)],
    }


def test_merge_names_every_process_and_track_in_order(tmp_path):
    write_run(tmp_path, good_files(), {5: 40.0})
    out, problems = tracefile.merge(tmp_path)
    assert problems == [] and out == tmp_path / "trace.json"
    trace = json.loads(out.read_text())
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    procs = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    # workers by number, then the aggregator, the updaters, and the launcher's commit marks
    assert [procs[p] for p in sorted(procs)] == ["worker0", "worker2", "worker10", "aggregator", "updater0", "updater1",
                                                 "launcher"]
    threads = {(procs[e["pid"]], e["args"]["name"]) for e in meta if e["name"] == "thread_name"}
    assert ("worker0", "compute") in threads and ("worker0", "h2d") in threads and ("launcher", "commits") in threads
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 8 and all(isinstance(e["pid"], int) and isinstance(e["tid"], int) for e in xs)
    assert [e for e in trace["traceEvents"] if e["ph"] == "i"][0]["ts"] == (T0 + 0.040) * 1e6
    assert tracefile.validate(trace, tracefile.commit_times(tmp_path)) == []
    spans = tracefile.spans(trace)
    assert {(s.process, s.track, s.name) for s in spans} >= {("updater1", "adamw", "adamw chunk 1"),
                                                             ("worker0", "h2d", "fetch layer.1")}


def test_checks_name_what_is_wrong(tmp_path):
    files = good_files()
    files["worker0"].append(event("worker0", "d2h", "grad chunk 0", 5, 12, -1))  # negative duration
    files["aggregator"].append(event("aggregator", "reduce", "sum chunk 1", 5, -3, 1))  # before any worker began step 5
    files["updater0"].append(event("updater0", "adamw", "adamw chunk 2", 5, 39, 2))  # ends after the commit at 40 ms
    files["updater1"].append(event("updater1", "adamw", "adamw chunk 3", 6, 50, 1))  # step 6 never committed
    files["updater1"].append('{"name": "torn')  # a process killed mid-line
    files["updater1"].append(json.dumps({"name": "x", "ph": "X", "ts": 1, "dur": 1, "pid": "u", "tid": "t"}))
    write_run(tmp_path, files, {5: 40.0})
    out, problems = tracefile.merge(tmp_path)
    assert problems == ["updater1.jsonl:3: not JSON", "updater1.jsonl:4: args.step = None is not a step number"]
    trace = json.loads(out.read_text())
    found = tracefile.validate(trace, tracefile.commit_times(tmp_path))
    assert any("grad chunk 0" in p and "duration" in p and "-1000" in p for p in found), found
    bad = [e for e in trace["traceEvents"] if e.get("dur", 0) < 0]
    for e in bad:  # durations fixed up: now the window checks run
        e["dur"] = 0
    found = tracefile.validate(trace, tracefile.commit_times(tmp_path))
    assert found == [
        "aggregator/reduce 'sum chunk 1' of step 5 starts 3.000 ms before the step's first worker event",
        "updater0/adamw 'adamw chunk 2' of step 5 ends 1.000 ms after the step committed",
        "step 6 has events but metrics.jsonl records no commit of it",
    ]


def test_validate_rejects_what_is_not_a_trace():
    assert tracefile.validate([]) == ["not a Chrome trace: expected an object with a traceEvents list"]
    got = tracefile.validate({"traceEvents": [{"name": "a", "ph": "X", "ts": 1.0, "dur": 1.0, "pid": 1, "tid": 1,
                                               "args": {"step": 0}}, {"ph": "B"}]})
    assert got == ["event 0 ('a'): pid/tid 1/1 has no name", "event 1: not an object with ph X, M or i: {'ph': 'B'}"]


def test_no_events_no_file(tmp_path):
    (tmp_path / "trace").mkdir()
    assert tracefile.merge(tmp_path) == (None, [])
    assert not (tmp_path / "trace.json").exists()


def test_real_run_trace_is_valid(tiny_run):
    trace = json.loads((tiny_run.run_dir / "trace.json").read_text())
    assert tracefile.validate(trace, tracefile.commit_times(tiny_run.run_dir)) == []
    spans = tracefile.spans(trace)
    assert {s.step for s in spans} == {TRACED}
    processes = {s.process for s in spans}
    assert {"worker0", "worker1", "aggregator"} <= processes and any(p.startswith("updater") for p in processes)
    assert trace["otherData"]["steps"] == [TRACED]
