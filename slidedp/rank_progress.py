"""A rank's progress through the collectives of a job on several hosts, in a tiny file its launcher reads.

On several hosts (docs/multi-host.md, Faults) each worker keeps, in its host's run directory,
`.progress-rank<G>` (G: its global rank; mode 0600): four native int64s, mapped into the worker's memory,

    [0] MAGIC     written last at creation: a file without it is not read
    [1] entered   the collectives the rank has entered on the group of every host's ranks
    [2] left      the collectives it has come back from (entered != left: it is inside one)
    [3] step      the step it is in

The worker stores into the mapping before entering each collective and after it returns: one 8-byte store,
no system call, so counting costs nothing beside a collective, and the launcher reads it even while the
worker hangs (in compute, in a collective, or on the GPU). No lock: each field is one aligned 8-byte word,
written by one thread of one process; a reader may see `entered` a step ahead of `left`, which is what it is.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

MAGIC = 0x53445052_50524F47  # "SDPRPROG"
_FIELDS = 4
_SIZE = 8 * _FIELDS


def progress_path(run_dir: Path, global_rank: int) -> Path:
    return run_dir / f".progress-rank{global_rank}"


@dataclass(frozen=True)
class RankProgress:
    """What one rank's file said when it was read."""

    entered: int
    left: int
    step: int

    @property
    def inside(self) -> bool:
        return self.entered != self.left


class ProgressFile:
    """The worker's side: counts the collectives it enters and leaves, and the step it is in."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, _SIZE)  # zeros
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self._words = memoryview(self._map).cast("q")
        self.entered = 0
        self._words[0] = MAGIC

    def enter(self) -> None:
        self.entered += 1
        self._words[1] = self.entered

    def leave(self) -> None:
        self._words[2] = self.entered

    def at_step(self, step: int) -> None:
        self._words[3] = step

    def close(self) -> None:
        self._words.release()
        self._map.close()


class NoProgress:
    """One host: nothing counted (a method call that does nothing)."""

    entered = 0

    def enter(self) -> None:
        pass

    def leave(self) -> None:
        pass

    def at_step(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


NO_PROGRESS = NoProgress()


def read_progress(path: Path) -> RankProgress | None:
    """A rank's progress; None where its file is not there (yet) or not whole."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size < _SIZE:
            return None
        with mmap.mmap(fd, _SIZE, prot=mmap.PROT_READ) as m:
            words = memoryview(m).cast("q")  # each field read as one 8-byte load, never torn
            try:
                magic, entered, left, step = words.tolist()
            finally:
                words.release()
    finally:
        os.close(fd)
    return RankProgress(entered, left, step) if magic == MAGIC else None
