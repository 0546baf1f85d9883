"""Progress output (terminal bar, key=value lines), the metrics.jsonl schema, host memory of the job's tree."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import re
import subprocess
import sys

import pytest

from slidedp.launch.progress import METRICS, Progress, check_record, device_side, make_record, process_tree_private_bytes
from slidedp.protocol import StepDone, WorkerStats
from slidedp.store.shm import Segment, segment_name

from pipeline.harness import unique_store
from .conftest import STEPS

MiB = 2**20


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def stats(rank: int, step: int, **kw) -> WorkerStats:
    base = dict(step_s=0.5, forward_s=0.2, backward_s=0.25, wait_version_s=0.01, wait_slot_s=0.02, wait_loss_s=0.03,
                h2d_bytes=1000, device_peak_bytes=5000, device_reserved_peak_bytes=6000)
    base.update(kw)
    return WorkerStats(rank, step, **base)


def done(step: int, loss: float = 2.5, skipped: int = 0) -> StepDone:
    return StepDone(step, loss, 1.25, skipped, 0.3, 0.1)


def run_progress(tmp_path, stream, steps: int = 3, log_every: int = 1, skipped_step: int = -1) -> list[dict]:
    p = Progress(unique_store("pg"), 1024, stream=stream, log_every=log_every)
    p.predicted_step_s = 0.4
    p.begin(0, steps, tmp_path)
    for s in range(steps):
        nan = s == skipped_step
        p.step(s, done(s, float("nan") if nan else 2.5 - s, int(nan)),
               {0: stats(0, s), 1: stats(1, s, forward_s=0.3, h2d_bytes=500, device_peak_bytes=7000,
                                         device_reserved_peak_bytes=8000, device_alloc_retries=3)}, 1e-3)
    p.end()
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_every_worker_stat_has_a_metrics_key():
    # A field added to WorkerStats must be given a meaning and a reduction over ranks here.
    missing = [f.name for f in dataclasses.fields(WorkerStats)
               if f.name not in ("rank", "step", "step_s") and f.name not in METRICS]
    assert missing == []
    assert all(METRICS[f.name].over_ranks in ("max", "sum") for f in dataclasses.fields(WorkerStats)
               if f.name not in ("rank", "step", "step_s"))


def test_the_gpu_side_of_a_step_leaves_out_waits_and_the_write_back():
    s = stats(0, 4, step_s=2.0, write_back_s=0.5)
    assert device_side(s) == pytest.approx(2.0 - 0.01 - 0.02 - 0.03 - 0.5)


def test_records_combine_the_ranks(tmp_path):
    records = run_progress(tmp_path, io.StringIO())
    assert [check_record(r) for r in records] == [[], [], []]
    r = records[1]
    assert (r["step"], r["loss"], r["grad_norm"], r["lr"], r["skipped"], r["tokens"]) == (1, 1.5, 1.25, 1e-3, False, 1024)
    assert (r["forward_s"], r["backward_s"], r["h2d_bytes"], r["device_peak_bytes"]) == (0.3, 0.25, 1500, 7000)
    assert (r["device_reserved_peak_bytes"], r["planned_device_bytes"], r["device_alloc_retries"]) == (8000, None, 3)
    assert (r["wait_version_s"], r["wait_slot_s"], r["wait_loss_s"]) == (0.01, 0.02, 0.03)
    assert (r["update_busy_s"], r["reduce_busy_s"], r["predicted_step_s"], r["ranks"]) == (0.3, 0.1, 0.4, 2)
    assert r["tokens_per_s"] == pytest.approx(1024 / r["step_s"])


def test_a_clipping_step_records_its_correction_and_the_plans_clipping_prediction(tmp_path):
    p = Progress(unique_store("pg"), 1024, stream=io.StringIO())
    p.predicted_step_s, p.predicted_clipped_step_s, p.predicted_corrected_step_s = 0.4, 0.7, 0.9
    p.begin(0, 4, tmp_path)
    p.step(0, StepDone(0, 2.5, 0.8, 0, 0.3, 0.1, 0, 4, 0, 0.0, 1), {0: stats(0, 0)}, 1e-3)  # kept
    p.step(1, StepDone(1, 2.4, 3.5, 0, 0.5, 0.1, 1, 2, 2, 0.12, 1), {0: stats(0, 1)}, 1e-3)  # speculated, corrected
    p.step(2, StepDone(2, 2.3, 3.1, 0, 0.5, 0.1, 1, 0, 0, 0.0, 0), {0: stats(0, 2)}, 1e-3)  # deferred, clipped
    p.step(3, StepDone(3, 2.2, 0.9, 0, 0.5, 0.1, 0, 0, 0, 0.0, 0), {0: stats(0, 3)}, 1e-3)  # deferred, kept
    p.end()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [check_record(r) for r in records] == [[]] * 4
    got = [(r["clipped"], r["speculated"], r["speculated_chunks"], r["corrected_chunks"], r["correction_s"],
            r["predicted_step_s"]) for r in records]
    assert got == [(False, True, 4, 0, 0.0, 0.4), (True, True, 2, 2, 0.12, 0.9), (True, False, 0, 0, 0.0, 0.7),
                   (False, False, 0, 0, 0.0, 0.7)]


def test_non_finite_loss_is_null_not_nan(tmp_path):
    out = io.StringIO()
    records = run_progress(tmp_path, out, skipped_step=1)
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text  # strict JSON readers reject NaN
    assert records[1]["loss"] is None and records[1]["skipped"] is True and check_record(records[1]) == []
    assert "step=2 steps=3 loss=nan" in out.getvalue() and " skipped=1" in out.getvalue()


def test_plain_lines_when_not_a_terminal(tmp_path):
    out = io.StringIO()
    run_progress(tmp_path, out, steps=5, log_every=2)
    lines = out.getvalue().splitlines()
    # every log_every-th step, and the last one
    assert [line.split()[0] for line in lines] == ["step=2", "step=4", "step=5"]
    for line in lines:
        kv = dict(item.split("=", 1) for item in line.split())
        assert list(kv) == ["step", "steps", "loss", "grad_norm", "lr", "tokens_per_s", "step_s", "eta_s"]
        assert kv["steps"] == "5" and kv["grad_norm"] == "1.2500" and kv["lr"] == "1.000e-03"
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_bar_on_a_terminal_with_log_lines_above_it(tmp_path, monkeypatch):
    """On a terminal the bar is tqdm's; the job's log lines (stderr, the same terminal) are written above it,
    each a whole line, never glued to the bar ('...ETA 0:1706:12:22 INFO [launcher] checkpoint ...')."""
    out = Terminal()
    monkeypatch.setattr(sys, "stderr", out)  # stdout and stderr: one terminal
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s [launcher] %(message)s"))
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    try:
        p = Progress(unique_store("pg"), 1024, stream=out)
        p.begin(0, 4, tmp_path)
        for s in range(4):
            nan = s == 2
            p.step(s, done(s, float("nan") if nan else 2.5 - s, int(nan)), {0: stats(0, s)}, 1e-3)
            logging.getLogger("slidedp.launcher").info("checkpoint of step %d written", s)
        p.end()
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    text = out.getvalue()
    visible = [line.split("\r")[-1] for line in text.split("\n")]  # what each terminal line shows at the end
    assert [v for v in visible if "checkpoint of step" in v] == [
        f"INFO [launcher] checkpoint of step {s} written" for s in range(4)]
    assert "step 3 skipped: a non-finite loss or gradient norm" in visible
    assert visible[-1] == "" and visible[-2].startswith("steps: 100%|") and "4/4, loss -0.5000 " in visible[-2]
    assert "tok/s" in visible[-2] and "ETA" in visible[-2]
    assert len(p.records) == 4 and [r["step"] for r in p.records] == [0, 1, 2, 3]


def test_eta_leaves_out_the_first_step():
    p = Progress("x", 1, stream=io.StringIO())
    p.start, p.end_step = 0, 10
    p.first, p.recent = [30.0], []
    assert p.eta_s(0) == 9 * 30.0  # only the first step known: it is the estimate
    p.recent = [1.0, 3.0]
    assert p.eta_s(2) == 7 * 2.0


def test_private_memory_covers_children_and_not_shared_memory():
    base = process_tree_private_bytes()
    child = subprocess.Popen([sys.executable, "-c", "import sys; b = b'x' * (300 << 20); print('ok', flush=True); "
                              "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ok"
        with_child = process_tree_private_bytes()
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert with_child - base >= 300 * MiB  # the child's 300 MiB bytes object (and its interpreter)
    name = segment_name(unique_store("pg"), "probe")
    seg = Segment.create(name, 256 * MiB)  # touched: resident, but shared
    try:
        grown = process_tree_private_bytes() - base
    finally:
        seg.close()
        seg.unlink()
    assert grown < 64 * MiB, f"{grown / MiB:.0f} MiB of a 256 MiB shared segment counted as private memory"


def test_real_run_metrics_match_the_schema(tiny_run):
    lines = (tiny_run.run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == list(range(STEPS))
    assert {i: check_record(r) for i, r in enumerate(records)} == {i: [] for i in range(STEPS)}
    for r in records:
        assert r["ranks"] == 2 and r["device_peak_bytes"] == 0 and r["h2d_bytes"] > 0
        assert r["shm_bytes"] >= 12 * 106_880  # the tiny store's state, plus its rings
        assert r["host_rss_bytes"] > 100 * MiB  # launcher, 3 daemons and 2 workers, each with torch loaded
        assert r["predicted_step_s"] is None  # CPU: no plan
    times = [r["time"] for r in records]
    assert times == sorted(times)


def test_real_run_prints_key_value_lines_and_start_up(tiny_run):
    lines = [line for line in tiny_run.stdout.splitlines() if line.startswith("step=")]
    assert [line.split()[0] for line in lines] == [f"step={i + 1}" for i in range(STEPS)]
    assert re.search(r"ready in \d+\.\d\d s: store ux-\w+ at step 0", tiny_run.stderr)
    assert re.search(r"first step committed \d+\.\d\d s after launch", tiny_run.stderr)
    assert "trace of the traced steps written to" in tiny_run.stderr


def test_host_bytes_per_parameter_add_what_the_ranks_and_the_daemons_moved():
    """The ranks' parameter copies in and gradients out, and the updaters' and the aggregator's bytes
    (StepDone.host_bytes), over the model's parameters."""
    d = StepDone(0, 2.5, 1.0, 0, 0.3, 0.1, host_bytes=28_000)
    ranks = {0: stats(0, 0, h2d_bytes=8_000, d2h_bytes=4_000), 1: stats(1, 0, h2d_bytes=8_000, d2h_bytes=4_000)}
    r = make_record(0, d, ranks, 1e-3, 1024, 0.5, None, 0, 0, params=1_000)
    assert (r["h2d_bytes"], r["d2h_bytes"], r["host_bytes_per_param"]) == (16_000, 8_000, 52.0)
    assert check_record(r) == []
    assert make_record(0, d, ranks, 1e-3, 1024, 0.5, None, 0, 0)["host_bytes_per_param"] is None  # no count
