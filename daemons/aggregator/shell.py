"""slidedp-aggregator: sums the ranks' gradients of each chunk and hands the chunk to the updater pool.

The shell around AggregatorCore and JobHandshake: it owns the lock, the store's `agg` ROUTER
(workers, updaters and the launcher join it), signals, readiness and the watchdog, and delivers
what the core and the handshake return.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import zmq

from slidedp import daemonlock
from slidedp import log as slog
from slidedp.daemons.aggregator.core import AggregatorCore, Outbox
from slidedp.daemons.aggregator.handshake import JobHandshake, route
from slidedp.daemons.loop import poll_or_stop, serve_loop, serving
from slidedp.lifetime import skip_collection_at_exit
from slidedp.protocol import Credit, Ready
from slidedp.stopflag import stop_on
from slidedp.transport import bind_router, recv_router, send

log = slog.get("aggregator")


def serve(store_name: str, timeout_s: float = 120.0) -> int:
    lock_fd = daemonlock.acquire(store_name, "aggregator")
    core = AggregatorCore(store_name)
    handshake = JobHandshake(core, store_name, timeout_s)
    ctx = zmq.Context()
    sock = bind_router(ctx, store_name, "agg")
    stop = stop_on(signal.SIGTERM, signal.SIGINT)

    def deliver(out: Outbox) -> None:
        for to, m in out:
            try:
                send(sock, m, to=to)
            except zmq.ZMQError as e:  # a vanished peer: the launcher's process watcher reports it
                level = log.debug if isinstance(m, (Credit, Ready)) else log.warning  # workers that finished
                level("could not send %s to %r: %s", type(m).__name__, to, e)

    def handle() -> None:
        item = recv_router(sock)
        if item is not None:
            deliver(route(core, handshake, *item, time.monotonic()))

    log.info("aggregator for store %s up (pid %d)", store_name, os.getpid())
    with serving(store_name, "aggregator", lock_fd, ctx, sock, f"aggregating for store {store_name}", core.end_job):
        serve_loop(stop, lambda: poll_or_stop(sock, stop, 100), handle, tick=lambda: deliver(handshake.tick(time.monotonic())))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="slidedp-aggregator", description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True)
    p.add_argument("--threads", type=int, default=0, help="torch threads for the sums (0 = all CPUs)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the updater pool at job start")
    args = p.parse_args(argv)
    slog.setup("aggregator")
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    try:
        return serve(args.store, args.timeout)
    finally:
        skip_collection_at_exit()
