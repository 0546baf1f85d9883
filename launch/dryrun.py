"""slidedp-launch --dry-run job.toml: check everything a run would trip over, in seconds, touching nothing.

It reads what a run reads (job file, model folder, data, an existing store's manifest, the
resume checkpoint, on CUDA the plan) but starts no daemon and creates no segment, run
directory or checkpoint. It prints what the run would do and every problem found, each
naming what to fix; exit status 0 when a run would start cleanly, 1 otherwise. What the
launcher decides (store, room, shadow, plan, resume point) it decides with the launcher's
own `admission.admit`, and prints that decision in its sections.
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
from slidedp.store.layout import Layout
from slidedp.store.manifest import Manifest
from slidedp.store.shm import SHM_DIR, list_store_segments, segment_name, shm_free_bytes

from .admission import Admission, AdmissionFacts, CheckpointFacts, HostFacts, StoreFacts, admit, job_layout
from .host_room import size, unplanned_need, unplanned_step
from .planning import check_layers, document_load
from .preflight import cuda_probe

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
    store_status: dict = field(default_factory=dict)  # the existing store as a run would find it (exists, ...)
    batches: object = None  # the training data as read (Batches or DocBatches), None until read
    # the facts a run gathers, and the launcher's decision on them (admission.py); None: not made
    store_facts: StoreFacts = field(default_factory=StoreFacts)
    checkpoint: CheckpointFacts | None = None  # the resume checkpoint, read and verified
    admission: Admission | None = None
    resume_error: str = ""  # why the resume checkpoint could not be read
    plan_error: str = ""  # why no decision was made: the plan's calibration failed
    host: HostFacts = field(default_factory=lambda: HostFacts(0, 0))  # read by store()
    _attached: tuple[int, bool, str] = (0, False, "")  # the store's attachment: launcher pid, alive, its job

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
            layers = check_layers(self.job, cfg)
            self.cfg, self.layout = cfg, job_layout(self.job, cfg)
            what = f"random:{m.shape}" if m.source == "random" else m.path
            self.say("model", f"{what}: {cfg.family}, {cfg.num_layers} layers, vocabulary {cfg.vocab_size:,}, "
                              f"{cfg.num_parameters():,} parameters in {len(self.layout.chunks)} chunks; "
                              + ("SlideDP's" if layers == "native" else "transformers'") + " layers")

    def data(self) -> None:
        from slidedp.data import setup as data_setup
        from slidedp.data.packing import DocBatches

        if self.cfg is None:
            self.say("data", "not checked: it needs the model's vocabulary (see the model's problem)")
            return
        job, t = self.job, self.job.train
        t0 = time.perf_counter()
        paths = ", ".join(job.data.paths)
        before = len(self.problems)
        with self.check("data"):
            batches = data_setup.open_training(job, self.cfg.vocab_size)  # every id < vocab, every record read
            self.batches = batches  # the plan charges rows of packed documents by their lengths
            epochs = t.steps * t.global_batch / batches.num_sequences
            took = f"(read in {time.perf_counter() - t0:.2f} s)"
            if isinstance(batches, DocBatches):
                rows = batches.stream
                self.say("data", f"{paths} ({job.data.format}, {rows.docs.kind}): "
                                 f"{rows.docs.stats.describe(t.seq_len)} {took}")
                self.say("", f"{data_setup.describe(rows)}; {t.steps} steps x {t.global_batch} sequences = "
                             f"{epochs:.2f} epoch(s)")
            else:
                self.say("data", f"{paths} ({job.data.format}): {len(batches.stream):,} tokens, "
                                 f"{batches.num_sequences:,} sequences of {t.seq_len}; {t.steps} steps x "
                                 f"{t.global_batch} sequences = {epochs:.2f} epoch(s) {took}")
        if job.data.eval_path and len(self.problems) == before:  # read like the training data: its problems once
            with self.check("data"):
                rows = data_setup.open_eval(job, self.cfg.vocab_size)
                assert rows is not None
                self.say("", f"eval {', '.join(job.data.paths_of_eval)}: {data_setup.describe(rows)}; after "
                             f"{f'every {t.eval_every} steps and ' if t.eval_every else ''}the last step")
        if job.run.tensorboard:
            from .tensorboard import check_available

            why = check_available()
            if why:
                self.problem("run", why)

    @property
    def start(self) -> int:
        """The step a run would start at: the admission's, or where it was not made, what is known of it."""
        if self.admission is not None:
            return self.admission.start
        return self.checkpoint.step if self.checkpoint else self.store_facts.committed_step

    def store(self) -> None:
        """The store as a run would find it, and the launcher's decision (admission.py), made here once all
        its facts are read: the store's section says its store and room parts."""
        job, layout = self.job, self.layout
        self._read_checkpoint()  # said by resume()
        if layout is None or self.cfg is None:
            self.say("store", "not checked: it needs the model (see the model's problem)")
            return
        name = job.store_name
        world = job.runtime.workers
        self.host = HostFacts(psutil.virtual_memory().available, shm_free_bytes())
        segments = dict(list_store_segments().get(name, []))
        if segments and self._left_behind(name, segments):
            segments = {}  # the run destroys it first: what it needs is a new store's space
        if segments:
            try:
                self.store_facts = self._existing_store(name, segments)
            except _BAD_INPUT as e:  # an incomplete or unreadable store: nothing is decided on it
                self.problem("store", str(e))
                return
        self._admit()
        adm = self.admission
        if adm is not None and not adm.matches:
            self.problem("store", adm.problems[0].text)  # another model: its space means nothing here
            return
        # what any plan takes (host_room.py), as the admission counted it before the plan; the slots of its
        # step (the plan picks an "auto" route later)
        need = unplanned_need(job, layout, bool(segments))
        step, held = unplanned_step(job, layout)
        clip = job.train.max_grad_norm > 0
        slots, _, full = jobrecord.gradient_space(layout, world, step.grad_route, clip, job.store.grad_slots, held)
        if segments:
            self.say("store", f"store {name!r} exists ({size(sum(segments.values()))}, same model), "
                              f"committed step {self.store_facts.committed_step}")
            if self._attachment(name) and adm is not None:
                for text in adm.of("store")[1]:
                    self.warn("store", text)
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
        self.say("", f"{SHM_DIR} has {size(self.host.shm_free)} free; the host has {size(self.host.available)} of "
                     f"memory available")
        for text in adm.of("store")[0] if adm is not None else ():
            self.problem("store", text)

    def _admit(self) -> None:
        """The launcher's decision on the facts read so far (admission.py)."""
        job = self.job
        assert self.cfg is not None
        gpus = cuda_probe()[0] if job.runtime.device == "cuda" else None
        facts = AdmissionFacts(job, self.cfg, self.store_facts, self.host, self.checkpoint,
                               document_load(self.batches), gpus)
        try:
            self.admission = admit(facts)
        except _BAD_INPUT as e:  # the plan's calibration failed (CUDA): said in the plan's place
            self.plan_error = str(e) or type(e).__name__

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

    def _existing_store(self, name: str, segments: dict[str, int]) -> StoreFacts:
        """The store as a run would find it, read from its manifest; what the host-state daemon would
        refuse at attach (another job attached) is kept for `_attachment` to say."""
        if "manifest" not in segments:
            raise RuntimeError(f"store {name!r} exists without a manifest segment (incomplete); "
                               f"destroy it with `slidedp-store destroy {name}`")
        m = Manifest.open(segment_name(name, "manifest"))
        try:
            held, pid = m.layout, m.attached_pid
            live = bool(pid) and _alive(pid)
            self._attached = (pid, live, m.job().get("job", "?") if live else "")
            self.store_status = {"exists": True, "generation": m.generation, "committed_step": m.committed_step,
                                 "attached_pid": pid if live else 0}
            # a running job's store is mid-step (chunk versions mixed, layers leased), not torn
            torn = None if live else m.torn_reason(allow_leased=False)
            return StoreFacts(True, m.meta.get("source", "?"), held.num_parameters, held.hash(), held.model.to_dict(),
                              held.chunk_rows, bool(m.meta.get("shadow")), m.committed_step, torn,
                              held.layer_chunk_numel)
        finally:
            m.close()

    def _attachment(self, name: str) -> bool:
        """What the host-state daemon says of the store at attach, which the dry run asks no daemon: a job
        attached, a torn store. False where the store is in use."""
        pid, live, job = self._attached
        if live:
            self.problem("store", f"store {name!r} has a job attached: {job!r} (launcher pid {pid}); wait for it to "
                                  f"finish or stop it")
            return False
        if pid:
            self.say("", f"a job of pid {pid} left without detaching; its attachment would be cleared")
        torn = self.store_facts.torn
        if torn and not self.job.checkpoint.resume:
            self.problem("store", f"store {name!r} is torn ({torn}); set checkpoint.resume = \"latest\" or a "
                                  f"checkpoint path (or `slidedp-store restore {name} CHECKPOINT`)")
        elif torn:
            self.say("", f"store is torn ({torn}); the resume checkpoint would restore it")
        return True

    def _read_checkpoint(self) -> None:
        """The resume checkpoint's record, every file verified (a run verifies it when it restores it)."""
        job = self.job
        want = job.checkpoint.resume
        if not want:
            return
        try:
            path = ckpt.latest_valid(job.checkpoint_dir) if want == "latest" else Path(want)
            if path is not None:
                self.checkpoint = CheckpointFacts.of(path, ckpt.read_record(path, verify=True), self.batches)
        except _BAD_INPUT as e:
            self.resume_error = str(e) or type(e).__name__

    def resume(self) -> None:
        job = self.job
        if not job.checkpoint.resume:
            self.say("resume", "none (checkpoint.resume = \"\")")
            return
        if self.resume_error:
            self.problem("resume", self.resume_error)
            return
        adm, ck = self.admission, self.checkpoint
        found = adm.of("resume")[0] if adm is not None else []
        if ck is None:
            if found:  # a torn store and nothing to restore
                self.problem("resume", found[0])
                return
            skipped = len(ckpt.list_checkpoints(job.checkpoint_dir))
            self.say("resume", f"latest: no valid checkpoint under {job.checkpoint_dir}"
                               f"{f' ({skipped} invalid ones skipped)' if skipped else ''}; would start from the "
                               f"store's step {self.start}")
            return
        if adm is not None and adm.resume is None:  # another model's checkpoint
            self.problem("resume", found[0])
            return
        self.say("resume", f"{ck.path}: step {ck.step}, files verified; would restore it into the store")
        for text in found:  # its data position
            self.problem("resume", text)

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
        job, adm = self.job, self.admission
        if self.cfg is None:
            self.say("plan", "not made: it needs the model")
            return
        if self.plan_error:
            self.problem("plan", self.plan_error)
            return
        if adm is None:
            self.say("plan", "not made: it needs the store (see the store's problem)")
            return
        problems, warnings = adm.of("plan")
        for text in warnings:
            self.warn("plan", text)
        p = adm.plan
        if p is None:
            if problems:
                self.problem("plan", problems[0])
            else:
                self.say("plan", "not made: a run stops at the store's problem above")
            return
        if job.runtime.device != "cuda":
            step = p.step
            self.say("plan", f"CPU run: no plan needed (resident_layers={step.resident_layers}, "
                             f"embedding={step.embedding}, micro_batch={step.micro_batch}, "
                             f"delivery={step.delivery})")
            for n in p.notes:
                self.say("", f"note: {n}")
        else:
            self.say("plan", p.describe().replace("\n", "\n" + " " * 11))
            if not adm.store_exists and adm.shadow and job.store.shadow_bf16 == "auto":
                self.say("", "the plan delivers bf16: a run would create the store with the bf16 shadow "
                             "(2 B/param more host memory; store.shadow_bf16 = false keeps 12 B/param)")
        # the launcher's host check with the plan's own choices (its offloaded layers' buffers, its held
        # layers' rings, the shadow), in its words: what the store's check above could not yet count
        for text in adm.of("host")[0]:
            self.problem("host", text)

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
