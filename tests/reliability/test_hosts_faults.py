"""A host that dies or fails, on a job of several hosts (docs/multi-host.md, Faults): two "hosts" on one machine
(own stores, daemons, launchers; Gloo over loopback), as tests/pipeline/test_hosts.py runs them.

Host 1's ranks hold at the start of step 1 (slidedp/faults.py), so the fault comes at the same point whatever
the machine's speed: host 0's ranks then wait in a collective for host 1's. Killed there:

- host 1's launcher (kill -9; its workers go with it): host 0's launcher fails naming host 1, whose heartbeat
  stopped (its own ranks' collectives fail as well, but the message names the host, not them); host 0's
  launcher, which serves the launchers' TCPStore: host 1 names host 0 when the store breaks off;
- host 1's updater (kill -9): host 1's launcher names its updater and host 0's names host 1 and why.

And a host that stalls with its launcher alive: host 1's rank holds before a layer's backward in step 1,
outside any collective, and is left there. Host 0's ranks wait in the all-gather or reduce-scatter host 1's
never enter; host 0's launcher names host 1 as stalled (from the ranks' progress, launch/host_progress.py),
not its own ranks' timed-out collective, and host 1's launcher names its own stalled rank.

runtime.timeout_s (15 s) only bounds the detection; nothing here measures how long it took. Each host's
store is left torn or at a committed step, and no process is left behind. The launchers talk only through
torch.distributed's TCPStore at the master port (the ranks through its process group at the next one).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import psutil
import pytest

from data.common import write_model_folder
from pipeline.test_hosts import free_ports, host_sets

from . import TINY, RunningJob, drop_store, manifest_state, unique_store, wait_gone, wait_marker

TIMEOUT = "runtime.timeout_s=15"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_model_folder(tmp_path_factory.mktemp("model") / "qwen3", "qwen3", tied=False, seed=2)


def start_hosts(tmp: Path, folder: Path, hosts: int, hold: dict[int, Path] | None = None, point: str = "step"
                ) -> tuple[list[RunningJob], list[str], list[Path]]:
    """`hosts` launchers of one job; hold: node rank -> a marker at which that host's ranks hold in step 1, at
    the fault point `point` (slidedp/faults.py)."""
    port = free_ports()
    runs, stores, dirs = [], [], []
    for r in range(hosts):
        store, run_dir = unique_store(f"hf{r}"), tmp / f"host{r}"
        env = {"SLIDEDP_HOLD_AT": f"{point}@1:{hold[r]}"} if hold and r in hold else None
        extra = ("--nnodes", "2", "--node-rank", str(r), "--master-addr", "127.0.0.1", "--master-port", str(port))
        runs.append(RunningJob.start(TINY, host_sets(folder, 1, 2, store, run_dir, tmp / "checkpoints", "checkpoint.every=0",
                                                       "checkpoint.final=false") + [TIMEOUT], tmp, store,
                                     extra=extra, env=env))
        stores.append(store)
        dirs.append(run_dir)
    return runs, stores, dirs


def failure(run: RunningJob) -> str:
    m = run.wait_for(r"ERROR \[launcher\] job failed: (.*)", 120)
    print(f"\n{run.store}: {m.group(1)}")  # with -s: what each host said
    return m.group(1)


def check_stores(stores: list[str]) -> None:
    """Each host's store is at a committed step (every chunk at it) or torn with a reason: never mixed."""
    for s in stores:
        committed, versions, torn = manifest_state(s)
        if torn is None:
            assert versions == [committed] * len(versions), (s, committed, versions)


def finish(runs: list[RunningJob], stores: list[str], markers: list[Path]) -> None:
    """No process of any host left running; then the stores are dropped."""
    for m in markers:
        m.unlink(missing_ok=True)
    pids = [p for run in runs for p in run.seen_pids]
    left = wait_gone(pids, 30)
    for run in runs:
        run.cleanup()
    assert left == [], f"processes left: {left}\n" + "\n----\n".join(r.output[-3000:] for r in runs)
    for s in stores:
        drop_store(s)


def both_failed_and_left_nothing(runs, stores, marker) -> None:
    """Both launchers exit with status 1 once the held rank is let go, no process of either is left, and every
    store is torn or at a committed step."""
    for run in runs:
        assert run.wait_exit(120) == 1, run.output[-4000:]
    marker.unlink(missing_ok=True)
    pids = [p for run in runs for p in run.seen_pids]
    assert wait_gone(pids, 30) == [], [psutil.Process(p).cmdline() for p in pids if psutil.pid_exists(p)]
    check_stores(stores)


