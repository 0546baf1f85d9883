"""Job-scoped gradient space: a ring of fp32 slots per rank, and the reduction space.

Created by the host-state daemon when a job attaches (sized for its world), removed when
it detaches. The reduction space is a ring of slots; with exact gradient clipping every
update waits for the global norm, so it is instead one slot per chunk (a full-model fp32
buffer, laid out like the master weights) -- the price of exact clipping, stated in the plan.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a tensor is made: the launcher sizes the rings without torch
    import torch

from .layout import Chunk, Layout
from .shm import Segment, check_space, segment_name

_HEADER = struct.Struct("<8sIIIIQQ")  # magic, world, slots, reduce slots, full flag, slot numel, reduce slot numel
_MAGIC = b"SDPRING2"
_HDR = 4096


def grad_slot_numel(layout: Layout, world: int, shard_slots: bool, shard_ranks: int = 0) -> int:
    """A rank's gradient slot: the largest chunk, or with shard_slots (reduce-scattered gradients, each
    rank copying out only its 1/N) the largest chunk's shard, so that the ranks' rings together
    take what one rank's would whatever the number of ranks. shard_ranks: the ranks a chunk is cut among
    (several hosts: every host's, so a host's rings take 1/H of one host's; 0: this host's `world`)."""
    return -(-layout.max_chunk_numel // (shard_ranks or world)) if shard_slots else layout.max_chunk_numel


def rings_bytes(layout: Layout, world: int, slots: int, reduce_slots: int, full_reduce: bool,
                shard_slots: bool = False, shard_ranks: int = 0) -> tuple[int, int]:
    grads = _HDR + world * slots * grad_slot_numel(layout, world, shard_slots, shard_ranks) * 4
    reduce = _HDR + (layout.total_numel * 4 if full_reduce
                     else (reduce_slots * layout.max_chunk_numel * 4 if world > 1 else 0))
    return grads, reduce


@dataclass
class GradRings:
    grads: Segment
    reduce: Segment
    world: int
    slots: int
    reduce_slots: int
    full_reduce: bool
    slot_numel: int  # a rank's gradient slot
    reduce_slot_numel: int  # a reduction slot: the largest chunk

    @classmethod
    def create(cls, store: str, layout: Layout, world: int, slots: int, reduce_slots: int, full_reduce: bool,
               shard_slots: bool = False, shard_ranks: int = 0) -> "GradRings":
        g, r = rings_bytes(layout, world, slots, reduce_slots, full_reduce, shard_slots, shard_ranks)
        check_space(g + r, f"gradient rings of store {store!r} for {world} rank(s)")
        grads = Segment.create(segment_name(store, "grads"), g)
        try:
            reduce = Segment.create(segment_name(store, "reduce"), r)
        except BaseException:
            grads.close()
            grads.unlink()
            raise
        slot = grad_slot_numel(layout, world, shard_slots, shard_ranks)
        grads.mm[0:_HEADER.size] = _HEADER.pack(_MAGIC, world, slots, reduce_slots, int(full_reduce), slot,
                                                layout.max_chunk_numel)
        return cls(grads, reduce, world, slots, reduce_slots, full_reduce, slot, layout.max_chunk_numel)

    @classmethod
    def open(cls, store: str) -> "GradRings":
        grads = Segment.open(segment_name(store, "grads"))
        magic, world, slots, rslots, full, numel, reduce_numel = _HEADER.unpack_from(grads.mm, 0)
        if magic != _MAGIC:
            raise RuntimeError(f"gradient ring {grads.name} is corrupt or of another SlideDP version (bad magic)")
        reduce = Segment.open(segment_name(store, "reduce"))
        return cls(grads, reduce, world, slots, rslots, bool(full), numel, reduce_numel)

    def slot(self, rank: int, k: int, numel: int | None = None) -> torch.Tensor:
        """Rank `rank`'s slot k, its first `numel` elements (a whole chunk's gradient, or a shard of one)."""
        if not (0 <= rank < self.world and 0 <= k < self.slots):
            raise IndexError(f"gradient slot ({rank}, {k}) outside the ring ({self.world} ranks x {self.slots} slots)")
        if numel is not None and numel > self.slot_numel:
            raise ValueError(f"{numel} elements do not fit a gradient slot of {self.slot_numel} "
                             "(slots sized for shards: only reduce-scattered gradients fit)")
        import torch

        start = _HDR // 4 + (rank * self.slots + k) * self.slot_numel
        return self.grads.tensor(torch.float32, start, self.slot_numel if numel is None else numel)  # 0: an empty shard

    def rank_ring(self, rank: int) -> torch.Tensor:
        """All of one rank's slots as one tensor (registered with CUDA once by that rank's worker)."""
        import torch

        start = _HDR // 4 + rank * self.slots * self.slot_numel
        return self.grads.tensor(torch.float32, start, self.slots * self.slot_numel)

    def reduce_slot(self, j: int, chunk: Chunk) -> torch.Tensor:
        import torch

        if self.full_reduce:
            return self.reduce.tensor(torch.float32, _HDR // 4 + chunk.offset, chunk.numel)
        if not 0 <= j < self.reduce_slots:
            raise IndexError(f"reduction slot {j} outside the ring of {self.reduce_slots}")
        return self.reduce.tensor(torch.float32, _HDR // 4 + j * self.reduce_slot_numel, chunk.numel)

    def close(self) -> None:
        self.grads.close()
        self.reduce.close()

    def unlink(self) -> None:
        self.grads.unlink()
        self.reduce.unlink()
