"""Helpers for the reliability tests: a launcher running in the background, its processes, the store it left.

Every wait here is bounded; `RunningJob.cleanup` kills (by pid) whatever the job left running
and `drop_store` removes its segments, so a failing test leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from slidedp import daemonlock
from slidedp.store.shm import list_store_segments, unlink_store

from pipeline.harness import TINY, unique_store  # noqa: F401 (re-exported)

PY = sys.executable

# Which process a command line belongs to (module after `-m`).
KINDS = {
    "slidedp.worker": "worker",
    "slidedp.daemons.hoststate": "hoststate",
    "slidedp.daemons.aggregator": "aggregator",
    "slidedp.daemons.updater": "updater",
    "slidedp.daemons.updater.member": "updater_member",
}


def kind_of(proc: psutil.Process) -> str | None:
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return None
    if "-m" in cmd:
        i = cmd.index("-m")
        if i + 1 < len(cmd):
            return KINDS.get(cmd[i + 1])
    return None


def fast_sets(store: str, run_dir: Path, *more: str) -> list[str]:
    """The tiny CPU job, fp32, a persistent store, short timeouts (so a hang shows up as a bounded failure)."""
    return [f'store.name="{store}"', "store.persist=true", f'run.dir="{run_dir}"', 'plan.compute_dtype="fp32"',
            'checkpoint.dtype="fp32"', "runtime.timeout_s=20", *more]


@dataclass
class RunningJob:
    """slidedp-launch in the background; stdout and stderr merged into `lines` by a reader thread."""

    proc: subprocess.Popen
    store: str
    lines: list[str] = field(default_factory=list)
    seen: dict[int, float] = field(default_factory=dict)  # pid -> create time of every descendant seen
    reader: threading.Thread | None = None

    @classmethod
    def start(cls, job: Path, sets: list[str], cwd: Path, store: str, extra: tuple[str, ...] = (),
              env: dict[str, str] | None = None, umask: int | None = None) -> "RunningJob":
        argv = [PY, "-m", "slidedp.launch.cli", str(job), *extra]
        for s in sets:
            argv += ["--set", s]
        env = dict(os.environ, PYTHONUNBUFFERED="1", SLIDEDP_LOG_LEVEL="INFO", **(env or {}))
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                stdin=subprocess.DEVNULL, umask=-1 if umask is None else umask)
        run = cls(proc, store)
        run.reader = threading.Thread(target=run._read, daemon=True)
        run.reader.start()
        return run

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 120.0) -> re.Match:
        """The first output line matching `pattern`; fails if the launcher exits or the time runs out first."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            while seen < len(self.lines):
                m = rx.search(self.lines[seen])
                seen += 1
                if m:
                    self.note_pids()
                    return m
            if self.proc.poll() is not None and seen >= len(self.lines):
                time.sleep(0.2)  # the reader may still be flushing
                if seen >= len(self.lines):
                    raise AssertionError(f"launcher exited ({self.proc.returncode}) before {pattern!r}:\n{self.output[-6000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} within {timeout:.0f} s:\n{self.output[-6000:]}")
            self.note_pids()
            time.sleep(0.02)

    def wait_step(self, n: int, run_dir: Path, timeout: float = 120.0) -> None:
        """Until run_dir/metrics.jsonl holds n lines (n steps committed and reported by the launcher)."""
        path = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + timeout
        while not (path.exists() and path.read_text().count("\n") >= n):
            if self.proc.poll() is not None:
                raise AssertionError(f"launcher exited ({self.proc.returncode}) before step {n}:\n{self.output[-6000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"step {n} not reached within {timeout:.0f} s:\n{self.output[-6000:]}")
            self.note_pids()
            time.sleep(0.01)

    def wait_exit(self, timeout: float = 120.0) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"launcher still running after {timeout:.0f} s:\n{self.output[-6000:]}") from None
        if self.reader is not None:
            self.reader.join(10)  # the rest of the output
        return rc

    # ---- the job's processes ----------------------------------------------------------------
    def processes(self) -> dict[str, list[psutil.Process]]:
        """The launcher's descendants by kind (worker, hoststate, aggregator, updater, updater_member)."""
        out: dict[str, list[psutil.Process]] = {}
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return out
        for p in kids:
            k = kind_of(p)
            if k:
                out.setdefault(k, []).append(p)
        return out

    @property
    def seen_pids(self) -> list[int]:
        return sorted(self.seen)

    def note_pids(self) -> None:
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                try:
                    self.seen.setdefault(p.pid, p.create_time())
                except psutil.Error:
                    pass
        except psutil.Error:
            pass

    def find(self, kind: str, timeout: float = 60.0) -> psutil.Process:
        """One live process of `kind` (rank 0's worker for "worker"), waiting for it to appear."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            procs = self.processes().get(kind, [])
            procs = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            if procs:
                procs.sort(key=lambda p: p.cmdline())
                self.note_pids()
                return procs[0]
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no {kind} process under the launcher:\n{self.output[-4000:]}")

    def cleanup(self) -> list[int]:
        """Kill (by pid) the launcher and every process it ever had; returns the pids that were still alive."""
        self.note_pids()
        left = []
        if self.proc.poll() is None:
            left.append(self.proc.pid)
            self.proc.kill()
        for pid, created in sorted(self.seen.items()):
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:  # not a reused pid
                    left.append(pid)
                    p.kill()
            except psutil.Error:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        return left


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Pids still alive (not zombies) after waiting up to `timeout` for them to exit."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        if alive:
            time.sleep(0.05)
    return alive


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def daemon_pids(store: str) -> dict[str, int]:
    """Pids of the store's live daemons, from their lock files."""
    return {r: daemonlock.holder_pid(store, r) for r in daemonlock.ROLES if daemonlock.held(store, r)}


