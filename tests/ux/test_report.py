"""slidedp-report: the summary's numbers and the PNGs, from a recorded run and from a fixture."""

from __future__ import annotations

import json
import sys

import pytest

from slidedp.launch import report

from .conftest import STEPS, TRACED

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1024, f"{path}: not a PNG of more than 1 KB ({len(data)} bytes)"


def record(step: int, step_s: float, **kw) -> dict:
    r = {"step": step, "time": 1e9 + step, "loss": 3.0 - 0.5 * step, "grad_norm": 1.0, "lr": 1e-4, "skipped": False,
         "tokens": 4000, "step_s": step_s, "tokens_per_s": 4000 / step_s, "worker_step_s": 1.8,
         "predicted_step_s": 1.6, "ranks": 2, "forward_s": 0.6, "backward_s": 0.9, "wait_version_s": 0.18,
         "wait_slot_s": 0.0, "wait_loss_s": 0.0, "h2d_bytes": 10, "device_peak_bytes": 3 * 2**30, "update_busy_s": 1.0,
         "reduce_busy_s": 0.5, "host_rss_bytes": 2**30, "shm_bytes": 12 * 2**30}
    r.update(kw)
    return r


def test_summary_of_a_fixture(tmp_path):
    records = [record(0, 9.0), record(1, 2.0), record(2, 1.9, skipped=True, loss=None), record(3, 2.2), record(4, 2.0)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 5, "lo')
    lines, pngs = report.report(tmp_path, plots=False)
    assert pngs == []
    text = "\n".join(lines)
    assert "steps        0..4 (5 recorded, 1 skipped (non-finite loss or gradient))" in text
    assert "clipping" not in text  # records from before exact clipping kept its fields
    assert "loss         3.0000 -> 1.0000" in text
    # median of 2.0, 1.9, 2.2, 2.0 (the first step, 9.0 s of start-up, left out)
    assert "step         median 2.000 s over 4 step(s) (the first, with start-up, left out)" in text
    assert "throughput   2,000 tokens/s (4,000 tokens per step)" in text
    assert "  forward                           0.600 s    33%" in text  # of the slowest rank's 1.8 s
    assert "  waiting for updates               0.180 s    10%" in text
    assert "  updaters busy (AdamW)             1.000 s    50% of the step, beside the workers" in text
    assert "plan         predicted 1.600 s per step, measured 2.000 s (1.25x the prediction)" in text
    assert "memory       GPU peak 3.00 GiB, host private peak 1.00 GiB, shared (store + rings) 12.00 GiB" in text


def test_summary_says_how_clipping_went(tmp_path):
    """Exact clipping: which steps clipped, and what their corrections cost beside the steps that kept
    every speculative update."""
    clip = dict(clipped=False, speculated_chunks=4, corrected_chunks=0, correction_s=0.0)
    records = [record(0, 9.0, **clip), record(1, 2.0, **clip), record(2, 2.1, **clip),
               record(3, 2.6, **dict(clip, clipped=True, speculated_chunks=2, corrected_chunks=2, correction_s=0.25)),
               record(4, 2.4, **dict(clip, clipped=True, speculated_chunks=1, corrected_chunks=1, correction_s=0.15))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = "\n".join(report.report(tmp_path, plots=False)[0])
    assert "clipping     2 of 4 step(s) that speculated clipped; median 3 chunk(s) updated before the norm was known" \
        in text
    assert "  steps that did not clip           2.050 s median (every speculative update kept)" in text
    assert "  steps that clipped                2.500 s median, 1.5 chunk(s) corrected in 0.200 s of updater time" in text
    assert "steps after a clipped step" not in text  # records from before the rule: every step speculated
    # with the rule: the steps after a clipped one deferred every update, and are counted apart
    tagged = [dict(r, speculated=r["step"] != 4) for r in records]
    tagged[4].update(speculated_chunks=0, corrected_chunks=0, correction_s=0.0)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tagged))
    text = "\n".join(report.report(tmp_path, plots=False)[0])
    assert "clipping     1 of 3 step(s) that speculated clipped; median 4 chunk(s) updated before the norm was known" \
        in text
    assert "  steps that clipped                2.600 s median, 2 chunk(s) corrected in 0.250 s of updater time" in text
    assert ("  steps after a clipped step        2.400 s median, 1 step(s), 1 clipped (every update waited for the "
            "norm)") in text
    # clipping off: nothing speculated, nothing clipped, no line
    off = dict(clip, speculated_chunks=0)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(record(s, 2.0, **off)) + "\n" for s in range(3)))
    assert "clipping" not in "\n".join(report.report(tmp_path, plots=False)[0])


def test_the_steps_median_leaves_out_a_write_back_of_device_held_units(tmp_path):
    """The job's last step wrote the device-held layers back to the store (0.7 s of its 2.9): the median
    is of the steady steps, and the write-back is named with its time."""
    records = [record(0, 9.0, write_back_s=0.0), record(1, 2.0, write_back_s=0.0), record(2, 2.2, write_back_s=0.0),
               record(3, 2.9, write_back_s=0.7)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = "\n".join(report.report(tmp_path, plots=False)[0])
    assert ("step         median 2.100 s over 2 step(s) (the first, with start-up and 1 with a write-back of "
            "device-held units (median 0.700 s), left out)") in text
    # a run of one steady step that wrote back keeps it: nothing else to take the median of
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (records[0], records[3])))
    text = "\n".join(report.report(tmp_path, plots=False)[0])
    assert "step         median 2.900 s over 1 step(s) (the first, with start-up, left out)" in text


