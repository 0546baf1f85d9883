"""benchmarks/updater_probe.py: the calibration's own AdamW probe at the sizes and thread counts asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import updater_probe
from slidedp.planner import measure


def test_each_row_is_the_calibrations_probe_at_that_size_and_thread_count(tmp_path, monkeypatch):
    calls = []

    def fake_probe(threads, device, gpus, params, repeat, state):
        assert state is None  # the process's own memory: the probe makes its tensors
        calls.append((threads, device, gpus, params, repeat))
        return 1.5e8 * threads

    monkeypatch.setattr(measure, "adamw_beside_copies", fake_probe)
    threads_before = torch.get_num_threads()
    out = tmp_path / "probe.json"
    assert updater_probe.main(["--out", str(out), "--params", "1,2", "--threads", "1,2", "--repeat", "1",
                               "--device", "cpu"]) == 0
    assert calls == [(1, "cpu", 1, 1_000_000, 1), (2, "cpu", 1, 1_000_000, 1),
                     (1, "cpu", 1, 2_000_000, 1), (2, "cpu", 1, 2_000_000, 1)]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["params"], r["threads"]) for r in rows] == [(1_000_000, 1), (1_000_000, 2), (2_000_000, 1), (2_000_000, 2)]
    for r in rows:
        assert r["bare_params_per_s"] > 0 and r["beside_copies_params_per_s"] == 1.5e8 * r["threads"]
        assert r["beside_over_bare"] == pytest.approx(r["beside_copies_params_per_s"] / r["bare_params_per_s"])
    assert torch.get_num_threads() == threads_before


def test_the_probe_runs_for_real_on_a_cpu(tmp_path):
    out = tmp_path / "probe.json"
    assert updater_probe.main(["--out", str(out), "--params", "1", "--threads", "1", "--repeat", "1",
                               "--device", "cpu"]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["params"] == 1_000_000 and row["bare_params_per_s"] > 0 and row["beside_copies_params_per_s"] > 0


def test_the_shm_rows_update_tensors_in_a_segment_made_as_the_stores_and_remove_it(tmp_path, monkeypatch):
    seen = []

    def fake_probe(threads, device, gpus, params, repeat, state):
        p, g, m, v = state
        segments = [f.stat().st_size for f in Path("/dev/shm").glob("slidedp.updater-probe-*")]
        seen.append((p.numel(), [t.data_ptr() - p.data_ptr() for t in (g, m, v)], segments))
        return 2.0e8

    monkeypatch.setattr(measure, "adamw_beside_copies", fake_probe)
    out = tmp_path / "probe.json"
    assert updater_probe.main(["--out", str(out), "--params", "1", "--threads", "1", "--repeat", "1",
                               "--device", "cpu", "--memory", "shm"]) == 0
    # one 16 MB segment holds the four tensors back to back
    assert seen == [(1_000_000, [4_000_000, 8_000_000, 12_000_000], [16_000_000])]
    doc = json.loads(out.read_text())
    [row] = doc["rows"]
    assert row["memory"] == "shm" and row["beside_copies_params_per_s"] == 2.0e8 and row["bare_params_per_s"] > 0
    assert "AnonHugePages" in row["huge_pages_kib"] and isinstance(doc["transparent_hugepage"], dict)
    assert not list(Path("/dev/shm").glob("slidedp.updater-probe-*"))


def test_an_unknown_memory_kind_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="--memory takes anon or shm, not 'numa'"):
        updater_probe.main(["--out", str(tmp_path / "p.json"), "--params", "1", "--threads", "1", "--repeat", "1",
                            "--device", "cpu", "--memory", "numa"])
