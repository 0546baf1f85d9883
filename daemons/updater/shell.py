"""slidedp-updater: the pool of processes that run AdamW on chunks as their gradients complete.

The pool's shell: argv, the lock, which CPUs the members get, signals, readiness. It starts
the members (pool.py), reports readiness to systemd once every one is up, and dies loudly with
any of them. It imports no torch: it starts fast.
"""

from __future__ import annotations

import argparse
import os
import signal

from slidedp import daemonlock
from slidedp import log as slog
from slidedp import numa
from slidedp.daemons.loop import serve_loop
from slidedp.daemons.sdnotify import notify
from slidedp.daemons.updater.pool import MEMBER_MODULE, Pool, split_cpus
from slidedp.lifetime import end_strays
from slidedp.stopflag import stop_on

log = slog.get("updater-pool")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="slidedp-updater", description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True)
    p.add_argument("--processes", type=int, default=0, help="pool size (0 = one per NUMA node)")
    p.add_argument("--threads", type=int, default=0, help="threads per process (0 = the CPUs of its node)")
    p.add_argument("--reserve-cpus", type=int, default=-1,
                   help="leave the last N CPUs to the GPU workers: an OpenMP thread sharing a core with a busy "
                        "worker stalls every parallel region of the fused AdamW, and the worker's kernel launches "
                        "(-1, the default: what a job on every GPU of this host needs, as the launcher reserves it; "
                        "0 with no GPU)")
    args = p.parse_args(argv)
    slog.setup("updater-pool")
    lock_fd = daemonlock.acquire(args.store, "updater")  # held for the pool's lifetime
    try:
        return _run(args)
    finally:
        daemonlock.release(args.store, "updater", lock_fd)


def _run(args: argparse.Namespace) -> int:
    daemonlock.clear_exit_note(args.store, "updater")
    # We hold the lock: a member of this store that is not ours belongs to a pool that died, and
    # would take a new member's place on the aggregator's socket.
    end_strays(MEMBER_MODULE, args.store, os.getpid(), "updater member")
    reserve = args.reserve_cpus
    if reserve < 0:  # a service started before any job: make room for a job on every GPU
        gpus = numa.gpu_count()
        reserve = numa.reserved_count(len(os.sched_getaffinity(0)), gpus) if gpus else 0
    nodes = numa.reserve(numa.nodes(), reserve)
    pool = Pool(args.store, split_cpus(nodes, args.processes or len(nodes)), args.threads)
    problem = pool.start()
    if problem:  # readiness means every member runs: say why not, and go (systemd restarts us)
        log.error("%s; stopping the pool", problem)
        daemonlock.note_exit(args.store, "updater", problem)
        pool.terminate()
        return 1
    stop = stop_on(signal.SIGTERM, signal.SIGINT)
    notify("READY=1", f"STATUS={len(pool.cpus)} updater process(es) for store {args.store}")
    code = 0

    def check() -> bool:
        nonlocal code
        dead = pool.first_dead()
        if dead:
            why = pool.describe_exit(dead[0])
            log.error("%s; stopping the pool", why)
            daemonlock.note_exit(args.store, "updater", why)  # the launcher names the member, not just the pool
            code = 1
        return dead is not None

    def nap() -> bool:  # no socket: the members' exits are polled (a stop's signal ends the nap)
        stop.sleep(0.2)
        return True

    serve_loop(stop, nap, check)
    notify("STOPPING=1")
    pool.stop()
    return code
