"""Helpers for the store tests: real daemons in subprocesses, /dev/shm listings, bounded waits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch

from slidedp.store.shm import PREFIX, SHM_DIR, unlink_store

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 60.0  # bound on every wait for a process (a loaded 2-core CI box starts python + torch in seconds)


def unique_store(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def shm_entries(store: str) -> list[str]:
    """The store's files in /dev/shm, read from the directory itself (not through the code under test)."""
    return sorted(e for e in os.listdir(SHM_DIR) if e.startswith(f"{PREFIX}{store}."))


def bits(t: torch.Tensor) -> torch.Tensor:
    """A float32 tensor's bit pattern (bit-exact comparison: NaN payloads and -0.0 included)."""
    return t.detach().contiguous().view(torch.int32).clone()


def cleanup_store(store: str) -> None:
    unlink_store(store)
    assert shm_entries(store) == [], f"segments of {store} left behind"


class Daemon:
    """`python -m slidedp.daemons.hoststate --store NAME` as a real process, its stderr in a file."""

    def __init__(self, store: str, log: Path) -> None:
        self.store, self.log = store, log
        env = dict(os.environ, SLIDEDP_LOG_LEVEL="INFO", PYTHONUNBUFFERED="1")
        with open(log, "ab") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "slidedp.daemons.hoststate", "--store", store],
                                         cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def text(self) -> str:
        return self.log.read_text()

    def wait_serving(self) -> None:
        """Until its log says it serves (it binds its socket first); a daemon that dies instead fails the test."""
        want = f"serving store {self.store} (pid {self.pid})"
        deadline = time.monotonic() + WAIT_S
        while want not in self.text():
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"daemon not serving after {WAIT_S} s:\n{self.text()}")
            time.sleep(0.05)

    def kill9(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        assert self.proc.wait(timeout=WAIT_S) == -signal.SIGKILL

    def stop(self) -> int:
        """SIGTERM and wait; SIGKILL if it does not go (never leaves a process behind)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=WAIT_S)
        return self.proc.returncode