def test_summary_sets_the_gpu_peak_beside_the_reserved_memory_and_the_plan(tmp_path):
    records = [record(s, 2.0, device_reserved_peak_bytes=int(3.5 * 2**30), planned_device_bytes=(4 + s) * 2**30)
               for s in range(3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = "\n".join(report.report(tmp_path, plots=False)[0])
    assert ("memory       GPU peak 3.00 GiB (3.50 reserved, plan 6.00 with the CUDA context), host private peak "
            "1.00 GiB, shared (store + rings) 12.00 GiB") in text


def test_summary_says_how_often_the_allocator_reached_the_budget(tmp_path):
    records = [record(s, 2.0, device_alloc_retries=r) for s, r in enumerate((9, 3, 0, 4))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = "\n".join(report.report(tmp_path, plots=False)[0])
    assert ("the caching allocator reached the budget 3 time(s) a step (median): each freed its cache and "
            "synchronized the device") in text  # the first step (start-up) left out: median of 3, 0, 4
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r | {"device_alloc_retries": 0}) + "\n" for r in records))
    assert "allocator" not in "\n".join(report.report(tmp_path, plots=False)[0])


def test_a_run_of_an_older_version_reads_its_gpu_named_memory_fields(tmp_path):
    """metrics.jsonl of a run from before "device" replaced "gpu" in the field names (old_names.RENAMED)."""
    old = []
    for s in range(3):
        r = record(s, 2.0, gpu_reserved_peak_bytes=int(3.5 * 2**30), planned_gpu_bytes=(4 + s) * 2**30)
        r["gpu_peak_bytes"] = r.pop("device_peak_bytes")
        old.append(r)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    assert report.read_metrics(tmp_path)[2]["planned_device_bytes"] == 6 * 2**30
    text = "\n".join(report.report(tmp_path, plots=False)[0])
    assert ("memory       GPU peak 3.00 GiB (3.50 reserved, plan 6.00 with the CUDA context), host private peak "
            "1.00 GiB, shared (store + rings) 12.00 GiB") in text


def test_pngs_of_a_fixture(tmp_path):
    records = [record(i, 2.0 + 0.1 * i) for i in range(6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    lines, pngs = report.report(tmp_path, tmp_path / "out")
    assert [p.name for p in pngs] == ["loss.png", "tokens_per_s.png", "step_breakdown.png"]
    for p in pngs:
        assert p.parent == tmp_path / "out"
        assert_png(p)


def test_recorded_run(tiny_run, tmp_path, capsys):
    assert report.main([str(tiny_run.run_dir), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"steps        0..{STEPS - 1} ({STEPS} recorded)" in out
    assert "plan         no prediction (a CPU run has no plan)" in out
    assert f"step plan    {tiny_run.run_dir / 'plan.json'} (chosen by the job file)" in out  # what the ranks ran
    assert "  micro_batch           2\n" in out and "  grad_route            host\n" in out
    assert f"trace        step {TRACED}: " in out and "worker0/compute" in out
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["loss.png", "step_breakdown.png", f"timeline_step{TRACED}.png", "tokens_per_s.png"]
    for name in names:
        assert_png(tmp_path / name)
        assert f"wrote {tmp_path / name}" in out


def test_untraced_step_is_refused(tiny_run, capsys):
    assert report.main([str(tiny_run.run_dir), "--no-plots", "--step", "3"]) == 1
    assert capsys.readouterr().err == (f"slidedp-report: error: step 3 is not traced; traced steps: {TRACED} "
                                       "(run.trace_steps)\n")


def test_without_matplotlib(tmp_path, monkeypatch, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(record(0, 1.0)) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert report.main([str(tmp_path)]) == 1
    assert capsys.readouterr().err == ("slidedp-report: error: slidedp-report draws with matplotlib, which is not "
                                       "installed: pip install 'slidedp[report]' (or --no-plots for the summary alone)\n")
    assert report.main([str(tmp_path), "--no-plots"]) == 0
    assert "step         median 1.000 s over 1 step(s)\n" in capsys.readouterr().out


def test_not_a_run_dir(tmp_path, capsys):
    assert report.main([str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"slidedp-report: error: {tmp_path / 'nope' / 'metrics.jsonl'} not found: is ")


@pytest.mark.parametrize("name,kind", [("adamw chunk 12", "adamw chunk"), ("fetch layer.1", "fetch layer"),
                                       ("step 3 committed", "step committed"), ("loss + head backward", "loss + head backward")])
def test_event_kinds(name, kind):
    assert report.event_kind(name) == kind


def test_summary_says_what_host_memory_moved_per_parameter(tmp_path):
    records = [record(s, 2.0, host_bytes_per_param=34.5 + s, h2d_bytes=2**31, d2h_bytes=2**30) for s in range(5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = "\n".join(report.report(tmp_path, plots=False)[0])
    assert ("host memory  37.0 B/param read and written per step (median): the ranks' copies in 2.00 GiB and "
            "gradients out 1.00 GiB") in text  # the first step, with the start-up, left out
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(record(s, 2.0)) + "\n" for s in range(5)))
    assert "host memory" not in "\n".join(report.report(tmp_path, plots=False)[0])  # an older run
