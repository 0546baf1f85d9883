"""Documents -> rows of seq_len (input, target) positions, and global batches as a pure function of the step.

A document of n tokens fills n - 1 positions: inputs t_0..t_{n-2}, targets t_1..t_{n-1} (a target
whose token is not trained is IGNORE_INDEX). Its position ids restart at 0 and each position carries
its document's segment number in the row, so attention stays inside the document.

packed  several documents per row: best fit in document order (each document goes to the open row
        with the least room that still holds it, else a new row), deterministic
padded  one document per row

The rest of a row is padding: input 0, no target, positions continuing the row's last document and
its segment. A padding token comes after everything real in its row, so causal attention never lets
a real token see it, and with no target it adds nothing to the loss or to any gradient.

Rows are then batched exactly as the token stream's windows are (batches.Batches): step s takes
rows s*B .. s*B + B - 1 of the epoch's order (shuffled per epoch when asked), so a batch is a pure
function of the step and a resumed run sees what an uninterrupted one would.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .batches import Batches
from .documents import Documents
from .errors import DataError
from .targets import IGNORE_INDEX

_FILES = ("tokens", "trained", "offsets", "row_docs", "row_offsets")


@dataclass(frozen=True)
class SftBatch:
    """A batch of rows, each [rows, seq_len]: ids, targets (IGNORE_INDEX where untrained), positions, segments,
    and which positions hold a document (real; the rest is padding)."""

    ids: np.ndarray
    targets: np.ndarray
    positions: np.ndarray
    segments: np.ndarray
    real: np.ndarray

    def rows(self, sl: slice | np.ndarray) -> "SftBatch":
        return SftBatch(self.ids[sl], self.targets[sl], self.positions[sl], self.segments[sl], self.real[sl])

    def arrays(self) -> tuple[np.ndarray, ...]:
        return self.ids, self.targets, self.positions, self.segments, self.real

    @property
    def trained_tokens(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())


def pack_rows(lengths: np.ndarray, seq_len: int, packed: bool) -> tuple[np.ndarray, np.ndarray]:
    """(row_docs, row_offsets): row r holds documents row_docs[row_offsets[r]:row_offsets[r+1]].

    lengths are positions (tokens - 1), each <= seq_len."""
    n = len(lengths)
    if not packed:
        return np.arange(n, dtype=np.int64), np.arange(n + 1, dtype=np.int64)
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free positions, row), sorted
    for d, length in enumerate(lengths.tolist()):
        i = bisect.bisect_left(room, (length, -1))
        if i < len(room):
            free, r = room.pop(i)
            rows[r].append(d)
            if free - length > 0:
                bisect.insort(room, (free - length, r))
        else:
            rows.append([d])
            if seq_len - length > 0:
                bisect.insort(room, (seq_len - length, len(rows) - 1))
    row_offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    row_offsets[1:] = np.cumsum([len(r) for r in rows])
    return np.fromiter((d for r in rows for d in r), dtype=np.int64, count=n), row_offsets


class PackedRows:
    """Documents laid into rows; builds any row's arrays on demand (nothing per row is stored)."""

    def __init__(self, docs: Documents, row_docs: np.ndarray, row_offsets: np.ndarray, seq_len: int,
                 source: str = "documents") -> None:
        self.docs, self.row_docs, self.row_offsets, self.seq_len = docs, row_docs, row_offsets, seq_len
        self.source = source
        if len(docs) and int(docs.lengths().max()) - 1 > seq_len:
            raise DataError(f"{source}: a document has more than seq_len + 1 = {seq_len + 1} tokens")

    @classmethod
    def build(cls, docs: Documents, seq_len: int, packed: bool, source: str = "documents") -> "PackedRows":
        row_docs, row_offsets = pack_rows(docs.lengths() - 1, seq_len, packed)
        return cls(docs, row_docs, row_offsets, seq_len, source)

    # the interface Batches reads
    def num_sequences(self, seq_len: int) -> int:
        return len(self.row_offsets) - 1

    def __len__(self) -> int:
        return int(len(self.docs.tokens))

    @property
    def positions_used(self) -> int:
        """Input positions holding a document (the rest of the rows is padding)."""
        return int((self.docs.lengths() - 1).sum())

    def document_lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """(lengths, row_offsets): the positions each row's documents take, in row order, a row's padding
        counted to its last document (it continues that document: see row()); row r's documents are
        lengths[row_offsets[r]:row_offsets[r + 1]]."""
        lengths = (self.docs.lengths() - 1)[self.row_docs].astype(np.int64)
        used = np.add.reduceat(lengths, self.row_offsets[:-1]) if len(lengths) else lengths
        lengths[self.row_offsets[1:] - 1] += self.seq_len - used
        return lengths, np.asarray(self.row_offsets)

    def fingerprint(self) -> str:
        """What the rows hold: a resume is refused when the data or its packing changed."""
        h = hashlib.sha256()
        for a in (self.docs.offsets, self.row_docs, self.row_offsets):
            h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(self.docs.tokens[: 1 << 20], dtype=np.int64).tobytes())
        return h.hexdigest()[:16]

    def row(self, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """ids, targets, positions, segments of row r."""
        return self._row(r)[:4]

    def _row(self, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """row(r), and how many of its positions its documents hold (the rest is padding)."""
        L = self.seq_len
        ids = np.zeros(L, dtype=np.int64)
        targets = np.full(L, IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros(L, dtype=np.int64)
        segments = np.zeros(L, dtype=np.int64)
        at, seg = 0, 0
        for seg, d in enumerate(self.row_docs[self.row_offsets[r]:self.row_offsets[r + 1]].tolist()):
            tok, trained = self.docs.document(d)
            n = len(tok) - 1
            ids[at:at + n] = tok[:-1]
            targets[at:at + n] = np.where(trained[1:] == 1, tok[1:], IGNORE_INDEX)
            positions[at:at + n] = np.arange(n)
            segments[at:at + n] = seg
            at += n
        if at < L:  # padding continues the last document's positions and segment
            last = positions[at - 1] + 1 if at else 0
            positions[at:] = last + np.arange(L - at)
            segments[at:] = seg
        return ids, targets, positions, segments, at

    def rows_batch(self, rows: np.ndarray) -> SftBatch:
        parts = [self._row(int(r)) for r in rows]
        used = np.array([p[4] for p in parts], dtype=np.int64).reshape(-1, 1)
        return SftBatch(*(np.stack([p[i] for p in parts]).reshape(-1, self.seq_len) for i in range(4)),
                        np.arange(self.seq_len)[None, :] < used)

    def empty_rows(self, n: int) -> SftBatch:
        L = self.seq_len
        z = np.zeros((n, L), dtype=np.int64)
        return SftBatch(z, np.full((n, L), IGNORE_INDEX, dtype=np.int64), np.tile(np.arange(L), (n, 1)), z.copy(),
                        np.zeros((n, L), dtype=bool))

    # ---- files the launcher writes once and every worker maps ------------------------------------
    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        arrays = dict(tokens=self.docs.tokens, trained=self.docs.trained, offsets=self.docs.offsets,
                      row_docs=self.row_docs, row_offsets=self.row_offsets)
        for name, a in arrays.items():
            tmp = folder / f".{name}.tmp.npy"
            np.save(tmp, np.asarray(a), allow_pickle=False)
            tmp.replace(folder / f"{name}.npy")

    @classmethod
    def load(cls, folder: Path, seq_len: int) -> "PackedRows":
        a = {n: np.load(folder / f"{n}.npy", mmap_mode="r", allow_pickle=False) for n in _FILES}
        docs = Documents(a["tokens"], a["trained"], np.asarray(a["offsets"]))
        return cls(docs, np.asarray(a["row_docs"]), np.asarray(a["row_offsets"]), seq_len, str(folder))


class DocBatches(Batches):
    """Global batches of rows as a pure function of the step (Batches' order, shuffle and resume rules)."""

    stream: PackedRows

    def __init__(self, rows: PackedRows, global_batch: int, shuffle: bool = False, seed: int = 0) -> None:
        n = rows.num_sequences(rows.seq_len)
        if n < global_batch:
            raise DataError(f"{rows.source}: {len(rows.docs):,} documents make {n:,} rows of seq_len {rows.seq_len}, "
                            f"fewer than train.global_batch ({global_batch}); use more data or a smaller batch")
        super().__init__(rows, rows.seq_len, global_batch, shuffle, seed)  # type: ignore[arg-type]
        self._fingerprint = rows.fingerprint()

    def batch(self, step: int) -> SftBatch:  # type: ignore[override]
        return self.stream.rows_batch(self.sequence_ids(step))

    def state(self, step: int) -> dict:
        return {**super().state(step), "rows": self._fingerprint}


def eval_rounds(rows: PackedRows, global_batch: int) -> int:
    """How many batches of global_batch rows the held-out set takes."""
    return -(-rows.num_sequences(rows.seq_len) // global_batch)


def eval_batch(rows: PackedRows, i: int, global_batch: int) -> SftBatch:
    """Batch i of the held-out rows in order (the last one filled up with empty rows, which train nothing)."""
    n = rows.num_sequences(rows.seq_len)
    b = rows.rows_batch(np.arange(i * global_batch, min((i + 1) * global_batch, n)))
    short = global_batch - b.ids.shape[0]
    if not short:
        return b
    e = rows.empty_rows(short)
    return SftBatch(*(np.concatenate([x, y]) for x, y in zip(b.arrays(), e.arrays())))
