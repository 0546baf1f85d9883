"""Which tensors are routed experts and how many a token uses (slidedp/model/moe_shape.py), on a real tiny
gpt-oss folder (tests/families.py) and a synthetic qwen3_moe-like table."""

from __future__ import annotations

import math

import pytest

from slidedp.model import moe_shape
from slidedp.model.config import named_shape

from moe_configs import qwen3_30b_a3b, qwen3_moe_like


def test_gpt_oss_tiny_folder_experts_and_active_parameters(tmp_path):
    pytest.importorskip("transformers")
    from families import write_family_folder
    from slidedp.model import hf

    cfg = hf.read_config(write_family_folder(tmp_path / "gpt_oss", "gpt_oss"))
    assert (moe_shape.num_experts(cfg), moe_shape.experts_per_token(cfg)) == (4, 2)
    experts = {n for n, s in cfg.layer_parameter_shapes(0) if moe_shape.is_expert_tensor(n, s, 4)}
    assert experts == {"mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj",
                       "mlp.experts.down_proj_bias"}  # not the router, whose dim 0 is the experts too
    shape = moe_shape.layer_shape(cfg, 0)
    expert = sum(math.prod(s) for n, s in cfg.layer_parameter_shapes(0) if n in experts)
    assert (shape.total, shape.expert) == (cfg.layer_numel(0), expert)
    assert shape.active == shape.dense + expert // 2
    assert moe_shape.is_moe(cfg) and 0.5 < moe_shape.active_fraction(cfg) < 1


def test_qwen3_moe_like_table_shared_expert_and_dense_layers_are_always_active():
    cfg = qwen3_moe_like(layers=3, experts=8, top_k=2, dense_layers=(0,), shared=16)
    dense, moe = moe_shape.layer_shape(cfg, 0), moe_shape.layer_shape(cfg, 1)
    assert (dense.expert, dense.experts, dense.active) == (0, 0, dense.total)
    assert moe.expert == 8 * (2 * 32 * 64 + 64 * 32)  # gate_up and down; the shared expert is dense
    assert moe.active == moe.dense + moe.expert * 2 // 8
    assert "mlp.shared_expert.gate_proj.weight" not in {
        n for n, s in cfg.layer_parameter_shapes(1) if moe_shape.is_expert_tensor(n, s, 8)}


def test_qwen3_30b_a3b_is_about_three_billion_active():
    cfg = qwen3_30b_a3b()
    shapes = [moe_shape.layer_shape(cfg, i) for i in range(cfg.num_layers)]
    assert shapes[0].expert == 128 * 3 * 2048 * 768  # 604 M: the layer the store would hold as one chunk
    active = sum(s.active for s in shapes) + 2 * cfg.vocab_size * cfg.hidden_size
    assert 3.0e9 < active < 3.5e9 and 30e9 < cfg.num_parameters() < 31e9


def test_a_dense_model_has_no_experts():
    cfg = named_shape("tiny")
    assert moe_shape.num_experts(cfg) == 0 and not moe_shape.is_moe(cfg)
    assert moe_shape.active_fraction(cfg) == 1.0
