"""The loop every daemon shell runs: wait for input, hand it to the core, ping the watchdog, stop on the flag.

A daemon's shell supplies what to wait on (`wait`, which returns whether there is input) and
what to do with it (`handle`, which returns True to stop serving); `tick` runs every turn, before
the wait (timers: a handshake's deadline, a periodic hello). The wait must return within the
watchdog's period, so the daemon never looks hung to systemd.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import zmq

from slidedp import daemonlock
from slidedp.daemons.sdnotify import Watchdog, notify
from slidedp.stopflag import StopFlag


def poll_or_stop(sock: zmq.Socket, stop: StopFlag, timeout_ms: int) -> bool:
    """`sock.poll(timeout_ms)` as a bool, but returning False as soon as a signal arrives for `stop`
    (its wake pipe), so a stop is not held up by the rest of the wait."""
    if timeout_ms <= 0 or stop.wake_fd < 0:
        return bool(sock.poll(timeout_ms))
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(stop.wake_fd, zmq.POLLIN)
    ready = dict(poller.poll(timeout_ms))
    if stop.wake_fd in ready:
        stop.drain()
    return sock in ready


def serve_loop(stop: StopFlag, wait: Callable[[], bool], handle: Callable[[], bool | None],
               tick: Callable[[], None] | None = None, watchdog: Watchdog | None = None) -> None:
    """Until `stop` is set or `handle` returns True: ping, tick, wait, handle."""
    watchdog = watchdog or Watchdog()
    while not stop.requested:
        watchdog.maybe_ping()
        if tick is not None:
            tick()
        if wait() and handle():
            return


@contextmanager
def serving(store_name: str, role: str, lock_fd: int, ctx: zmq.Context, sock: zmq.Socket, status: str,
            close_core: Callable[[], None]) -> Iterator[None]:
    """READY (with `status`) to systemd while the body serves; then, however it ends, STOPPING, the core
    closed, the socket and its context ended and the role's lock released."""
    notify("READY=1", f"STATUS={status}")
    try:
        yield
    finally:
        notify("STOPPING=1")
        close_core()
        sock.close(linger=0)
        ctx.term()
        daemonlock.release(store_name, role, lock_fd)
