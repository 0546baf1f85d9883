"""Layers cut into several chunks (store/layout.py, layer_chunk_numel): the layout's invariants hold for
every cut, fused expert tensors are cut between experts, and the cut is part of the layout's identity."""

from __future__ import annotations

import math

import pytest
import torch

from slidedp.model import moe_shape
from slidedp.model.config import named_shape
from slidedp.store.layout import (ALIGN, Layout, default_chunk_rows, default_layer_chunk_numel, layer_chunk_sizes,
                                  layer_split, make_layout, unit_tensors, units_of)
from slidedp.store.mismatch import describe_layouts

from moe_configs import qwen3_30b_a3b, qwen3_moe_like


def check_invariants(layout: Layout, limit: int) -> None:
    cfg = layout.model
    # chunks tile the flat space in order
    end = 0
    for i, c in enumerate(layout.chunks):
        assert (c.id, c.offset) == (i, end)
        end = c.offset + c.numel
    assert end == layout.total_numel
    # every tensor's blocks: rows in order, adjacent, the first aligned at the tensor's offset
    blocks: dict[str, list[tuple[int, int, int, tuple[int, ...]]]] = {}
    for c in layout.chunks:
        for m in c.members:
            blocks.setdefault(m.name, []).append((c.offset + m.offset, m.row_start, m.row_end, m.shape))
    assert [n for n, _ in cfg.parameter_shapes()] == [t.name for t in layout.tensors] == list(blocks)
    for t in layout.tensors:
        bs = blocks[t.name]
        assert bs[0][0] == t.offset and t.offset % ALIGN == 0
        rows = t.shape[0] if t.shape else 1
        assert bs[0][1] == 0 and bs[-1][2] == rows
        for (o1, _, b1, s1), (o2, a2, _, _) in zip(bs, bs[1:]):
            assert (a2, o2) == (b1, o1 + math.prod(s1))  # adjacent, no padding between blocks
        for _, a, b, s in bs:
            assert tuple(s[1:]) == tuple(t.shape[1:]) and s[0] == b - a  # cut along dim 0 only
    # a layer's chunks: consecutive, one contiguous unit; each at most the limit where a row fits
    units = units_of(layout)
    for layer in range(cfg.num_layers):
        chunks = layout.layer_chunks(layer)
        assert [c.id for c in chunks] == list(range(chunks[0].id, chunks[-1].id + 1))
        unit = units[f"layer.{layer}"]
        assert unit.chunks == tuple(chunks) and unit.offset == chunks[0].offset
        if limit:
            for c in chunks:
                content = max(m.offset + m.numel for m in c.members)
                assert content <= limit or (len(c.members) == 1 and c.members[0].row_end - c.members[0].row_start == 1)
        assert layer_chunk_sizes(cfg, layer, limit)[:-1] == [c.numel for c in chunks][:-1]
    # unit_tensors rebuilds every full tensor where the flat space has it
    flat = torch.arange(layout.total_numel, dtype=torch.float64)
    for name, unit in units.items():
        views = unit_tensors(flat[unit.offset:unit.offset + unit.numel], unit)
        for t in layout.tensors:
            if t.name in views:
                n = math.prod(t.shape)
                assert views[t.name].shape == t.shape
                assert torch.equal(views[t.name].reshape(-1), flat[t.offset:t.offset + n])
    assert {t.name for u in units.values() for t in layout.tensors if t.name in unit_tensors(flat, u)} == {
        t.name for t in layout.tensors}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("limit", [0, 100, 3000, 5000, 6144, 12_000, None])
def test_invariants_hold_for_every_cut(tied, limit):
    cfg = qwen3_moe_like(layers=3, tied=tied, dense_layers=(1,), shared=16)
    layout = make_layout(cfg, layer_chunk_numel=limit)
    check_invariants(layout, layout.layer_chunk_numel)
    assert Layout.from_dict(layout.to_dict()) == layout


def test_expert_tensors_are_cut_between_experts():
    cfg = qwen3_moe_like(layers=2, experts=8)
    one_expert = 2 * 32 * 64  # a row of gate_up_proj [8, 64, 64]
    layout = make_layout(cfg, layer_chunk_numel=2 * one_expert)
    check_invariants(layout, 2 * one_expert)
    pieces = [m for c in layout.layer_chunks(0) for m in c.members if m.name.endswith("experts.gate_up_proj")]
    assert [(m.row_start, m.row_end) for m in pieces] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert all(m.shape == (2, 64, 64) for m in pieces)
    # a limit below one expert: one expert a chunk, never part of one
    small = make_layout(cfg, layer_chunk_numel=one_expert - 1)
    check_invariants(small, one_expert - 1)
    assert all(m.row_end - m.row_start == 1 for c in small.layer_chunks(0) for m in c.members
               if "experts." in m.name)


def test_the_default_cuts_moe_layers_at_their_active_parameters_and_leaves_dense_models_whole():
    cfg = qwen3_moe_like(layers=2, experts=8, top_k=2)
    active = moe_shape.layer_shape(cfg, 0).active
    assert default_layer_chunk_numel(cfg) == active
    layout = make_layout(cfg)
    assert layout.layer_chunk_numel == active and len(layout.layer_chunks(0)) > 1
    assert layout.max_chunk_numel <= active
    assert default_chunk_rows(cfg) == min(cfg.vocab_size, active // cfg.hidden_size)  # blocks no larger than a layer chunk
    for name in ("tiny", "tiny-llama", "qwen3-4b"):
        dense = make_layout(named_shape(name))
        assert default_layer_chunk_numel(dense.model) == 0 and dense.layer_chunk_numel == 0
        assert "layer_chunk_numel" not in dense.to_dict()  # its hash is the one stores and checkpoints recorded
        assert all(len(dense.layer_chunks(i)) == 1 for i in range(dense.model.num_layers))
    big = qwen3_30b_a3b()
    assert layer_split(big) == default_layer_chunk_numel(big) < 70e6  # a layer of 604 M in chunks of its 53 M active
    sizes = layer_chunk_sizes(big, 0)
    assert len(sizes) == 11 and max(sizes) <= default_layer_chunk_numel(big)


def test_the_cut_is_part_of_the_layouts_identity():
    cfg = qwen3_moe_like(layers=2)
    whole, default, fine = (make_layout(cfg, layer_chunk_numel=n) for n in (0, None, 3000))
    assert len({whole.hash(), default.hash(), fine.hash()}) == 3
    # a limit no layer exceeds is whole layers, whatever it says
    assert make_layout(cfg, layer_chunk_numel=10 ** 9).hash() == whole.hash()
    said = describe_layouts(default, fine)
    assert said.startswith(f"layer_chunk_numel: store {default.layer_chunk_numel:,} (layers cut into chunks of at "
                           "most that many elements), job 3,000"), said
    assert "0 (one chunk a layer)" in describe_layouts(whole, fine)
    with pytest.raises(ValueError, match="layer_chunk_numel must be >= 0"):
        make_layout(cfg, layer_chunk_numel=-1)
