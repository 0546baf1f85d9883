"""The stop flag every process shell shares: signals set it, loops read it between messages.

A signal handler only sets the flag, so whatever a process has in hand (a request, an update,
a step) finishes before it stops. The signal also writes a byte to the flag's wake pipe, so a
loop that waits on it beside its socket (daemons/loop.py `poll_or_stop`), or without one
(`StopFlag.sleep`), stops at once instead of at the end of its wait.
"""

from __future__ import annotations

import os
import select
import signal
import time


class StopFlag:
    """Set once a stop was asked for (SIGTERM, SIGINT or a caller); never cleared."""

    def __init__(self) -> None:
        self.requested = False
        self.wake_fd = -1  # readable once a signal arrived (stop_on's pipe); -1: none

    def drain(self) -> None:
        """Empty the wake pipe (a loop that goes on waiting must not find it readable again)."""
        try:
            while os.read(self.wake_fd, 64):
                pass
        except (BlockingIOError, OSError):
            pass

    def sleep(self, timeout_s: float) -> bool:
        """Wait up to timeout_s, less if a signal arrives (its byte is drained); whether one did."""
        if self.wake_fd < 0:
            time.sleep(timeout_s)
            return False
        woken = bool(select.select([self.wake_fd], [], [], timeout_s)[0])
        if woken:
            self.drain()
        return woken

    def set(self, *_: object) -> None:
        self.requested = True

    def __bool__(self) -> bool:
        return self.requested


def stop_on(*signals: int, ignore: tuple[int, ...] = ()) -> StopFlag:
    """A flag that `signals` set; the signals in `ignore` are ignored (their owner is another process)."""
    flag = StopFlag()
    for s in signals:
        signal.signal(s, flag.set)
    for s in ignore:
        signal.signal(s, signal.SIG_IGN)
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        flag.wake_fd = r
    except ValueError:  # not the main thread: no wake pipe, loops wait out their timeout
        os.close(r)
        os.close(w)
    return flag
