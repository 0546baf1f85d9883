"""The planner on Mixture-of-Experts models: GPU time by active parameters, the host's work by all of them,
the layers cut into chunks the store's layout chooses, and what `--plan` says where the host bounds the step."""

from __future__ import annotations

import functools
from dataclasses import replace

from slidedp.model.config import named_shape
from slidedp.planner import REFERENCE_CALIBRATION, Workload, costs, make_plan
from slidedp.planner.step_model import device_times, predict_step
from slidedp.store.layout import default_layer_chunk_numel, make_layout

from moe_configs import qwen3_30b_a3b, qwen3_moe_like

GiB = 1 << 30


def _work(model, **kw) -> Workload:
    args = dict(global_batch=8, seq_len=4096, world=1, micro_batch=1, clip=False, compiled=True, layers="transformers")
    return Workload(model, **dict(args, **kw))


@functools.cache
def _big_plan():
    """Qwen3-30B-A3B's plan at 120 GiB, the micro-batch the planner's (its search is seconds of the suite)."""
    return make_plan(_work(qwen3_30b_a3b(), micro_batch=0), 120 * GiB, REFERENCE_CALIBRATION)


def test_gpu_time_scales_with_active_parameters_and_the_host_with_all_of_them():
    calib = REFERENCE_CALIBRATION
    few, many = (qwen3_moe_like(layers=4, experts=64, top_k=k, hidden=1024, inter=512, vocab=4096, heads=8,
                                kv_heads=2, head_dim=128) for k in (2, 8))
    assert few.num_parameters() == many.num_parameters()
    plan = make_plan(_work(few), 60 * GiB, calib).step
    seq = 4096
    q = few.num_heads * few.head_dim
    for m in (few, many):  # 2 FLOPs per active parameter, and attention's
        assert costs.layer_forward_flops_per_token(m, seq) == 2.0 * costs.active_layer_params(m) + 2.0 * seq * q
    expert = 64 * 3 * 1024 * 512 // 64  # one expert's parameters
    assert costs.active_layer_params(many) - costs.active_layer_params(few) == 6 * expert
    (fwd_few, bwd_few, _), (fwd_many, bwd_many, _) = (device_times(_work(m), plan, calib) for m in (few, many))
    attention = 2.0 * seq * q
    ratio = (2.0 * costs.active_layer_params(many) + attention) / (2.0 * costs.active_layer_params(few) + attention)
    assert abs(fwd_many / fwd_few - ratio) < 1e-9 and abs(bwd_many / bwd_few - ratio) < 1e-9
    busy_few, busy_many = (predict_step(_work(m), plan, calib)[0] for m in (few, many))
    assert busy_many["device"] > busy_few["device"]
    for r in ("h2d", "d2h", "update"):  # copies and AdamW: every parameter, routed or not
        assert abs(busy_many[r] - busy_few[r]) < 1e-12


def test_the_plan_cuts_a_big_moe_model_into_chunks_and_leaves_a_dense_one_whole():
    big, dense = qwen3_30b_a3b(), named_shape("qwen3-4b")
    cut = default_layer_chunk_numel(big)
    assert _work(big).layer_cut == cut > 0 and _work(dense, layers="native").layer_cut == 0
    plan = _big_plan()
    assert plan.step.layer_chunk_numel == cut == make_layout(big).layer_chunk_numel
    assert plan.step.chunk_rows == cut // big.hidden_size  # the head's blocks no larger than a layer chunk
    text = plan.describe()
    assert f"layer_chunk_numel     {cut:,} (11 chunks a layer, experts whole)" in text
    assert "layers cut into 11 chunks of at most 56.9 M parameters" in text
    assert "a gradient slot 217 MiB instead of 2,377 MiB" in text
    assert "Mixture-of-Experts: 128 experts, 8 a token" in text
    assert make_plan(_work(dense, layers="native"), 24 * GiB, REFERENCE_CALIBRATION).step.layer_chunk_numel == 0
    # the job's own value: whole layers
    assert _work(big, layer_chunk_numel=0).layer_cut == 0


