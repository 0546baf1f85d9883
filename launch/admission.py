"""Whether a job may start, and how: one decision, which `JobRun` acts on and `--dry-run` prints.

The launcher and the dry run gather the facts each in its own way (the host-state daemon's status, or
the store's manifest read directly; the resume checkpoint's record; the host's free memory; the GPUs)
and hand them to `admit`, which decides the rest the same way for both: the job's layout and whether
the store holds it, whether the host has room for what any plan of the job takes, the bf16 shadow and
the step plan (`planning.plan_job`), whether the host has room for the planned job, and the step the
job starts from. It starts no process and opens no socket or segment; the one thing it does not take
as a fact is a CUDA plan's calibration, which plan_job reads from this host's cache (or measures, in a
subprocess) unless the facts bring one.

What the host-state daemon refuses at attach (another job attached, a torn store that nothing
restores) stays the daemon's: the run hears it from the daemon, the dry run checks it itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from slidedp.config import JobConfig
from slidedp.data.errors import DataError
from slidedp.jobrecord import held_chunk_ids, held_unit_names
from slidedp.model.config import ModelConfig
from slidedp.planner import Calibration, PlanError
from slidedp.planner.workload import DocumentLoad
from slidedp.store.layout import Layout, make_layout
from slidedp.store.mismatch import describe as describe_mismatch
from slidedp.store.part import StorePart

from .host_room import host_need, job_part, room_for_plan, room_problem, shadow_fits, unplanned_need
from .planning import DeliveryError, JobPlan, plan_job


@dataclass(frozen=True)
class StoreFacts:
    """The job's store as the caller found it. A store that a dead job left behind counts as absent:
    a run destroys it and creates the store anew."""

    exists: bool = False
    source: str = "?"  # what it was made from ("random:tiny", a model folder)
    parameters: int = 0
    layout_hash: str = ""
    model_config: Mapping[str, Any] = field(default_factory=dict)  # its model's: a mismatch names the fields
    chunk_rows: int | None = None
    shadow: bool = False  # it holds the bf16 shadow of the weights
    committed_step: int = 0
    torn: str | None = None  # why it cannot be trained from as it is (None: clean, or mid-step in a running job)
    layer_chunk_numel: int | None = None  # where its layers are cut (0: whole layers; None: not said)
    part: Mapping[str, int] | None = None  # several hosts: the host's part it holds (store/part.py)

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> StoreFacts:
        """The store as the host-state daemon's `status` answer describes it."""
        if not status.get("exists"):
            return cls()
        return cls(True, status["model"], status["parameters"], status["layout_hash"],
                   status.get("model_config") or {}, status.get("chunk_rows"), "shadow" in status.get("segments", {}),
                   status["committed_step"], status.get("torn"), status.get("layer_chunk_numel"), status.get("part"))


@dataclass(frozen=True)
class HostFacts:
    available: int  # host memory available now
    shm_free: int  # free in /dev/shm, where the store and the gradient rings live


@dataclass(frozen=True)
class CheckpointFacts:
    """The checkpoint a job would resume from, as its record says."""

    path: Path
    step: int
    layout_hash: str | None
    family: str  # its model's family, to name it
    data_problem: str | None = None  # why this job's data cannot go on from its recorded position (None: it can)

    @classmethod
    def of(cls, path: Path, record: Mapping[str, Any], batches: Any = None) -> CheckpointFacts:
        """From the checkpoint's record (store/checkpoint.py:read_record); batches: the job's training
        data (data.Batches), whose position at the checkpoint's step must be the one it recorded (None:
        not checked, the data could not be read)."""
        step = int(record["step"])
        data = (record.get("extra") or {}).get("data")
        problem = None
        if data is not None and batches is not None:
            try:
                batches.check_state(step, data)
            except DataError as e:
                problem = str(e)
        return cls(Path(path), step, record.get("layout_hash"), (record.get("model") or {}).get("family", "?"), problem)


@dataclass(frozen=True)
class AdmissionFacts:
    job: JobConfig
    model: ModelConfig  # the job's model (config.model_config: a model folder's config is read from disk)
    store: StoreFacts
    host: HostFacts
    checkpoint: CheckpointFacts | None = None  # the one checkpoint.resume names, or "latest" found (None: none)
    documents: DocumentLoad | None = None  # what rows of packed documents cost attention (planning.document_load)
    gpus: int | None = None  # CUDA devices visible to the workers (None: not counted, e.g. a CPU job)
    calibration: Calibration | None = None  # a CUDA plan's (None: plan_job's own, this host's)


@dataclass(frozen=True)
class Finding:
    topic: str  # the dry run's section it belongs to: "store", "resume", "plan" or "host"
    text: str  # in the words a run fails (a problem) or warns with


@dataclass(frozen=True)
class Admission:
    """The launcher's decision on a job: a run stops at the first problem before it makes anything."""

    layout: Layout
    store_exists: bool  # False: the run creates the store
    matches: bool  # the existing store holds this job's layout (True where the run creates it)
    shadow: bool  # the store has, or the run creates it with, the bf16 shadow
    plan: JobPlan | None  # None: not made, a problem before it
    device_chunks: tuple[int, ...]  # the chunks the plan holds on the devices (no ring slot, leased)
    resume: Path | None  # the checkpoint restored before the job starts (None: it trains on from the store's step)
    start: int  # the step the job starts at
    problems: tuple[Finding, ...] = ()  # in the order a run meets them
    warnings: tuple[Finding, ...] = ()

    @property
    def problem(self) -> str | None:
        """Why a run refuses the job (the first problem), or None."""
        return self.problems[0].text if self.problems else None

    def of(self, topic: str) -> tuple[list[str], list[str]]:
        """(problems, warnings) of one topic, each as its text."""
        return [f.text for f in self.problems if f.topic == topic], [f.text for f in self.warnings if f.topic == topic]


