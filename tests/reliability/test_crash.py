"""kill -9 each kind of process at a random point of a step of a running job.

The rest must notice within a bounded time, the launcher must exit non-zero naming the dead
process and its exit status, nothing may be left running, and the store must be either at a
committed step (every chunk at that version, and, in the slow trials, bit-identical to an
uninterrupted run at that step) or torn with a reason -- never mixed silently. A torn store
refuses the next job until a checkpoint is restored.

Default suite: one kill per process kind. `-m slow`: TRIALS randomized kills per kind; the
summary (committed vs torn, slowest detection) is printed (run with -s to see it).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch

from slidedp.store import checkpoint as ckpt
from slidedp.store.client import StoreRequestError, call
from slidedp.store.manifest import UPDATING
from slidedp.store.store import HostStore

from . import (PY, TINY, RunningJob, daemon_pids, drop_store, fast_sets, manifest_state, run_uninterrupted,
               start_daemons, stop_daemons, unique_store, wait_gone)
from pipeline.harness import checkpoint_weights

KINDS = ("worker", "aggregator", "updater_member", "hoststate", "launcher")
STEPS = 40  # the schedule (cosine over train.steps) must be the same in every trial and the reference
TRIALS = int(os.environ.get("SLIDEDP_CRASH_TRIALS", "20"))


@dataclass
class Outcome:
    kind: str
    at_step: int  # steps committed when the victim was chosen
    detect_s: float  # kill -> the launcher's "job failed" line (launcher kind: -> every child gone)
    exit_s: float  # kill -> the launcher exited (launcher kind: 0)
    committed: int
    torn: str | None


def _expected_message(kind: str, victim: psutil.Process) -> str:
    if kind == "worker":
        return rf"worker rank \d+ \(pid {victim.pid}\) was killed by signal SIGKILL"
    if kind == "updater_member":  # the pool stops with its member; the launcher names both, and how the member died
        index = re.search(r"--member (\d+)", " ".join(victim.cmdline())).group(1)
        return (rf"slidedp-updater \(pid {victim.ppid()}\) exited with code 1: updater member {index} "
                rf"\(pid {victim.pid}\) was killed by signal SIGKILL")
    return rf"slidedp-{kind} \(pid {victim.pid}\) was killed by signal SIGKILL"


def crash_trial(kind: str, tmp: Path, rng: random.Random, store: str, at: int | None = None,
                extra: tuple[str, ...] = ()) -> Outcome:
    """One job of STEPS steps, checkpoint every 2; kill -9 a process of `kind` after `at` (default: 2..8,
    random) committed steps plus a random fraction of a step."""
    run_dir = tmp / f"run-{store}"
    run = RunningJob.start(TINY, fast_sets(store, run_dir, f"train.steps={STEPS}", "checkpoint.every=2", *extra),
                           tmp, store)
    try:
        at = rng.randint(2, 8) if at is None else at  # >= 2: a checkpoint exists to restore a torn store from
        run.wait_step(at, run_dir)
        victim = psutil.Process(run.proc.pid) if kind == "launcher" else run.find(kind)
        want = None if kind == "launcher" else _expected_message(kind, victim)
        member_index = None
        if kind == "updater_member":
            member_index = re.search(r"--member (\d+)", " ".join(victim.cmdline())).group(1)
        run.note_pids()
        family = run.seen_pids
        time.sleep(rng.uniform(0.0, 0.25))  # a step takes ~0.05-0.3 s here: anywhere in the next step or two
        t0 = time.monotonic()
        victim.kill()
        if kind == "launcher":
            assert run.wait_exit(30) == -9
            left = wait_gone(family, 30)  # PR_SET_PDEATHSIG: workers SIGKILL, daemons SIGTERM
            assert left == [], f"children of a killed launcher still running: {left}\n{run.output[-4000:]}"
            detect, exit_s = time.monotonic() - t0, 0.0
        else:
            m = run.wait_for(r"ERROR \[launcher\] job failed: (.*)", 60)
            detect = time.monotonic() - t0
            assert re.search(want, m.group(1)), (want, m.group(1), run.output[-4000:])
            rc = run.wait_exit(60)
            exit_s = time.monotonic() - t0
            assert rc == 1, run.output[-4000:]
            if member_index is not None:
                assert f"updater member {member_index} (pid {victim.pid}) was killed by signal SIGKILL" in run.output
            left = wait_gone(family, 30)
            assert left == [], f"processes left after the launcher exited: {left}\n{run.output[-4000:]}"
        committed, versions, torn = manifest_state(store)
        if torn is None:
            assert versions == [committed] * len(versions), (versions, committed)
        return Outcome(kind, at, detect, exit_s, committed, torn)
    finally:
        run.cleanup()


def check_refused_then_restore(store: str, run_dir: Path) -> int:
    """A torn store refuses a job (attach) until a checkpoint is restored; returns the step restored."""
    with pytest.raises(StoreRequestError) as e:
        call(store, "attach", job="next", pid=os.getpid(), layout_hash="", world=2, grad_slots=3)
    assert re.search(r"is torn \(.+\); restore a checkpoint first", str(e.value)), str(e.value)
    latest = ckpt.latest_valid(run_dir / "checkpoints")
    assert latest is not None
    out = call(store, "restore", path=str(latest))
    committed, versions, torn = manifest_state(store)
    assert torn is None and committed == out["step"] and versions == [committed] * len(versions)
    return committed


def assert_store_matches(store: str, ref_dir: Path, step: int) -> None:
    """The store's master and moments are bit-identical to the uninterrupted run's checkpoint of `step`."""
    path = ref_dir / "checkpoints" / f"step-{step:08d}"
    weights = checkpoint_weights(path)
    moments = _state_tensors(path)  # exp_avg.<name>, exp_avg_sq.<name>
    st = HostStore.attach(store)
    try:
        for name, want in weights.items():
            assert torch.equal(st.tensor("master", name), want), f"master {name} differs from the run at step {step}"
        for key, want in moments.items():
            kind, _, name = key.partition(".")
            assert torch.equal(st.tensor(kind, name), want), f"{key} differs from the run at step {step}"
    finally:
        st.close()


def _state_tensors(path: Path) -> dict[str, torch.Tensor]:
    from slidedp.model import hf

    folder = path / "state"
    return {n: hf.load_tensor(folder, n) for n in hf.tensor_index(folder)}


# ---- the default suite: one kill per kind ---------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_kill_one_process(tmp_path, kind):
    store = unique_store(f"crash-{kind[:4]}")
    try:
        out = crash_trial(kind, tmp_path, random.Random(KINDS.index(kind)), store, at=2)
        if out.torn is not None:
            check_refused_then_restore(store, tmp_path / f"run-{store}")
    finally:
        drop_store(store)


def test_kill_a_worker_whose_peer_waits_in_a_collective(tmp_path):
    """Sharded routes: the surviving rank is inside an all-gather or reduce-scatter with the dead one;
    the launcher still names the dead worker, stops the job and leaves nothing running."""
    store = unique_store("crash-shard")
    try:
        out = crash_trial("worker", tmp_path, random.Random(7), store, at=2,
                          extra=('plan.param_route="sharded"', 'plan.grad_route="reduce_scatter"'))
        if out.torn is not None:
            check_refused_then_restore(store, tmp_path / f"run-{store}")
    finally:
        drop_store(store)


def test_kill_a_worker_holding_layers_leaves_the_store_torn_naming_them(tmp_path):
    """plan.device_layers: the first layer lives on the workers for the job; a dead worker takes its
    current state with it, so the store says which chunk was held and not written back (never stale
    weights passing for current ones) and refuses jobs until a checkpoint is restored."""
    store = unique_store("crash-held")
    try:
        out = crash_trial("worker", tmp_path, random.Random(11), store, at=2, extra=("plan.device_layers=1",))
        layer0 = HostStore.attach(store)
        try:
            chunk = layer0.layout.layer_chunk(0).id
        finally:
            layer0.close()
        # named whatever else the kill left (a speculative update not yet validated, where it came mid-step)
        assert out.torn is not None and re.search(rf"(^|; )chunk\(s\) \[{chunk}\] are held on a job's GPUs",
                                                  out.torn), out.torn
        assert check_refused_then_restore(store, tmp_path / f"run-{store}") >= 2
    finally:
        drop_store(store)


def test_torn_store_refuses_a_job_until_restored(tmp_path):
    """A store torn mid-update: slidedp-launch refuses it naming the fix; `slidedp-store restore` fixes it."""
    store = unique_store("torn")
    run_dir = tmp_path / "run"
    try:
        call(store, "create", source="random", shape="tiny", vocab_size=512, init_seed=0)
        ck = call(store, "checkpoint", dir=str(run_dir / "checkpoints"), dtype="fp32", keep=3)["path"]
        st = HostStore.attach(store)
        st.manifest.updating[1] = UPDATING  # as an updater killed inside chunk 1's AdamW leaves it
        st.close()
        job = RunningJob.start(TINY, fast_sets(store, run_dir, "train.steps=6"), tmp_path, store)
        try:
            assert job.wait_exit(120) == 1
        finally:
            job.cleanup()
        assert (f"store {store!r} is torn (chunk(s) [1] were being updated when their writer stopped); restore a "
                f"checkpoint first (`slidedp-store restore {store} CHECKPOINT`") in job.output, job.output[-3000:]
        assert manifest_state(store)[2] is not None  # still torn: the refusal changed nothing
        restore = subprocess.run([PY, "-m", "slidedp.launch.store_cli", "restore", store, ck],
                                 capture_output=True, text=True, timeout=120)
        assert restore.returncode == 0, restore.stderr
        assert f"store {store} restored to step 0" in restore.stdout
        assert manifest_state(store) == (0, [0, 0, 0, 0], None)
    finally:
        drop_store(store)


# ---- -m slow: randomized trials --------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The uninterrupted run, with a checkpoint after every step (the truth for every committed step)."""
    tmp = tmp_path_factory.mktemp("crash-ref")
    store = unique_store("crash-ref")
    run_uninterrupted(tmp, store, fast_sets(store, tmp / "run", f"train.steps={STEPS}", "checkpoint.every=1",
                                            f"checkpoint.keep={STEPS + 1}"), 600)
    return tmp / "run"


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_kill_randomized(tmp_path, kind, reference_run):
    seed = int(os.environ.get("SLIDEDP_CRASH_SEED", str(random.randrange(1 << 30))))
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    for i in range(TRIALS):
        store = unique_store(f"crash-{kind[:4]}")
        try:
            out = crash_trial(kind, tmp_path, rng, store)
            outcomes.append(out)
            if out.torn is None:
                assert_store_matches(store, reference_run, out.committed)
            else:
                step = check_refused_then_restore(store, tmp_path / f"run-{store}")
                assert_store_matches(store, reference_run, step)
        finally:
            drop_store(store)
    torn = [o for o in outcomes if o.torn]
    summary = {
        "kind": kind, "seed": seed, "trials": len(outcomes), "committed": len(outcomes) - len(torn), "torn": len(torn),
        "max_detect_s": round(max(o.detect_s for o in outcomes), 3),
        "mean_detect_s": round(sum(o.detect_s for o in outcomes) / len(outcomes), 3),
        "max_exit_s": round(max(o.exit_s for o in outcomes), 3),
        "torn_reasons": sorted({re.sub(r"\d+", "N", o.torn) for o in torn}),
    }
    print("\ncrash summary " + json.dumps(summary))
    report = os.environ.get("SLIDEDP_CRASH_REPORT")
    if report:
        with open(report, "a") as f:
            f.write(json.dumps(summary) + "\n")


