"""benchmarks/updater_share.py: the updaters' kernel share in training, a fixed cost per chunk taken out."""

from __future__ import annotations

import json

import pytest

from benchmarks import updater_share
from slidedp.planner.calibration import Calibration


def test_the_host_updates_the_layers_not_held_and_an_embedding_left_on_the_host():
    # tiny: embed 32,768, two layers of 37,120, the final norm 64
    assert updater_share.host_chunks("tiny", 0, "host") == [32768, 37120, 37120, 64]
    assert updater_share.host_chunks("tiny", 1, "host") == [32768, 37120, 64]
    assert updater_share.host_chunks("tiny", 2, "device") == [64]


def test_the_kernels_rate_is_the_chunks_over_the_busy_time_less_the_fixed_cost(tmp_path, monkeypatch):
    cal = tmp_path / "plan-choice-tiny-b8-abc1234-calibration.json"
    cal.write_text(json.dumps({"learned": {"106944": {"adamw_train_params_per_s": 1.0e6}}}))
    calib = Calibration(host="h", device_name="cpu", h2d_gbps=1, d2h_gbps=1, bidir_gbps=1, adamw_params_per_s=4.0e6,
                        adamw_threads=2, reduce_gbps=1, device_tflops=1, device_mem_bytes=1 << 30)
    monkeypatch.setattr(updater_share.replay_plan, "load", lambda *a: (calib, {}))
    monkeypatch.setattr(updater_share.replay_plan, "replay",
                        lambda *a, **k: [{"device_layers": 1, "embedding": "host"}])
    row = updater_share.share(cal, per_chunk_s=0.01)
    params = 32768 + 37120 + 64  # the embedding, layer 1 and the norm: 69,952 in 3 chunks
    busy = params / 1.0e6  # 69.952 ms at the rate the run measured
    assert (row["chunks"], row["observed"], row["bare"]) == (3, 1.0e6, 4.0e6)
    assert row["kernel"] == pytest.approx(params / (busy - 3 * 0.01))
    assert row["kernel_share"] == pytest.approx(row["kernel"] / 4.0e6)
    assert row["observed_share"] == 0.25
    assert updater_share.share(tmp_path / "no-name-calibration.json", 0.0) is None
