"""Running a child in its own process group with its output teed to a log (and stderr), under a
time limit: the harness runs each system so, and SlideDP's peer runs the launcher so. No torch here."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path


def run_teed(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float, log_path: Path,
             tail: collections.deque[str], prefix: str = "", echo: bool = True,
             grace_s: float = 30.0) -> tuple[int, bool]:
    """Run cmd; each output line goes to log_path, to `tail` (the last lines kept) and, with echo, to
    stderr after `prefix`. Past `timeout` the process group is stopped (SIGTERM, SIGKILL after grace_s).
    Returns (exit code, whether the time ran out)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    timed_out = threading.Event()

    def on_timeout() -> None:
        timed_out.set()
        stop_group(proc, grace_s)

    timer = threading.Timer(timeout, on_timeout)
    timer.start()
    try:
        with open(log_path, "w") as log:
            for line in proc.stdout:  # type: ignore[union-attr]
                log.write(line)
                log.flush()
                tail.append(line)
                if echo:
                    sys.stderr.write(prefix + line)
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:  # we are being stopped ourselves: leave no orphan on the GPU
            stop_group(proc, grace_s)
    return rc, timed_out.is_set()


def stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the child's process group (a launcher stops its daemons and workers on it), SIGKILL
    after grace_s."""
    for sig, grace in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue
