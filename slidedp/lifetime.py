"""Process lifetimes: a child dies with its parent, and a process of a dead pool is found and ended.

PR_SET_PDEATHSIG makes the kernel signal a child when the thread that forked it exits, kill -9
included, so a dead parent never leaves orphans that hold a store's segments or its sockets.
The signal is lost if the parent died between fork and prctl, hence the parent-pid check
after it; long-lived children also check their parent pid in their loops (`ParentWatch`).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import sys
from typing import NoReturn

import psutil

log = logging.getLogger("slidedp.lifetime")
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int, parent: int) -> None:
    """In the child, before exec: get `sig` when the parent dies -- or now, if it died since the fork."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died between fork and prctl: nobody would signal us
        os.kill(os.getpid(), sig)


def skip_collection_at_exit() -> None:
    """gc.freeze(): the cyclic collection that the interpreter runs as it exits skips every object alive now.
    With torch imported that collection walks all of torch's objects, about 0.5 s of each process's exit
    (the launcher's, each daemon's, each worker's); the process ends all the same. Call it as a process's
    main returns, never in a process that goes on (a test calling a main in-process)."""
    gc.freeze()


def end_process(code: int) -> NoReturn:
    """End this process now with `code`, skipping the interpreter's teardown (atexit handlers, module
    clean-up, C++ static destructors); for a process whose main has closed everything it owns. Torch's C++
    state torn down at exit can abort a process whose work is done: a two-rank Gloo worker after its last
    committed step, SIGABRT ("terminate called without an active exception", no Python frame left), and the
    launcher then fails the job. Logs and stdio are flushed first; the interpreter's exit-time collection
    (skip_collection_at_exit) is skipped with the rest."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or a broken pipe: nothing more can be said there
            pass
    os._exit(code)


class ParentWatch:
    """`gone()` is true once the process that started this one has exited (we were reparented)."""

    def __init__(self) -> None:
        self.parent = os.getppid()

    def gone(self) -> bool:
        return os.getppid() != self.parent


def processes_of(module: str, store: str) -> list[psutil.Process]:
    """This user's live processes running `python -m <module> --store <store>`."""
    uid = os.getuid()
    out = []
    for p in psutil.process_iter(["cmdline", "uids"]):
        try:
            cmd, uids = p.info["cmdline"] or [], p.info["uids"]
            if uids is None or uids.real != uid or p.pid == os.getpid():
                continue
            if module in cmd and "--store" in cmd and cmd[cmd.index("--store") + 1:][:1] == [store] \
                    and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.Error, ValueError, IndexError):
            continue
    return out


def end_strays(module: str, store: str, keep_parent: int, what: str, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every process of `module` for `store` whose parent is not `keep_parent`; returns their pids.

    The caller holds the role's lock, so it is the one legitimate owner of such processes: any
    other is a stray of a pool that died (it would hold the store's segments and take the
    identity of a new member on the aggregator's socket)."""
    strays = []
    for p in processes_of(module, store):
        try:
            if p.ppid() == keep_parent:
                continue
            log.warning("ending a stray %s of store %s (pid %d, parent %d): its pool is gone", what, store, p.pid,
                        p.ppid())
            p.send_signal(signal.SIGKILL)
            strays.append(p)
        except psutil.Error:
            continue
    psutil.wait_procs(strays, timeout=timeout_s)
    return [p.pid for p in strays]
