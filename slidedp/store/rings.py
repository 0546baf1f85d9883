"""Job-scoped gradient space: a ring of fp32 slots per rank, and the reduction space.

Created by the host-state daemon when a job attaches (sized for its world), removed when
it detaches. The reduction space is a ring of slots; with exact gradient clipping every
update waits for the global norm, so it is instead one slot per chunk (a full-model fp32
buffer, laid out like the master weights) -- the price of exact clipping, stated in the plan.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from .layout import Chunk, Layout
from .shm import Segment, check_space, segment_name

_HEADER = struct.Struct("<8sIIIIQ")  # magic, world, slots, reduce slots, full flag, slot numel
_MAGIC = b"SDPRING1"
_HDR = 4096


def rings_bytes(layout: Layout, world: int, slots: int, reduce_slots: int, full_reduce: bool) -> tuple[int, int]:
    slot = layout.max_chunk_numel * 4
    grads = _HDR + world * slots * slot
    reduce = _HDR + (layout.total_numel * 4 if full_reduce else (reduce_slots * slot if world > 1 else 0))
    return grads, reduce


@dataclass
class GradRings:
    grads: Segment
    reduce: Segment
    world: int
    slots: int
    reduce_slots: int
    full_reduce: bool
    slot_numel: int

    @classmethod
    def create(cls, store: str, layout: Layout, world: int, slots: int, reduce_slots: int, full_reduce: bool) -> "GradRings":
        g, r = rings_bytes(layout, world, slots, reduce_slots, full_reduce)
        check_space(g + r, f"gradient rings of store {store!r} for {world} rank(s)")
        grads = Segment.create(segment_name(store, "grads"), g)
        try:
            reduce = Segment.create(segment_name(store, "reduce"), r)
        except BaseException:
            grads.close()
            grads.unlink()
            raise
        grads.mm[0:_HEADER.size] = _HEADER.pack(_MAGIC, world, slots, reduce_slots, int(full_reduce), layout.max_chunk_numel)
        return cls(grads, reduce, world, slots, reduce_slots, full_reduce, layout.max_chunk_numel)

    @classmethod
    def open(cls, store: str) -> "GradRings":
        grads = Segment.open(segment_name(store, "grads"))
        magic, world, slots, rslots, full, numel = _HEADER.unpack_from(grads.mm, 0)
        if magic != _MAGIC:
            raise RuntimeError(f"gradient ring {grads.name} is corrupt (bad magic)")
        reduce = Segment.open(segment_name(store, "reduce"))
        return cls(grads, reduce, world, slots, rslots, bool(full), numel)

    def slot(self, rank: int, k: int, numel: int | None = None) -> torch.Tensor:
        if not (0 <= rank < self.world and 0 <= k < self.slots):
            raise IndexError(f"gradient slot ({rank}, {k}) outside the ring ({self.world} ranks x {self.slots} slots)")
        start = _HDR // 4 + (rank * self.slots + k) * self.slot_numel
        return self.grads.tensor(torch.float32, start, numel or self.slot_numel)

    def rank_ring(self, rank: int) -> torch.Tensor:
        """All of one rank's slots as one tensor (registered with CUDA once by that rank's worker)."""
        start = _HDR // 4 + rank * self.slots * self.slot_numel
        return self.grads.tensor(torch.float32, start, self.slots * self.slot_numel)

    def reduce_slot(self, j: int, chunk: Chunk) -> torch.Tensor:
        if self.full_reduce:
            return self.reduce.tensor(torch.float32, _HDR // 4 + chunk.offset, chunk.numel)
        if not 0 <= j < self.reduce_slots:
            raise IndexError(f"reduction slot {j} outside the ring of {self.reduce_slots}")
        return self.reduce.tensor(torch.float32, _HDR // 4 + j * self.slot_numel, chunk.numel)

    def close(self) -> None:
        self.grads.close()
        self.reduce.close()

    def unlink(self) -> None:
        self.grads.unlink()
        self.reduce.unlink()
