"""The updater pool's members as processes: CPUs for each, started, awaited until up, watched, stopped.

One member per NUMA node (or as many as asked), each pinned to its share of a node's CPUs
(member.py runs the updates). It imports no torch: the pool starts fast.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

from slidedp import log as slog

log = slog.get("updater-pool")


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


def member_argv(store: str, index: int, pool: int, cpus: list[int], threads: int, ready_fd: int) -> list[str]:
    return [sys.executable, "-m", "slidedp.daemons.updater.member", "--store", store, "--member", str(index),
            "--pool", str(pool), "--cpus", ",".join(map(str, cpus)), "--threads", str(threads),
            "--ready-fd", str(ready_fd)]


class Pool:
    """The members of one store's pool, one per entry of `cpus` (the CPUs it is pinned to)."""

    def __init__(self, store: str, cpus: list[list[int]], threads: int) -> None:
        self.store, self.cpus, self.threads = store, cpus, threads
        self.members: list[subprocess.Popen] = []

    def start(self, timeout_s: float = 120.0) -> str | None:
        """Start every member and wait until each has said it is up (one byte each on a pipe);
        the problem, or None."""
        ready_r, ready_w = os.pipe()
        count = len(self.cpus)
        self.members = [subprocess.Popen(member_argv(self.store, i, count, c, self.threads, ready_w), pass_fds=(ready_w,))
                        for i, c in enumerate(self.cpus)]
        os.close(ready_w)
        try:
            return self._await_members(ready_r, timeout_s)
        finally:
            os.close(ready_r)

    def _await_members(self, ready_r: int, timeout_s: float) -> str | None:
        got, deadline = 0, time.monotonic() + timeout_s
        while got < len(self.members):
            dead = self.first_dead()
            if dead:
                return f"updater member {dead[0]} exited with code {dead[1]} while starting"
            left = deadline - time.monotonic()
            if left <= 0:
                return f"only {got} of {len(self.members)} updater members came up within {timeout_s:.0f} s"
            if select.select([ready_r], [], [], min(left, 0.2))[0]:
                got += len(os.read(ready_r, 64))
        return None

    def first_dead(self) -> tuple[int, int] | None:
        """(index, exit code) of the first member that has exited, or None while all run."""
        return next(((i, c.returncode) for i, c in enumerate(self.members) if c.poll() is not None), None)

    def terminate(self) -> None:
        for c in self.members:
            if c.poll() is None:
                c.terminate()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every member, then SIGKILL one that is still there after `timeout_s`."""
        self.terminate()
        for c in self.members:
            try:
                c.wait(timeout_s)
            except subprocess.TimeoutExpired:
                c.kill()
