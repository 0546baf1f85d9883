"""benchmarks/updater_probe.py: the calibration's own AdamW probe at the sizes and thread counts asked."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import updater_probe
from slidedp.planner import measure


def test_each_row_is_the_calibrations_probe_at_that_size_and_thread_count(tmp_path, monkeypatch):
    calls = []

    def fake_probe(threads, device, gpus, params, repeat):
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
