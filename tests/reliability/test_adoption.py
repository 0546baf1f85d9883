"""What a job adopts, restores or writes over: never a store a dead job left behind, never a resume
checkpoint unverified, never another run's run directory.

The daemons here are started by the test (as systemd would), for one store that each test sets up
as the case needs (a store at step 1, its checkpoint, a run directory). Every job trains nothing
(train.steps = the store's step), so each one costs the launcher's start-up only.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from slidedp.config import load_job
from slidedp.launch import dryrun
from slidedp.launch.jobrun import run_job
from slidedp.launch.progress import Progress
from slidedp.model import hf
from slidedp.store.client import call
from slidedp.store.store import HostStore

from . import PY, TINY, drop_store, fast_sets, start_daemons, stop_daemons, unique_store


@pytest.fixture(scope="module")
def store():
    name = unique_store("adopt")
    procs = start_daemons(name)
    try:
        yield name
    finally:
        stop_daemons(procs)
        drop_store(name)


def fresh(store: str, step: int = 1, seed: int = 0, **create) -> dict:
    """The store made anew (random tiny model, `seed`) and moved to a clean committed `step`; its status."""
    if call(store, "status", timeout_s=60)["exists"]:
        call(store, "destroy", timeout_s=60, force=True)
    call(store, "create", timeout_s=120, source="random", shape="tiny", vocab_size=512, init_seed=seed, **create)
    st = HostStore.attach(store)
    try:  # as if `step` steps had been trained: every chunk at that version, no update in flight
        st.manifest.versions[:] = step
        st.manifest.adam_steps[:] = step
        st.manifest.set_committed_step(step)
    finally:
        st.close()
    return call(store, "status", timeout_s=60)


def checkpoint(store: str, root: Path) -> Path:
    return Path(call(store, "checkpoint", timeout_s=120, dir=str(root), dtype="fp32", keep=5)["path"])


def launch(store: str, run_dir: Path, caplog, *sets: str) -> tuple[int, str]:
    """run_job in this process with train.steps = 1 (the store is at step 1: nothing to train)."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    caplog.clear()
    try:
        with caplog.at_level(logging.INFO, logger="slidedp.launcher"):
            job = load_job(TINY, fast_sets(store, run_dir, "train.steps=1", *sets))
            rc = run_job(job, TINY, Progress(job.store_name, 1, stream=open(os.devnull, "w")))
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    return rc, "\n".join(r.getMessage() for r in caplog.records)


def master_bits(source) -> dict[str, torch.Tensor]:
    """The fp32 master of a store (HostStore) or a checkpoint (its path), as int32 bits."""
    if isinstance(source, HostStore):
        return {n: t.clone().view(torch.int32) for n, t in source.tensors("master")}
    folder = source / "state"
    index = hf.tensor_index(folder)
    return {n[len("master."):]: hf.load_tensor(folder, n, index=index).view(torch.int32)
            for n in index if n.startswith("master.")}