@pytest.mark.slow
def test_launcher_killed_beside_daemons_it_did_not_start(tmp_path):
    """Daemons someone else started (systemd; here the test) outlive a killed launcher. Its workers go with it
    (PR_SET_PDEATHSIG); the host-state daemon releases the dead job's attachment the next time it is asked;
    the aggregator and updaters keep the dead job's state until the next JobStart resets it; the next job resumes."""
    store = unique_store("ext")
    procs = start_daemons(store, tmp_path)
    run_dir = tmp_path / "run"
    try:
        pids = daemon_pids(store)
        run = RunningJob.start(TINY, fast_sets(store, run_dir, f"train.steps={STEPS}", "checkpoint.every=2"),
                               tmp_path, store)
        try:
            run.wait_step(3, run_dir)
            assert sorted(run.processes()) == ["worker"]  # the daemons are not its children
            workers = [p.pid for p in run.processes()["worker"]]
            run.proc.kill()
            assert run.wait_exit(30) == -9
            assert wait_gone(workers, 30) == []
        finally:
            run.cleanup()
        assert daemon_pids(store) == pids and all(p.poll() is None for p in procs)
        st = call(store, "status", timeout_s=30)
        assert st["attached_pid"] == 0
        assert f"job of pid {run.proc.pid} is gone without detaching; releasing it" in (tmp_path / "hoststate.log").read_text()
        nxt = RunningJob.start(TINY, fast_sets(store, run_dir, f"train.steps={STEPS}", "checkpoint.every=2",
                                               'checkpoint.resume="latest"'), tmp_path, store)
        try:
            assert nxt.wait_exit(240) == 0, nxt.output[-4000:]
        finally:
            nxt.cleanup()
        assert re.search(r"resumed from .*/step-\d{8} \(step \d+\)", nxt.output)
        assert manifest_state(store) == (STEPS, [STEPS] * 4, None)
    finally:
        stop_daemons(procs)
        drop_store(store)
