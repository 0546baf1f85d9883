"""POSIX shared-memory segments: created private (0600), space reserved up front, pages touched in parallel.

A full /dev/shm must be an error at creation, never a SIGBUS in the middle of a step, so
every segment is reserved with posix_fallocate before it is mapped.
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import posix_ipc

if TYPE_CHECKING:  # imported where a tensor is made: the launcher lists and sizes segments without torch
    import torch

SHM_DIR = "/dev/shm"
PREFIX = "slidedp."


class ShmSpaceError(RuntimeError):
    pass


def segment_name(store: str, kind: str) -> str:
    """POSIX name of a store segment: /slidedp.<store>.<kind>."""
    return f"/{PREFIX}{store}.{kind}"


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def page_ranges(ranges: list[tuple[int, int]], page: int = mmap.PAGESIZE) -> list[tuple[int, int]]:
    """Byte ranges widened to whole pages and merged where they touch (sorted input)."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        a, b = a // page * page, -(-b // page) * page
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def check_space(needed: int, what: str) -> None:
    """Refuse before creating anything when /dev/shm or host RAM cannot hold `needed` bytes."""
    import psutil

    free = shm_free_bytes()
    if needed > free:
        raise ShmSpaceError(
            f"{what} needs {needed / 2**30:.2f} GiB of shared memory but {SHM_DIR} has only {free / 2**30:.2f} GiB free; "
            f"enlarge it (e.g. `mount -o remount,size=<N>G {SHM_DIR}`) or choose a smaller model/store"
        )
    avail = psutil.virtual_memory().available
    if needed > avail:
        raise ShmSpaceError(
            f"{what} needs {needed / 2**30:.2f} GiB of memory but the host has only {avail / 2**30:.2f} GiB available"
        )


@dataclass
class Segment:
    """One mapped POSIX shared-memory segment."""

    name: str
    size: int
    mm: mmap.mmap

    @classmethod
    def create(cls, name: str, size: int, touch: bool = True,
               ranges: list[tuple[int, int]] | None = None) -> "Segment":
        """ranges: byte ranges [a, b) to reserve and touch, the rest left sparse (a host's part of a store,
        part.py); None: all of it."""
        shm = posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=0o600, size=0)
        pages = page_ranges(ranges) if ranges is not None else [(0, size)] if size else []
        try:
            os.fchmod(shm.fd, 0o600)  # the umask may not take bits away from posix_ipc's mode; make it exact
            if size:
                os.ftruncate(shm.fd, size)
            for a, b in pages:
                os.posix_fallocate(shm.fd, a, min(b, size) - a)
            mm = mmap.mmap(shm.fd, max(size, 1))
        except BaseException:
            shm.close_fd()
            posix_ipc.unlink_shared_memory(name)
            raise
        shm.close_fd()
        seg = cls(name, size, mm)
        seg.advise_huge()
        if touch and size:
            if ranges is None:
                seg.touch()
            else:
                import torch

                whole = seg.tensor(torch.uint8)
                for a, b in pages:
                    whole[a:min(b, size)].zero_()
        return seg

    @classmethod
    def open(cls, name: str) -> "Segment":
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            raise FileNotFoundError(f"shared-memory segment {name} does not exist") from None
        size = os.fstat(shm.fd).st_size
        try:
            mm = mmap.mmap(shm.fd, max(size, 1))
        finally:
            shm.close_fd()
        seg = cls(name, size, mm)
        seg.advise_huge()
        return seg

    def advise_huge(self) -> None:
        """Ask for huge pages (fewer TLB misses in AdamW's streaming passes); a no-op where tmpfs has none."""
        try:
            self.mm.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError, ValueError):
            pass

    @staticmethod
    def exists(name: str) -> bool:
        return os.path.exists(os.path.join(SHM_DIR, name.lstrip("/")))

    def touch(self) -> float:
        """First-touch every page with torch's parallel fill (placement and speed); returns GB/s."""
        import torch

        t0 = time.perf_counter()
        self.tensor(torch.uint8).zero_()
        return self.size / max(time.perf_counter() - t0, 1e-9) / 1e9

    def tensor(self, dtype: torch.dtype, offset: int = 0, count: int | None = None) -> torch.Tensor:
        """A zero-copy tensor over the segment (offset and count in elements of dtype)."""
        import torch

        itemsize = torch.empty((), dtype=dtype).element_size()
        if count is None:
            count = (self.size - offset * itemsize) // itemsize
        if count == 0:
            return torch.empty(0, dtype=dtype)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about non-writable buffers; ours are writable
            return torch.frombuffer(self.mm, dtype=dtype, count=count, offset=offset * itemsize)

    def array(self, dtype: np.dtype, offset_bytes: int, count: int) -> np.ndarray:
        return np.ndarray((count,), dtype=dtype, buffer=self.mm, offset=offset_bytes)

    def address(self) -> int:
        import torch

        return self.tensor(torch.uint8).data_ptr() if self.size else 0

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            pass  # views still alive; the mapping goes when they do

    def unlink(self) -> None:
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass


def list_store_segments() -> dict[str, list[tuple[str, int]]]:
    """Every SlideDP segment in /dev/shm, grouped by store: {store: [(kind, bytes)]}."""
    out: dict[str, list[tuple[str, int]]] = {}
    for entry in sorted(os.listdir(SHM_DIR)):
        if not entry.startswith(PREFIX):
            continue
        store, _, kind = entry[len(PREFIX):].rpartition(".")
        try:
            size = os.stat(os.path.join(SHM_DIR, entry)).st_size
        except FileNotFoundError:
            continue
        out.setdefault(store, []).append((kind, size))
    return out


def unlink_store(store: str) -> list[str]:
    """Remove every segment of a store; returns the names removed."""
    removed = []
    for kind, _ in list_store_segments().get(store, []):
        name = segment_name(store, kind)
        try:
            posix_ipc.unlink_shared_memory(name)
            removed.append(name)
        except posix_ipc.ExistentialError:
            pass
    return removed