def job_layout(job: JobConfig, model: ModelConfig) -> Layout:
    """The job's chunk table: its model cut as plan.layer_chunk_numel says ("auto": the layout's rule)."""
    return make_layout(model, layer_chunk_numel=job.plan.chosen("layer_chunk_numel"))


def admit(facts: AdmissionFacts) -> Admission:
    """The decision on a job, from its facts; see the module's docstring."""
    job, store, host = facts.job, facts.store, facts.host
    layout = job_layout(job, facts.model)
    exists = store.exists
    resume, start, resume_problems = _resume_point(facts, layout)
    warnings: list[Finding] = []
    shadow = store.shadow if exists else job.store.shadow_bf16 is True

    def refused(finding: Finding, matches: bool = True) -> Admission:
        return Admission(layout, exists, matches, shadow, None, (), resume, start, (finding, *resume_problems),
                         tuple(warnings))

    if exists and store.layout_hash != layout.hash():
        return refused(Finding("store", _another_model(job, store, layout)), matches=False)
    part = job_part(job)
    if exists and (StorePart(**store.part) if store.part else None) != part:
        return refused(Finding("store", _another_part(job, store.part, part)), matches=False)
    if exists and job.store.shadow_bf16 != "auto" and store.shadow != job.store.shadow_bf16:
        warnings.append(Finding("store", f"store.shadow_bf16 = {str(job.store.shadow_bf16).lower()} but the existing "
                                         f"store was made {'with' if store.shadow else 'without'} the bf16 shadow; the "
                                         f"store's wins"))
    # what any plan takes, asked before the plan: where it has no room no plan fits, and the planner would
    # only say which plan is smallest on the GPU
    room = room_problem(job, unplanned_need(job, layout, exists), host.available, host.shm_free)
    if room:
        return refused(Finding("store", room))
    if job.runtime.device == "cuda" and facts.gpus is not None:
        if facts.gpus == 0:
            return refused(Finding("plan", "runtime.device = \"cuda\" but no CUDA device is visible to this process"))
        if job.runtime.workers > facts.gpus:
            warnings.append(Finding("plan", f"{job.runtime.workers} ranks share {facts.gpus} GPU(s)"))
    # the plan says whether a store the run creates gets the bf16 shadow (store.shadow_bf16 = "auto")
    fits = exists or job.store.shadow_bf16 != "auto" or shadow_fits(job, layout, host.available, host.shm_free)
    try:
        plan = plan_job(job, facts.calibration, store_shadow=store.shadow if exists else None, shadow_fits=fits,
                        host_room=room_for_plan(job, layout, exists, host.available), documents=facts.documents)
    except (DeliveryError, PlanError) as e:
        return refused(Finding("plan", str(e)))
    held = held_chunk_ids(layout, held_unit_names(facts.model, plan.step))
    # everything the planned job takes: its offloaded layers' buffers, its held layers' rings, the shadow
    room = room_problem(job, host_need(job, layout, plan.step, exists, plan.shadow, held), host.available,
                        host.shm_free)
    problems = ((Finding("host", room),) if room else ()) + resume_problems
    return Admission(layout, exists, True, plan.shadow, plan, held, resume, start, problems, tuple(warnings))


def _another_part(job: JobConfig, held: Mapping[str, int] | None, want: StorePart | None) -> str:
    def say(p: StorePart | None) -> str:
        return "every range of the state (one host)" if p is None else f"the ranges of {p.describe()}"

    return (f"store {job.store_name!r} holds {say(StorePart(**held) if held else None)}, and this job needs "
            f"{say(want)} (runtime.nnodes, node_rank, workers); give each host's job its own store (store.name), or "
            f"destroy this one with `slidedp-store destroy {job.store_name}`")


def _another_model(job: JobConfig, store: StoreFacts, layout: Layout) -> str:
    name = job.store_name
    diff = describe_mismatch(dict(store.model_config), store.chunk_rows, store.layout_hash, layout,
                             held_layer_chunk_numel=store.layer_chunk_numel)
    return (f"store {name!r} holds another model ({store.source}, {store.parameters:,} parameters) than this job "
            f"({job.model.source}:{job.model.shape or job.model.path}): {diff}; "
            f"set store.name to another store, or destroy it with `slidedp-store destroy {name}`")


def _resume_point(facts: AdmissionFacts, layout: Layout) -> tuple[Path | None, int, tuple[Finding, ...]]:
    """(the checkpoint to restore, the step the job starts at, why it cannot resume)."""
    job, store, ck = facts.job, facts.store, facts.checkpoint
    at = store.committed_step if store.exists else 0
    want = job.checkpoint.resume
    if not want:
        return None, at, ()
    if ck is None:  # "latest", and none is valid
        if want == "latest" and store.exists and store.torn:
            return None, at, (Finding("resume", f"store {job.store_name!r} is torn ({store.torn}) and "
                                                f"{job.checkpoint_dir} holds no valid checkpoint to restore; destroy the "
                                                f"store or name a checkpoint in checkpoint.resume"),)
        return None, at, ()
    if ck.layout_hash != layout.hash():
        return None, at, (Finding("resume", f"checkpoint {ck.path} was taken from another model or chunking than this "
                                            f"job's ({ck.family}); choose a checkpoint of this model"),)
    if ck.data_problem:
        return ck.path, ck.step, (Finding("resume", f"cannot resume from {ck.path}: {ck.data_problem}"),)
    return ck.path, ck.step, ()
