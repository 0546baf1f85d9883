"""Whether a store already holds a checkpoint, byte for byte: the one case where a resume restores nothing.

A resume names a checkpoint to continue from; skipping its restore because the steps agree would
accept a corrupt checkpoint unread, or ignore another run's at the same step. So the checkpoint is
verified (every file's sha256) and compared with the store: step, AdamW step counts and the bits of
the fp32 master and both moments. Anything else, and it is restored.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..model import hf
from . import checkpoint as ckpt
from .store import HostStore


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)  # NaN and -0.0 compare as the bytes they are


def store_holds(store: HostStore, path: str | os.PathLike, record: dict[str, Any]) -> bool:
    """True when the store is clean, at the checkpoint's step, and its state is the checkpoint's to the bit."""
    path = Path(path)
    m = store.manifest
    if (record.get("layout_hash") != store.layout.hash() or m.torn_reason() is not None
            or m.committed_step != int(record["step"]) or m.adam_steps.tolist() != list(record["adam_steps"])):
        return False
    if store.part is not None or record.get("parts"):  # range by range (flat_state.py)
        from .flat_state import FlatState

        state = FlatState(path, record, store.layout)
        return all(torch.equal(_bits(state.read(kind, a, b)), _bits(store.flat(kind)[a:b]))
                   for kind in ("master", "exp_avg", "exp_avg_sq") for a, b in store.owned())
    master_dir, state_dir = path / record["master_in"], path / "state"
    index_master, index_state = hf.tensor_index(master_dir), hf.tensor_index(state_dir)
    for span in store.layout.tensors:
        name = span.name
        pairs = [(hf.load_tensor(master_dir, f"master.{name}" if record["master_in"] == "state" else name,
                                 index=index_master), store.tensor("master", name))]
        pairs += [(hf.load_tensor(state_dir, f"{kind}.{name}", index=index_state), store.tensor(kind, name))
                  for kind in ("exp_avg", "exp_avg_sq")]
        if not all(torch.equal(_bits(a), _bits(b)) for a, b in pairs):
            return False
    return True


def restore_unless_held(store: HostStore, path: str | os.PathLike) -> tuple[dict[str, Any], bool]:
    """Verify the checkpoint and restore it unless the store holds it already: (its record, restored?)."""
    record = ckpt.read_record(path, verify=True)
    if store_holds(store, path, record):
        return record, False
    return ckpt.restore_checkpoint(store, path), True
