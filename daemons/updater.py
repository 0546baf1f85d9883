"""slidedp-updater: the pool of processes that run AdamW on chunks as their gradients complete.

One member process per NUMA node (or --processes), each pinned to its node's CPUs
(daemons/updater_member.py does the updating). This parent starts the members, reports
readiness to systemd, and dies loudly with any of them. It imports no torch: it starts fast.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import time

from slidedp import daemonlock
from slidedp import log as slog
from slidedp import numa
from slidedp.lifetime import die_with_parent, end_strays
from slidedp.sdnotify import Watchdog, notify

log = slog.get("updater-pool")


class _Stop:
    requested = False


def split_cpus(nodes: list[list[int]], count: int) -> list[list[int]]:
    """CPUs for each of `count` members: spread over nodes; members sharing a node split its CPUs."""
    plan: list[list[int]] = []
    for i in range(count):
        node = nodes[i % len(nodes)]
        sharing = len(range(i % len(nodes), count, len(nodes)))
        part = i // len(nodes)
        per = max(1, len(node) // sharing)
        plan.append(node[part * per:(part + 1) * per] or node)
    return plan


def _member_command(store: str, index: int, pool: int, cpus: list[int], threads: int, ready_fd: int) -> list[str]:
    return [sys.executable, "-m", MEMBER_MODULE, "--store", store, "--member", str(index),
            "--pool", str(pool), "--cpus", ",".join(map(str, cpus)), "--threads", str(threads),
            "--ready-fd", str(ready_fd)]


MEMBER_MODULE = "slidedp.daemons.updater_member"


def describe_member_exit(index: int, child: subprocess.Popen) -> str:
    rc = child.returncode
    how = f"was killed by signal {signal.Signals(-rc).name}" if rc is not None and rc < 0 else f"exited with code {rc}"
    return f"updater member {index} (pid {child.pid}) {how}"


def _spawn_member(argv: list[str], ready_w: int) -> subprocess.Popen:
    """A member that gets SIGTERM when this pool process dies, however it dies (kill -9 included)."""
    parent = os.getpid()
    return subprocess.Popen(argv, pass_fds=(ready_w,), preexec_fn=lambda: die_with_parent(signal.SIGTERM, parent))


def _await_members(children: list[subprocess.Popen], ready_r: int, timeout_s: float) -> str | None:
    """Wait until every member has said it is up (one byte each on the pipe); the problem, or None."""
    got, deadline = 0, time.monotonic() + timeout_s
    while got < len(children):
        dead = [i for i, c in enumerate(children) if c.poll() is not None]
        if dead:
            return f"{describe_member_exit(dead[0], children[dead[0]])} while starting"
        left = deadline - time.monotonic()
        if left <= 0:
            return f"only {got} of {len(children)} updater members came up within {timeout_s:.0f} s"
        if select.select([ready_r], [], [], min(left, 0.2))[0]:
            got += len(os.read(ready_r, 64))
    return None


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
        return _run_pool(args, lock_fd)
    finally:
        daemonlock.release(args.store, "updater", lock_fd)


def _run_pool(args: argparse.Namespace, lock_fd: int) -> int:
    daemonlock.clear_exit_note(args.store, "updater")
    # We hold the lock: a member of this store that is not ours belongs to a pool that died, and
    # would take a new member's place on the aggregator's socket.
    end_strays(MEMBER_MODULE, args.store, os.getpid(), "updater member")
    reserve = args.reserve_cpus
    if reserve < 0:  # a service started before any job: make room for a job on every GPU
        gpus = numa.gpu_count()
        reserve = numa.reserved_count(len(os.sched_getaffinity(0)), gpus) if gpus else 0
    nodes = numa.reserve(numa.nodes(), reserve)
    count = args.processes or len(nodes)
    plan = split_cpus(nodes, count)
    ready_r, ready_w = os.pipe()
    children = [_spawn_member(_member_command(args.store, i, count, cpus, args.threads, ready_w), ready_w)
                for i, cpus in enumerate(plan)]
    os.close(ready_w)
    problem = _await_members(children, ready_r, 120.0)
    os.close(ready_r)
    if problem:  # readiness means every member runs: say why not, and go (systemd restarts us)
        log.error("%s; stopping the pool", problem)
        daemonlock.note_exit(args.store, "updater", problem)
        for c in children:
            if c.poll() is None:
                c.terminate()
        return 1
    stop = _Stop()

    def on_signal(signum, frame):
        stop.requested = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    notify("READY=1", f"STATUS={count} updater process(es) for store {args.store}")
    watchdog = Watchdog()
    code = 0
    while not stop.requested:
        watchdog.maybe_ping()
        dead = [i for i, c in enumerate(children) if c.poll() is not None]
        if dead:
            why = describe_member_exit(dead[0], children[dead[0]])
            log.error("%s; stopping the pool", why)
            daemonlock.note_exit(args.store, "updater", why)  # the launcher names the member, not just the pool
            code = 1
            break
        time.sleep(0.2)
    notify("STOPPING=1")
    for c in children:
        if c.poll() is None:
            c.terminate()
    for c in children:
        try:
            c.wait(10)
        except subprocess.TimeoutExpired:
            c.kill()
    return code


if __name__ == "__main__":
    sys.exit(main())
