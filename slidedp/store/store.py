"""A host store: the authoritative training state (fp32 master, exp_avg, exp_avg_sq) in shared memory.

Segments: /slidedp.<store>.manifest, .master, .exp_avg, .exp_avg_sq and, with the bf16
delivery policy, .shadow. 12 bytes per parameter (14 with the shadow) plus the
manifest. Job-scoped gradient rings live in rings.py.
"""

from __future__ import annotations

import math
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:  # imported where a tensor is made: the launcher sizes segments without torch
    import torch

from .layout import Chunk, Layout, Member
from .manifest import Manifest, ManifestError
from .part import StorePart, overlaps
from .shm import Segment, check_space, list_store_segments, page_ranges, segment_name, unlink_store

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")


class StoreError(RuntimeError):
    pass


def segment_sizes(layout: Layout, meta: dict[str, Any], shadow: bool) -> dict[str, int]:
    sizes = {"manifest": Manifest.size_for(layout, meta)}
    sizes.update({k: layout.total_numel * 4 for k in STATE_KINDS})
    if shadow:
        sizes["shadow"] = layout.total_numel * 2
    return sizes


def held_sizes(layout: Layout, meta: dict[str, Any], shadow: bool, part: StorePart | None) -> dict[str, int]:
    """The memory each segment takes: segment_sizes, or for a host's part (part.py) its ranges' share."""
    sizes = segment_sizes(layout, meta, shadow)
    if part is not None:
        owned = part.numel(layout)
        for k in sizes:
            if k != "manifest":
                sizes[k] = owned * (2 if k == "shadow" else 4)
    return sizes


