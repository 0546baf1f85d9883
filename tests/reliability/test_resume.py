"""Resume: a run killed after a checkpoint and resumed ends bit-identical to the uninterrupted run.

CPU, fp32, fixed seed, checkpoint.every=2. The killed run's store is also marked torn and its
newest checkpoint corrupted (one flipped byte), so `--resume latest` must skip that checkpoint
(saying why), restore the one before it into a torn store, and still reproduce the
uninterrupted run: final weights and both AdamW moments equal tensor by tensor (torch.equal),
and the loss and gradient norm of every step either run reported equal.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch

from slidedp.model import hf
from slidedp.store import checkpoint as ckpt
from slidedp.store.client import call
from slidedp.store.manifest import UPDATING
from slidedp.store.store import HostStore

from . import TINY, RunningJob, drop_store, fast_sets, manifest_state, run_uninterrupted, unique_store, wait_gone
from pipeline.harness import metrics

STEPS = 12


def _sets(store: str, run_dir: Path) -> list[str]:
    return fast_sets(store, run_dir, f"train.steps={STEPS}", "checkpoint.every=2", "checkpoint.keep=3",
                     "train.seed=1234", "data.shuffle=true", "data.seed=7")


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for sub in ("model", "state"):
        folder = path / sub
        out.update({f"{sub}/{n}": hf.load_tensor(folder, n) for n in hf.tensor_index(folder)})
    return out


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume-ref")
    store = unique_store("res-ref")
    run_uninterrupted(tmp, store, _sets(store, tmp / "run"), 300)
    return tmp / "run"


def test_kill_resume_is_bit_identical(tmp_path, uninterrupted):
    store = unique_store("res")
    run_dir = tmp_path / "run"
    try:
        # 1. the run, killed (-9, the launcher) as soon as its checkpoint of step 6 exists
        run = RunningJob.start(TINY, _sets(store, run_dir), tmp_path, store)
        try:
            deadline = time.monotonic() + 300
            while not (run_dir / "checkpoints" / "step-00000006").is_dir():
                assert run.proc.poll() is None and time.monotonic() < deadline, run.output[-4000:]
                run.note_pids()
                time.sleep(0.005)
            run.proc.kill()
            assert run.wait_exit(30) == -9
            assert wait_gone(run.seen_pids, 30) == []
        finally:
            run.cleanup()
        done = metrics(run_dir)
        assert len(done) < STEPS, "the run finished before it was killed; nothing was resumed"
        have = ckpt.list_checkpoints(run_dir / "checkpoints")
        newest = have[-1]
        assert int(newest.name[5:]) >= 6 and len(have) >= 2
        # 2. the newest checkpoint corrupted, the store torn
        _flip_byte(newest / "model" / hf.SINGLE_FILE, 200)
        st = HostStore.attach(store)
        st.manifest.updating[0] = UPDATING
        st.close()
        assert manifest_state(store)[2] is not None
        # 3. resumed from the newest valid checkpoint (the one before)
        resumed = RunningJob.start(TINY, _sets(store, run_dir), tmp_path, store, extra=("--resume", "latest"))
        try:
            assert resumed.wait_exit(300) == 0, resumed.output[-4000:]
        finally:
            resumed.cleanup()
        out = resumed.output
        assert re.search(rf"WARNING \[launcher\] resume: skipping checkpoint {re.escape(str(newest))}: checkpoint "
                         rf"{re.escape(str(newest))}: model/model.safetensors does not match its recorded sha256", out), out[-3000:]
        previous = have[-2]
        assert f"resumed from {previous} (step {int(previous.name[5:])})" in out, out[-3000:]
        # 4. the same end as the uninterrupted run, bit for bit
        mine = _tensors(run_dir / "checkpoints" / f"step-{STEPS:08d}")
        ref = _tensors(uninterrupted / "checkpoints" / f"step-{STEPS:08d}")
        assert mine.keys() == ref.keys() and any(k.startswith("state/exp_avg_sq.") for k in ref)
        differ = [k for k in ref if not torch.equal(mine[k], ref[k])]
        assert differ == [], f"{len(differ)} tensor(s) differ from the uninterrupted run, e.g. {differ[:3]}"
        record = json.loads((run_dir / "checkpoints" / f"step-{STEPS:08d}" / "state.json").read_text())
        ref_record = json.loads((uninterrupted / "checkpoints" / f"step-{STEPS:08d}" / "state.json").read_text())
        assert record["adam_steps"] == ref_record["adam_steps"] and record["extra"]["data"] == ref_record["extra"]["data"]
        # every step either run reported (the killed one's, then the resumed one's) has the same loss and norm
        want = {m["step"]: m for m in metrics(uninterrupted)}
        got = metrics(run_dir)
        assert {m["step"] for m in got} == set(range(STEPS)) and len(got) > STEPS  # overlap: steps run twice
        for m in got:
            assert (m["loss"], m["grad_norm"]) == (want[m["step"]]["loss"], want[m["step"]]["grad_norm"]), m["step"]
        assert manifest_state(store) == (STEPS, [STEPS] * 4, None)
    finally:
        drop_store(store)


def test_checkpoints_are_verified_pruned_and_complete(uninterrupted):
    """keep=3 newest kept; every file of each has its sha256 in state.json; no temporary folder left."""
    root = uninterrupted / "checkpoints"
    names = [p.name for p in ckpt.list_checkpoints(root)]
    assert names == [f"step-{s:08d}" for s in (STEPS - 4, STEPS - 2, STEPS)]
    assert sorted(p.name for p in root.iterdir()) == names  # no .step-*.tmp-* left behind
    for name in names:
        path = root / name
        record = ckpt.read_record(path)
        files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
        assert "model/tokenizer.json" in record["files"]  # written with the checkpoint, hashed with the rest
        assert sorted(record["files"]) == [f for f in files if f not in ("state.json", ".seconds")]
        assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in record["files"].values())


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    """Written under a temporary name, every file and folder fsynced, then renamed; a failure leaves nothing."""
    store = unique_store("atomic")
    try:
        call(store, "create", source="random", shape="tiny", vocab_size=512, init_seed=0)
        st = HostStore.attach(store)
        try:
            events: list[tuple[str, str]] = []
            real_fsync, real_rename = os.fsync, os.rename

            def fsync(fd):
                events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                return real_fsync(fd)

            def rename(a, b):
                events.append(("rename", f"{a} -> {b}"))
                return real_rename(a, b)

            monkeypatch.setattr(os, "fsync", fsync)
            monkeypatch.setattr(os, "rename", rename)
            path = ckpt.write_checkpoint(st, tmp_path / "ck", 0, {}, torch.float32, keep=2)
            renames = [e for e in events if e[0] == "rename" and e[1].endswith(f"-> {path}")]
            assert len(renames) == 1 and re.search(r"/\.step-00000000\.tmp-\d+-[0-9a-f]+ -> ", renames[0][1])
            before = events[:events.index(renames[0])]
            synced = {p for k, p in before if k == "fsync"}
            tmp_dir = renames[0][1].split(" -> ")[0]
            for rel in ckpt.read_record(path)["files"]:  # model/ is itself written as .model.tmp-* then renamed
                name = rel.rpartition("/")[2]
                assert any(p.startswith(tmp_dir + "/") and p.endswith("/" + name) for p in synced), \
                    f"{rel} renamed into place before it was fsynced"
            assert {f"{tmp_dir}/state.json", tmp_dir, f"{tmp_dir}/model", f"{tmp_dir}/state"} <= synced
            assert ("fsync", str(tmp_path / "ck")) in events[events.index(renames[0]):]  # the rename made durable

            # a failure half-way leaves neither a checkpoint nor a temporary folder
            def boom(*a, **k):
                raise OSError(28, "No space left on device")

            monkeypatch.setattr(hf, "_write_safetensors", boom)
            with pytest.raises(OSError, match="No space left"):
                ckpt.write_checkpoint(st, tmp_path / "ck", 1, {}, torch.float32, keep=2)
            assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000000"]
        finally:
            st.close()
    finally:
        drop_store(store)