def flip_byte(path: Path, offset_from_end: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


# ---- item 2: a store left behind by a dead job with store.persist = false -----------------------------
def test_a_store_left_behind_by_a_dead_job_is_destroyed_not_adopted(store, tmp_path, caplog):
    dead = subprocess.Popen([PY, "-c", "pass"])
    dead.wait()
    st = fresh(store, persist=False, creator={"pid": dead.pid, "started": 0.0, "job": "ghost"})
    assert st["persist"] is False
    ck = checkpoint(store, tmp_path / "ck")  # the newest checkpoint the dead job wrote (step 1)
    # slidedp-store status says what will happen to it
    status = subprocess.run([PY, "-m", "slidedp.launch.store_cli", "status", store], capture_output=True, text=True,
                            timeout=120)
    assert (f"persist         no: made by job 'ghost' (launcher pid {dead.pid}) for itself; it is gone, so the next "
            f"job with this store destroys it") in status.stdout, status.stdout
    # so does the dry run
    out = io.StringIO()
    job = load_job(TINY, fast_sets(store, tmp_path / "run", "train.steps=1", f'checkpoint.resume="{ck}"'))
    dryrun.dry_run(job, TINY, out)
    assert (f"store {store!r} was left behind by job 'ghost' (launcher pid {dead.pid}), which made it with "
            f"store.persist = false and is gone: a run would destroy it and create it anew") in out.getvalue()

    rc, logs = launch(store, tmp_path / "run", caplog, f'checkpoint.resume="{ck}"')
    assert rc == 0, logs
    assert re.search(rf"store {store} was left behind by job 'ghost' \(launcher pid {dead.pid}\), which is gone: it "
                     rf"created the store with store.persist = false and should have destroyed it at its end\. "
                     rf"Destroying it and creating the store anew", logs), logs
    assert f"resumed from {ck} (step 1)" in logs, logs  # restored into the new store, not trained on from the old
    after = call(store, "status", timeout_s=60)
    assert after["generation"] != st["generation"] and after["committed_step"] == 1 and after["torn"] is None


# ---- item 4: checkpoint.resume = PATH is always verified, restored unless the store holds it ------------
def test_a_corrupt_resume_checkpoint_at_the_stores_step_is_refused(store, tmp_path, caplog):
    fresh(store)
    ck = checkpoint(store, tmp_path / "ck")
    before = master_bits(ck)
    flip_byte(ck / "state" / hf.SINGLE_FILE)
    rc, logs = launch(store, tmp_path / "run", caplog, f'checkpoint.resume="{ck}"')
    assert rc == 1, logs
    assert (f"job failed: checkpoint.resume: checkpoint {ck}: state/{hf.SINGLE_FILE} does not match its recorded "
            f"sha256 (corrupt or modified)") in logs, logs
    st = HostStore.attach(store)
    try:
        got = master_bits(st)  # the refusal changed nothing
        assert all(torch.equal(got[n], before[n]) for n in before)
    finally:
        st.close()


def test_another_runs_checkpoint_at_the_same_step_is_restored(store, tmp_path, caplog):
    fresh(store, seed=1)
    other = checkpoint(store, tmp_path / "other")  # another run's state at step 1 (other initial weights)
    fresh(store, seed=0)
    own = checkpoint(store, tmp_path / "own")
    rc, logs = launch(store, tmp_path / "run", caplog, f'checkpoint.resume="{other}"')
    assert rc == 0 and f"resumed from {other} (step 1)" in logs, logs
    st = HostStore.attach(store)
    try:
        got, want = master_bits(st), master_bits(other)
        assert all(torch.equal(got[n], want[n]) for n in want) and got.keys() == want.keys()
    finally:
        st.close()
    # the store now holds `other` to the bit: resuming it again restores nothing; `own` differs and is restored
    rc, logs = launch(store, tmp_path / "run", caplog, f'checkpoint.resume="{other}"')
    assert rc == 0 and f"the store already holds {other} byte for byte (step 1); nothing to restore" in logs, logs
    rc, logs = launch(store, tmp_path / "run", caplog, f'checkpoint.resume="{own}"')
    assert rc == 0 and f"resumed from {own} (step 1)" in logs, logs


# ---- item 6: a run directory that holds another run --------------------------------------------------
def _another_run(store: str, run_dir: Path) -> tuple[bytes, Path]:
    """run_dir as an earlier run left it: three steps in metrics.jsonl and its checkpoint of step 1."""
    run_dir.mkdir(parents=True)
    lines = "".join(json.dumps({"step": s, "loss": 6.0 - s}) + "\n" for s in range(3))
    (run_dir / "metrics.jsonl").write_text(lines)
    return lines.encode(), checkpoint(store, run_dir / "checkpoints")


def test_a_run_directory_holding_another_run_is_refused(store, tmp_path, caplog):
    fresh(store)
    run_dir = tmp_path / "run"
    metrics, ck = _another_run(store, run_dir)
    digest = (ck / "state.json").read_bytes()
    fresh(store, step=0)  # a new store: this job would train steps 0.. again into the same directory
    out = io.StringIO()  # the dry run says it first
    assert dryrun.dry_run(load_job(TINY, fast_sets(store, run_dir, "train.steps=3")), TINY, out) == 1
    assert f"PROBLEM: run directory {run_dir} holds another run (metrics.jsonl with 3 step record(s)" in out.getvalue()
    rc, logs = launch(store, run_dir, caplog, "train.steps=3")
    assert rc == 1, logs
    assert (f"job failed: run directory {run_dir} holds another run (metrics.jsonl with 3 step record(s), steps 0..2 "
            f"and 1 checkpoint(s) (step-00000001)); this job would start over at step 0 and mix its steps and "
            f"checkpoints into it. Resume that run (--resume latest, or checkpoint.resume = PATH), give this one its "
            f"own directory (run.dir, or run.name), or set run.overwrite = true to replace it") in logs, logs
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics and (ck / "state.json").read_bytes() == digest
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "metrics.jsonl"]  # nothing written
    assert call(store, "status", timeout_s=60)["committed_step"] == 0


