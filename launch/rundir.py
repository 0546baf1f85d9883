"""A run directory holds one run: a new job may continue it, resume it, or replace it when told, never mix in.

A run's directory has its metrics.jsonl (one record per step) and checkpoints, plus `run.json`:
which store (by name and generation, a random number fixed at the store's creation) its steps
trained, and what the run measured beside its steps (on several hosts, "network": the network between
hosts, as the ranks' probe timed it). A job may use a directory that holds steps already when

- it resumes (`checkpoint.resume`): the resumed steps are appended again, the checkpoints are its own;
- it continues the same store where the directory stopped (same generation, the store's committed
  step past the last step recorded): a persistent store trained further with a larger train.steps;
- `run.overwrite = true`: the previous run's metrics, trace and checkpoints are removed first.

Anything else would append a second series to metrics.jsonl and overwrite or prune the other
run's checkpoints, so it is refused, naming the choices.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slidedp.config import JobConfig
from slidedp.store import checkpoint as ckpt

log = logging.getLogger("slidedp.launcher")
RUN_RECORD = "run.json"
_RUN_OUTPUTS = ("metrics.jsonl", "trace.json", "trace", "report", RUN_RECORD, "network.json")


class RunDirInUse(RuntimeError):
    pass


@dataclass(frozen=True)
class PastRun:
    steps: int  # records in metrics.jsonl
    first_step: int | None
    last_step: int | None
    checkpoints: tuple[Path, ...]
    store: str | None  # from run.json (None: no record, e.g. a run of an older SlideDP)
    generation: int | None

    def describe(self) -> str:
        parts = []
        if self.steps:
            parts.append(f"metrics.jsonl with {self.steps} step record(s), steps {self.first_step}..{self.last_step}")
        if self.checkpoints:
            parts.append(f"{len(self.checkpoints)} checkpoint(s) ({', '.join(p.name for p in self.checkpoints[-3:])})")
        return " and ".join(parts)


def past_run(job: JobConfig) -> PastRun | None:
    """What the job's run directory (and checkpoint directory) hold of an earlier run, or None."""
    steps, first, last = 0, None, None
    metrics = job.run_dir / "metrics.jsonl"
    if metrics.is_file():
        with open(metrics) as f:
            for line in f:
                try:
                    step = int(json.loads(line)["step"])
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line of a killed run
                steps += 1
                first = step if first is None else first
                last = step
    checkpoints = tuple(ckpt.list_checkpoints(job.checkpoint_dir))
    if not steps and not checkpoints:
        return None
    record: dict[str, Any] = {}
    try:
        record = json.loads((job.run_dir / RUN_RECORD).read_text())
    except (OSError, ValueError):
        if checkpoints:  # no run record (checkpoints alone, e.g. `slidedp-store checkpoint`): whose the newest is
            try:
                extra = ckpt.read_record(checkpoints[-1], verify=False).get("extra") or {}
                record = {"store": extra.get("store"), "generation": extra.get("store_generation")}
            except ckpt.CheckpointError:
                pass
    gen = record.get("generation")
    return PastRun(steps, first, last, checkpoints, record.get("store"), int(gen) if gen is not None else None)


def continues(past: PastRun, store: str, status: dict[str, Any]) -> bool:
    """The job trains on the store whose steps the directory holds, from past its last recorded step."""
    return (bool(status.get("exists")) and past.store == store and past.generation == status.get("generation")
            and (past.last_step is None or int(status["committed_step"]) > past.last_step))


def to_replace(job: JobConfig, status: dict[str, Any]) -> PastRun | None:
    """The other run the job's directory holds that run.overwrite replaces (None: nothing to replace);
    RunDirInUse when it holds one and nothing says to replace it. Touches nothing.

    `status`: the store's status before the job creates or restores anything."""
    past = past_run(job)
    if past is None:
        return None
    if job.checkpoint.resume:
        return None  # resuming: its steps repeat in metrics.jsonl, its checkpoints are this run's
    if status.get("exists") and status.get("attached_pid"):
        return None  # a job runs on the store: attaching refuses this one, naming it
    if continues(past, job.store_name, status):
        return None
    where = job.run_dir
    if not job.run.overwrite:
        raise RunDirInUse(
            f"run directory {where} holds another run ({past.describe()}); this job would "
            f"{'start over at step ' + str(status['committed_step']) if status.get('exists') else 'start a new store'} "
            f"and mix its steps and checkpoints into it. Resume that run (--resume latest, or checkpoint.resume = PATH), "
            f"give this one its own directory (run.dir, or run.name), or set run.overwrite = true to replace it")
    return past


def check_run_dir(job: JobConfig, status: dict[str, Any]) -> str | None:
    """Refuse (RunDirInUse) a run directory that holds another run; with run.overwrite, clear it first.
    Returns what was removed (a line for the log), or None."""
    past = to_replace(job, status)
    return _clear(job, past) if past is not None else None


def _clear(job: JobConfig, past: PastRun) -> str:
    for name in _RUN_OUTPUTS:
        p = job.run_dir / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    for c in past.checkpoints:
        shutil.rmtree(c)
    return f"run.overwrite = true: removed the previous run from {job.run_dir} ({past.describe()})"


def write_run_record(job: JobConfig, status: dict[str, Any]) -> None:
    """Say which store (and which creation of it) this directory's steps train."""
    path = job.run_dir / RUN_RECORD
    tmp = path.with_name(f".{RUN_RECORD}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"store": job.store_name, "generation": status.get("generation")}, indent=1) + "\n")
    os.replace(tmp, path)


def add_to_run_record(run_dir: Path, key: str, value: Any) -> None:
    """Add what the run measured (e.g. "network": the network between hosts) to its record."""
    path = run_dir / RUN_RECORD
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        record = {}
    record[key] = value
    tmp = path.with_name(f".{RUN_RECORD}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
