"""Checkpoints of a store: Hugging Face weights + exact optimizer state, written atomically.

<root>/step-00000010/
    model/        Hugging Face folder in the checkpoint dtype (loadable by transformers)
    state/        model.safetensors with fp32 master (when model/ is not fp32) and both moments
    state.json    step, layout hash, AdamW step counts, the last step's clipping verdict, data position, RNG,
                  sha256 of every file
Written under a temporary name, fsynced, then renamed: a crash never leaves a half
checkpoint under a real name. The newest `keep` are kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .manifest import CLIPPED, KEPT, SKIPPED
from .store import STATE_KINDS, HostStore

if TYPE_CHECKING:  # torch and the safetensors code are imported by the writes and the restore: the launcher
    import torch   # lists and reads checkpoints' records without them

_NAME = re.compile(r"^step-(\d{8})$")
FORMAT = 1
# state.json's "last_step_norm": what the last step's gradient norm said (exact clipping decides from it whether
# the next step speculates); a checkpoint from before it has none and reads as "kept" (the next step speculates)
_CLIP_HISTORY = {"kept": KEPT, "clipped": CLIPPED, "skipped": SKIPPED}


class CheckpointError(RuntimeError):
    pass


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _state_members(store: HostStore) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor by tensor in store order, all three kinds together: one pass copies each chunk once."""
    return [(f"{k}.{t.name}", t.shape) for t in store.layout.tensors for k in STATE_KINDS]


def _releaser(store: HostStore, release) -> "callable":
    """get(name) for the state file: a copy of the store tensor; once a tensor's last kind is copied, the
    chunks whose members are all copied are released (their next update may run)."""
    layout = store.layout
    pending = {c.id: {m.name for m in c.members} for c in layout.chunks}

    def get(name: str) -> torch.Tensor:
        kind, _, tensor = name.partition(".")
        out = store.tensor(kind, tensor).clone()
        if kind == STATE_KINDS[-1] and release is not None:
            for cid, names in pending.items():
                if tensor in names:
                    names.discard(tensor)
                    if not names:
                        release(cid)
        return out

    return get


def write_checkpoint(store: HostStore, root: str | os.PathLike, step: int, extra: dict[str, Any] | None = None,
                     dtype: torch.dtype | None = None, keep: int = 3, extra_files: list[str] = (),
                     release=None, part_wait_s: float = 3600.0) -> Path:
    """Write the store's state at committed step `step` under root/step-XXXXXXXX; returns the path.

    The store is read once, chunk by chunk in store order, into state/ (fp32 master and moments);
    `release(chunk_id)` is called as each chunk is copied, so training may go on updating the chunks
    already copied. model/ is then written from state/, not from the store. dtype: model/'s (None: bfloat16).
    A host's part on several hosts (store.part) writes its part instead, and host 0 completes the checkpoint
    once every part is in, waiting up to part_wait_s (part_checkpoint.py); other hosts return their part's path."""
    import torch

    from ..model import hf

    dtype = torch.bfloat16 if dtype is None else dtype
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    if store.part is not None:  # several hosts: this host's part, and on host 0 the whole checkpoint
        return _write_on_hosts(store, root, step, extra or {}, dtype, keep, list(extra_files), release, part_wait_s)
    final = root / f"step-{step:08d}"
    tmp = root / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    t0 = time.perf_counter()
    try:
        cfg = store.layout.model
        adam_steps = store.manifest.adam_steps.tolist()  # before any chunk is released
        clip_history = {v: k for k, v in _CLIP_HISTORY.items()}[store.manifest.clip_history]
        (tmp / "state").mkdir()
        hf._write_safetensors(tmp / "state" / hf.SINGLE_FILE, _state_members(store), _releaser(store, release),
                              torch.float32)
        index = hf.tensor_index(tmp / "state")
        hf.write_folder(tmp / "model", cfg, lambda n: hf.load_tensor(tmp / "state", f"master.{n}", index=index),
                        dtype=dtype, extra_files=extra_files)
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        record = {
            "format": FORMAT,
            "step": step,
            "layout_hash": store.layout.hash(),
            "model": cfg.to_dict(),
            "adam_steps": adam_steps,
            "last_step_norm": clip_history,
            "master_in": "state",
            "created": time.time(),
            "extra": extra or {},
            "files": {str(p.relative_to(tmp)): _sha256(p) for p in files},
        }
        with open(tmp / "state.json", "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        for d in [tmp, tmp / "model", tmp / "state"]:
            hf.fsync_dir(d)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        hf.fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(root, keep)
    record_seconds = time.perf_counter() - t0
    (final / ".seconds").write_text(f"{record_seconds:.3f}\n")
    return final


def _write_on_hosts(store: HostStore, root: Path, step: int, extra: dict[str, Any], dtype: torch.dtype, keep: int,
                    extra_files: list[str], release, wait_s: float) -> Path:
    from . import part_checkpoint

    t0 = time.perf_counter()
    clip_history = {v: k for k, v in _CLIP_HISTORY.items()}[store.manifest.clip_history]
    path = part_checkpoint.write_part(store, root, step, extra, release)
    if store.part.host != 0:  # type: ignore[union-attr]
        return path

    def record(fields: dict[str, Any]) -> dict[str, Any]:
        return {"format": FORMAT, "step": step, "layout_hash": store.layout.hash(), "model": store.layout.model.to_dict(),
                "last_step_norm": clip_history, "created": time.time(), **fields}

    final = part_checkpoint.complete(store, root, step, dtype, extra_files, wait_s, record)
    prune(root, keep)
    (final / ".seconds").write_text(f"{time.perf_counter() - t0:.3f}\n")
    return final


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name))


