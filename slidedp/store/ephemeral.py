"""Stores a job made for itself (store.persist = false): who made them, and whether one was left behind.

Such a store is destroyed by its job at the end; a job killed with -9 cannot, and its store stays
in /dev/shm. The creator is recorded in the manifest at creation (pid and process start time, so a
reused pid is not taken for it), so that the next start can tell a store left behind by a dead job
from a store meant to persist, and never adopt the former silently.
"""

from __future__ import annotations

import os
from typing import Any

import psutil


def creator_record(job: str) -> dict[str, Any]:
    """What a job that creates a store for itself records in its manifest."""
    return {"pid": os.getpid(), "started": psutil.Process().create_time(), "job": job}


def _alive(pid: int, started: float) -> bool:
    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE and abs(p.create_time() - started) < 1.0
    except psutil.Error:
        return False


def left_behind(status: dict[str, Any]) -> str | None:
    """For a store's status: which dead job should have destroyed it (e.g. "job 'tiny' (launcher pid 12)"),
    or None for a store that persists, or whose creating job still runs."""
    if not status.get("exists") or status.get("persist", True):
        return None
    creator = status.get("creator") or {}
    pid, started = int(creator.get("pid") or 0), float(creator.get("started") or 0.0)
    if pid and _alive(pid, started):
        return None
    return f"job {creator.get('job', '?')!r} (launcher pid {pid or '?'})"
