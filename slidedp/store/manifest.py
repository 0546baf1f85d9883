"""The manifest segment: what the store holds, and the per-chunk versions that are the truth.

Fixed binary header (magic, format, generation, layout hash), the layout as JSON, then
int64 arrays. Each mutable field has exactly one writer process: versions/updating/adam
steps the updater that owns the chunk, committed_step the aggregator, the attachment the
host-state daemon. Aligned 8-byte stores are atomic on every platform we run on, and the
messages that accompany them are only wake-ups.
"""

from __future__ import annotations

import functools
import json
import struct
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .layout import Layout
from .shm import Segment

MAGIC = b"SLIDEDP\x01"
FORMAT = 2
PAGE = 4096
_FIXED = struct.Struct("<8sII Q 64s Q Q d")  # magic, format, header size, generation, hash, json len, chunks, created
_MUTABLE_AT = 256  # committed_step, attached_pid, attach_token, torn, clip_history (int64 each)
_JOB_AT = 1024  # job record: u32 length + UTF-8 JSON, up to 3 KiB
_JOB_MAX = PAGE - _JOB_AT - 4
# values of updating[c]: being rewritten by an updater / held on a job's GPUs / updated before the step's
# gradient norm was known and not yet validated against it (exact clipping: speculate, validate, correct)
UPDATING, LEASED, SPECULATIVE = 1, 2, 3
# values of clip_history: what the last committed step's gradient norm said (exact clipping reads it to decide
# whether the next step speculates: slidedp/clipping/schedule.py); 0 also for a store that never clipped
KEPT, CLIPPED, SKIPPED = 0, 1, 2


class ManifestError(RuntimeError):
    pass


