"""One daemon of each role per store: an flock'd file in the store's run dir says who runs.

A held lock is a live daemon (the kernel drops it when the process dies, kill -9 included),
so "is a daemon running?" needs no pid files that go stale and no ping that races a start.
"""

from __future__ import annotations

import fcntl
import os
import time

from .paths import run_dir

ROLES = ("hoststate", "aggregator", "updater")


class AlreadyRunning(SystemExit):
    pass


def _path(store: str, role: str):
    return run_dir(store) / f"{role}.lock"


def acquire(store: str, role: str) -> int:
    """Take the role's lock for this process's lifetime; refuse if another process holds it."""
    path = _path(store, role)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    # `held()` takes the lock for an instant to test it: retry briefly so a status query
    # racing a daemon's start does not turn it away.
    deadline = time.monotonic() + 0.5
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.02)
                continue
            other = path.read_text().strip() or "?"
            os.close(fd)
            raise AlreadyRunning(
                f"another slidedp-{role} already serves store {store!r} (pid {other}); refusing to start a second"
            ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def held(store: str, role: str) -> bool:
    path = _path(store, role)
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def holder_pid(store: str, role: str) -> int:
    try:
        return int(_path(store, role).read_text().strip() or 0)
    except (OSError, ValueError):
        return 0
