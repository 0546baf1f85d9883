"""The chunk table: how the model's parameters lie in the store's flat fp32 space.

A chunk is the unit of streaming, reduction and update. Default chunking: the embedding
in row blocks, one chunk per decoder layer, the final norm, and (untied) the LM head in
row blocks. Every tensor is contiguous in the flat space (its row blocks are adjacent),
so a whole tensor is one view and a chunk is one contiguous range: one DMA, one memcpy.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..model.config import ModelConfig

if TYPE_CHECKING:
    import torch

ALIGN = 64  # elements (256 B for fp32): every tensor starts on a cache-line multiple


@dataclass(frozen=True)
class Member:
    """A tensor, or a block of its rows, inside a chunk."""

    name: str  # full Hugging Face name
    row_start: int
    row_end: int  # rows [row_start, row_end) of the full tensor; a 1-D tensor has rows == elements
    shape: tuple[int, ...]  # shape of this block
    offset: int  # element offset inside the chunk

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def decay(self) -> bool:
        """Weight decay applies to matrices, never to norms and biases."""
        return len(self.shape) >= 2


@dataclass(frozen=True)
class Chunk:
    id: int
    kind: str  # "embed" | "layer" | "norm" | "head"
    layer: int  # decoder layer index, -1 for the others
    offset: int  # element offset of the chunk in the flat space
    numel: int  # elements including alignment padding
    members: tuple[Member, ...]


@dataclass(frozen=True)
class TensorSpan:
    name: str
    shape: tuple[int, ...]
    offset: int  # element offset of the whole tensor in the flat space


@dataclass(frozen=True)
class Layout:
    model: ModelConfig
    chunk_rows: int
    chunks: tuple[Chunk, ...]
    tensors: tuple[TensorSpan, ...]
    total_numel: int

    @property
    def max_chunk_numel(self) -> int:
        return max(c.numel for c in self.chunks)

    @property
    def num_parameters(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors)

    def tensor(self, name: str) -> TensorSpan:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def chunks_of(self, kind: str) -> list[Chunk]:
        return [c for c in self.chunks if c.kind == kind]

    def layer_chunk(self, layer: int) -> Chunk:
        return next(c for c in self.chunks if c.kind == "layer" and c.layer == layer)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.to_dict(),
            "chunk_rows": self.chunk_rows,
            "total_numel": self.total_numel,
            "tensors": [[t.name, list(t.shape), t.offset] for t in self.tensors],
            "chunks": [
                [c.id, c.kind, c.layer, c.offset, c.numel,
                 [[m.name, m.row_start, m.row_end, list(m.shape), m.offset] for m in c.members]]
                for c in self.chunks
            ],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Layout":
        return cls(
            model=ModelConfig.from_dict(d["model"]),
            chunk_rows=int(d["chunk_rows"]),
            total_numel=int(d["total_numel"]),
            tensors=tuple(TensorSpan(n, tuple(s), o) for n, s, o in d["tensors"]),
            chunks=tuple(
                Chunk(cid, kind, layer, off, numel, tuple(Member(n, a, b, tuple(s), o) for n, a, b, s, o in members))
                for cid, kind, layer, off, numel, members in d["chunks"]
            ),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def hash(self) -> str:
        """Identity of the layout: two stores with the same hash hold interchangeable state."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()


def unit_name(chunk: Chunk) -> str:
    """The unit a chunk is fetched, held and updated with: "layer.N" for a decoder layer's chunk,
    else its kind ("embed", "norm", "head"; a tied head is the embedding's unit)."""
    return f"layer.{chunk.layer}" if chunk.kind == "layer" else chunk.kind


@dataclass(frozen=True)
class Unit:
    """What one fetch delivers: a contiguous range of the flat space covering whole chunks."""

    name: str  # "embed", "layer.3", "norm", "head"
    chunks: tuple[Chunk, ...]

    @property
    def offset(self) -> int:
        return self.chunks[0].offset

    @property
    def numel(self) -> int:
        return self.chunks[-1].offset + self.chunks[-1].numel - self.offset


