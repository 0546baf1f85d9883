"""slidedp-hoststate: the daemon that owns a store (segments, manifest, checkpoints).

The shell around slidedp.store.service.HostStateCore: the lock, the control socket, signals,
systemd's readiness and watchdog. It outlives jobs and never unlinks a store unless told to
destroy it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any

import torch
import zmq

from slidedp import daemonlock
from slidedp import log as slog
from slidedp.daemons.loop import poll_or_stop, serve_loop, serving
from slidedp.daemons.sdnotify import Watchdog, notify
from slidedp.lifetime import skip_collection_at_exit
from slidedp.protocol import KIND_OF, ControlRequest, Reply, Request, decode_control
from slidedp.stopflag import stop_on
from slidedp.store.manifest import ManifestError
from slidedp.store.service import REFUSALS, HostStateCore, refusal_text
from slidedp.store.shm import list_store_segments
from slidedp.store.store import StoreError
from slidedp.transport import bind_router, recv_router, send

log = slog.get("hoststate")

# Requests whose work grows with the model (touching pages, writing or reading a checkpoint,
# creating or unmapping the gradient rings): they run under the watchdog's keepalive thread,
# so a 100 GB store does not look hung to systemd. Each is finite: no wait on a peer.
LONG_REQUESTS = frozenset({"create", "attach", "checkpoint", "checkpoint_wait", "restore", "destroy"})


def _handle(core: HostStateCore, watchdog: Watchdog, req: ControlRequest) -> dict[str, Any]:
    kind = KIND_OF[type(req)]
    if kind not in LONG_REQUESTS:
        return core.handle(req)
    with watchdog.keepalive():
        notify(f"STATUS={kind} of store {core.name} in progress")
        try:
            return core.handle(req)
        finally:
            notify(f"STATUS=serving store {core.name}")


def answer(core: HostStateCore, watchdog: Watchdog, req: Request) -> Reply:
    """The reply to one request: its result, or the reason it was refused (the daemon serves on)."""
    try:
        return Reply(1, json.dumps(_handle(core, watchdog, decode_control(req))))
    except REFUSALS as e:
        log.warning("%s request failed: %s", req.name, refusal_text(e))
        return Reply(0, refusal_text(e))


def serve(store_name: str) -> int:
    lock_fd = daemonlock.acquire(store_name, "hoststate")
    try:
        core = HostStateCore(store_name)
    except (StoreError, ManifestError) as e:
        log.error("cannot attach store %s: %s (`slidedp-store destroy %s` removes it)", store_name, e, store_name)
        daemonlock.release(store_name, "hoststate", lock_fd)
        return 2
    ctx = zmq.Context()
    sock = bind_router(ctx, store_name, "control")
    stop = stop_on(signal.SIGTERM, signal.SIGINT)  # the loop finishes the request in hand
    watchdog = Watchdog()

    def handle() -> bool:
        item = recv_router(sock, (Request,))
        if item is None:
            return False
        peer, req = item
        if req.name == "shutdown":
            send(sock, Reply(1, json.dumps({"pid": os.getpid()})), to=peer)
            return True
        reply = answer(core, watchdog, req)
        try:
            send(sock, reply, to=peer)
        except zmq.ZMQError:
            log.warning("client of a %s request went away before the reply", req.name)
        return False

    log.info("serving store %s (pid %d)", store_name, os.getpid())
    try:
        with serving(store_name, "hoststate", lock_fd, ctx, sock, f"serving store {store_name}", core.close):
            serve_loop(stop, lambda: poll_or_stop(sock, stop, 200), handle, watchdog=watchdog)
    finally:
        if list_store_segments().get(store_name):
            log.info("stopped; store %s left in place", store_name)
        else:
            log.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slidedp-hoststate", description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="store name (segments /dev/shm/slidedp.<store>.*)")
    args = parser.parse_args(argv)
    slog.setup("hoststate")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    try:
        return serve(args.store)
    finally:
        skip_collection_at_exit()