@dataclass
class HostStore:
    name: str
    manifest: Manifest
    segments: dict[str, Segment] = field(default_factory=dict)
    creation_gbps: float = 0.0

    # ---- lifecycle ----------------------------------------------------------------------
    @classmethod
    def create(cls, name: str, layout: Layout, meta: dict[str, Any], shadow: bool = False,
               fill: Callable[["HostStore"], None] | None = None, part: StorePart | None = None) -> "HostStore":
        """Create every segment (space checked and reserved first), fill the master weights, zero the moments.
        part: on several hosts, the host's part (part.py): only its ranges are reserved, zeroed and filled."""
        if list_store_segments().get(name):
            raise StoreError(f"store {name!r} already exists; destroy it first (`slidedp-store destroy {name}`) or attach to it")
        meta = dict(meta, shadow=shadow, created=time.time())
        if part is not None:
            meta["part"] = part.to_dict()
        sizes = segment_sizes(layout, meta, shadow)
        owned = part.ranges(layout) if part is not None else None
        held = held_sizes(layout, meta, shadow, part)  # what the segments really take
        what = f"store {name!r} ({layout.num_parameters / 1e9:.3f} B parameters{', ' + part.describe() if part else ''})"
        check_space(sum(held.values()), what)
        generation = secrets.randbits(62)
        store = None
        try:
            t0 = time.perf_counter()
            segs = {k: Segment.create(segment_name(name, k), sizes[k], ranges=None if owned is None else
                                      [(a * (2 if k == "shadow" else 4), b * (2 if k == "shadow" else 4))
                                       for a, b in owned])
                    for k in sizes if k != "manifest"}
            touched = time.perf_counter() - t0
            manifest = Manifest.create(segment_name(name, "manifest"), layout, meta, generation)
            manifest.set_torn_flag(1)  # not trainable until filled
            store = cls(name, manifest, segs)
            store.creation_gbps = sum(held[k] for k in segs) / max(touched, 1e-9) / 1e9
            if fill is not None:
                fill(store)
            store.refresh_shadow()
            manifest.set_torn_flag(0)
            return store
        except BaseException:
            if store is not None:
                store.close()
            unlink_store(name)
            raise

    @classmethod
    def attach(cls, name: str) -> "HostStore":
        present = dict(list_store_segments().get(name, []))
        if not present:
            raise StoreError(f"store {name!r} does not exist (no /dev/shm/slidedp.{name}.* segments); create it first")
        if "manifest" not in present:
            raise StoreError(f"store {name!r} has no manifest segment: it is incomplete; destroy it and create it again")
        manifest = Manifest.open(segment_name(name, "manifest"))
        expected = segment_sizes(manifest.layout, manifest.meta, bool(manifest.meta.get("shadow")))
        segs: dict[str, Segment] = {}
        try:
            for kind, size in expected.items():
                if kind == "manifest":
                    continue
                if kind not in present:
                    raise StoreError(f"store {name!r} is missing its {kind} segment ({segment_name(name, kind)})")
                seg = Segment.open(segment_name(name, kind))
                segs[kind] = seg
                if seg.size != size:
                    raise StoreError(
                        f"store {name!r}: segment {seg.name} is {seg.size} bytes, the manifest's layout needs {size}"
                    )
        except BaseException:
            for s in segs.values():
                s.close()
            manifest.close()
            raise
        return cls(name, manifest, segs)

    def close(self) -> None:
        for s in self.segments.values():
            s.close()
        self.manifest.close()

    def destroy(self) -> list[str]:
        self.close()
        return unlink_store(self.name)

    # ---- views --------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        return self.manifest.layout

    @property
    def has_shadow(self) -> bool:
        return "shadow" in self.segments

    @property
    def part(self) -> StorePart | None:
        """The host's part on several hosts (None: the store holds every range)."""
        return StorePart.of(self.manifest.meta)

    def owned(self) -> list[tuple[int, int]]:
        """The flat ranges this store holds: everything, or its part's."""
        part = self.part
        return [(0, self.layout.total_numel)] if part is None else part.ranges(self.layout)

    def owned_pages(self, kind: str) -> list[torch.Tensor]:
        """Byte views of the pages of a segment that hold the store's ranges (what a worker registers with
        CUDA: registering pins, so a part's store registers only its own pages)."""
        import torch

        seg = self.segments[kind]
        elt = 2 if kind == "shadow" else 4
        whole = seg.tensor(torch.uint8)
        return [whole[a:min(b, seg.size)] for a, b in page_ranges([(x * elt, y * elt) for x, y in self.owned()])]

    def flat(self, kind: str) -> torch.Tensor:
        import torch

        dtype = torch.bfloat16 if kind == "shadow" else torch.float32
        return self.segments[kind].tensor(dtype, 0, self.layout.total_numel)

    def tensor(self, kind: str, name: str) -> torch.Tensor:
        span = self.layout.tensor(name)
        n = 1
        for s in span.shape:
            n *= s
        return self.flat(kind)[span.offset:span.offset + n].view(span.shape)

    def chunk(self, kind: str, chunk: Chunk) -> torch.Tensor:
        return self.flat(kind)[chunk.offset:chunk.offset + chunk.numel]

    def tensors(self, kind: str) -> Iterator[tuple[str, torch.Tensor]]:
        for span in self.layout.tensors:
            yield span.name, self.tensor(kind, span.name)

    def refresh_shadow(self, chunk: Chunk | None = None) -> None:
        if not self.has_shadow:
            return
        lo, hi = (0, self.layout.total_numel) if chunk is None else (chunk.offset, chunk.offset + chunk.numel)
        shadow, master = self.flat("shadow"), self.flat("master")
        for a, b in overlaps(self.owned(), lo, hi):  # a part's store never reads (so never allocates) the rest
            shadow[a:b].copy_(master[a:b])

    def segment_bytes(self) -> dict[str, int]:
        out = {"manifest": self.manifest.seg.size}
        out.update({k: s.size for k, s in self.segments.items()})
        return out

    def status(self) -> dict[str, Any]:
        m = self.manifest
        sizes = self.segment_bytes()
        params = self.layout.num_parameters
        return {
            "store": self.name,
            "model": m.meta.get("source", "?"),
            "family": self.layout.model.family,
            "parameters": params,
            "chunks": len(self.layout.chunks),
            "segments": sizes,
            "bytes_per_parameter": round(sum(sizes.values()) / params, 4),
            "committed_step": m.committed_step,
            "generation": m.generation,
            "layout_hash": self.layout.hash(),
            "model_config": self.layout.model.to_dict(),  # a job for another model is told which fields differ
            "chunk_rows": self.layout.chunk_rows,
            "layer_chunk_numel": self.layout.layer_chunk_numel,
            "torn": m.torn_reason(),
            "attached_pid": m.attached_pid,
            "job": m.job() if m.attached_pid else {},
            "last_train": m.job().get("hyper"),  # the [train] of the last job attached: what its LR schedule was
            "persist": bool(m.meta.get("persist", True)),  # false: made by a job for itself (store/ephemeral.py)
            "part": m.meta.get("part"),  # several hosts: which host's ranges it holds (part.py)
            "creator": m.meta.get("creator"),
        }


