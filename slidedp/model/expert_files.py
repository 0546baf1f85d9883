"""Mixture-of-Experts folders that keep one tensor per expert, mapped onto the fused tensors the store holds.

transformers 5 trains an MoE layer's experts as fused 3-D tensors (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]), but saves and reads most families' checkpoints with one tensor per expert
(`mlp.experts.3.gate_proj.weight` [I, H], Mixtral's `block_sparse_moe.experts.3.w1.weight`), converting on
load by the family's checkpoint conversion mapping. The store holds what the modules train, the fused
tensors; the folder's per-expert tensors are pieces of them. Every conversion SlideDP accepts (stack the
experts along a new first dimension, then optionally concatenate two such stacks along dimension 1) puts
each per-expert tensor in one contiguous element range of its fused tensor: expert e of the j-th of k
sources lands at element (e * k + j) * its size. So a piece is (name on disk, fused name, element offset,
shape on disk): the store is filled by reading each piece into its range, and a checkpoint is written piece
by piece from views of the fused tensor, in the folder's own format.

The renames and merges are transformers' own (`conversion_mapping.get_checkpoint_conversion_mapping` for the
folder's model_type, applied by `core_model_loading.rename_source_key`); a conversion of any other kind
(transposes, interleaves, dequantization) is refused by name.
"""

from __future__ import annotations

import re
from collections import defaultdict

Piece = tuple[str, str, int, tuple[int, ...]]  # (name on disk, fused name in the store, element offset, shape)
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


class ExpertFormatError(ValueError):
    pass


def per_expert(names) -> bool:
    """Whether any of the folder's tensor names is one expert's."""
    return any(_EXPERT.search(n) for n in names)


def _transforms(model_type: str) -> tuple[list, list]:
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import (
            Concatenate, MergeModulelist, WeightConverter, WeightRenaming,
        )
    except ImportError as e:  # transformers before 5 fused nothing
        raise ExpertFormatError(f"reading one tensor per expert needs transformers >= 5 ({e})") from None
    mapping = get_checkpoint_conversion_mapping(model_type) or []
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    for c in converters:
        ops = [type(op) for op in c.operations]
        dims = [getattr(op, "dim", None) for op in c.operations]
        if ops not in ([MergeModulelist], [MergeModulelist, Concatenate]) or any(d not in (0, None) for d in dims[:1]) \
                or (len(dims) == 2 and dims[1] != 1):
            raise ExpertFormatError(
                f"{model_type}: transformers converts {c.source_patterns} to {c.target_patterns} by "
                f"{[type(op).__name__ for op in c.operations]}; SlideDP maps only stacked experts (MergeModulelist "
                "along 0, then Concatenate along 1) onto the store")
    return renamings, converters


def expert_pieces(model_type: str, shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, tuple[int, ...]], list[Piece]]:
    """The store's tensors and the pieces they are read from, for a folder whose tensors `shapes` (name ->
    shape) keep one tensor per expert: (fused and renamed table name -> shape, pieces). Tensors that are
    only renamed (Mixtral's router) are pieces covering their whole tensor."""
    from transformers.core_model_loading import rename_source_key

    renamings, converters = _transforms(model_type)
    groups: dict[str, dict[str, list[tuple[int, str]]]] = defaultdict(lambda: defaultdict(list))
    order: dict[str, list[str]] = {}  # fused name -> its converter's source patterns, in concatenation order
    table: dict[str, tuple[int, ...]] = {}
    pieces: list[Piece] = []
    for name, shape in shapes.items():
        target, pattern = rename_source_key(name, renamings, converters)
        table.setdefault(target, ())  # the store keeps the folder's order: a fused tensor where its first expert was
        if pattern is None:
            if _EXPERT.search(target):
                raise ExpertFormatError(f"{name}: transformers' {model_type} mapping does not fuse this expert "
                                        "tensor; SlideDP cannot place it in the store")
            table[target] = shape
            if target != name:
                pieces.append((name, target, 0, shape))
            continue
        found = _EXPERT.search(name)
        if found is None:
            raise ExpertFormatError(f"{name}: matched transformers' expert pattern {pattern!r} without an expert index")
        converter = next(c for c in converters if pattern in c.source_patterns)
        order[target] = list(converter.source_patterns)
        groups[target][pattern].append((int(found.group(1)), name))
    for target, by_pattern in groups.items():
        sources = order[target]
        missing = [p for p in sources if p not in by_pattern]
        if missing:
            raise ExpertFormatError(f"{target}: the folder has no tensors matching {missing[0]!r}")
        experts = sorted(e for e, _ in by_pattern[sources[0]])
        first_shape = None
        for j, pattern in enumerate(sources):
            got = sorted(by_pattern[pattern])
            if [e for e, _ in got] != list(range(len(got))) or len(got) != len(experts):
                raise ExpertFormatError(f"{target}: the experts of {pattern!r} in the folder are "
                                        f"{[e for e, _ in got][:8]}..., not 0..{len(experts) - 1}")
            for e, name in got:
                shape = shapes[name]
                if first_shape is None:
                    first_shape = shape
                if shape != first_shape:
                    raise ExpertFormatError(f"{name} has shape {list(shape)}; the other experts' {list(first_shape)}")
        size = 1
        for s in first_shape:
            size *= s
        k = len(sources)
        placed = [(name, target, (e * k + j) * size, first_shape)
                  for j, pattern in enumerate(sources) for e, name in by_pattern[pattern]]
        pieces += sorted(placed, key=lambda piece: piece[2])
        table[target] = (len(experts), k * first_shape[0], *first_shape[1:])
    return table, pieces
