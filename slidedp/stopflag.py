"""The stop flag every process shell shares: signals set it, loops read it between messages.

A signal handler only sets the flag, so whatever a process has in hand (a request, an update,
a step) finishes before it stops.
"""

from __future__ import annotations

import signal


class StopFlag:
    """Set once a stop was asked for (SIGTERM, SIGINT or a caller); never cleared."""

    def __init__(self) -> None:
        self.requested = False

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
    return flag