def start_daemons(store: str, log_dir: Path | None = None, timeout: float = 60.0, updaters: int = 1) -> list[subprocess.Popen]:
    """The three daemons started by the test (not by a launcher), as systemd would; waits until each holds its lock.

    Their logs go to log_dir/<role>.log (or nowhere)."""
    argv = {
        "hoststate": [PY, "-m", "slidedp.daemons.hoststate", "--store", store],
        "aggregator": [PY, "-m", "slidedp.daemons.aggregator", "--store", store, "--timeout", "30"],
        "updater": [PY, "-m", "slidedp.daemons.updater", "--store", store, "--processes", str(updaters)],
    }
    env = dict(os.environ, SLIDEDP_LOG_LEVEL="INFO", PYTHONUNBUFFERED="1")
    procs = []
    for role, a in argv.items():
        err = open(log_dir / f"{role}.log", "ab") if log_dir is not None else subprocess.DEVNULL
        procs.append(subprocess.Popen(a, stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=env))
        if log_dir is not None:
            err.close()
    deadline = time.monotonic() + timeout
    for role, p in zip(argv, procs):
        while not daemonlock.held(store, role):
            if p.poll() is not None or time.monotonic() > deadline:
                stop_daemons(procs)
                raise AssertionError(f"slidedp-{role} did not start (exit status {p.poll()})")
            time.sleep(0.05)
    return procs


def stop_daemons(procs: list[subprocess.Popen], timeout: float = 15.0) -> None:
    """SIGTERM the test's daemons (and the updater pool's members), then SIGKILL what is left."""
    members = []
    for p in procs:
        try:
            members += [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
        except psutil.Error:
            pass
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
    for pid in wait_gone(members, 5):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def drop_store(store: str) -> None:
    """Remove the store's segments (test cleanup; no daemon may be running for it)."""
    unlink_store(store)
    assert not list_store_segments().get(store)


def manifest_state(store: str) -> tuple[int, list[int], str | None]:
    """(committed step, chunk versions, torn reason) of a store, read straight from its manifest."""
    from slidedp.store.store import HostStore

    st = HostStore.attach(store)
    try:
        m = st.manifest
        return m.committed_step, m.versions.tolist(), m.torn_reason()
    finally:
        st.close()


def run_uninterrupted(tmp: Path, store: str, sets: list[str], timeout: float) -> None:
    """A job run to its end, nothing killed: the truth a crash or resume test compares against.
    Its store is dropped afterwards; what it wrote stays under its run dir."""
    run = RunningJob.start(TINY, sets, tmp, store)
    try:
        assert run.wait_exit(timeout) == 0, run.output[-4000:]
    finally:
        run.cleanup()
        drop_store(store)


def wait_marker(run: RunningJob, marker: Path, timeout: float = 120.0) -> dict:
    """What the process held at a fault point wrote (slidedp/faults.py), once it is there (the timeout
    only bounds a hang: whenever the point is reached, the wait ends)."""
    deadline = time.monotonic() + timeout
    while not marker.exists():
        assert run.proc.poll() is None, f"launcher exited before the hold:\n{run.output[-4000:]}"
        assert time.monotonic() < deadline, f"nothing reached the hold point:\n{run.output[-4000:]}"
        run.note_pids()
        time.sleep(0.02)
    run.note_pids()
    return json.loads(marker.read_text())
