"""ZeroMQ plumbing shared by every process: sockets inside the store's 0700 run directory.

Topology per store: the aggregator binds one ROUTER (`agg`) that workers, updaters and the
launcher join as DEALERs named by role and rank; the host-state daemon binds a ROUTER
(`control`) for requests; the launcher binds a ROUTER (`job`) for its workers' stats.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

import zmq

from .paths import socket_address
from .protocol import MAX_TEXT, REQUESTS, Message, ProtocolError, Request, decode

log = logging.getLogger("slidedp.transport")


class PeerTimeout(TimeoutError):
    """A wait ran past its limit; the message names the peer and the setting to raise."""


def identity(role: str, rank: int = 0) -> bytes:
    return f"{role}{rank}".encode()


def bind_router(ctx: zmq.Context, store: str, name: str) -> zmq.Socket:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished peer raises instead of dropping
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_TEXT + 4096)  # an oversized frame is refused, never buffered whole
    addr = socket_address(store, name)
    path = addr[len("ipc://"):]
    if os.path.exists(path):
        os.unlink(path)  # a stale socket file from a killed daemon; the run dir is private
    old = os.umask(0o077)
    try:
        sock.bind(addr)
    finally:
        os.umask(old)
    return sock


def connect_dealer(ctx: zmq.Context, store: str, name: str, ident: bytes) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.IDENTITY, ident)
    sock.connect(socket_address(store, name))
    return sock


def send(sock: zmq.Socket, msg: Message, to: bytes | None = None) -> None:
    if to is None:
        sock.send(msg.encode())
    else:
        sock.send_multipart([to, msg.encode()])


def recv_router(sock: zmq.Socket, expect=None) -> tuple[bytes, Message] | None:
    """One message from a ROUTER, or None when it was malformed (logged and dropped)."""
    frames = sock.recv_multipart()
    if len(frames) != 2:
        log.warning("dropped a message of %d frames (expected 2)", len(frames))
        return None
    try:
        return frames[0], decode(frames[1], expect)
    except ProtocolError as e:
        log.warning("dropped a bad message from %r: %s", frames[0][:32], e)
        return None


def recv_dealer(sock: zmq.Socket, expect=None) -> Message | None:
    frames = sock.recv_multipart()
    if len(frames) != 1:
        log.warning("dropped a message of %d frames (expected 1)", len(frames))
        return None
    try:
        return decode(frames[0], expect)
    except ProtocolError as e:
        log.warning("dropped a bad message: %s", e)
        return None


def request(ctx: zmq.Context, store: str, req: Message, timeout_s: float, reply_types=None,
            check: Callable[[], None] | None = None) -> Message:
    """One request/reply with the host-state daemon's ROUTER, on a fresh DEALER (safe from any thread or
    process). `check` runs between polls and raises to give up early (the daemon died meanwhile)."""
    sock = connect_dealer(ctx, store, "control", identity(f"client{os.getpid()}-{time.monotonic_ns()}-"))
    what = f"the {REQUESTS[req.kind]} request" if isinstance(req, Request) else type(req).__name__
    try:
        send(sock, req)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerTimeout(
                    f"no reply to {what} from the host-state daemon of store {store!r} within {timeout_s:.0f} s "
                    f"(is `slidedp-hoststate --store {store}` running? raise runtime.timeout_s if it is busy)"
                )
            if sock.poll(int(min(left, 0.2) * 1000)):
                msg = recv_dealer(sock, reply_types)
                if msg is not None:
                    return msg
            if check is not None:
                check()
    finally:
        sock.close(linger=0)