def units_of(layout: Layout) -> dict[str, Unit]:
    """The model's units by name (unit_name); a tied head is the embedding's unit."""
    groups: dict[str, list[Chunk]] = {}
    for c in layout.chunks:
        groups.setdefault(unit_name(c), []).append(c)
    units = {name: Unit(name, tuple(chunks)) for name, chunks in groups.items()}
    if layout.model.tie_word_embeddings:
        units["head"] = units["embed"]
    return units


def unit_tensors(flat: torch.Tensor, unit: Unit, strip: str = "") -> dict[str, torch.Tensor]:
    """Full tensors of a unit as views of `flat` (the unit's range), keyed by name minus `strip`."""
    out: dict[str, torch.Tensor] = {}
    for c in unit.chunks:
        base = c.offset - unit.offset
        for m in c.members:
            if m.row_start == 0:
                rows = sum(x.row_end - x.row_start for cc in unit.chunks for x in cc.members if x.name == m.name)
                shape = (rows,) + m.shape[1:] if len(m.shape) > 1 else (rows,)
                n = 1
                for s in shape:
                    n *= s
                out[m.name.removeprefix(strip)] = flat[base + m.offset:base + m.offset + n].view(shape)
    return out


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Shard:
    """Rank `rank`'s part [start, end) of a flat range of `numel` elements cut into `world` shards of `size`."""

    numel: int
    world: int
    rank: int

    @property
    def size(self) -> int:
        return -(-self.numel // self.world)

    @property
    def padded(self) -> int:
        return self.size * self.world

    @property
    def start(self) -> int:
        return min(self.rank * self.size, self.numel)

    @property
    def end(self) -> int:
        return min(self.start + self.size, self.numel)


def default_chunk_rows(cfg: ModelConfig) -> int:
    """Row blocks of embedding/head no larger than one decoder layer."""
    layer_numel = max(map(cfg.layer_numel, range(cfg.num_layers)))
    return max(1, min(cfg.vocab_size, layer_numel // cfg.hidden_size))


def make_layout(cfg: ModelConfig, chunk_rows: int | None = None) -> Layout:
    rows = chunk_rows or default_chunk_rows(cfg)
    if rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {rows}")
    chunks: list[Chunk] = []
    tensors: list[TensorSpan] = []
    cursor = 0  # element offset of the next chunk

    def add_chunk(kind: str, layer: int, entries: list[tuple[str, int, int, tuple[int, ...]]]) -> None:
        nonlocal cursor
        members, local = [], 0
        for name, a, b, shape in entries:
            if a == 0:  # a tensor's first block starts aligned; later blocks follow it directly
                local = _align(local)
                tensors.append(TensorSpan(name, full_shapes[name], cursor + local))
            members.append(Member(name, a, b, shape, local))
            local += math.prod(shape)
        chunks.append(Chunk(len(chunks), kind, layer, cursor, local, tuple(members)))
        cursor += local

    full_shapes = dict(cfg.parameter_shapes())

    def row_blocks(kind: str, name: str) -> None:
        v, h = full_shapes[name]
        for a in range(0, v, rows):
            b = min(v, a + rows)
            add_chunk(kind, -1, [(name, a, b, (b - a, h))])

    # The blocks of one tensor must be adjacent with no padding between them: only the
    # first block of a tensor is aligned, and a row-block chunk ends exactly where the next begins.
    row_blocks("embed", "model.embed_tokens.weight")
    cursor = _align(cursor)
    for layer in range(cfg.num_layers):
        prefix = f"model.layers.{layer}."
        add_chunk("layer", layer, [(prefix + n, 0, s[0] if s else 1, s) for n, s in cfg.layer_parameter_shapes(layer)])
        cursor = _align(cursor)
    add_chunk("norm", -1, [("model.norm." + n, 0, s[0] if s else 1, s) for n, s in cfg.norm_parameter_shapes()])
    cursor = _align(cursor)
    if not cfg.tie_word_embeddings:
        row_blocks("head", "lm_head.weight")
        cursor = _align(cursor)
    # Chunk numel covers the padding up to the next chunk so chunk ranges tile the space.
    fixed = [
        Chunk(c.id, c.kind, c.layer, c.offset, (chunks[i + 1].offset if i + 1 < len(chunks) else cursor) - c.offset, c.members)
        for i, c in enumerate(chunks)
    ]
    return Layout(cfg, rows, tuple(fixed), tuple(tensors), cursor)
