"""The chunk table: how the model's parameters lie in the store's flat fp32 space.

A chunk is the unit of reduction and update (and of a gradient's copy out). Default chunking:
the embedding in row blocks, each decoder layer in one chunk, or, where a layer holds more than
`layer_chunk_numel` elements (a Mixture-of-Experts layer: model/moe_shape.py), in several, the
final norm, and (untied) the LM head in row blocks.

Invariants:
- Every tensor is contiguous in the flat space: its blocks (rows along dim 0; a fused expert
  tensor [E, ...] is cut between experts) are adjacent with no padding between them, and only its
  first block is aligned (ALIGN), so a whole tensor is one view.
- Chunks tile the flat space in table order: a chunk is one contiguous range (one DMA, one memcpy).
- A unit (what one fetch delivers: "layer.N", "embed", "norm", "head") is one contiguous range
  covering its chunks: a layer comes to the device whole, however many chunks it is.
- `unit_tensors` rebuilds full tensors from a unit's range.
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
    layer_chunk_numel: int = 0  # the most elements of a layer's chunk where a layer is cut; 0: one chunk a layer

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
        """The layer's first chunk (its only one unless the layer is cut)."""
        return next(c for c in self.chunks if c.kind == "layer" and c.layer == layer)

    def layer_chunks(self, layer: int) -> list[Chunk]:
        return [c for c in self.chunks if c.kind == "layer" and c.layer == layer]

    def to_dict(self) -> dict[str, Any]:
        # layer_chunk_numel only where layers are cut: a layout of whole layers keeps the dict (and the
        # hash, which stores and checkpoints record) it always had
        split = {"layer_chunk_numel": self.layer_chunk_numel} if self.layer_chunk_numel else {}
        return {
            **split,
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
            layer_chunk_numel=int(d.get("layer_chunk_numel", 0)),
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


def default_chunk_rows(cfg: ModelConfig, layer_chunk_numel: int | None = None) -> int:
    """Row blocks of embedding/head no larger than a decoder layer's chunk: the largest layer, or where
    layers are cut (layer_chunk_numel; None: default_layer_chunk_numel), the limit they are cut at."""
    limit = default_layer_chunk_numel(cfg) if layer_chunk_numel is None else layer_chunk_numel
    layer_numel = max(map(cfg.layer_numel, range(cfg.num_layers)))
    size = min(limit, layer_numel) if limit else layer_numel
    return max(1, min(cfg.vocab_size, size // cfg.hidden_size))


def default_layer_chunk_numel(cfg: ModelConfig) -> int:
    """The most elements of a layer's chunk (0: whole layers): for a model with routed experts, the
    largest layer's active parameters (its dense part and top_k of its experts: what a token computes
    with), so each chunk carries about the host work (copy out, sum, AdamW) of a dense layer of the same
    GPU time; the dense tensors stay whole and the experts are cut between experts. A dense model's layers
    stay whole. docs/planner.md, "Layers cut into chunks", says what the cut changes."""
    from ..model import moe_shape

    shapes = [moe_shape.layer_shape(cfg, i) for i in range(cfg.num_layers)]
    if not any(s.expert for s in shapes):
        return 0
    limit = max(s.active for s in shapes)
    return 0 if limit >= max(s.total for s in shapes) else limit


def _pieces(shapes: list[tuple[str, tuple[int, ...]]], limit: int, start: int) -> list[list[tuple[str, int, int, tuple[int, ...]]]]:
    """A layer's tensors (name, shape) in table order, cut into chunks of at most `limit` elements where
    possible: a tensor that does not fit the chunk's room starts the next chunk when it fits a whole one,
    else its rows (dim 0: experts of a fused expert tensor) fill the room, whole chunks, and the rest
    opens the next chunk; a chunk holds at least one row (more than `limit` only where one row is).
    `start`: the layer's offset (aligned). The alignment padding before a tensor's first block counts
    against the chunk that block is in, as make_layout places it."""
    chunks: list[list[tuple[str, int, int, tuple[int, ...]]]] = [[]]
    pos = chunk_start = start
    for name, shape in shapes:
        rows = shape[0] if shape else 1
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        a = 0
        while a < rows:
            pad = _align(pos) - pos if a == 0 else 0
            room = limit - (pos + pad - chunk_start)
            if (rows - a) * row > room and a == 0 and rows * row <= limit and chunks[-1]:
                k = 0  # the whole tensor fits a chunk of its own: start one
            else:
                k = min(rows - a, max(0, room) // row)
                if k == 0 and not chunks[-1]:
                    k = 1  # a row larger than the limit: a chunk of one row
            if k:
                block = ((k,) + tuple(shape[1:])) if len(shape) > 1 else (k,)
                chunks[-1].append((name, a, a + k, block))
                pos += pad + k * row
                a += k
            if a < rows or k == 0:  # the chunk is full: the next piece opens the next one
                chunks.append([])
                chunk_start = pos  # the alignment before a tensor's first block is its chunk's
    return [c for c in chunks if c]


def layer_chunk_sizes(cfg: ModelConfig, layer: int, layer_chunk_numel: int | None = None) -> list[int]:
    """The elements of each of a layer's chunks as make_layout cuts it (None: the default limit); the last
    one without the padding up to the next unit."""
    limit = default_layer_chunk_numel(cfg) if layer_chunk_numel is None else layer_chunk_numel
    shapes = cfg.layer_parameter_shapes(layer)
    if not limit or cfg.layer_numel(layer) <= limit:
        pieces = [[(n, 0, s[0] if s else 1, s) for n, s in shapes]]
    else:
        pieces = _pieces(shapes, limit, 0)
    sizes, pos = [], 0
    for entries in pieces:
        start = pos
        for _, a, _, shape in entries:
            pos = (_align(pos) if a == 0 else pos) + math.prod(shape)
        sizes.append(pos - start)
    return sizes


def layer_split(cfg: ModelConfig, layer_chunk_numel: int | None = None) -> int:
    """The layout's layer_chunk_numel for a requested limit (None: the default): the limit where it cuts
    some layer into several chunks, else 0 (whole layers, whatever was asked)."""
    limit = default_layer_chunk_numel(cfg) if layer_chunk_numel is None else layer_chunk_numel
    cut = limit and any(len(layer_chunk_sizes(cfg, i, limit)) > 1 for i in range(cfg.num_layers))
    return limit if cut else 0


def make_layout(cfg: ModelConfig, chunk_rows: int | None = None, layer_chunk_numel: int | None = None) -> Layout:
    """The model's chunk table. chunk_rows: rows per embedding/head block (None or 0: default_chunk_rows);
    layer_chunk_numel: the most elements of a layer's chunk (None: default_layer_chunk_numel; 0: whole
    layers). A limit no layer exceeds is the same layout as whole layers (layer_chunk_numel 0)."""
    limit = default_layer_chunk_numel(cfg) if layer_chunk_numel is None else layer_chunk_numel
    if limit < 0:
        raise ValueError(f"layer_chunk_numel must be >= 0, got {limit}")
    rows = chunk_rows or default_chunk_rows(cfg, limit)
    if rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {rows}")
    chunks: list[Chunk] = []
    tensors: list[TensorSpan] = []
    cursor = 0  # element offset of the next chunk

    def add_chunk(kind: str, layer: int, entries: list[tuple[str, int, int, tuple[int, ...]]]) -> None:
        nonlocal cursor
        members, local = [], 0
        for name, a, b, shape in entries:
            if a == 0:  # a tensor's first block starts aligned (in the flat space); later blocks follow it directly
                local = _align(cursor + local) - cursor
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
    split = False
    for layer in range(cfg.num_layers):
        prefix = f"model.layers.{layer}."
        shapes = [(prefix + n, s) for n, s in cfg.layer_parameter_shapes(layer)]
        if limit and cfg.layer_numel(layer) > limit:
            pieces = _pieces(shapes, limit, cursor)
            split |= len(pieces) > 1
        else:
            pieces = [[(n, 0, s[0] if s else 1, s) for n, s in shapes]]
        for entries in pieces:  # a chunk opening with a tensor holds the padding before its first block
            add_chunk("layer", layer, entries)
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
    return Layout(cfg, rows, tuple(fixed), tuple(tensors), cursor, limit if split else 0)
