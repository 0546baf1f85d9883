"""One daemon of each role per store: an flock'd file in the store's run dir says who runs.

A held lock is a live daemon (the kernel drops it when the process dies, kill -9 included),
so "is a daemon running?" needs no pid files that go stale and no ping that races a start.

A daemon removes its lock file as it exits, and the last one out removes the run directory
(`release`): nothing is left under the socket root once no daemon serves the store. Removing a
lock file is safe because `acquire` checks, after taking the lock, that the file it locked is
still the one at the path (else it takes the new one).
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from .paths import resolve_run_dir, run_dir

ROLES = ("hoststate", "aggregator", "updater")
# Run directories that belong to systemd (RuntimeDirectory=): it makes and removes them, not us.
_SYSTEMD_RULES = ("RUNTIME_DIRECTORY", "system")


class AlreadyRunning(SystemExit):
    pass


def _path(store: str, role: str, create: bool = True) -> Path:
    return run_dir(store, create=create) / f"{role}.lock"


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def acquire(store: str, role: str) -> int:
    """Take the role's lock for this process's lifetime; refuse if another process holds it."""
    # `held()` and a cleanup take the lock for an instant: retry briefly so that racing a status
    # query or the last daemon's exit does not turn a start away.
    deadline = time.monotonic() + 0.5
    while True:
        path = _path(store, role)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except FileNotFoundError:  # the run dir went away between mkdir and open
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() < deadline:
                time.sleep(0.02)
                continue
            other = holder_pid(store, role) or "?"
            raise AlreadyRunning(
                f"another slidedp-{role} already serves store {store!r} (pid {other}); refusing to start a second"
            ) from None
        if not _same_file(fd, path):  # unlinked by an exiting daemon after our open: take the new file
            os.close(fd)
            continue
        break
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def release(store: str, role: str, fd: int) -> None:
    """Give the lock up as the daemon exits: its file goes, and the run dir with it once no daemon is left."""
    try:
        path = _path(store, role, create=False)
        if _same_file(fd, path):
            path.unlink(missing_ok=True)
    finally:
        os.close(fd)
    remove_idle_run_dir(store)


def remove_idle_run_dir(store: str) -> bool:
    """Remove the store's run directory when no daemon holds a lock in it; True if it is gone.

    Each free lock is taken before its file is removed (a daemon starting meanwhile retries on a
    new file); sockets and notes left by daemons killed with -9 go with it. A directory that
    systemd manages, or one still in use, is left alone."""
    rd = resolve_run_dir(store)
    if rd.rule in _SYSTEMD_RULES or not rd.path.is_dir():
        return not rd.path.exists()
    taken: list[tuple[int, Path]] = []
    try:
        for role in ROLES:
            path = rd.path / f"{role}.lock"
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False  # a daemon runs
            taken.append((fd, path))
        for fd, path in taken:
            if _same_file(fd, path):
                path.unlink(missing_ok=True)
        for leftover in list(rd.path.glob("*.sock")) + list(rd.path.glob("*.exit")):
            leftover.unlink(missing_ok=True)
        try:
            rd.path.rmdir()
        except OSError:  # something else lives there (a launcher's socket, a user's file): keep it
            return False
        return True
    finally:
        for fd, _ in taken:
            os.close(fd)


def held(store: str, role: str) -> bool:
    path = _path(store, role, create=False)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
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
        return int(_path(store, role, create=False).read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


# ---- why a daemon stopped: a one-line note in the run dir that whoever watched it can read ----------
def note_exit(store: str, role: str, text: str) -> None:
    path = _path(store, role).with_suffix(".exit")
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)


def clear_exit_note(store: str, role: str) -> None:
    _path(store, role).with_suffix(".exit").unlink(missing_ok=True)


def exit_note(store: str, role: str) -> str:
    try:
        return _path(store, role, create=False).with_suffix(".exit").read_text().strip()
    except OSError:
        return ""
