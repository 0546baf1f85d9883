"""benchmarks.plan_choice_summary: issue 23's comparison of the plan's choice with the forced micro-batches,
read from run outputs as a device call returns them (the run folders recorded under another machine's paths)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import plan_choice_summary as pcs


def _run(folder: Path, name: str, micro_batch: int, steps: list[float], finished: str, *, predicted: float | None = 2.6,
         updaters: float | None = 3.0, status: str = "ok", device_layers: int = 4, write_back_last: bool = True) -> Path:
    """One benchmarks.run output as plan_choice.sh leaves it: NAME.json, with NAME.logs/ beside it holding the
    launcher's log, plan.json and metrics.jsonl. The row names the paths the device machine had."""
    logs = folder / f"{name}.logs"
    run_dir = logs / "slidedp-work" / "bench-1"
    run_dir.mkdir(parents=True)
    (run_dir / "plan.json").write_text(json.dumps({"micro_batch": micro_batch, "device_layers": device_layers}))
    records = [{"step": i, "step_s": s} for i, s in enumerate(steps)]
    if write_back_last:  # the job's end wrote the held layers back: no peer times that
        records[-1]["write_back_s"] = 1.5
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + "not json\n")
    log = "12:00:00 INFO [launcher] ready\n"
    if updaters is not None:
        log += f"12:01:00 INFO [launcher] updaters ran AdamW at {updaters:.2f} G params/s per process in this run (bare kernel: 4.26)\n"
    (logs / "slidedp.log").write_text(log)
    remote = Path("/root/pc8") / f"{name}.logs"
    row = {"system": "slidedp", "status": status, "step_s": 1.0, "warmup": 2, "predicted_step_s": predicted,
           "run_dir": str(remote / "slidedp-work" / "bench-1"), "log": str(remote / "slidedp.log")}
    out = folder / f"{name}.json"
    out.write_text(json.dumps({"date": finished, "rows": [row]}))
    return out


def test_forced_runs_are_pooled_by_micro_batch_and_the_choice_compared_with_the_best(tmp_path):
    # finished out of name order: the summary lists them as they ran
    files = [
        _run(tmp_path, "q-b8-m2", 2, [30.0, 2.5, 2.4, 9.0], "2026-12-03T12:47:00", updaters=None,
             status="timeout after 93 s (its figures: the 4 steps it committed)", write_back_last=False),
        _run(tmp_path, "q-b8-m1", 1, [30.0, 2.5, 2.7, 2.5, 2.9, 2.6, 5.0], "2026-12-03T12:43:00", predicted=2.5,
             updaters=3.65),
        _run(tmp_path, "q-b8-m2-r2", 2, [30.0, 2.5, 2.9, 3.0, 2.8, 3.2, 5.0], "2026-12-03T12:53:00", updaters=3.0),
        _run(tmp_path, "q-b8-m8", 8, [30.0, 2.5, 3.1, 3.0, 3.2, 3.1, 5.0], "2026-12-03T12:50:00", device_layers=2),
    ]
    runs = []
    for f in files:
        found, other = pcs.load(f)
        assert other == []
        runs += found
    by_name = {r.name: r for r in runs}
    # the write-back step is left out, a run stopped early keeps the steps it committed
    assert by_name["q-b8-m1"].timed_s == (2.7, 2.5, 2.9, 2.6)
    assert by_name["q-b8-m2"].timed_s == (2.4, 9.0)
    assert (by_name["q-b8-m1"].updaters_gps, by_name["q-b8-m2"].updaters_gps) == (3.65, None)
    table = pcs.pooled(runs)
    assert {mb: (round(med, 9), n, k) for mb, (med, n, k) in table.items()} == {1: (2.65, 1, 4), 2: (2.95, 2, 6),
                                                                               8: (3.1, 1, 4)}
    lines = pcs.summary(runs, [], chosen=2)
    assert [line.split()[1] for line in lines[:4]] == ["q-b8-m1", "q-b8-m2", "q-b8-m8", "q-b8-m2-r2"]
    assert lines[0] == ("1. q-b8-m1                  micro_batch 1 (4 held): predicted 2.500 s, measured median 2.650 s, "
                        "error -5.7%; 4 timed steps 2.500-2.900 s; updaters 3.65 G params/s")
    assert lines[1].endswith("2 timed steps 2.400-9.000 s [timeout after 93 s]")
    assert lines[4:] == [
        "forced runs pooled by micro-batch (median of all their timed steps):",
        "  micro_batch 1: 2.650 s (1 run(s), 4 steps)",
        "  micro_batch 2: 2.950 s (2 run(s), 6 steps)",
        "  micro_batch 8: 3.100 s (1 run(s), 4 steps)",
        "chosen micro_batch 2, forced: 2.950 s; best forced micro_batch 1: 2.650 s: +11.3%",
    ]


def test_a_first_run_is_the_choice_and_is_also_compared_run_by_run(tmp_path, capsys):
    _run(tmp_path, "q-b32-auto", 8, [90.0, 7.5, 7.4, 7.6, 7.5, 7.5], "2026-12-03T12:30:00", device_layers=0,
         write_back_last=False)
    _run(tmp_path, "q-b32-m4", 4, [40.0, 7.3, 7.3, 7.2, 7.4, 7.3], "2026-12-03T12:32:00", device_layers=0,
         write_back_last=False)
    _run(tmp_path, "q-b32-m8", 8, [40.0, 7.3, 7.3, 7.4, 7.4, 7.5], "2026-12-03T12:35:00", device_layers=0,
         write_back_last=False)
    (tmp_path / "q-b32-resident.json").write_text(json.dumps({"rows": [
        {"system": "gpu_resident_chunked", "status": "out of memory", "step_s": None}]}))
    (tmp_path / "q-b32-m1.json").write_text(json.dumps({"rows": [  # stopped before a timed step
        {"system": "slidedp", "status": "timeout after 60 s", "step_s": None, "run_dir": "/root/x.logs/w/b"}]}))
    log = tmp_path / "q-b32-auto.logs" / "slidedp.log"
    log.write_text("  measuring one decoder layer at micro-batches 1, 2, 4, 8: 92.9 s\n"
                   "    micro-batches weighed (train.micro_batch = 0)\n"
                   "      8   7.254 s  chosen\n      4   7.361 s\n    \n  after\n" + log.read_text())
    forced_log = tmp_path / "q-b32-m4.logs" / "slidedp.log"  # a forced plan prints its one candidate too
    forced_log.write_text("    micro-batches weighed (train.micro_batch set in the job file)\n      4   7.398 s  chosen\n"
                          + forced_log.read_text())
    assert pcs.main([str(p) for p in sorted(tmp_path.glob("q-b32-*.json"))] + [str(tmp_path / "q-b32-m2.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == ["micro-batches weighed (train.micro_batch = 0)", "8   7.254 s  chosen", "4   7.361 s"]
    assert "micro-batches weighed (train.micro_batch set in the job file)" not in out
    assert "q-b32-m1: slidedp timeout after 60 s, no timed step" in out
    assert "q-b32-resident: gpu_resident_chunked out of memory, no step" in out
    assert f"{tmp_path / 'q-b32-m2.json'}: no such file" in out
    assert any(line.startswith("1. q-b32-auto") and line.endswith("measured the blocks in 92.9 s") for line in out)
    assert "chosen micro_batch 8 ran 7.500 s; best forced run q-b32-m4 (micro_batch 4) ran 7.300 s: +2.7%" in out
    assert out[-1] == "chosen micro_batch 8, forced: 7.400 s; best forced micro_batch 4: 7.300 s: +1.4%"
