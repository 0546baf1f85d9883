"""A host's part of the training state, on several hosts (docs/multi-host.md).

With H hosts of N ranks, the reduce_scatter route cuts every chunk into H x N shards of ceil(numel / HN)
elements, and host R's ranks take shards R*N .. R*N + N - 1: one contiguous range of each chunk. Host R's
updaters update only that range and its ranks read only that range, so its store holds master, moments
and shadow there and nowhere else. Its segments are made at the full layout's size (offsets stay the
layout's) but sparse: shared memory gives pages where they are first written, and only the part's
ranges are reserved, zeroed and filled. Host memory is then about 1/H of one host's.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass
from typing import Any

from .layout import Layout


@dataclass(frozen=True)
class StorePart:
    hosts: int
    host: int
    ranks: int  # ranks per host

    def __post_init__(self) -> None:
        if self.hosts < 2 or not 0 <= self.host < self.hosts or self.ranks < 1:
            raise ValueError(f"a store part is host 0..{self.hosts - 1} of 2 or more hosts with ranks >= 1; got {self}")

    def chunk_range(self, numel: int) -> tuple[int, int]:
        """[lo, hi) of a chunk of `numel` elements that this host owns (possibly empty at a short chunk's end)."""
        size = -(-numel // (self.hosts * self.ranks))
        return min(self.host * self.ranks * size, numel), min((self.host + 1) * self.ranks * size, numel)

    def ranges(self, layout: Layout) -> list[tuple[int, int]]:
        """The owned [start, end) ranges of the layout's flat tensors, in order, empty ones left out."""
        out = []
        for c in layout.chunks:
            lo, hi = self.chunk_range(c.numel)
            if hi > lo:
                out.append((c.offset + lo, c.offset + hi))
        return out

    def numel(self, layout: Layout) -> int:
        return sum(b - a for a, b in self.ranges(layout))

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def of(cls, meta: dict[str, Any]) -> StorePart | None:
        """The part a store's meta records (None: a whole store)."""
        d = meta.get("part")
        return None if not d else cls(int(d["hosts"]), int(d["host"]), int(d["ranks"]))

    @classmethod
    def for_hosts(cls, nnodes: int, node_rank: int, ranks: int) -> StorePart | None:
        """A job's part (runtime.nnodes, node_rank, workers); None on one host."""
        return None if nnodes == 1 else cls(nnodes, node_rank, ranks)

    def describe(self) -> str:
        return f"host {self.host} of {self.hosts} ({self.ranks} rank(s) each)"


def overlaps(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of [lo, hi) inside sorted, disjoint `ranges`."""
    i = max(0, bisect.bisect_right(ranges, (lo, lo)) - 1)
    out = []
    while i < len(ranges) and ranges[i][0] < hi:
        a, b = max(ranges[i][0], lo), min(ranges[i][1], hi)
        if b > a:
            out.append((a, b))
        i += 1
    return out
