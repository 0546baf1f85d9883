"""benchmarks/replay_plan.py: a plan made again off the GPU machine from the cache files a call brought back."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import replay_plan
from slidedp.model.config import NAMED_SHAPES, ModelConfig, named_shape
from slidedp.planner import REFERENCE_CALIBRATION, cache, measure
from slidedp.planner.measure import LayerTime, LossTime, MeasuredBlocks

SHAPE = "qwen3-1.7b"


def write_cache(tmp_path, learned_rate: float | None = None):
    cfg = named_shape(SHAPE)
    cal_path, blocks_path = tmp_path / "calibration.json", tmp_path / "measured.json"
    learned = ({cfg.num_parameters(): {"adamw_train_params_per_s": learned_rate,
                                       "adamw_train_model_params": cfg.num_parameters()}} if learned_rate else None)
    cache.save(REFERENCE_CALIBRATION, cal_path, learned)
    key = measure.shape_key(cfg, 2048, "bf16", True)
    blocks = MeasuredBlocks(key, "NVIDIA H200",
                            tuple(LayerTime(m, 0, 0.4e-3 * m + 0.4e-3, 1.3e-3 * m + 3.5e-3, 0) for m in (1, 2, 4, 8)),
                            tuple(LossTime(m, 0, 1024, 11.4e-3 * m, 0) for m in (1, 2, 4, 8)))
    cache._write_blocks(blocks_path, {key: blocks})
    return cal_path, blocks_path


def test_replays_every_micro_batch_asked_and_the_plans_choice(tmp_path, capsys):
    cal_path, blocks_path = write_cache(tmp_path)
    assert replay_plan.main([str(cal_path), str(blocks_path), "--shape", SHAPE, "--batch", "8", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["asked"] for r in rows] == [0, 1, 2, 4, 8]
    chosen = rows[0]
    assert chosen["micro_batch"] in (1, 2, 4, 8)
    same = next(r for r in rows[1:] if r["asked"] == chosen["micro_batch"])
    assert same["judged_s"] == pytest.approx(chosen["judged_s"])  # the choice replays as that micro-batch forced
    assert all(r["judged_s"] >= chosen["judged_s"] * 0.98 for r in rows[1:])  # the fastest, within the 2% rule
    assert all(r["clipped_s"] >= r["unclipped_s"] for r in rows)


def test_learned_charges_the_rate_runs_of_the_model_measured(tmp_path, capsys):
    slow = REFERENCE_CALIBRATION.adamw_beside_copies_params_per_s or REFERENCE_CALIBRATION.adamw_params_per_s
    cal_path, blocks_path = write_cache(tmp_path, learned_rate=slow / 4)
    args = [str(cal_path), str(blocks_path), "--shape", SHAPE, "--batch", "8", "--micro", "4", "--json"]
    replay_plan.main(args)
    first = json.loads(capsys.readouterr().out)[0]
    replay_plan.main(args + ["--learned"])
    learned = json.loads(capsys.readouterr().out)[0]
    assert learned["clipped_s"] > first["clipped_s"]  # a quarter of the rate: the deferred updates take longer


def test_a_blocks_file_without_the_shape_is_named(tmp_path):
    cal_path, blocks_path = write_cache(tmp_path)
    with pytest.raises(SystemExit, match="the blocks file has no entry for 'qwen3 h2560"):
        replay_plan.main([str(cal_path), str(blocks_path), "--shape", "qwen3-4b", "--batch", "8"])


def test_a_replay_reads_the_blocks_a_run_was_planned_with_where_a_plan_measures_again(tmp_path, capsys):
    """The blocks kept beside this repository's results were timed the older way (schema 1: the same
    fields): a plan measures them again, a replay reads them as they are."""
    cal_path, blocks_path = write_cache(tmp_path)
    doc = json.loads(blocks_path.read_text())
    blocks_path.write_text(json.dumps(dict(doc, schema=1)))
    assert cache.read_blocks(blocks_path) == {}  # what a plan sees: nothing cached, measure again
    assert list(cache.read_blocks(blocks_path, cache.READABLE_SCHEMAS)) == list(doc["shapes"])
    assert replay_plan.main([str(cal_path), str(blocks_path), "--shape", SHAPE, "--batch", "8", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 5


RESULTS = Path(__file__).resolve().parent.parent / "results"
# issue 23's first runs on one H200: (results tag, shape, batch, clipping); the unseen shape is the Llama
# config plan_choice.sh writes
FIRST_RUNS = [("qwen3-1.7b-b8", "qwen3-1.7b", 8, True), ("qwen3-4b-b8", "qwen3-4b", 8, True),
              ("qwen3-1.7b-b32", "qwen3-1.7b", 32, True), ("qwen3-4b-b32", "qwen3-4b", 32, True),
              ("unseen-b8", "llama-unseen", 8, True), ("qwen3-8b-b8-before-queue-model", "qwen3-8b", 8, False),
              ("qwen3-8b-b32-before-queue-model", "qwen3-8b", 32, False), ("qwen3-8b-b8", "qwen3-8b", 8, False),
              ("qwen3-8b-b32", "qwen3-8b", 32, False)]


@pytest.mark.parametrize("tag, shape, batch, clip", FIRST_RUNS)
def test_recorded_first_runs_replay_their_choice_within_10_percent_of_the_measured_step(tag, shape, batch, clip,
                                                                                       monkeypatch):
    """From the calibration and blocks each first run measured, this checkout's planner makes the choice
    the run made and predicts its step within 10% of the run's measured median (its summary's line)."""
    monkeypatch.setitem(NAMED_SHAPES, "llama-unseen", ModelConfig(
        family="llama", vocab_size=151936, hidden_size=3072, intermediate_size=8192, num_layers=26, num_heads=24,
        num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=8192))
    summary = (RESULTS / f"plan-choice-{tag}-summary.txt").read_text()
    ran = re.search(r"-auto\s+micro_batch (\d+): predicted [0-9.]+ s, measured median ([0-9.]+) s", summary)
    chose, measured = int(ran[1]), float(ran[2])
    params = named_shape(shape).num_parameters()
    calib, shapes = replay_plan.load(RESULTS / f"plan-choice-{tag}-calibration.json",
                                     RESULTS / f"plan-choice-{tag}-measured.json", params, learned=False)
    plan = replay_plan.replay(calib, shapes, shape, batch, [0], clip=clip)[0]
    assert plan["micro_batch"] == chose
    assert abs(plan["judged_s"] / measured - 1) < 0.10, (plan["judged_s"], measured)