def test_run_overwrite_replaces_the_other_run(store, tmp_path, caplog):
    fresh(store)
    run_dir = tmp_path / "run"
    _another_run(store, run_dir)
    rc, logs = launch(store, run_dir, caplog, "run.overwrite=true")
    assert rc == 0, logs
    assert (f"run.overwrite = true: removed the previous run from {run_dir} (metrics.jsonl with 3 step record(s), "
            f"steps 0..2 and 1 checkpoint(s) (step-00000001))") in logs, logs
    assert (run_dir / "metrics.jsonl").read_text() == "" and not list((run_dir / "checkpoints").iterdir())
    assert json.loads((run_dir / "run.json").read_text())["store"] == store


def test_a_run_continued_on_its_store_or_resumed_is_not_refused(store, tmp_path, caplog):
    st = fresh(store)
    run_dir = tmp_path / "run"
    _another_run(store, run_dir)
    # the directory's steps were trained on this store (run.json), and the store is past them: continue
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    (run_dir / "run.json").write_text(json.dumps({"store": store, "generation": st["generation"]}))
    rc, logs = launch(store, run_dir, caplog)
    assert rc == 0 and "nothing to train" in logs, logs
    # another store's steps, but resuming: the directory is this run's
    (run_dir / "run.json").write_text(json.dumps({"store": store, "generation": 12345}))
    rc, logs = launch(store, run_dir, caplog, 'checkpoint.resume="latest"')
    assert rc == 0 and "nothing to train" in logs, logs


# ---- the host's memory: a job it has no room for is refused before the plan, and nothing is made ------------
def test_a_job_the_host_has_no_room_for_is_refused_in_the_launchers_words(store, tmp_path, caplog, monkeypatch):
    """Before it plans, the launcher asks whether the host has room for what any plan takes (admission.py);
    the planner, asked first, blamed the GPU: a Qwen3-8B job with clipping on the 125 GiB H200 host was told
    "no plan fits the GPU memory budget of 24.00 GiB: the smallest plan needs 7.20 GiB"."""
    from types import SimpleNamespace

    from slidedp.launch import host_room, jobrun
    from slidedp.store.layout import make_layout
    from slidedp.model.config import named_shape

    fresh(store)
    st = HostStore.attach(store)
    try:
        before = master_bits(st)
    finally:
        st.close()
    available = 3 * 2**29  # 1.5 GiB: the existing store's rings fit, its two CPU ranks' 2 GiB do not
    monkeypatch.setattr(jobrun.psutil, "virtual_memory", lambda: SimpleNamespace(available=available))
    rc, logs = launch(store, tmp_path / "run", caplog, "train.steps=2")
    assert rc == 1, logs
    job = load_job(TINY, fast_sets(store, tmp_path / "run", "train.steps=2"))
    need = host_room.unplanned_need(job, make_layout(named_shape("tiny", 512)), store_exists=True)
    assert [what for what, _ in need.items] == ["gradient rings", "the job's processes (2 rank(s))"]  # the store exists
    assert f"job failed: {host_room.room_problem(job, need, available)}" in logs, logs
    assert "no plan fits" not in logs and "calibrat" not in logs
    status = call(store, "status", timeout_s=60)
    assert status["committed_step"] == 1 and not status["job"]  # never attached, nothing trained
    st = HostStore.attach(store)
    try:
        got = master_bits(st)
        assert got.keys() == before.keys() and all(torch.equal(got[n], before[n]) for n in before)
    finally:
        st.close()