def member_view(flat_chunk: torch.Tensor, member: Member) -> torch.Tensor:
    """The member's block inside a flat chunk tensor (store view, gradient slot or device buffer)."""
    return flat_chunk[member.offset:member.offset + member.numel].view(member.shape)


def fill_random(seed: int, threads: int | None = None) -> Callable[[HostStore], None]:
    """Fill the master weights with init_tensor_'s values, a tensor per thread, largest first.

    Each tensor's values depend only on (seed, name), so the order and the threads change nothing;
    torch draws one tensor's normals on one core, and a Qwen3-8B store took 52 s to fill that way."""
    from concurrent.futures import ThreadPoolExecutor

    from ..model.init import init_tensor_

    def fill(store: HostStore) -> None:
        views = sorted(owned_tensors(store), key=lambda nv: -nv[1].numel())
        n = threads or len(os.sched_getaffinity(0))
        if store.part is not None:  # a tensor cut by the part's range is drawn whole in scratch memory: few at once
            n = min(n, 8)
        with ThreadPoolExecutor(max_workers=max(1, n), thread_name_prefix="fill") as pool:
            for done in [pool.submit(fill_owned, store, name, view, lambda out, name=name: init_tensor_(name, out, seed))
                         for name, view in views]:
                done.result()  # an error in any tensor is the creation's error

    return fill


def fill_from_hf(folder: str | os.PathLike) -> Callable[[HostStore], None]:
    from ..model import hf

    def fill(store: HostStore) -> None:
        cfg = store.layout.model
        hf.check_folder(folder, cfg)
        index = hf.tensor_index(folder)
        for name, view in owned_tensors(store):
            fill_owned(store, name, view, lambda out, name=name: hf.load_model_tensor(folder, cfg, name, out,
                                                                                       index=index))

    return fill


def owned_tensors(store: HostStore) -> Iterator[tuple[str, torch.Tensor]]:
    """The master's tensors that hold any of the store's ranges."""
    owned = store.owned()
    for span in store.layout.tensors:
        if overlaps(owned, span.offset, span.offset + math.prod(span.shape)):
            yield span.name, store.tensor("master", span.name)


def fill_owned(store: HostStore, name: str, view: torch.Tensor, make: Callable[[torch.Tensor], Any]) -> None:
    """make(out) writes tensor `name`'s values into `out`: straight into the store where it holds all of
    the tensor, else into a scratch tensor of which only the store's ranges are copied (a part never
    writes, so never allocates, the rest)."""
    import torch

    span = store.layout.tensor(name)
    lo, hi = span.offset, span.offset + view.numel()
    pieces = overlaps(store.owned(), lo, hi)
    if pieces == [(lo, hi)]:
        make(view)
        return
    scratch = torch.empty(view.shape, dtype=view.dtype)
    make(scratch)
    flat, out = scratch.reshape(-1), store.flat("master")
    for a, b in pieces:
        out[a:b].copy_(flat[a - lo:b - lo])


__all__ = ["HostStore", "StoreError", "ManifestError", "member_view", "fill_random", "fill_from_hf",
           "segment_sizes", "held_sizes", "STATE_KINDS"]