def test_the_cut_overlaps_the_last_layers_update_with_its_copies_out():
    """The tail after the last backward: with whole layers the last layer's gradient leaves, then is updated;
    cut, the updaters start on its first chunk while the later ones copy out. Never slower."""
    big = qwen3_30b_a3b()
    plan = _big_plan().step
    work = _work(big, micro_batch=plan.micro_batch)
    cut = predict_step(work, plan, REFERENCE_CALIBRATION)[2]
    whole = predict_step(work, replace(plan, layer_chunk_numel=0, chunk_rows=costs.default_chunk_rows(big)),
                         REFERENCE_CALIBRATION)[2]
    assert cut < whole
    assert abs(sum(costs.layer_chunk_shares(big, plan.layer_chunk_numel)) - 1) < 1e-12


def test_a_host_bound_moe_plan_says_what_bounds_it_and_what_would_help():
    text = _big_plan().describe()
    assert "the host bounds the step: the updaters' AdamW takes" in text
    assert "this Mixture-of-Experts model's GPU work is that of its active parameters" in text
    assert "more updater cores or memory bandwidth" in text
    assert "more tokens per step" in text


def test_blocks_timed_on_transformers_layers_are_what_the_plan_charges():
    """An MoE model runs on transformers' layer modules, whose blocks the launcher times under a shape key of
    their own (measure.shape_key(..., layers="transformers")). The step model charges those blocks, not the
    FLOPs of the active parameters: the 5.8B Qwen3-MoE shape's layer took about twice its FLOPs' time on
    an H200 (benchmarks/RESULTS.md, "Mixture of experts"), and a plan that fell back to the FLOPs predicted
    a GPU half as busy as it was. The layer workspace its backward measured bounds the memory item too."""
    from slidedp.planner import plan as plan_mod  # noqa: PLC0415
    from slidedp.planner.measure import LayerTime, LossTime, MeasuredBlocks, shape_key  # noqa: PLC0415
    from slidedp.planner.step_model import device_time_source  # noqa: PLC0415
    from slidedp.stepplan import StepPlan  # noqa: PLC0415

    model = qwen3_moe_like(layers=4, experts=64, top_k=8, hidden=1024, inter=512, vocab=4096, heads=8, kv_heads=2,
                           head_dim=128)
    work = _work(model, global_batch=8, seq_len=2048, micro_batch=2, clip=False)
    ch = StepPlan(embedding="host", micro_batch=2, loss_chunk_tokens=1024)
    workspace = 3 * GiB  # the backward's allocator peak above its inputs
    key = shape_key(model, 2048, "bf16", True, None, "transformers")
    assert key != shape_key(model, 2048, "bf16", True)  # SlideDP's own layers: another key
    blocks = MeasuredBlocks(key, "GPU T", (LayerTime(2, 0, 0.011, 0.033, workspace),), (LossTime(2, 0, 1024, 0.004),))
    calib = replace(REFERENCE_CALIBRATION, blocks=blocks)
    # 8 sequences a step in passes of 2: 4 passes of each block
    assert device_times(work, ch, calib) == (0.011 * 4, 0.033 * 4, 0.004 * 4)
    assert device_time_source(work, ch, calib) == "measured"
    busy = predict_step(work, ch, calib)[0]
    assert abs(busy["device"] - (4 * 4 * (0.011 + 0.033) + 4 * 0.004)) < 1e-12  # 4 layers, 4 passes, the loss
    # the same blocks under SlideDP's layers' key are another shape's: the FLOPs are charged
    native = replace(calib, blocks=replace(blocks, shape=shape_key(model, 2048, "bf16", True)))
    assert device_time_source(work, ch, native) == "FLOPs"
    flops_fwd = work.local_tokens * costs.layer_forward_flops_per_token(model, 2048) / (
        REFERENCE_CALIBRATION.device_tflops * 1e12) / costs.COMPILED_LAYER_SPEEDUP
    assert abs(device_times(work, ch, native)[0] - flops_fwd) < 1e-15
    # the memory: the measured workspace, less the layer's bf16 gradient and the incoming gradient counted elsewhere
    counted = dict(plan_mod._bounded_memory(work, ch, calib))["layer workspace"]
    assert counted == workspace - (costs.layer_params(model) + 2 * 2048 * 1024) * 2
    assert counted > dict(plan_mod._bounded_memory(work, ch, native))["layer workspace"]
