"""slidedp-launch --dry-run job.toml: check everything a run would trip over, in seconds, touching nothing.

It reads what a run reads (job file, model folder, data, an existing store's manifest, the
resume checkpoint, on CUDA the plan) but starts no daemon and creates no segment, run
directory or checkpoint. It prints what the run would do and every problem found, each
naming what to fix; exit status 0 when a run would start cleanly, 1 otherwise.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, TextIO

import psutil

from slidedp import jobrecord
from slidedp import daemonlock, paths
from slidedp.config import JobConfig, model_config
from slidedp.model.config import ModelConfig
from slidedp.store import checkpoint as ckpt
from slidedp.store.ephemeral import left_behind
from slidedp.store.layout import Layout, make_layout
from slidedp.store.manifest import Manifest
from slidedp.store.mismatch import describe_layouts
from slidedp.store.shm import SHM_DIR, list_store_segments, segment_name, shm_free_bytes

from .host_room import planned_room_problem, room_for_plan, room_problem, size, unplanned_need, unplanned_step

# What a check can raise for bad input: ConfigError, DataError, ModelConfigError (ValueError);
# CheckpointError, StoreError, ManifestError (RuntimeError); missing or unreadable files (OSError).
_BAD_INPUT = (OSError, ValueError, RuntimeError, KeyError)


def _alive(pid: int) -> bool:
    return pid > 0 and psutil.pid_exists(pid)


def writable_dir(path: Path) -> str | None:
    """Why `path` could not be created or written as a directory (None if it can)."""
    p = path
    while not p.exists():
        if p.parent == p:
            break
        p = p.parent
    if not p.is_dir():
        return f"{p} is not a directory, so {path} cannot be created"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{p} is not writable by this user, so {path} cannot be {'written' if p == path else 'created'}"
    return None


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


@dataclass
class DryRun:
    job: JobConfig
    job_path: Path
    out: TextIO = sys.stdout
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    cfg: ModelConfig | None = None
    layout: Layout | None = None
    start: int = 0
    torn: str | None = None  # why the existing store cannot be trained from as it is
    store_status: dict = field(default_factory=dict)  # the existing store as a run would find it (exists, ...)
    store_shadow: bool | None = None  # whether the existing store has the bf16 shadow (None: a run creates the store)
    store_exists: bool = False
    room_flagged: bool = True  # the store's host-memory check spoke, or never ran: the plan's check stays quiet
    batches: object = None  # the training data as read (Batches or DocBatches), None until read

    _topic: str = ""  # the topic whose lines are being printed

    def say(self, topic: str, text: str) -> None:
        self._topic = topic or self._topic
        print(f"{topic:<11}{text}", file=self.out)

    def _flag(self, topic: str, kind: str, text: str) -> None:
        label = "" if topic == self._topic else topic  # a check that failed before saying anything
        self._topic = topic
        print(f"{label:<11}{kind}: {text}", file=self.out)

    def problem(self, topic: str, text: str) -> None:
        self.problems.append(f"{topic}: {text}")
        self._flag(topic, "PROBLEM", text)

    def warn(self, topic: str, text: str) -> None:
        self.warnings.append(f"{topic}: {text}")
        self._flag(topic, "warning", text)

    @contextmanager
    def check(self, topic: str) -> Iterator[None]:
        try:
            yield
        except _BAD_INPUT as e:
            self.problem(topic, str(e) or type(e).__name__)

    # ---- the checks, in the order a run meets them -----------------------------------------------
    def run_dir(self) -> None:
        job = self.job
        self.say("job", f"{job.run.name} ({self.job_path}); store {job.store_name!r}; run dir {job.run_dir}")
        why = writable_dir(job.run_dir)
        if why:
            self.problem("job", f"{why}; set run.dir to a writable directory")

    def model(self) -> None:
        m = self.job.model
        with self.check("model"):
            cfg = model_config(self.job)
            if m.source == "hf":
                from slidedp.model import hf_folder

                hf_folder.check_folder(m.path, cfg)
            self.cfg, self.layout = cfg, make_layout(cfg)
            what = f"random:{m.shape}" if m.source == "random" else m.path
            self.say("model", f"{what}: {cfg.family}, {cfg.num_layers} layers, vocabulary {cfg.vocab_size:,}, "
                              f"{cfg.num_parameters():,} parameters in {len(self.layout.chunks)} chunks")

    def data(self) -> None:
        from slidedp.sft import setup as sft_setup
        from slidedp.sft.packing import DocBatches

        if self.cfg is None:
            self.say("data", "not checked: it needs the model's vocabulary (see the model's problem)")
            return
        job, t = self.job, self.job.train
        t0 = time.perf_counter()
        paths = ", ".join(job.data.paths)
        before = len(self.problems)
        with self.check("data"):
            batches = sft_setup.open_training(job, self.cfg.vocab_size)  # every id < vocab, every record read
            self.batches = batches  # the plan charges rows of packed documents by their lengths
            epochs = t.steps * t.global_batch / batches.num_sequences
            took = f"(read in {time.perf_counter() - t0:.2f} s)"
            if isinstance(batches, DocBatches):
                rows = batches.stream
                self.say("data", f"{paths} ({job.data.format}, {rows.docs.kind}): "
                                 f"{rows.docs.stats.describe(t.seq_len)} {took}")
                self.say("", f"{sft_setup.describe(rows)}; {t.steps} steps x {t.global_batch} sequences = "
                             f"{epochs:.2f} epoch(s)")
            else:
                self.say("data", f"{paths} ({job.data.format}): {len(batches.stream):,} tokens, "
                                 f"{batches.num_sequences:,} sequences of {t.seq_len}; {t.steps} steps x "
                                 f"{t.global_batch} sequences = {epochs:.2f} epoch(s) {took}")
        if job.data.eval_path and len(self.problems) == before:  # read like the training data: its problems once
            with self.check("data"):
                rows = sft_setup.open_eval(job, self.cfg.vocab_size)
                assert rows is not None
                self.say("", f"eval {', '.join(job.data.paths_of_eval)}: {sft_setup.describe(rows)}; after "
                             f"{f'every {t.eval_every} steps and ' if t.eval_every else ''}the last step")
        if job.run.tensorboard:
            from .tensorboard import check_available

            why = check_available()
            if why:
                self.problem("run", why)

    def store(self) -> None:
        job, layout = self.job, self.layout
        if layout is None or self.cfg is None:
            self.say("store", "not checked: it needs the model (see the model's problem)")
            return
        name = job.store_name
        world = job.runtime.workers
        # the slots of the step unplanned_need counts (the plan picks an "auto" route later)
        step, held = unplanned_step(job, layout)
        clip = job.train.max_grad_norm > 0
        slots, _, full = jobrecord.gradient_space(layout, world, step.grad_route, clip, job.store.grad_slots, held)
        segments = dict(list_store_segments().get(name, []))
        if segments and self._left_behind(name, segments):
            segments = {}  # the run destroys it first: what it needs is a new store's space
        self.store_exists = bool(segments)
        # the launcher's own count and question (host_room.py), before the plan; once planned, plan() asks
        # it again with the plan's
        need = unplanned_need(job, layout, self.store_exists)
        if segments:
            try:
                self._existing_store(name, segments)
            except _BAD_INPUT as e:  # another model or an incomplete store: its space means nothing here
                self.problem("store", str(e))
                return
            self.say("", f"would attach and add gradient rings of {size(need.rings)} ({world} rank(s) x {slots} slots"
                         + (", a full-model reduction buffer for exact clipping" if full else
                            ", one per chunk: exact clipping keeps each gradient until the step's norm" if clip else "")
                         + ")")
        else:
            per = ("14" if job.store.shadow_bf16 is True else
                   "12; 14 with the bf16 shadow, where the plan delivers bf16: store.shadow_bf16 = \"auto\""
                   if job.store.shadow_bf16 == "auto" and job.plan.dtype == "bf16" else "12")
            self.say("store", f"would create store {name!r}: {size(need.state)} of state ({per} "
                              f"bytes/parameter) + {size(need.rings)} of gradient rings = {size(need.shm_bytes)}; "
                              f"{'kept' if job.store.persist else 'destroyed'} after the job (store.persist)")
        free, avail = shm_free_bytes(), psutil.virtual_memory().available
        self.say("", f"{SHM_DIR} has {size(free)} free; the host has {size(avail)} of memory available")
        problem = room_problem(job, need, avail, free)
        self.room_flagged = problem is not None
        if problem:
            self.problem("store", problem)

    def _left_behind(self, name: str, segments: dict[str, int]) -> bool:
        """A store that a dead job made for itself (store.persist = false): a run destroys it, never adopts it."""
        if "manifest" not in segments:
            return False
        try:
            m = Manifest.open(segment_name(name, "manifest"))
        except _BAD_INPUT:
            return False
        try:
            dead = left_behind({"exists": True, "persist": m.meta.get("persist", True), "creator": m.meta.get("creator")})
        finally:
            m.close()
        if dead:
            self.say("store", f"store {name!r} was left behind by {dead}, which made it with store.persist = false "
                              f"and is gone: a run would destroy it and create it anew")
        return dead is not None

    def _existing_store(self, name: str, segments: dict[str, int]) -> None:
        if "manifest" not in segments:
            raise RuntimeError(f"store {name!r} exists without a manifest segment (incomplete); "
                               f"destroy it with `slidedp-store destroy {name}`")
        m = Manifest.open(segment_name(name, "manifest"))
        try:
            held, mine = m.layout, self.layout
            assert mine is not None
            if held.hash() != mine.hash():
                raise RuntimeError(
                    f"store {name!r} holds another model ({m.meta.get('source', '?')}, {held.model.family}, "
                    f"{held.num_parameters:,} parameters) than this job ({mine.model.family}, {mine.num_parameters:,}): "
                    f"{describe_layouts(held, mine)}; set store.name to another store, or destroy it with `slidedp-store destroy {name}`")
            self.start = m.committed_step
            self.store_shadow = bool(m.meta.get("shadow"))
            self.store_status = {"exists": True, "generation": m.generation, "committed_step": m.committed_step,
                                 "attached_pid": m.attached_pid if _alive(m.attached_pid) else 0}
            self.say("store", f"store {name!r} exists ({size(sum(segments.values()))}, same model), "
                              f"committed step {m.committed_step}")
            pid = m.attached_pid
            if pid and _alive(pid):
                job = m.job().get("job", "?")
                # a running job's store is mid-step (chunk versions mixed, layers leased), not torn: say it is in use
                self.problem("store", f"store {name!r} has a job attached: {job!r} (launcher pid {pid}); wait for it to "
                                      f"finish or stop it")
                return
            if pid:
                self.say("", f"a job of pid {pid} left without detaching; its attachment would be cleared")
            torn = self.torn = m.torn_reason(allow_leased=False)
            if torn and not self.job.checkpoint.resume:
                self.problem("store", f"store {name!r} is torn ({torn}); set checkpoint.resume = \"latest\" or a "
                                      f"checkpoint path (or `slidedp-store restore {name} CHECKPOINT`)")
            elif torn:
                self.say("", f"store is torn ({torn}); the resume checkpoint would restore it")
            if self.job.store.shadow_bf16 != "auto" and bool(m.meta.get("shadow")) != self.job.store.shadow_bf16:
                self.warn("store", f"store.shadow_bf16 = {str(self.job.store.shadow_bf16).lower()} but the existing store "
                                   f"was made {'with' if m.meta.get('shadow') else 'without'} the bf16 shadow; the store's wins")
        finally:
            m.close()

    def resume(self) -> None:
        job = self.job
        want = job.checkpoint.resume
        if not want:
            self.say("resume", "none (checkpoint.resume = \"\")")
            return
        with self.check("resume"):
            if want == "latest":
                path = ckpt.latest_valid(job.checkpoint_dir)
                if path is None and self.torn:
                    raise ckpt.CheckpointError(f"store {job.store_name!r} is torn ({self.torn}) and {job.checkpoint_dir} "
                                               f"holds no valid checkpoint to restore; destroy the store or name a "
                                               f"checkpoint in checkpoint.resume")
                if path is None:
                    found = len(ckpt.list_checkpoints(job.checkpoint_dir))
                    self.say("resume", f"latest: no valid checkpoint under {job.checkpoint_dir}"
                                       f"{f' ({found} invalid ones skipped)' if found else ''}; would start from the "
                                       f"store's step {self.start}")
                    return
            else:
                path = Path(want)
            record = ckpt.read_record(path, verify=True)  # every file's sha256
            if self.layout is not None and record.get("layout_hash") != self.layout.hash():
                raise ckpt.CheckpointError(f"checkpoint {path} was taken from another model or chunking than this job's "
                                           f"({record.get('model', {}).get('family', '?')}); choose a checkpoint of this model")
            self.start = int(record["step"])
            self.say("resume", f"{path}: step {self.start}, files verified; would restore it into the store")
            self._data_position(record)

    def history(self) -> None:
        """What the run directory holds of another run, as the launcher decides it (launch/rundir.py)."""
        from .rundir import RunDirInUse, to_replace

        with self.check("job"):
            try:
                past = to_replace(self.job, self.store_status)
            except RunDirInUse as e:
                raise RuntimeError(str(e)) from None
            if past is not None:
                self.say("job", f"run.overwrite = true: would remove the previous run from {self.job.run_dir} "
                                f"({past.describe()})")

    def _data_position(self, record: dict) -> None:
        state = (record.get("extra") or {}).get("data")
        if not state or self.cfg is None:
            return
        from slidedp.data import DataError
        from slidedp.sft.setup import open_training

        try:
            open_training(self.job, self.cfg.vocab_size).check_state(self.start, state)
        except DataError as e:
            self.warn("resume", str(e))

    def steps(self) -> None:
        job, t = self.job, self.job.train
        world = job.runtime.workers
        if self.start >= t.steps:
            self.say("steps", f"the store would be at step {self.start} >= train.steps = {t.steps}: nothing to train")
            return
        per_rank = t.global_batch // world
        mb = job.plan.chosen("micro_batch")
        passes = (f"{per_rank // mb} micro-batch(es) of {mb} x {t.seq_len} tokens per rank"
                  if mb else f"{per_rank} x {t.seq_len} tokens per rank in micro-batches the plan chooses")
        self.say("steps", f"would train steps {self.start}..{t.steps - 1} on {world} {job.runtime.device} rank(s): "
                          f"{passes}, {t.global_batch * t.seq_len:,} tokens per step")
        traced = job.run.traced
        outside = [s for s in traced if not self.start <= s < t.steps]
        if traced:
            self.say("", f"would trace step(s) {', '.join(map(str, traced))} into {job.run_dir / 'trace.json'}")
        if outside:
            self.warn("steps", f"run.trace_steps {outside} are outside the steps this run trains "
                               f"({self.start}..{t.steps - 1}): nothing is traced for them")

    def checkpoints(self) -> None:
        job, c = self.job, self.job.checkpoint
        if not (c.every or c.final):
            self.say("checkpoint", "none (checkpoint.every = 0 and checkpoint.final = false)")
            return
        when = (f"every {c.every} steps (keeping {c.keep})" if c.every else "") + (
            " and " if c.every and c.final else "") + ("at the end" if c.final else "")
        self.say("checkpoint", f"{when}, into {job.checkpoint_dir} ({c.dtype} weights + fp32 moments)")
        why = writable_dir(job.checkpoint_dir)
        if why:
            self.problem("checkpoint", f"{why}; set checkpoint.dir to a writable directory")
            return
        if self.layout is None:
            return
        n = self.layout.num_parameters
        one = n * ((2 + 12) if c.dtype == "bf16" else 12)  # HF weights + moments (+ exact fp32 master with bf16)
        free = shutil.disk_usage(_existing_ancestor(job.checkpoint_dir)).free
        kept = (c.keep if c.every else 0) + (1 if c.final else 0)
        if one > free:
            self.problem("checkpoint", f"one checkpoint needs about {size(one)} but {_existing_ancestor(job.checkpoint_dir)} "
                                       f"has {size(free)} free; free space or set checkpoint.dir elsewhere")
        elif one * kept > free:
            self.warn("checkpoint", f"{kept} checkpoint(s) of about {size(one)} each need more than the "
                                    f"{size(free)} free on {_existing_ancestor(job.checkpoint_dir)}")

    def daemons(self) -> None:
        name = self.job.store_name
        running, start = [], []
        for role in daemonlock.ROLES:
            lock = paths.run_dir(name, create=False) / f"{role}.lock"
            if lock.exists() and daemonlock.held(name, role):
                running.append(f"slidedp-{role} (pid {daemonlock.holder_pid(name, role)})")
            else:
                start.append(f"slidedp-{role}")
        if running:
            self.say("daemons", f"would attach to the running {', '.join(running)}")
        if start:
            self.say("daemons" if not running else "", f"would start {', '.join(start)} as child processes")

    def plan(self) -> None:
        from .planning import DeliveryError, document_load, plan_job, shadow_fits

        job = self.job
        store = dict(store_shadow=self.store_shadow, shadow_fits=self.store_shadow is not None
                     or job.store.shadow_bf16 != "auto" or self.layout is None or shadow_fits(job, self.layout),
                     host_room=None if self.layout is None else room_for_plan(job, self.layout, self.store_exists),
                     documents=document_load(self.batches))
        if self.cfg is None:
            self.say("plan", "not made: it needs the model")
            return
        with self.check("plan"):
            if job.runtime.device != "cuda":
                try:
                    p = plan_job(job, **store)
                except DeliveryError as e:
                    raise RuntimeError(str(e)) from None
                step = p.step
                self.say("plan", f"CPU run: no plan needed (resident_layers={step.resident_layers}, "
                                 f"embedding={step.embedding}, micro_batch={step.micro_batch}, "
                                 f"delivery={step.delivery})")
                for n in p.notes:
                    self.say("", f"note: {n}")
                self._planned_room(p)
                return
            from slidedp.planner import PlanError

            from .jobrun import cuda_device_count

            count = cuda_device_count()
            if count == 0:
                raise RuntimeError("runtime.device = \"cuda\" but no CUDA device is visible to this process")
            if job.runtime.workers > count:
                self.warn("plan", f"{job.runtime.workers} ranks share {count} GPU(s)")
            try:
                p = plan_job(job, **store)
            except PlanError as e:
                raise RuntimeError(f"no plan fits: {e}") from None
            except DeliveryError as e:
                raise RuntimeError(str(e)) from None
            assert p.plan is not None
            self.say("plan", p.describe().replace("\n", "\n" + " " * 11))
            if self.store_shadow is None and p.shadow and job.store.shadow_bf16 == "auto":
                self.say("", "the plan delivers bf16: a run would create the store with the bf16 shadow "
                             "(2 B/param more host memory; store.shadow_bf16 = false keeps 12 B/param)")
            self._planned_room(p)

    def _planned_room(self, p) -> None:
        """The launcher's host check with the plan's own choices (its offloaded layers' buffers, its held
        layers' rings, the shadow), in its words: what the store's check above could not yet count."""
        if self.layout is None or self.room_flagged:
            return  # the store's check said it already
        room = planned_room_problem(self.job, self.layout, p.step, self.store_exists, p.shadow)
        if room:
            self.problem("host", room)

    def run(self) -> int:
        t0 = time.perf_counter()
        self.run_dir()
        self.model()
        self.data()
        self.store()
        self.resume()
        self.history()
        self.steps()
        self.checkpoints()
        self.daemons()
        self.plan()
        took = time.perf_counter() - t0
        if self.problems:
            print(f"dry run: {len(self.problems)} problem(s) a run would hit ({took:.2f} s); nothing was started "
                  f"or created", file=self.out)
            return 1
        print(f"dry run: no problems found{f', {len(self.warnings)} warning(s)' if self.warnings else ''} "
              f"({took:.2f} s); nothing was started or created", file=self.out)
        return 0


def dry_run(job: JobConfig, job_path: Path, out: TextIO | None = None) -> int:
    return DryRun(job, job_path, out or sys.stdout).run()
