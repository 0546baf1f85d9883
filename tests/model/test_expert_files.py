"""expert_files.py places each per-expert tensor of a folder in its range of the fused tensor transformers
trains, and refuses folders it cannot place."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from slidedp.model.expert_files import ExpertFormatError, expert_pieces  # noqa: E402

INTER, H, E = 3, 5, 4


def _qwen3_moe_layer(experts=range(E)) -> dict[str, tuple[int, ...]]:
    shapes = {"model.layers.0.mlp.gate.weight": (E, H)}
    for e in experts:
        for proj, shape in (("gate_proj", (INTER, H)), ("up_proj", (INTER, H)), ("down_proj", (H, INTER))):
            shapes[f"model.layers.0.mlp.experts.{e}.{proj}.weight"] = shape
    return shapes


def test_pieces_are_the_experts_ranges_of_the_fused_tensors():
    table, pieces = expert_pieces("qwen3_moe", _qwen3_moe_layer())
    assert table == {"model.layers.0.mlp.gate.weight": (E, H),
                     "model.layers.0.mlp.experts.gate_up_proj": (E, 2 * INTER, H),
                     "model.layers.0.mlp.experts.down_proj": (E, H, INTER)}
    where = {disk: (fused, offset) for disk, fused, offset, _ in pieces}
    # gate_up_proj[e] is gate_e's rows then up_e's: expert e's gate at e * 2IH, its up IH further
    assert where["model.layers.0.mlp.experts.2.gate_proj.weight"] == ("model.layers.0.mlp.experts.gate_up_proj",
                                                                      2 * 2 * INTER * H)
    assert where["model.layers.0.mlp.experts.2.up_proj.weight"] == ("model.layers.0.mlp.experts.gate_up_proj",
                                                                    2 * 2 * INTER * H + INTER * H)
    assert where["model.layers.0.mlp.experts.3.down_proj.weight"] == ("model.layers.0.mlp.experts.down_proj",
                                                                      3 * H * INTER)
    # the pieces tile each fused tensor exactly
    for fused, shape in table.items():
        spans = sorted((o, o + s[0] * s[1]) for _, f, o, s in pieces if f == fused)
        if spans:
            assert spans[0][0] == 0 and spans[-1][1] == shape[0] * shape[1] * shape[2]
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_a_missing_expert_is_named():
    with pytest.raises(ExpertFormatError, match=r"experts of .* are \[0, 1, 3\]\.\.\., not 0\.\.2"):
        expert_pieces("qwen3_moe", _qwen3_moe_layer(experts=(0, 1, 3)))


def test_experts_of_unequal_shapes_are_refused():
    shapes = _qwen3_moe_layer()
    shapes["model.layers.0.mlp.experts.1.gate_proj.weight"] = (INTER + 1, H)
    with pytest.raises(ExpertFormatError, match=r"experts\.1\.gate_proj\.weight has shape \[4, 5\]"):
        expert_pieces("qwen3_moe", shapes)
