"""Child processes of the launcher: embedded daemons and workers.

Children run in their own session so a Ctrl-C reaches only the launcher, which decides
(graceful stop, then kill). PR_SET_PDEATHSIG makes them go with the launcher even if it
is killed with -9, so a dead launcher never leaves orphans holding the store: daemons get
SIGTERM (they finish the message in hand), workers SIGKILL (a worker mid-step would wait
out runtime.timeout_s for peers that are gone, and its job cannot finish anyway).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from slidedp import daemonlock
from slidedp.lifetime import die_with_parent

log = logging.getLogger("slidedp.launcher")


@dataclass
class Child:
    name: str
    proc: subprocess.Popen

    def alive(self) -> bool:
        return self.proc.poll() is None

    def describe_exit(self) -> str:
        rc = self.proc.returncode
        if rc is None:
            return f"{self.name} is running"
        if rc < 0:
            return f"{self.name} (pid {self.proc.pid}) was killed by signal {signal.Signals(-rc).name}"
        return f"{self.name} (pid {self.proc.pid}) exited with code {rc}"


def spawn(name: str, argv: list[str], env: dict[str, str] | None = None,
          on_parent_death: int = signal.SIGTERM) -> Child:
    """Start a child in its own session that receives `on_parent_death` when the launcher dies."""
    parent = os.getpid()
    proc = subprocess.Popen(argv, env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                            preexec_fn=lambda: die_with_parent(on_parent_death, parent))
    return Child(name, proc)


def stop(children: list[Child], timeout_s: float = 15.0) -> None:
    """SIGTERM, wait, then SIGKILL whatever is left."""
    for c in children:
        if c.alive():
            c.proc.terminate()
    deadline = time.monotonic() + timeout_s
    for c in children:
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0f s; killing it", c.name, timeout_s)
            c.proc.kill()
            c.proc.wait()


def daemon_argv(role: str, store: str, extra: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", f"slidedp.daemons.{role}", "--store", store] + (extra or [])


def start_daemons(store: str, updaters: int, updater_threads: int, timeout_s: float,
                  reserve_cpus: int = 0) -> list[Child]:
    """Start each daemon that no one runs for the store yet (the embedded default), without waiting for them
    to come up (`await_daemons`); return what we started."""
    started: list[Child] = []
    extra = {"updater": ["--processes", str(updaters), "--threads", str(updater_threads),
                         "--reserve-cpus", str(reserve_cpus)],
             "aggregator": ["--timeout", str(timeout_s)]}
    for role in daemonlock.ROLES:
        if daemonlock.held(store, role):
            log.info("attaching to the running slidedp-%s of store %s (pid %d)", role, store,
                     daemonlock.holder_pid(store, role))
        else:  # all missing daemons start at once: their imports overlap
            started.append(spawn(f"slidedp-{role}", daemon_argv(role, store, extra.get(role))))
    return started


def await_daemons(started: list[Child], store: str, timeout_s: float) -> None:
    """Wait until each started daemon serves the store (holds its role's lock); stop them all and raise
    where one exits or is not up within timeout_s."""
    deadline = time.monotonic() + timeout_s
    for child in started:
        role = child.name.removeprefix("slidedp-")
        while not daemonlock.held(store, role):
            if not child.alive():
                stop(started)
                raise RuntimeError(f"could not start {child.name} for store {store}: {child.describe_exit()}")
            if time.monotonic() > deadline:
                stop(started)
                raise RuntimeError(f"{child.name} for store {store} did not come up within {timeout_s:.0f} s")
            time.sleep(0.05)
        log.info("started %s for store %s (pid %d)", child.name, store, child.proc.pid)
