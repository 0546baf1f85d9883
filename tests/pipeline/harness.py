"""Running the real thing from tests: slidedp-launch in a subprocess, then reading what it left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Callable

import torch

from slidedp.model import hf
from slidedp.store.shm import list_store_segments

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny.toml"


def unique_store(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def attached_job_record(store: str, world: int, clip: bool, max_grad_norm: float = 1.0, sets: tuple[str, ...] = (),
                        shadow: bool = False, **record: object):
    """A created store (tiny shape, in this process) with a job attached (rings made), and its job record,
    for driving a daemon's core in-process. clip: train.max_grad_norm = max_grad_norm, else 0; `sets`
    more job file values; shadow: the store keeps a bf16 shadow; `record` overrides JobRecord fields (e.g. grad_route)."""
    from slidedp.config import job_to_dict, load_job
    from slidedp.jobrecord import JobRecord
    from slidedp.store.client import call

    call(store, "create", source="random", shape="tiny", vocab_size=512, init_seed=0, shadow_bf16=shadow)
    st = call(store, "status")
    train = job_to_dict(load_job(TINY, [f"train.max_grad_norm={max_grad_norm if clip else 0.0}", *sets]))["train"]
    from slidedp.jobrecord import gradient_space
    from slidedp.store.store import HostStore

    job = JobRecord("j", store, world, train, st["layout_hash"], **record)  # type: ignore[arg-type]
    hs = HostStore.attach(store)
    try:  # exact clipping keeps a slot per chunk in the rings where nothing sums ranks: 4 for tiny
        slots, _, _ = gradient_space(hs.layout, world, job.grad_route, job.clip, 3, job.device_chunks)
    finally:
        hs.close()
    call(store, "attach", job="j", pid=os.getpid(), world=world, grad_slots=slots, full_reduce=job.full_reduce,
         reduce_slots=3, layout_hash=st["layout_hash"], shard_slots=job.grad_route == "reduce_scatter")
    return job


def launch(job: Path, *sets: str, cwd: Path, timeout: float = 240, extra: tuple[str, ...] = (),
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "slidedp.launch.cli", str(job), *extra]
    for s in sets:
        argv += ["--set", s]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


Launched = tuple[subprocess.CompletedProcess, Path, list[str], str]
_launched: dict[tuple, Launched] = {}


def launch_once(key: tuple, tmp_path_factory, sets_for: Callable[[str, Path], list[str]],
                env: dict[str, str] | None = None) -> Launched:
    """(proc, run_dir, sets, store) of the tiny job whose `sets_for(store, run_dir)` values `key` names,
    launched the first time a test of this session asks for it: tests that read one run in different ways
    (another test's twin, a shared-memory check) share its launch instead of paying for their own."""
    if key not in _launched:
        cwd = tmp_path_factory.mktemp("run")
        store, run_dir = unique_store("once"), cwd / "run"
        sets = sets_for(store, run_dir)
        _launched[key] = (launch(TINY, *sets, cwd=cwd, env=env), run_dir, sets, store)
    return _launched[key]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def checkpoint_weights(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's model/ weights in fp32 by the store's names (experts kept one tensor each on disk fused,
    as transformers loads them)."""
    folder = path / "model"
    cfg = hf.read_config(folder)
    index = hf.tensor_index(folder)
    shapes = cfg.parameter_shapes()
    if cfg.tie_word_embeddings and "lm_head.weight" in index:  # a redundant copy of the tied head
        shapes.append(("lm_head.weight", index["lm_head.weight"].shape))
    return {n: hf.load_model_tensor(folder, cfg, n, torch.empty(s), index=index) for n, s in shapes}


def checkpoint_state(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's AdamW moments, keyed "exp_avg.<name>" and "exp_avg_sq.<name>"."""
    folder = path / "state"
    return {name: hf.load_tensor(folder, name) for name in hf.tensor_index(folder) if name.startswith("exp_avg")}


def store_segments(store: str) -> list[tuple[str, int]]:
    return list_store_segments().get(store, [])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