# under -m slow: the suite's time (25 s each); a killed updater is named across hosts by default
@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_launcher_is_named_by_the_other_host(tmp_path, folder, victim):
    """Host 1's launcher; or host 0's, which serves the launchers' store: host 1 names it when the store breaks."""
    marker, survivor = tmp_path / "held", 1 - victim
    runs, stores, _ = start_hosts(tmp_path, folder, 2, hold={victim: marker})
    try:
        wait_marker(runs[victim], marker)  # the victim's rank is at step 1; the other's waits for it in a collective
        for run in runs:
            run.note_pids()
        runs[victim].proc.kill()
        assert runs[victim].wait_exit(60) == -9
        text = failure(runs[survivor])
        assert text.startswith(f"host {victim} (node rank {victim}) "), runs[survivor].output[-4000:]
        assert runs[survivor].wait_exit(120) == 1, runs[survivor].output[-4000:]
        marker.unlink(missing_ok=True)
        pids = [p for run in runs for p in run.seen_pids]
        assert wait_gone(pids, 30) == [], runs[survivor].output[-4000:]
        check_stores(stores)
    finally:
        finish(runs, stores, [marker])


def test_a_killed_updater_is_named_by_its_host_and_its_host_by_the_other(tmp_path, folder):
    marker = tmp_path / "held"
    runs, stores, _ = start_hosts(tmp_path, folder, 2, hold={1: marker})
    try:
        wait_marker(runs[1], marker)
        updater = runs[1].find("updater")
        for run in runs:
            run.note_pids()
        updater.kill()
        own = failure(runs[1])
        want = rf"slidedp-updater \(pid {updater.pid}\) was killed by signal SIGKILL"
        assert re.match(want, own), runs[1].output[-4000:]
        other = failure(runs[0])
        assert re.match(r"host 1 \(node rank 1\) failed: " + want, other), runs[0].output[-4000:]
        both_failed_and_left_nothing(runs, stores, marker)
    finally:
        finish(runs, stores, [marker])


@pytest.mark.slow
def test_a_host_that_never_joins_is_named(tmp_path, folder):
    """Host 1 is never started: host 0 names it once runtime.timeout_s has passed, and starts no worker."""
    runs, stores, _ = start_hosts(tmp_path, folder, 1)
    try:
        text = failure(runs[0])
        assert text.startswith("host 1 (node rank 1) did not join within"), runs[0].output[-4000:]
        assert runs[0].wait_exit(60) == 1
        assert "worker" not in runs[0].processes()
        check_stores(stores)
    finally:
        finish(runs, stores, [])


@pytest.mark.slow  # 30 s: the default suite names a stall over a real TCPStore (test_host_link.py)
def test_a_host_whose_ranks_stall_is_named_by_the_other_and_names_its_own_ranks(tmp_path, folder):
    """Host 1's rank hangs in compute (held before a layer's backward in step 1, never let go): nobody's
    launcher dies and host 1's heartbeat beats on. Host 0 names host 1 as stalled (its own rank's collective
    timing out comes after it, if at all), and host 1 names its own rank, not host 0 which waited for it."""
    marker = tmp_path / "held"
    runs, stores, _ = start_hosts(tmp_path, folder, 2, hold={1: marker}, point="backward")
    try:
        held = wait_marker(runs[1], marker)
        t0 = time.monotonic()
        for run in runs:
            run.note_pids()
        other = failure(runs[0])
        named = time.monotonic() - t0
        assert re.match(r"host 1 \(node rank 1\) stalled: its (ranks|worker rank 0 \(pid \d+\)) (have|has) not entered "
                        r"collective \d+ \(step 1\), which the ranks of host 0 \(node rank 0\) have waited in for \d+ s",
                        other), runs[0].output[-4000:]
        own = failure(runs[1])
        assert re.match(rf"this host's ranks stalled: worker rank 0 \(pid {held['pid']}\) has not entered collective "
                        r"\d+ \(step 1\), which the ranks of host 0 \(node rank 0\) have waited in for \d+ s$",
                        own), runs[1].output[-4000:]
        print(f"host 0 named host 1 {named:.1f} s after host 1's rank held (runtime.timeout_s = 15)")
        both_failed_and_left_nothing(runs, stores, marker)
    finally:
        finish(runs, stores, [marker])
