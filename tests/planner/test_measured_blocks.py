"""The planner's measured GPU blocks and its choice of the micro-batch: injected measurements decide
the plan (no timing thresholds anywhere), the cache is read on a second plan, and the measuring code
itself runs on CPU at a tiny shape."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from slidedp.config import ConfigError, load_job
from slidedp.launch.planning import plan_job
from slidedp.model.config import ModelConfig, named_shape
from slidedp.planner import REFERENCE_CALIBRATION, PlanError, Workload, make_plan, predict_step
from slidedp.planner import cache, measure
from slidedp.planner import plan as plan_mod
from slidedp.planner.costs import GiB
from slidedp.planner.job import CPU_MAX_MICRO_BATCH, cpu_micro_batch
from slidedp.planner.measure import LayerTime, LossTime, MeasuredBlocks, shape_key
from slidedp.planner.plan import device_work_sizes
from slidedp.planner.step_model import device_times

from pipeline.harness import TINY

FP32 = {"delivery": ("fp32",)}
BUDGET = 24 * GiB


def _work(micro_batch: int = 0, **kw) -> Workload:
    return Workload(named_shape("qwen3-1.7b"), global_batch=8, seq_len=2048, world=1, micro_batch=micro_batch,
                    clip=False, compiled=True, **kw)


def _blocks(work: Workload, per_sequence_s: dict[int, float], *budgets: int) -> MeasuredBlocks:
    """Blocks at every size the plan weighs at these budgets, a layer's forward taking per_sequence_s[m]
    per sequence at micro-batch m (its backward 3x that), the loss a tenth of the forward. Large enough
    that the GPU bounds the step."""
    layers, losses = {}, []
    sizes = {s for b in budgets or (BUDGET,) for s in device_work_sizes(work, b, FP32)}
    for m, tile, chunk in sorted(sizes):
        fwd = per_sequence_s[m] * m
        layers[(m, tile)] = LayerTime(m, tile, fwd, 3 * fwd, 0)
        losses.append(LossTime(m, tile, chunk, fwd / 10, 0))
    return MeasuredBlocks(shape_key(work.model, work.seq_len, work.compute_dtype, work.compiled), "GPU T",
                          tuple(layers.values()), tuple(losses))


FAVOURS_8 = {1: 0.040, 2: 0.030, 4: 0.024, 8: 0.020}  # s per sequence per layer forward: GEMMs grow more efficient
FAVOURS_2 = {1: 0.030, 2: 0.020, 4: 0.026, 8: 0.032}


def test_a_measured_layer_time_decides_the_micro_batch():
    work = _work()
    assert sorted({m for m, _, _ in device_work_sizes(work, BUDGET, FP32)}) == [1, 2, 4, 8]
    for times, want in ((FAVOURS_8, 8), (FAVOURS_2, 2)):
        calib = dataclasses.replace(REFERENCE_CALIBRATION, blocks=_blocks(work, times))
        plan = make_plan(work, BUDGET, calib, FP32)
        assert plan.step.micro_batch == want  # what the workers carry out (plan.json)
        # the GPU time is the measured blocks times the passes: 28 layers x (fwd + bwd) + the loss
        nl, passes = work.model.num_layers, 8 // want
        per_pass = times[want] * want
        gpu = dict(plan.busy_s)["device"]
        held = gpu - nl * passes * 4 * per_pass - passes * per_pass / 10
        assert 0 <= held < 0.05 * gpu  # what remains is the device-held units' AdamW
        weighed = {c.micro_batch: c for c in plan.weighed}
        assert sorted(weighed) == [1, 2, 4, 8] and plan.weighed[0].micro_batch == want
        assert weighed[want].verdict == "chosen" and all(c.device_time == "measured" for c in plan.weighed)
        for m, c in weighed.items():
            if m != want:
                assert c.predicted_step_s > weighed[want].predicted_step_s
                assert c.verdict == f"{100 * (c.predicted_step_s / weighed[want].predicted_step_s - 1):.1f}% slower"
        assert "the plan's choice" in plan.describe()


def test_a_budget_that_rules_the_fastest_out_picks_the_best_that_fits():
    work = _work()
    roomy = make_plan(work, BUDGET, dataclasses.replace(REFERENCE_CALIBRATION, blocks=_blocks(work, FAVOURS_8)), FP32)
    need = {c.micro_batch: c.device_bytes for c in roomy.weighed}
    assert need[8] > need[4]
    # a budget below the smallest plan at 8 sequences but above one at 4
    smallest_8 = plan_mod._total(work, plan_mod._least_memory(work, 8, FP32))
    smallest_4 = plan_mod._total(work, plan_mod._least_memory(work, 4, FP32))
    assert smallest_4 < smallest_8
    budget = (smallest_4 + smallest_8) // 2
    calib = dataclasses.replace(REFERENCE_CALIBRATION, blocks=_blocks(work, FAVOURS_8, budget))
    tight = make_plan(work, budget, calib, FP32)
    assert tight.step.micro_batch == 4 and tight.device_total_bytes <= budget
    rejected = [c for c in tight.weighed if c.micro_batch == 8]
    assert len(rejected) == 1 and rejected[0].predicted_step_s is None
    assert rejected[0].verdict == f"does not fit: its smallest plan needs {smallest_8 / GiB:.2f} GiB"
    assert "does not fit: its smallest plan needs" in tight.describe()


def test_a_forced_micro_batch_is_kept():
    work = _work(micro_batch=2)
    calib = dataclasses.replace(REFERENCE_CALIBRATION, blocks=_blocks(_work(), FAVOURS_8))
    plan = make_plan(work, BUDGET, calib, FP32)
    assert plan.step.micro_batch == 2 and [c.micro_batch for c in plan.weighed] == [2]
    assert plan.weighed[0].verdict == "chosen" and plan.weighed[0].device_time == "measured"
    assert "micro-batches weighed (plan.micro_batch set in the job file)" in plan.describe()
    assert "2 (job's value; 4 per rank per step)" in plan.describe()


def test_the_candidate_table_lists_what_was_weighed():
    work = _work()
    plan = make_plan(work, BUDGET, dataclasses.replace(REFERENCE_CALIBRATION, blocks=_blocks(work, FAVOURS_8)), FP32)
    text = plan.describe()
    assert "micro-batches weighed (plan.micro_batch = \"auto\": the fastest predicted that fits; within 2% of it, the larger)" in text
    for c in plan.weighed:
        assert (f"  {c.micro_batch:<13}{f'{c.predicted_step_s:.3f} s':>15}{c.device_bytes / GiB:>9.2f} GiB   "
                f"measured  {c.verdict}") in text
    assert "GPU time: one decoder layer and the loss timed on the GPU T at this shape, from this host's cache" in text


def test_without_blocks_the_flops_charge_every_micro_batch_alike():
    """No blocks measured (CPU CI, the reference figures): a layer's GPU time depends on the tokens only,
    whatever the micro-batch, so memory decides (a smaller micro-batch leaves room for more device-held
    layers), and the plan says where its GPU time came from."""
    work = _work()
    plan = make_plan(work, BUDGET, REFERENCE_CALIBRATION, FP32)
    assert {c.device_time for c in plan.weighed} == {"FLOPs"} and plan.weighed[0].micro_batch == plan.step.micro_batch
    layer_time = {m: device_times(work, plan_mod.replace(plan.step, micro_batch=m), REFERENCE_CALIBRATION)
                  for m in (1, 2, 4, 8)}
    assert len(set(layer_time.values())) == 1
    assert "GPU time: the matmul FLOPs at 405 TFLOP/s effective (compiled layers 1.44x faster)" in plan.describe()
    # blocks measured for another shape are not this job's
    other = dataclasses.replace(REFERENCE_CALIBRATION, blocks=_blocks(_work(), FAVOURS_2))
    longer = Workload(work.model, global_batch=8, seq_len=4096, world=1, micro_batch=0, clip=False, compiled=True)
    assert predict_step(longer, plan_mod.replace(plan.step, micro_batch=2), other) == \
        predict_step(longer, plan_mod.replace(plan.step, micro_batch=2), REFERENCE_CALIBRATION)


def test_more_budget_is_not_slower_beyond_the_models_tolerance():
    """With the micro-batch the plan's to choose, a larger budget may take a larger micro-batch that is
    predicted up to 2% slower (the least-compromise rule), never more."""
    work = _work()
    budgets = (6, 8, 12, 16, 24, 32, 48, 64, 96)
    calib = dataclasses.replace(REFERENCE_CALIBRATION, blocks=_blocks(work, FAVOURS_2, *(g * GiB for g in budgets)))
    last = math.inf
    for gib in budgets:
        try:
            plan = make_plan(work, gib * GiB, calib, FP32)
        except PlanError:
            assert last == math.inf
            continue
        low = calib.at_lowest_share(work.model.num_parameters()) or calib
        judged = max(plan.step.predicted_step_s, predict_step(work, plan.step, low)[2])
        assert judged <= last * (1 + plan_mod._EQUAL) + 1e-12
        last = min(last, judged)
    assert last < math.inf


# --------------------------------------------------------------------------------------
# the cache


def _tiny_cfg() -> ModelConfig:
    return ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, tie_word_embeddings=True, qk_norm=True)


def test_the_cache_is_read_on_the_second_plan(tmp_path, caplog):
    cfg = _tiny_cfg()
    calls: list[list] = []

    def fake_measure(model, seq_len, dtype, compiled, sizes, local_batch, **kw):
        calls.append(list(sizes))
        key = shape_key(model, seq_len, dtype, compiled)
        return MeasuredBlocks(key, kw["device_name"], tuple(LayerTime(m, t, 0.1 * m, 0.3 * m) for m, t, _ in sizes),
                              tuple(LossTime(m, t, c, 0.01 * m) for m, t, c in sizes))

    def get(sizes):
        return cache.measured_blocks(cfg, 16, "bf16", True, sizes, 4, "host-c", "GPU C", cache_dir=tmp_path,
                                       measure=fake_measure)

    first = get([(1, 0, 16), (2, 0, 16), (2, 64, 16)])  # a tile over the whole micro-batch is no tile
    assert calls == [[(1, 0, 16), (2, 0, 16)]] and first.measured_s > 0
    second = get([(2, 0, 16), (1, 0, 16)])
    assert len(calls) == 1 and second.measured_s == 0.0  # instant: nothing measured
    assert dataclasses.replace(first, measured_s=0.0) == second
    third = get([(1, 0, 16), (4, 8, 16)])  # a size no plan weighed before: only it is measured
    assert calls[-1] == [(4, 8, 16)] and third.has((1, 0, 16)) and third.has((4, 8, 16))
    path = cache.blocks_file("host-c", "GPU C", tmp_path)
    doc = json.loads(path.read_text())
    assert doc["schema"] == measure.SCHEMA == 2 and list(doc["shapes"]) == [shape_key(cfg, 16, "bf16", True)]
    # another shape (another sequence length) is measured apart, beside it
    cache.measured_blocks(cfg, 32, "bf16", True, [(1, 0, 16)], 4, "host-c", "GPU C", cache_dir=tmp_path,
                            measure=fake_measure)
    assert len(json.loads(path.read_text())["shapes"]) == 2
    # an unreadable file is measured again, with a warning, not a crash
    path.write_text("{not json")
    with caplog.at_level("WARNING"):
        again = get([(1, 0, 16)])
    assert again.measured_s > 0 and "is unreadable" in caplog.text and calls[-1] == [(1, 0, 16)]


def test_blocks_reject_bad_times():
    good = MeasuredBlocks("s", "d", (LayerTime(1, 0, 0.1, 0.3),), (LossTime(1, 0, 16, 0.01),))
    assert MeasuredBlocks.from_dict(json.loads(json.dumps(good.to_dict()))) == good
    bad = good.to_dict()
    bad["layers"][0]["forward_s"] = -1.0
    with pytest.raises(measure.MeasureError, match="not a positive number"):
        MeasuredBlocks.from_dict(bad)
    with pytest.raises(measure.MeasureError, match="measured blocks"):
        MeasuredBlocks.from_dict({"shape": "s"})


# --------------------------------------------------------------------------------------
# the measuring code itself, on CPU


def test_the_measuring_code_runs_on_cpu_at_a_tiny_shape():
    """The same code as on the GPU, device = "cpu": well-formed blocks at every size asked (their times
    are the CPU's and mean nothing for a GPU)."""
    cfg = _tiny_cfg()
    sizes = [(1, 0, 16), (2, 0, 8), (2, 8, 8)]
    blocks = measure.measure_blocks(cfg, 16, "fp32", False, sizes, 2, device="cpu", repeat=1, device_name="cpu")
    assert blocks.shape == shape_key(cfg, 16, "fp32", False) and blocks.device_name == "cpu"
    assert [(t.micro_batch, t.seq_tile_tokens) for t in blocks.layers] == [(1, 0), (2, 0), (2, 8)]
    assert [(t.micro_batch, t.seq_tile_tokens, t.loss_chunk_tokens) for t in blocks.losses] == sizes
    for t in blocks.layers:
        assert t.forward_s > 0 and t.backward_s > 0 and t.workspace_bytes == 0  # no allocator peak on CPU
    assert all(t.seconds > 0 for t in blocks.losses) and all(blocks.has(s) for s in sizes)
    assert MeasuredBlocks.from_dict(json.loads(json.dumps(blocks.to_dict()))) == blocks
    with pytest.raises(measure.MeasureError, match="micro_batch 3 does not divide the 2 sequences per rank"):
        measure.measure_blocks(cfg, 16, "fp32", False, [(3, 0, 16)], 2, device="cpu", repeat=1)


def test_the_adamw_beside_copies_runs_on_cpu():
    assert measure.adamw_beside_copies(threads=1, device="cpu", params=1 << 16, copy_mib=1, repeat=1) > 0


def test_the_launchers_subprocess_returns_the_calibration_and_the_blocks(tmp_path, monkeypatch):
    from slidedp.planner import cache as cache_mod  # noqa: PLC0415
    from slidedp.planner import calibration as calibration_mod  # noqa: PLC0415
    from slidedp.planner.inputs import plan_inputs  # noqa: PLC0415

    monkeypatch.setenv("SLIDEDP_CACHE_DIR", str(tmp_path))
    first = dataclasses.replace(REFERENCE_CALIBRATION, host=cache_mod.socket.gethostname(),
                                device_name=cache_mod.device_label("cpu"), host_read_gbps=80.0,
                                host_write_gbps=40.0, host_copy_gbps=60.0)
    monkeypatch.setattr(cache_mod, "calibrate", lambda device, quick=False: first)
    # measured again after the blocks: the AdamW and the copy faster (a first minute's slowness gone), the
    # read slower (something beside the probe): each field keeps the better figure
    again = {"adamw_params_per_s": 5.5e9, "reduce_gbps": 41.0, "host_read_gbps": 50.0, "host_write_gbps": 40.0,
             "host_copy_gbps": 70.0, "host_node_copy_gbps": ""}
    asked = []
    monkeypatch.setattr(cache_mod, "host_rates", lambda *a: asked.append(a) or again)
    cfg = _tiny_cfg()
    spec = {"gpus": 1, "model_params": None, "model": cfg.to_dict(), "seq_len": 16, "compute_dtype": "fp32",
            "compiled": False, "local_batch": 2, "sizes": [[1, 0, 16], [2, 0, 16]]}
    doc = json.loads(json.dumps(plan_inputs(spec, device="cpu")))
    blocks = MeasuredBlocks.from_dict(doc["blocks"])
    assert blocks.has((1, 0, 16)) and blocks.has((2, 0, 16)) and blocks.measured_s > 0
    calib = calibration_mod.Calibration.from_dict(doc["calibration"])
    assert calib.device_tflops == REFERENCE_CALIBRATION.device_tflops
    assert (calib.adamw_params_per_s, calib.host_copy_gbps, calib.host_read_gbps) == (5.5e9, 70.0, 80.0)
    assert asked == [("cpu", REFERENCE_CALIBRATION.adamw_threads, 1, False)]
    cached = cache_mod.load(cache_mod.cache_path("cpu"))
    assert (cached.adamw_params_per_s, cached.host_copy_gbps, cached.host_read_gbps) == (5.5e9, 70.0, 80.0)
    second = plan_inputs(spec, device="cpu")  # the blocks cached: nothing measured, the host not again
    assert MeasuredBlocks.from_dict(second["blocks"]).measured_s == 0.0 and len(asked) == 1
    assert second["calibration"]["adamw_params_per_s"] == 5.5e9


# --------------------------------------------------------------------------------------
# the job file


def test_the_micro_batch_defaults_to_the_plans_choice_and_is_validated():
    job = load_job(TINY, ["plan.micro_batch=auto"])
    assert job.plan.micro_batch == "auto"
    step = plan_job(job).step  # CPU: the largest divisor of the per-rank batch up to CPU_MAX_MICRO_BATCH
    assert step.micro_batch == cpu_micro_batch(job.train.global_batch // job.runtime.workers)
    assert [cpu_micro_batch(n) for n in (1, 7, 9, 12, 16, 64)] == [1, 7, 3, 6, 8, 8] and CPU_MAX_MICRO_BATCH == 8
    with pytest.raises(ConfigError, match=r"train.global_batch \(5\) must be divisible by runtime.workers \(2\): "
                                          r"every rank runs the same number of sequences"):
        load_job(TINY, ["plan.micro_batch=auto", "train.global_batch=5", "runtime.workers=2"])
    with pytest.raises(ConfigError, match=r'plan.micro_batch must be "auto" or an integer >= 1; got -1'):
        load_job(TINY, ["plan.micro_batch=-1"])
    with pytest.raises(ConfigError, match=r"plan.micro_batch \(3\) must divide train.global_batch \(4\)"):
        load_job(TINY, ["plan.micro_batch=3", "train.global_batch=4"])
    cuda = ['runtime.device="cuda"', "runtime.workers=1", "train.global_batch=4", 'model.shape="qwen3-0.6b"',
            "train.seq_len=512"]
    chosen = plan_job(load_job(TINY, cuda + ["plan.micro_batch=auto"]), REFERENCE_CALIBRATION)
    assert chosen.plan is not None and chosen.step.micro_batch == chosen.plan.step.micro_batch in (1, 2, 4)
    forced = plan_job(load_job(TINY, cuda + ["plan.micro_batch=2"]), REFERENCE_CALIBRATION)
    assert forced.step.micro_batch == 2


def test_a_measured_layer_workspace_larger_than_the_model_bounds_the_plan():
    """Where the GPU measured more workspace for a layer's backward than the memory model gives (an
    architecture the model was not fitted on), the plan charges the measurement and still fits the
    budget: here micro-batch 8's untiled backward measured 2 GiB more than the plan's whole slack."""
    work = _work()
    fast = _blocks(work, FAVOURS_8)
    plain = make_plan(work, BUDGET, dataclasses.replace(REFERENCE_CALIBRATION, blocks=fast), FP32)
    assert (plain.step.micro_batch, plain.step.seq_tile_tokens) == (8, 0)
    model_ws = dict(plain.device_memory)["layer workspace"]
    extra = BUDGET - plain.device_total_bytes + 2 * GiB
    counted_elsewhere = (plan_mod.costs.layer_params(work.model) + 8 * 2048 * work.model.hidden_size) * 2  # bf16
    big = dataclasses.replace(fast, layers=tuple(
        dataclasses.replace(t, workspace_bytes=model_ws + extra + counted_elsewhere)
        if (t.micro_batch, t.seq_tile_tokens) == (8, 0) else t for t in fast.layers))
    calib = dataclasses.replace(REFERENCE_CALIBRATION, blocks=big)
    charged = plan_mod._bounded_memory(work, plain.step, calib)
    assert dict(charged)["layer workspace"] == model_ws + extra
    assert plan_mod.costs.device_memory_peak(charged, 1).total_bytes > BUDGET  # the plain plan would not fit
    bounded = make_plan(work, BUDGET, calib, FP32)
    assert bounded.device_total_bytes <= BUDGET and bounded.budget_bytes == BUDGET
    assert plan_mod.costs.device_memory_peak(bounded.device_memory, 1).total_bytes == bounded.device_total_bytes
    assert bounded.step != plain.step
    if (bounded.step.micro_batch, bounded.step.seq_tile_tokens) == (8, 0):
        assert dict(bounded.device_memory)["layer workspace"] == model_ws + extra
    # the plan says both figures and which it counts: the data to tell whether the formula is near the GPU
    note = plan_mod._workspace_note(work, plain.step, calib, dict(charged)["layer workspace"])
    assert note == (f"layer workspace at micro-batch 8: the formula's {model_ws / GiB:.3f} GiB, the GPU's backward "
                    f"{(model_ws + extra + counted_elsewhere) / GiB:.3f} GiB above its inputs; the plan counts "
                    f"{(model_ws + extra) / GiB:.3f} GiB (the larger of the formula's and the GPU's less the gradients "
                    "other items count)")
    assert plan_mod._workspace_note(work, plain.step, dataclasses.replace(REFERENCE_CALIBRATION, blocks=fast),
                                    model_ws) is None


@pytest.mark.gpu
def test_the_measured_blocks_on_a_gpu_are_well_formed_and_within_the_memory_model():
    """On CUDA, compiled as a run compiles (train.compile = "auto"): positive times at every size, an
    allocator peak for every block, and a layer's measured workspace (less what other items count)
    within the memory model's item for Qwen3-0.6B's layer at 2 x 1,024 tokens."""
    import torch  # noqa: PLC0415

    from slidedp.planner import costs  # noqa: PLC0415

    cfg = named_shape("qwen3-0.6b")
    sizes = [(1, 0, 1024), (2, 0, 1024), (2, 1024, 512)]
    blocks = measure.measure_blocks(cfg, 1024, "bf16", True, sizes, 2, device="cuda",
                                    device_name=torch.cuda.get_device_name())
    assert all(blocks.has(s) for s in sizes)
    for t in blocks.layers:
        assert t.forward_s > 0 and t.backward_s > 0 and t.workspace_bytes > 0
        counted_elsewhere = (costs.layer_params(cfg) + t.micro_batch * 1024 * cfg.hidden_size) * 2
        model = costs.layer_workspace_bytes(cfg, t.micro_batch, 1024, t.seq_tile_tokens, "bf16")
        assert t.workspace_bytes - counted_elsewhere <= model, (t, model)
    assert all(t.seconds > 0 and t.workspace_bytes > 0 for t in blocks.losses)


def test_a_size_not_measured_takes_the_nearest_measured_one_per_sequence():
    """The plan may weigh a size the launcher did not measure (a plan made again in less memory): it is
    charged the measured size nearest to it, per sequence, not the FLOPs, and says so."""
    from slidedp.planner.step_model import device_time_source  # noqa: PLC0415

    work = _work()
    key = shape_key(work.model, work.seq_len, work.compute_dtype, work.compiled)
    only_2 = MeasuredBlocks(key, "GPU T", (LayerTime(2, 0, 0.2, 0.6),), (LossTime(2, 0, 1024, 0.05),))
    calib = dataclasses.replace(REFERENCE_CALIBRATION, blocks=only_2)
    ch = plan_mod.StepPlan(embedding="host", micro_batch=4, loss_chunk_tokens=512, seq_tile_tokens=4096)
    assert device_times(work, ch, calib) == pytest.approx((0.2 * 4, 0.6 * 4, 0.05 * 4))  # 8 sequences = 4 x 2
    assert device_time_source(work, ch, calib) == "nearby"
    assert device_time_source(work, dataclasses.replace(ch, micro_batch=2, seq_tile_tokens=0, loss_chunk_tokens=1024),
                           calib) == "measured"
    assert device_time_source(work, ch, REFERENCE_CALIBRATION) == "FLOPs"


def test_with_clipping_the_micro_batch_is_judged_by_the_slower_regime():
    """Exact clipping has two step times: the norm under the threshold (updates overlap the backward) and a
    step after a clipped one (they wait for the norm). The plan judges each micro-batch by the slower:
    these blocks make 1 the fastest without clipping by 3%, 4 within 2% of 1 after a clipped step."""
    times = {1: 0.00093, 2: 0.00091, 4: 0.00086, 8: 0.00105}
    work = Workload(named_shape("qwen3-4b"), global_batch=8, seq_len=2048, world=1, micro_batch=0, clip=True,
                    compiled=True)
    n = work.model.num_parameters()
    calib = dataclasses.replace(REFERENCE_CALIBRATION, blocks=_blocks(dataclasses.replace(work, clip=False), times),
                                adamw_train_params_per_s=2.5e9, adamw_train_model_params=n)  # a learned rate
    assert make_plan(dataclasses.replace(work, clip=False), BUDGET, calib, FP32).step.micro_batch == 1
    plan = make_plan(work, BUDGET, calib, FP32)
    assert plan.step.micro_batch == 4
    for c in plan.weighed:  # each row: the slower regime of that micro-batch's plan
        step = make_plan(dataclasses.replace(work, micro_batch=c.micro_batch), BUDGET, calib, FP32).step
        assert c.predicted_step_s == pytest.approx(max(step.predicted_step_s, step.predicted_clipped_step_s))
        assert step.predicted_clipped_step_s > step.predicted_step_s  # the updater bounds a clipped step here
    assert "judged by the slower of its regimes" in plan.describe()


def test_a_timed_block_runs_back_to_back_for_its_window(monkeypatch):
    """A pass of a few milliseconds is timed inside a window of at least BLOCK_WINDOW_S (at most
    MAX_INNER passes) and counted as one pass's share; without a window each timed run is one call.
    A fake clock: every call of the block takes 1/64 s (exact in binary, so the window's count is too)."""
    clock = [0.0]
    calls = []

    def fn() -> None:
        calls.append(1)
        clock[0] += 1 / 64

    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])
    assert measure.timed(fn, lambda: None, repeat=5, warmup=2) == 1 / 64
    assert len(calls) == 2 + 5
    calls.clear()
    assert measure.timed(fn, lambda: None, repeat=5, warmup=2, min_window_s=1 / 16) == 1 / 64  # one call's share
    assert len(calls) == 2 + 1 + 5 * 4  # warm-up, the probe, five windows of four calls
    calls.clear()
    measure.timed(fn, lambda: None, repeat=5, warmup=2, min_window_s=1e6)  # no window that long: the cap
    assert len(calls) == 2 + 1 + 5 * measure.MAX_INNER
