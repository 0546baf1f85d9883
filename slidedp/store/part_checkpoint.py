"""Checkpoints on several hosts: each host writes its part, host 0 completes the checkpoint.

<root>/step-00000010/
    model/              Hugging Face folder in the checkpoint dtype, assembled by host 0 from every part
    host-R-of-H/state/  host R's range of every chunk, fp32: `<kind>.chunk<id>` for master and both moments
    host-R-of-H/part.json  its record (step, layout, part, AdamW step counts, files' sha256)
    state.json          the checkpoint's record, written last by host 0 ("parts": H; every file's sha256)

1. Every host writes its part into <root>/.step-S.parts/ (under a temporary name, fsynced, renamed: a part
   is there whole or not at all), copying each chunk's range once and releasing the chunk for training.
2. Host 0 waits until every host's part is there, writes model/ from the parts (flat_state.py), moves the
   parts in beside it, writes state.json and renames the whole to step-S: a checkpoint exists under its
   real name only when every host's part is in it. Other hosts return once their part is written.

So the checkpoint directory must be storage every host reaches (the shared file system a cluster's jobs
write to). Where it is not, host 0 names the hosts whose parts never came.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import torch

from ..model import hf
from .flat_state import FlatState, part_name
from .store import STATE_KINDS, HostStore

PART_RECORD = "part.json"


def parts_dir(root: Path, step: int) -> Path:
    return root / f".step-{step:08d}.parts"


def _members(store: HostStore) -> list[tuple[str, tuple[int, ...], int, int, int]]:
    """(name, shape, chunk id, lo, hi) of every chunk range the part holds, the three kinds side by side."""
    part = store.part
    assert part is not None
    out = []
    for c in store.layout.chunks:
        lo, hi = part.chunk_range(c.numel)
        if hi > lo:
            out += [(f"{k}.chunk{c.id}", (hi - lo,), c.id, lo, hi) for k in STATE_KINDS]
    return out


def write_part(store: HostStore, root: Path, step: int, extra: dict[str, Any], release: Callable | None) -> Path:
    """Host R's part of checkpoint `step` under root/.step-S.parts/host-R-of-H; returns its path."""
    from .checkpoint import _sha256

    part = store.part
    assert part is not None
    parts = parts_dir(root, step)
    parts.mkdir(parents=True, exist_ok=True)
    final = parts / part_name(part)
    tmp = parts / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    (tmp / "state").mkdir(parents=True)
    try:
        members = _members(store)
        by_name = {m[0]: m for m in members}
        adam_steps = store.manifest.adam_steps.tolist()  # before any chunk is released
        last_kind = STATE_KINDS[-1]

        def get(name: str) -> torch.Tensor:
            kind = name.partition(".")[0]
            _, _, cid, lo, hi = by_name[name]
            out = store.chunk(kind, store.layout.chunks[cid])[lo:hi].clone()
            if kind == last_kind and release is not None:
                release(cid)
            return out

        for c in store.layout.chunks:  # chunks with no range here are released at once
            lo, hi = part.chunk_range(c.numel)
            if hi <= lo and release is not None:
                release(c.id)
        hf._write_safetensors(tmp / "state" / hf.SINGLE_FILE, [(m[0], m[1]) for m in members], get, torch.float32)
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        record = {"step": step, "layout_hash": store.layout.hash(), "part": part.to_dict(), "adam_steps": adam_steps,
                  "clip_history": store.manifest.clip_history, "extra": extra,
                  "files": {str(p.relative_to(tmp)): _sha256(p) for p in files}}
        _write_json(tmp / PART_RECORD, record)
        for d in (tmp / "state", tmp):
            hf.fsync_dir(d)
        if final.exists():  # an earlier attempt's part of this step
            shutil.rmtree(final)
        os.rename(tmp, final)
        hf.fsync_dir(parts)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _write_json(path: Path, record: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def complete(store: HostStore, root: Path, step: int, dtype: torch.dtype, extra_files: list[str], wait_s: float,
             make_record: Callable[[dict[str, Any]], dict[str, Any]]) -> Path:
    """Host 0: wait for every host's part of `step`, write model/ from them, and name the checkpoint.
    make_record(fields) gives state.json's record (checkpoint.py's, with these fields)."""
    from .checkpoint import CheckpointError, _sha256

    part = store.part
    assert part is not None and part.host == 0
    parts = parts_dir(root, step)
    names = [part_name(type(part)(part.hosts, h, part.ranks)) for h in range(part.hosts)]
    deadline = time.monotonic() + wait_s
    while True:
        missing = [h for h, n in enumerate(names) if not (parts / n / PART_RECORD).is_file()]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"checkpoint of step {step}: the parts of host(s) {', '.join(map(str, missing))} did not appear under "
                f"{parts} within {wait_s:.0f} s; checkpoint.dir must be storage every host writes to (a shared file "
                "system, docs/multi-host.md), and every host must checkpoint the same steps")
        time.sleep(0.2)
    records = [json.loads((parts / n / PART_RECORD).read_text()) for n in names]
    for h, r in enumerate(records):
        if r["step"] != step or r["layout_hash"] != store.layout.hash() or r["part"]["ranks"] != part.ranks:
            raise CheckpointError(f"checkpoint of step {step}: host {h}'s part is of another step, model or rank count "
                                  f"({parts / names[h]})")
    final = root / f"step-{step:08d}"
    tmp = root / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for n in names:
            os.rename(parts / n, tmp / n)
        fields = {"parts": part.hosts, "ranks": part.ranks, "master_in": "parts",
                  "adam_steps": records[0]["adam_steps"], "extra": records[0]["extra"]}
        reader = FlatState(tmp, fields, store.layout)
        spans = {s.name: s for s in store.layout.tensors}

        def master(name: str) -> torch.Tensor:
            s = spans[name]
            n = 1
            for d in s.shape:
                n *= d
            return reader.read("master", s.offset, s.offset + n).view(s.shape)

        hf.write_folder(tmp / "model", store.layout.model, master, dtype=dtype, extra_files=extra_files)
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        record = make_record(dict(fields, files={str(p.relative_to(tmp)): _sha256(p) for p in files}))
        _write_json(tmp / "state.json", record)
        for d in [tmp, tmp / "model", *(tmp / n for n in names)]:
            hf.fsync_dir(d)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        hf.fsync_dir(root)
        shutil.rmtree(parts, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
