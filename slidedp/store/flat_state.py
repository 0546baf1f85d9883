"""A checkpoint's training state read by ranges of the store's flat tensors, whoever wrote it.

A checkpoint of one host keeps master and moments tensor by tensor (`state/`: `master.<name>`,
`exp_avg.<name>`, `exp_avg_sq.<name>`); one of several hosts keeps each host's range of every chunk
(`host-R-of-H/state/`: `<kind>.chunk<id>`, part_checkpoint.py). Both are the same flat state cut
differently, so a store of any part (or a whole one) is restored, compared or exported by asking for
its ranges: a checkpoint written on H hosts resumes on H', or on one, and the other way round.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from ..model import hf
from .layout import Layout
from .part import StorePart, overlaps


def part_name(part: StorePart) -> str:
    return f"host-{part.host}-of-{part.hosts}"


class FlatState:
    """read(kind, lo, hi): elements [lo, hi) of the checkpoint's flat `kind` ("master", "exp_avg",
    "exp_avg_sq"), fp32. Reads in store order are cheap: the last tensor (or chunk range) read is kept."""

    def __init__(self, path: str | os.PathLike, record: dict[str, Any], layout: Layout) -> None:
        self.path, self.record, self.layout = Path(path), record, layout
        self._cache: tuple[str, torch.Tensor] | None = None
        hosts = record.get("parts")
        if hosts:  # several hosts: each host's range of every chunk
            ranks = int(record["ranks"])
            self.parts = [StorePart(int(hosts), h, ranks) for h in range(int(hosts))]
            self.dirs = [self.path / part_name(p) / "state" for p in self.parts]
            self.indexes = [hf.tensor_index(d) for d in self.dirs]
        else:
            self.parts = []
            master_in = record.get("master_in", "state")
            self.master_dir, self.state_dir = self.path / master_in, self.path / "state"
            self.master_named = master_in == "state"  # master.<name> in state/, or <name> in model/ (fp32)
            self.index_master, self.index_state = hf.tensor_index(self.master_dir), hf.tensor_index(self.state_dir)
            self.spans = [(s.offset, s.offset + math.prod(s.shape), s.name) for s in layout.tensors]

    def _load(self, key: str, folder: Path, name: str, index) -> torch.Tensor:
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, hf.load_tensor(folder, name, index=index).reshape(-1))
        return self._cache[1]

    def read(self, kind: str, lo: int, hi: int) -> torch.Tensor:
        out = torch.empty(hi - lo, dtype=torch.float32)
        if self.parts:
            for c in self.layout.chunks:
                if c.offset >= hi or c.offset + c.numel <= lo:
                    continue
                for p, folder, index in zip(self.parts, self.dirs, self.indexes):
                    a, b = p.chunk_range(c.numel)
                    for x, y in overlaps([(c.offset + a, c.offset + b)], lo, hi):
                        flat = self._load(f"{kind}.chunk{c.id}@{p.host}", folder, f"{kind}.chunk{c.id}", index)
                        out[x - lo:y - lo] = flat[x - c.offset - a:y - c.offset - a]
            return out
        for a, b, name in self.spans:
            for x, y in overlaps([(a, b)], lo, hi):
                if kind == "master":
                    flat = self._load(f"master.{name}", self.master_dir,
                                      f"master.{name}" if self.master_named else name, self.index_master)
                else:
                    flat = self._load(f"{kind}.{name}", self.state_dir, f"{kind}.{name}", self.index_state)
                out[x - lo:y - lo] = flat[x - a:y - a]
        return out