def _round_up(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


@dataclass
class Manifest:
    seg: Segment
    layout: Layout
    meta: dict[str, Any]
    generation: int

    # ---- creation and validation ------------------------------------------------------
    @staticmethod
    def size_for(layout: Layout, meta: dict[str, Any]) -> int:
        body = _body(layout, meta)
        return PAGE + _round_up(len(body)) + _round_up(4 * 8 * len(layout.chunks))

    @classmethod
    def create(cls, name: str, layout: Layout, meta: dict[str, Any], generation: int) -> "Manifest":
        body = _body(layout, meta)
        seg = Segment.create(name, cls.size_for(layout, meta))
        seg.mm[0:_FIXED.size] = _FIXED.pack(
            MAGIC, FORMAT, PAGE, generation, layout.hash().encode(), len(body), len(layout.chunks), time.time()
        )
        seg.mm[PAGE:PAGE + len(body)] = body
        m = cls(seg, layout, meta, generation)
        m._ints()[:] = (0, 0, 0, 0, 0)
        return m

    @classmethod
    def open(cls, name: str) -> "Manifest":
        seg = Segment.open(name)
        try:
            return cls._parse(seg)
        except BaseException:
            seg.close()
            raise

    @classmethod
    def _parse(cls, seg: Segment) -> "Manifest":
        if seg.size < PAGE:
            raise ManifestError(f"manifest {seg.name} is corrupt: {seg.size} bytes, smaller than its header")
        magic, fmt, header, generation, digest, body_len, n_chunks, _ = _FIXED.unpack_from(seg.mm, 0)
        if magic != MAGIC:
            raise ManifestError(f"manifest {seg.name} is corrupt: bad magic {magic!r} (expected {MAGIC!r})")
        if fmt != FORMAT or header != PAGE:
            raise ManifestError(f"manifest {seg.name} has format {fmt}; this SlideDP reads format {FORMAT}")
        if PAGE + body_len > seg.size:
            raise ManifestError(f"manifest {seg.name} is corrupt: its layout runs past the segment end")
        try:
            body = json.loads(bytes(seg.mm[PAGE:PAGE + body_len]))
            layout = Layout.from_dict(body["layout"])
        except (ValueError, KeyError, TypeError) as e:
            raise ManifestError(f"manifest {seg.name} is corrupt: layout unreadable ({e})") from None
        if layout.hash().encode() != digest:
            raise ManifestError(
                f"manifest {seg.name} is corrupt: layout hash mismatch (header {digest.decode(errors='replace')[:16]}..., "
                f"layout {layout.hash()[:16]}...)"
            )
        if n_chunks != len(layout.chunks):
            raise ManifestError(f"manifest {seg.name} is corrupt: header says {n_chunks} chunks, layout has {len(layout.chunks)}")
        return cls(seg, layout, body.get("meta", {}), generation)

    # ---- fields -------------------------------------------------------------------------
    def _ints(self) -> np.ndarray:
        return self.seg.array(np.int64, _MUTABLE_AT, 5)

    def _array(self, index: int) -> np.ndarray:
        c = len(self.layout.chunks)
        return self.seg.array(np.int64, self._arrays_at + index * 8 * c, c)

    @functools.cached_property
    def _arrays_at(self) -> int:
        """Where the int64 arrays start: past the layout's JSON, whose length the header holds. Read once:
        the updater reads a field several times per chunk update, and serializing the layout to find it
        each time slowed every update (the journal "The updater's per-chunk cost found in a trace" of docs/tuning.md, in git history)."""
        body_len = _FIXED.unpack_from(self.seg.mm, 0)[5]
        return PAGE + _round_up(body_len)

    @property
    def versions(self) -> np.ndarray:
        """versions[c] = the step whose forward may use chunk c (updates applied so far, skipped steps included)."""
        return self._array(0)

    @property
    def updating(self) -> np.ndarray:
        """Non-zero while the chunk's master/moments are being rewritten: a crash then leaves it torn."""
        return self._array(1)

    @property
    def snapshot(self) -> np.ndarray:
        """Non-zero while a checkpoint still has to copy the chunk: its next update waits (one writer: the
        host-state daemon sets it for a checkpoint and clears it chunk by chunk as it copies)."""
        return self._array(3)

    def wait_snapshot(self, chunk_id: int, timeout_s: float = 3600.0) -> None:
        """Block while a checkpoint written during training has not copied this chunk yet."""
        deadline = time.monotonic() + timeout_s
        snap = self.snapshot
        while snap[chunk_id]:
            if time.monotonic() > deadline:
                raise ManifestError(f"the checkpoint writer (slidedp-hoststate) has not copied chunk {chunk_id} "
                                    f"in {timeout_s:.0f} s")
            time.sleep(0.001)

    @property
    def adam_steps(self) -> np.ndarray:
        """AdamW's step count per chunk (bias correction); skipped steps do not count."""
        return self._array(2)

    @property
    def committed_step(self) -> int:
        return int(self._ints()[0])

    def set_committed_step(self, step: int, clip_history: int | None = None) -> None:
        """clip_history (KEPT / CLIPPED / SKIPPED): the committed step's verdict, written before the step."""
        ints = self._ints()
        if clip_history is not None:
            ints[4] = clip_history
        ints[0] = step

    @property
    def clip_history(self) -> int:
        """What the last committed step's gradient norm said: KEPT (or no step yet), CLIPPED or SKIPPED."""
        return int(self._ints()[4])

    @property
    def attached_pid(self) -> int:
        return int(self._ints()[1])

    def set_attached(self, pid: int, token: int) -> None:
        ints = self._ints()
        ints[2] = token
        ints[1] = pid

    @property
    def attach_token(self) -> int:
        return int(self._ints()[2])

    @property
    def torn_flag(self) -> int:
        return int(self._ints()[3])

    def set_torn_flag(self, value: int) -> None:
        self._ints()[3] = value

    def torn_reason(self, allow_leased: bool = False) -> str | None:
        """Why the store cannot be trained from as it is, or None when it is at a committed step.

        allow_leased: chunks a running job holds on its GPUs count as clean when their last
        write-back is at the committed step (a checkpoint during the job).
        """
        if self.torn_flag:
            return "a restore into it did not finish"
        # every chunk state that tears the store, named together: which of them a crash leaves depends on
        # where in the step it came
        reasons = []
        busy = np.nonzero(self.updating == UPDATING)[0]
        if len(busy):
            reasons.append(f"chunk(s) {busy[:8].tolist()} were being updated when their writer stopped")
        unsure = np.nonzero(self.updating == SPECULATIVE)[0]
        if len(unsure):
            reasons.append(f"chunk(s) {unsure[:8].tolist()} hold a speculative update that was never validated "
                           f"against the step's gradient norm (the updater or aggregator stopped)")
        leased = np.nonzero(self.updating == LEASED)[0]
        if len(leased) and not allow_leased:
            reasons.append(f"chunk(s) {leased[:8].tolist()} are held on a job's GPUs and were not written back "
                           f"(the job ended without finishing)")
        if reasons:
            return "; ".join(reasons)
        step = self.committed_step
        off = np.nonzero(self.versions != step)[0]
        if len(off) and (self.versions == step + 1).all():
            return (f"every chunk finished step {step} but its commit was not recorded (the aggregator stopped); "
                    f"restore a checkpoint, as for any interrupted step")
        if len(off):
            return (f"chunk versions are mixed ({sorted(set(self.versions.tolist()))}) around committed step {step}: "
                    f"a step stopped half-way")
        return None

    def job(self) -> dict[str, Any]:
        (n,) = struct.unpack_from("<I", self.seg.mm, _JOB_AT)
        if not n or n > _JOB_MAX:
            return {}
        try:
            return json.loads(bytes(self.seg.mm[_JOB_AT + 4:_JOB_AT + 4 + n]))
        except ValueError:
            return {}

    def set_job(self, record: dict[str, Any]) -> None:
        data = json.dumps(record, sort_keys=True).encode()
        if len(data) > _JOB_MAX:
            raise ManifestError(f"job record too large for the manifest ({len(data)} > {_JOB_MAX} bytes)")
        self.seg.mm[_JOB_AT + 4:_JOB_AT + 4 + len(data)] = data
        struct.pack_into("<I", self.seg.mm, _JOB_AT, len(data))

    def close(self) -> None:
        self.seg.close()


def _body(layout: Layout, meta: dict[str, Any]) -> bytes:
    return json.dumps({"layout": layout.to_dict(), "meta": meta}, sort_keys=True, separators=(",", ":")).encode()
