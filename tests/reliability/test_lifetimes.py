"""Process lifetimes and what they leave: updater members die with their pool, a stray member of a dead
pool never takes a new member's place, a member whose pool stopped before it came up leaves quietly,
and no store's run directory stays under the socket root once nothing serves it.

Every wait is bounded by a generous timeout that only limits a failure; nothing here depends on timing.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil

from slidedp import daemonlock
from slidedp.launch import store_cli
from slidedp.paths import resolve_run_dir

from . import PY, unique_store, wait_gone

MEMBER = "slidedp.daemons.updater.member"


def _wait_text(path: Path, pattern: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and re.search(pattern, path.read_text(errors="replace"))):
        assert proc.poll() is None, f"exited ({proc.returncode}) before {pattern!r}:\n{path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {pattern!r} within {timeout:.0f} s:\n{path.read_text()[-3000:]}"
        time.sleep(0.05)


def _pool(store: str, log: Path) -> subprocess.Popen:
    with open(log, "ab") as f:
        return subprocess.Popen([PY, "-m", "slidedp.daemons.updater", "--store", store, "--processes", "1",
                                 "--threads", "1", "--reserve-cpus", "0"], stdin=subprocess.DEVNULL, stdout=f, stderr=f,
                                env=dict(os.environ, SLIDEDP_LOG_LEVEL="INFO", PYTHONUNBUFFERED="1"))


def _members(pool: subprocess.Popen) -> list[psutil.Process]:
    return [c for c in psutil.Process(pool.pid).children() if MEMBER in c.cmdline()]


def _kill(*procs) -> None:
    for p in procs:
        try:
            p.kill()
        except (ProcessLookupError, psutil.Error):
            pass


def test_updater_members_die_with_their_pool(tmp_path):
    store = unique_store("life")
    log = tmp_path / "updater.log"
    first = _pool(store, log)
    member = None
    try:
        _wait_text(log, r"updater 0/1 up", first)
        member = _members(first)[0]
        first.kill()  # kill -9 of the pool's parent
        assert first.wait(30) == -signal.SIGKILL
        assert wait_gone([member.pid], 60) == [], "the updater member outlived its pool (orphaned to PID 1)"
        assert not daemonlock.held(store, "updater")
    finally:
        _kill(*(p for p in (first, member) if p is not None))
        first.wait(30)


def test_a_stray_member_is_ended_by_the_next_pool(tmp_path):
    """A member whose pool is gone but which lives on (here: started by hand, its parent alive) is ended by
    the next pool before it starts its own: it would hold the aggregator's identity u0 and block every job."""
    store = unique_store("life")
    log = tmp_path / "updater.log"
    stray = second = None
    try:
        with open(tmp_path / "stray.log", "ab") as f:
            stray = subprocess.Popen([PY, "-m", MEMBER, "--store", store, "--member", "0", "--pool", "1", "--threads", "1"],
                                     stdin=subprocess.DEVNULL, stdout=f, stderr=f,
                                     env=dict(os.environ, SLIDEDP_LOG_LEVEL="INFO"))
        _wait_text(tmp_path / "stray.log", r"updater 0/1 up", stray)
        second = _pool(store, log)
        _wait_text(log, rf"ending a stray updater member of store {store} \(pid {stray.pid}, parent {os.getpid()}\)",
                   second)
        assert stray.wait(60) == -signal.SIGKILL
        _wait_text(log, r"ending a stray[\s\S]*updater 0/1 up", second)  # then its own member came up
        assert [m.pid for m in _members(second)] and second.poll() is None
    finally:
        _kill(*(p for p in (stray, second) if p is not None))
        for p in (stray, second):
            if p is not None:
                p.wait(30)


def test_a_member_whose_pool_stopped_before_it_came_up_leaves_quietly(tmp_path):
    """The pool parent of a refused job is stopped while its members still import torch: a member that then
    finds the readiness pipe closed exits at once, with no BrokenPipeError traceback after the real error."""
    read, write = os.pipe()
    os.close(read)  # the pool is gone
    try:
        out = subprocess.run([PY, "-m", MEMBER, "--store", unique_store("life"), "--member", "0", "--pool", "1",
                              "--threads", "1", "--ready-fd", str(write)], pass_fds=(write,), capture_output=True,
                             text=True, timeout=120, env=dict(os.environ, SLIDEDP_LOG_LEVEL="INFO"))
    finally:
        os.close(write)
    assert "Traceback" not in out.stderr and "BrokenPipeError" not in out.stderr, out.stderr
    assert out.returncode == 0, out.stderr


def test_no_run_directory_is_left_after_destroy_or_a_failed_create(capsys):
    store = unique_store("life")
    where = resolve_run_dir(store).path
    assert store_cli.main(["create", store, "--model", "/nonexistent/model"]) == 1
    assert "/nonexistent/model" in capsys.readouterr().err
    assert not where.exists(), f"a failed create left {sorted(p.name for p in where.iterdir())} in {where}"
    assert store_cli.main(["create", store, "--model", "random:tiny"]) == 0
    assert not where.exists()  # served in this process: nothing runs for the store now
    assert store_cli.main(["destroy", store]) == 0
    assert not where.exists(), f"destroy left {sorted(p.name for p in where.iterdir())} in {where}"


def test_status_of_a_store_that_does_not_exist_fails(capsys):
    store = unique_store("life")
    assert store_cli.main(["status", store]) == 1
    captured = capsys.readouterr()
    assert f"slidedp-store: error: store {store!r} does not exist" in captured.err, captured
    assert store_cli.main(["status", store, "--json"]) == 1
    assert not resolve_run_dir(store).path.exists()
