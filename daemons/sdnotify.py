"""systemd's readiness and watchdog protocol (sd_notify), without libsystemd.

Under a `Type=notify` unit systemd sets $NOTIFY_SOCKET (a filesystem path, or an abstract
socket written with a leading '@') and, with `WatchdogSec=`, $WATCHDOG_USEC and
$WATCHDOG_PID. A daemon sends newline-separated `KEY=VALUE` states as one datagram:
`READY=1` once it serves, `WATCHDOG=1` as a keep-alive, `STATUS=...` for
`systemctl status`, `STOPPING=1` on shutdown. Outside systemd every call is a quiet no-op,
so the same daemon code runs embedded under the launcher.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator

_log = logging.getLogger("slidedp.daemons.sdnotify")


def _address(spec: str) -> str | None:
    if spec.startswith("@"):
        return "\0" + spec[1:]  # abstract namespace: leading NUL, no file
    if spec.startswith("/"):
        return spec
    return None


def notify(*states: str) -> bool:
    """Send `states` (e.g. "READY=1", "STATUS=attached") to systemd as one datagram.

    True when sent; False, quietly, when $NOTIFY_SOCKET is unset (not under systemd); False
    with a warning when it is set but the send fails (a missed ping must not kill a daemon:
    systemd's own watchdog is what reports a daemon that stopped pinging).
    """
    if not states:
        raise ValueError("notify() needs at least one state, e.g. notify('READY=1')")
    for state in states:
        if "=" not in state or "\n" in state:
            raise ValueError(f"sd_notify state {state!r} must be one line of the form KEY=VALUE")
    spec = os.environ.get("NOTIFY_SOCKET")
    if not spec:
        return False
    address = _address(spec)
    if address is None:
        _log.warning("NOTIFY_SOCKET=%r is neither a path nor an '@' abstract name; not notifying systemd", spec)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(1.0)  # a full, unread queue must not hang the daemon (10 datagrams by default)
            sock.sendto("\n".join(states).encode(), address)
    except OSError as exc:
        _log.warning("could not notify systemd at NOTIFY_SOCKET=%r: %s", spec, exc)
        return False
    return True


def watchdog_interval() -> float | None:
    """The unit's `WatchdogSec=` in seconds, or None when this process has no watchdog.

    $WATCHDOG_PID, when set, names the one process systemd watches: children that inherit
    the environment (the updater pool's workers) get None and leave the pinging to it.
    """
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    return int(usec) / 1_000_000


class Watchdog:
    """Pings systemd's watchdog at half its interval; `maybe_ping()` is cheap enough for
    every loop iteration (one clock read when no ping is due, nothing when disabled).

    A loop that calls it must not block longer than `period` seconds at a time (use it as
    an upper bound on poll timeouts), or systemd kills the daemon as hung. One long operation
    that makes progress but cannot ping (creating a store, writing a checkpoint) runs inside
    `keepalive()`.
    """

    def __init__(self) -> None:
        interval = watchdog_interval()
        self.period: float | None = None if interval is None else interval / 2
        self._due = float("-inf")

    @property
    def enabled(self) -> bool:
        return self.period is not None

    def maybe_ping(self) -> None:
        if self.period is None:
            return
        now = time.monotonic()
        if now >= self._due:
            notify("WATCHDOG=1")
            self._due = now + self.period

    @contextlib.contextmanager
    def keepalive(self) -> Iterator[None]:
        """Ping from a background thread while the body runs, then stop that thread.

        Only for operations that are finite by construction: a hang inside the body is no
        longer caught by systemd's watchdog.
        """
        if self.period is None:
            yield
            return
        stop = threading.Event()

        def ping() -> None:
            while not stop.wait(self.period):
                notify("WATCHDOG=1")

        self.maybe_ping()
        thread = threading.Thread(target=ping, name="slidedp-watchdog", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self._due = float("-inf")  # the loop's next maybe_ping() pings at once
