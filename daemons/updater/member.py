"""One member of the updater pool: the shell around UpdaterCore.

Started by the pool (`python -m slidedp.daemons.updater.member`), pinned to its CPUs, it joins
the aggregator's socket, takes Update/Norm/JobStart/JobEnd and answers Updated/Ack. A failed
update would silently corrupt training: it is reported and the member exits.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
import zmq

from slidedp import adamw
from slidedp import log as slog
from slidedp import numa
from slidedp.daemons.loop import poll_or_stop, serve_loop
from slidedp.daemons.updater.core import UpdaterCore
from slidedp.lifetime import ParentWatch, skip_collection_at_exit
from slidedp.protocol import ROLE_UPDATER, Ack, Hello, JobEnd, JobStart, Norm, Update
from slidedp.stopflag import stop_on
from slidedp.transport import connect_dealer, identity, recv_dealer, send

log = slog.get("updater")

HELLO_EVERY_S = 2.0  # an idle member says hello again: an aggregator that restarted needs it


def _tell_ready(fd: int) -> bool:
    """Tell the pool parent this member is up (it reports readiness for all); False if it is gone."""
    try:
        os.write(fd, b"1")
        return True
    except BrokenPipeError:
        return False
    finally:
        os.close(fd)


def serve_member(store: str, index: int, pool: int, ready_fd: int = -1) -> int:
    parent = ParentWatch()
    if ready_fd >= 0 and not _tell_ready(ready_fd):  # the pool stopped while we started (a refused job)
        log.debug("updater %d: the pool is gone before this member came up; exiting", index)
        return 0
    core = UpdaterCore(store, index)
    ctx = zmq.Context()
    sock = connect_dealer(ctx, store, "agg", identity("u", index))
    hello = Hello(ROLE_UPDATER, index, pool, os.getpid())
    send(sock, hello)
    stop = stop_on(signal.SIGTERM, ignore=(signal.SIGINT,))  # the parent or launcher decides; Ctrl-C goes to the group
    log.info("updater %d/%d up, %d threads on CPUs %s; AdamW kernels: %s", index, pool, torch.get_num_threads(),
             numa.format_cpulist(list(os.sched_getaffinity(0))),
             "compiled for every clipped, shadow and corrected update" if adamw.STEP_COMPILED else
             "torch's for updates, compiled for corrections" if adamw.USE_COMPILED else
             "torch's (numba missing or SLIDEDP_ADAMW_KERNEL=torch)")
    last_hello = time.monotonic()
    failed = False

    def wait() -> bool:
        nonlocal last_hello, failed
        if parent.gone():  # its pool died before PR_SET_PDEATHSIG could tell us: never outlive it
            log.warning("updater %d: the pool (pid %d) is gone; exiting", index, parent.parent)
            failed = True
            return True  # handle() sees it and ends the loop
        if not poll_or_stop(sock, stop, 0 if core.ready else 500) and not core.ready and core.job is None:
            # a member that is stopping says no hello: undelivered, it would hold the socket's close for its linger
            if time.monotonic() - last_hello > HELLO_EVERY_S and not stop.requested:
                send(sock, hello)
                last_hello = time.monotonic()
        return True  # ready work runs whether or not a message came

    def handle() -> bool:
        """Take every message waiting, then run the most urgent update."""
        nonlocal failed
        if failed:
            return True
        try:
            while sock.poll(0):
                for reply in core.receive(recv_dealer(sock, (Update, Norm, JobStart, JobEnd))):
                    send(sock, reply)
            done = core.next()
        except Exception as e:  # a failed update would silently corrupt training: report and die
            log.exception("update failed")
            send(sock, Ack(0, f"updater {index}: {type(e).__name__}: {e}"))
            failed = True
            return True
        if done is not None:
            send(sock, done)
        return False

    try:
        serve_loop(stop, wait, handle)
    finally:
        core.end_job()
        sock.close(linger=500)
        ctx.term()
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="slidedp-updater member", description="one process of the updater pool")
    p.add_argument("--store", required=True)
    p.add_argument("--member", type=int, required=True)
    p.add_argument("--pool", type=int, required=True)
    p.add_argument("--cpus", default="")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--ready-fd", type=int, default=-1)
    args = p.parse_args(argv)
    slog.setup("updater", args.member)
    cpus = numa.parse_cpulist(args.cpus) if args.cpus else sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(args.threads or len(cpus))
    try:
        return serve_member(args.store, args.member, args.pool, ready_fd=args.ready_fd)
    finally:
        skip_collection_at_exit()


if __name__ == "__main__":
    sys.exit(main())