def prune(root: Path, keep: int) -> None:
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".step-*.tmp-*"):  # a crash mid-write
        if not stale.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(stale, ignore_errors=True)


def read_record(path: str | os.PathLike, verify: bool = True) -> dict[str, Any]:
    """state.json of a checkpoint, with every file's hash checked (error names the bad file)."""
    path = Path(path)
    if not (path / "state.json").is_file():
        raise CheckpointError(f"{path} is not a SlideDP checkpoint (no state.json)")
    try:
        record = json.loads((path / "state.json").read_text())
    except ValueError as e:
        raise CheckpointError(f"{path}/state.json is corrupt: {e}") from None
    if record.get("format") != FORMAT:
        raise CheckpointError(f"{path} has checkpoint format {record.get('format')}; this SlideDP reads {FORMAT}")
    if record.get("master_in") not in ("state", "model", "parts"):
        raise CheckpointError(f"{path}/state.json: master_in must be 'state' or 'model', got {record.get('master_in')!r} "
                              f"(a checkpoint reads nothing outside its folder)")
    for rel, digest in record.get("files", {}).items():
        f = (path / rel).resolve()
        if path.resolve() not in f.parents:
            raise CheckpointError(f"{path}/state.json names a file outside the checkpoint: {rel!r}")
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is missing {rel}")
        if verify and _sha256(f) != digest:
            raise CheckpointError(f"checkpoint {path}: {rel} does not match its recorded sha256 (corrupt or modified)")
    return record


def latest_valid(root: str | os.PathLike) -> Path | None:
    """Newest checkpoint under root whose files all verify (a torn or corrupt one is skipped)."""
    for p in reversed(list_checkpoints(root)):
        try:
            read_record(p)
            return p
        except CheckpointError:
            continue
    return None


def restore_checkpoint(store: HostStore, path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint into the store (same layout); the store is at the checkpoint's step afterwards."""
    from ..model import hf

    path = Path(path)
    record = read_record(path)
    if record["layout_hash"] != store.layout.hash():
        raise CheckpointError(
            f"checkpoint {path} was taken from a store with another model or chunking "
            f"(layout {record['layout_hash'][:12]}..., store {store.layout.hash()[:12]}...)"
        )
    clip_history = record.get("last_step_norm", "kept")
    if clip_history not in _CLIP_HISTORY:
        raise CheckpointError(f"{path}/state.json: last_step_norm must be one of {sorted(_CLIP_HISTORY)}, "
                              f"got {clip_history!r}")
    m = store.manifest
    m.set_torn_flag(1)  # a crash while loading leaves the store refusing to train
    if store.part is None and not record.get("parts"):
        master_dir = path / record["master_in"]
        state_dir = path / "state"
        index_master = hf.tensor_index(master_dir)
        index_state = hf.tensor_index(state_dir)
        for span in store.layout.tensors:
            name = span.name
            hf.load_tensor(master_dir, f"master.{name}" if record["master_in"] == "state" else name,
                           out=store.tensor("master", name), index=index_master)
            hf.load_tensor(state_dir, f"exp_avg.{name}", out=store.tensor("exp_avg", name), index=index_state)
            hf.load_tensor(state_dir, f"exp_avg_sq.{name}", out=store.tensor("exp_avg_sq", name), index=index_state)
    else:  # a host's part, or a checkpoint of several hosts: range by range, whoever wrote it (flat_state.py)
        from .flat_state import FlatState

        state = FlatState(path, record, store.layout)
        for kind in STATE_KINDS:
            flat = store.flat(kind)
            for a, b in store.owned():
                flat[a:b] = state.read(kind, a, b)
    store.refresh_shadow()
    step = int(record["step"])
    m.adam_steps[:] = record["adam_steps"]
    m.updating[:] = 0
    m.versions[:] = step
    m.set_committed_step(step, _CLIP_HISTORY[clip_history])
    m.set_torn_flag(0)
    return record
