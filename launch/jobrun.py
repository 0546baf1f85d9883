"""One job from start to end: store, daemons, attach, workers, steps, checkpoints, teardown.

The launcher never touches tensors: it owns the job's lifecycle. It starts the daemons
that are not running (the embedded default), creates or restores the store, attaches,
spawns one worker per rank, follows the steps (StepDone from the aggregator, stats from the
workers), checkpoints at step boundaries, and on any child's death stops the job naming
the child and its exit status. It leaves behind only what is meant to persist.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import psutil
import zmq

from slidedp import daemonlock, numa
from slidedp.config import JobConfig, job_to_dict, job_to_toml, model_config
from slidedp.jobrecord import JobRecord, gradient_space
from slidedp.model.config import ModelConfig
from slidedp.data import setup as data_setup
from slidedp.data.packing import DocBatches
from slidedp.data.serve import stage_serve_files
from slidedp.rank_progress import RankProgress, progress_path, read_progress
from slidedp.protocol import (CONTROL_CONTINUE, CONTROL_STOP, ROLE_LAUNCHER, Ack, Control, Fault, Hello, JobEnd,
                              JobStart)
from slidedp.schedule import lr_at
from slidedp.stepplan import PLAN_FILE
from slidedp.planner.netfit import PROBE_FILE
from slidedp.store import checkpoint as ckpt
from slidedp.store.client import StoreRequestError, call
from slidedp.store.ephemeral import creator_record, left_behind
from slidedp.store.shm import shm_free_bytes
from slidedp.transport import bind_router, connect_dealer, identity, recv_dealer, recv_router, send

from . import children
from .admission import AdmissionFacts, CheckpointFacts, HostFacts, StoreFacts, admit
from .host_progress import HostProgress, Stall
from .host_room import job_part
from .host_plan import SharedPlan, adopted, agreement, job_with_choices
from .hosts import HostFault, HostLink
from .network import Probe, gpu_links_cap, read_probe
from .network import words as network_words
from .planning import check_layers, document_load, record_network, record_training
from .preflight import cuda_probe
from .rundir import RunDirInUse, add_to_run_record, check_run_dir, write_run_record
from .schedule_note import schedule_note
from .summary import summary
from .progress import Progress
from .steps import StepLedger

log = logging.getLogger("slidedp.launcher")


def worker_env() -> dict[str, str]:
    """The workers' environment: the caching allocator grows segments in place unless the user
    chose otherwise (a worker keeps hundreds of layer inputs alive between transient tensors,
    which fixed segments fragment: docs/tuning.md, in git history)."""
    env = dict(os.environ)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return env


class JobFailed(RuntimeError):
    pass


class RanksStalled(JobFailed):
    """On several hosts: this host's ranks stalled outside a collective that another host's ranks wait in."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"this host's ranks stalled: {detail}")
        self.detail = detail  # what the other hosts are told (they name this host with it)


def cuda_device_count() -> int:
    """GPUs visible to the workers, asked of a subprocess so the launcher holds no CUDA context."""
    return cuda_probe()[0]


def model_source(job: JobConfig) -> dict:
    m = job.model
    if m.source == "random":
        return {"source": "random", "shape": m.shape, "vocab_size": m.vocab_size, "init_seed": m.init_seed}
    return {"source": "hf", "path": m.path}


class JobRun:
    def __init__(self, job: JobConfig, job_path: Path) -> None:
        self.job = job
        self.store = job.store_name
        self.run_dir = job.run_dir
        self.world = job.runtime.workers
        self.timeout = job.runtime.timeout_s
        self.daemons: list[children.Child] = []
        self.workers: list[children.Child] = []
        self.created_store = False
        self.attached_token: int | None = None
        self.job_started = False
        self.stop_requested = 0
        self.stop_signal = 0  # the first signal that asked the job to stop
        self.last_checkpoint: Path | None = None  # the newest one this job wrote
        self.ctx = zmq.Context()
        self.agg: zmq.Socket | None = None
        self.job_sock: zmq.Socket | None = None
        self.checkpoint_pending = False
        self.external: dict[str, int] = {}  # role -> pid of the daemons this launcher found running
        self._gone: dict[str, str] = {}  # role -> how a daemon of the store died
        self._next_lock_check = 0.0
        self.gpus = 0  # CUDA devices the workers see (counted before the plan, for a CUDA job)
        self.hosts: HostLink | None = None  # on several hosts: the launchers' rendezvous and heartbeats
        self.network: Probe | None = None  # on several hosts: what the ranks' probe measured of the network
        # GPU workers get cores of their own (an OpenMP updater thread that shares a core with a busy
        # worker stalls every parallel region of the fused AdamW); CPU workers compute on every
        # core, so nothing is set aside for them.
        cores = len(os.sched_getaffinity(0))
        self.reserved_cpus = numa.reserved_count(cores, self.world) if job.runtime.device == "cuda" else 0

    # ---- setup ---------------------------------------------------------------------------------
    def prepare(self) -> tuple[int, int]:
        """Everything before the first step: the data, the daemons, the launcher's decision on the job
        (admission.py) and what it says to do, the job started on the daemons. Returns (the step training
        starts at, train.steps)."""
        job = self.job
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cfg = model_config(job)
        # the daemons start (seconds of imports each) while the launcher checks the model's layers and reads
        # the data; a refusal stops them (teardown) before any store is made
        self.daemons = children.start_daemons(self.store, job.runtime.updaters, job.runtime.updater_threads,
                                              self.timeout, reserve_cpus=self.reserved_cpus)
        check_layers(job, cfg)  # a model transformers' layers cannot run is refused before anything is made
        self._open_data(cfg.vocab_size)
        children.await_daemons(self.daemons, self.store, self.timeout)
        started = {c.name.removeprefix("slidedp-") for c in self.daemons}
        self.external = {r: daemonlock.holder_pid(self.store, r) for r in daemonlock.ROLES if r not in started}
        status = self._call("status", self.timeout)
        previous_train = status.get("last_train")  # before this job's attach replaces it
        dead_owner = left_behind(status)
        if dead_owner:
            log.warning("store %s was left behind by %s, which is gone: it created the store with store.persist = "
                        "false and should have destroyed it at its end. Destroying it and creating the store anew "
                        "rather than training on from its state (checkpoint.resume = \"latest\" restores the newest "
                        "checkpoint into the new store; store.persist = true keeps a store between jobs)",
                        self.store, dead_owner)
            self._call("destroy", self.timeout)
            status = self._call("status", self.timeout)
        # the launcher's decision (admission.py), before anything is cleared, created, restored or written; on
        # several hosts host 0's plan is every host's (host_plan.py)
        facts = self._facts(cfg, status)
        host0 = self._host0_plan()
        if host0 is not None:
            facts = replace(facts, job=job_with_choices(job, host0.step), calibration=host0.calibration)
        self.admission = adm = admit(facts)
        if adm.problem:
            raise JobFailed(adm.problem if host0 is None else f"host 0's plan on this host: {adm.problem}")
        for w in adm.warnings:
            log.warning("%s", w.text)
        self.layout, self.plan = adm.layout, adm.plan
        assert self.plan is not None  # a plan is made where nothing refused the job
        if host0 is not None:
            try:
                self.plan = replace(self.plan, step=adopted(self.plan.step, host0.step))
            except ValueError as e:
                raise JobFailed(str(e)) from None
            log.info("planned with host 0's calibration and choices: every host carries out host 0's plan")
        elif self.hosts is not None:
            calib = self.plan.plan.calibration if self.plan.plan is not None else None
            self.hosts.share_plan(SharedPlan(self.plan.step, calib).to_json())
        try:
            cleared = check_run_dir(job, status)
        except RunDirInUse as e:
            raise JobFailed(str(e)) from None
        if cleared:
            log.warning("%s", cleared)
        _write_atomic(self.run_dir / "job.resolved.toml", job_to_toml(job).encode())
        self._write_data(job)
        if not adm.store_exists:
            log.info("creating store %s from %s%s", self.store, model_source(job),
                     " with the bf16 shadow of the weights" if adm.shadow else "")
            t0 = time.perf_counter()
            st = self._call("create", max(self.timeout, 3600), shadow_bf16=adm.shadow,
                            layer_chunk_numel=job.plan.chosen("layer_chunk_numel"),
                            persist=job.store.persist, creator=creator_record(job.run.name),
                            part=part.to_dict() if (part := job_part(job)) else None, **model_source(job))
            self.created_store = True
            log.info("store %s created: %.3f B parameters, %.2f bytes/parameter, in %.2f s", self.store,
                     st["parameters"] / 1e9, st["bytes_per_parameter"], time.perf_counter() - t0)
            status = st
        self._resume(adm.resume, status)
        write_run_record(job, status)
        return self._start_job(cfg, adm.device_chunks, previous_train), job.train.steps

    def _open_data(self, vocab_size: int) -> None:
        """The training data (and the eval set's), read and checked against the vocabulary."""
        job = self.job
        t0 = time.perf_counter()
        self.batches = data_setup.open_training(job, vocab_size)
        if isinstance(self.batches, DocBatches):  # rows of documents, mapped by the workers
            rows = self.batches.stream
            log.info("data: %s: %s", ", ".join(job.data.paths), rows.docs.stats.describe(job.train.seq_len))
            log.info("data: %s (%.2f s)", data_setup.describe(rows), time.perf_counter() - t0)
        else:
            log.info("data: %s, %d tokens, %d sequences of %d (%.2f s)", ", ".join(job.data.paths),
                     len(self.batches.stream), self.batches.num_sequences, job.train.seq_len, time.perf_counter() - t0)
        self.eval_rows = data_setup.open_eval(job, vocab_size)
        if self.eval_rows is not None:
            when = f"every {job.train.eval_every} steps and " if job.train.eval_every else ""
            log.info("eval data: %s: %s; the eval loss after %sthe last step", ", ".join(job.data.paths_of_eval),
                     data_setup.describe(self.eval_rows), when)
        self.tokens_path = self.run_dir / "tokens.npy"
        self.docs_path = self.eval_path = None

    def _start_job(self, cfg: ModelConfig, device_chunks: tuple[int, ...], previous_train: dict | None) -> int:
        """Write the plan for the ranks, attach to the store and start the job on the daemons; returns the
        store's committed step, where training starts. previous_train: the last job's [train] on the store."""
        job = self.job
        assert self.plan is not None
        if self.plan.plan is not None or self.plan.notes:
            log.info("plan: %s", self.plan.describe().replace("\n", "\n    "))
        step = self.plan.step
        self.plan_path = self.run_dir / PLAN_FILE  # beside job.resolved.toml: what every rank carries out
        _write_atomic(self.plan_path, step.to_json().encode())
        slots, reduce_slots, _ = gradient_space(self.layout, self.world, step.grad_route, job.train.max_grad_norm > 0,
                                                job.store.grad_slots, device_chunks)
        record = JobRecord(job=job.run.name, store=self.store, world=self.world, train=job_to_dict(job)["train"],
                           layout_hash=self.layout.hash(), grad_slots=slots, device_chunks=device_chunks,
                           run_dir=str(self.run_dir), trace_steps=job.run.traced, grad_route=step.grad_route,
                           reduce_slots=reduce_slots, nnodes=job.runtime.nnodes, node_rank=job.runtime.node_rank)
        att = self._call("attach", self.timeout, job=job.run.name, pid=os.getpid(),
                   layout_hash=self.layout.hash(), model_desc=f"{cfg.family}, {cfg.num_parameters():,} parameters",
                   world=self.world, grad_slots=slots, full_reduce=record.full_reduce,
                   reduce_slots=record.reduce_slots, shard_slots=record.grad_route == "reduce_scatter",
                   shard_ranks=job.runtime.world,
                   hyper=job_to_dict(job)["train"])
        self.attached_token = att["token"]
        note = schedule_note(previous_train, job.train, att["committed_step"])
        if note:
            log.info("%s", note)
        self.agg = connect_dealer(self.ctx, self.store, "agg", identity("launcher", 0))
        send(self.agg, Hello(ROLE_LAUNCHER, 0, 1, os.getpid()))
        send(self.agg, JobStart(0, record.to_json()))
        ack = self._await_ack("the aggregator to start the job (slidedp-aggregator and slidedp-updater)")
        if not ack.ok:
            raise JobFailed(f"the daemons refused the job: {ack.text}")
        self.job_started = True
        self.job_sock = bind_router(self.ctx, self.store, "job")
        return att["committed_step"]

    def _facts(self, cfg: ModelConfig, status: dict) -> AdmissionFacts:
        """What the decision needs, gathered here: the store as its daemon says, this host's free memory,
        the resume checkpoint's record, the GPUs (counted once: the workers are placed on them)."""
        job = self.job
        gpus = cuda_device_count() if job.runtime.device == "cuda" else None
        self.gpus = gpus or 0
        return AdmissionFacts(job, cfg, StoreFacts.from_status(status),
                              HostFacts(psutil.virtual_memory().available, shm_free_bytes()),
                              checkpoint=self._resume_checkpoint(), documents=document_load(self.batches), gpus=gpus)

    def _write_data(self, job: JobConfig) -> None:
        """What the workers read, into the run dir (checked first: it holds no other run): the token ids or the
        documents' rows, the eval set's rows, and the files a checkpoint's model folder serves with."""
        if isinstance(self.batches, DocBatches):
            self.docs_path = self.run_dir / "data" / "train"
            self.batches.stream.save(self.docs_path)
        elif job.data.format == "npy":
            self.tokens_path = Path(job.data.path)
        else:
            _save_npy_atomic(self.tokens_path, np.asarray(self.batches.stream.tokens))
        if self.eval_rows is not None:
            self.eval_path = self.run_dir / "data" / "eval"
            self.eval_rows.save(self.eval_path)
        self.serve_files = stage_serve_files(job, self.run_dir / "serve")

    def _resume_checkpoint(self) -> CheckpointFacts | None:
        """The checkpoint checkpoint.resume names, or the newest valid one ("latest"), as its record says
        (its files are verified when the daemon restores it); None where none is asked or found."""
        want = self.job.checkpoint.resume
        if not want:
            return None
        path = self._latest_checkpoint() if want == "latest" else Path(want)
        if path is None:
            return None
        try:
            record = ckpt.read_record(path, verify=False)
        except ckpt.CheckpointError as e:
            raise JobFailed(f"checkpoint.resume: {e}") from None
        return CheckpointFacts.of(path, record, self.batches)

    def _resume(self, path: Path | None, status: dict) -> None:
        """Restore the checkpoint the admission chose, if any, into the store."""
        job = self.job
        if path is None:
            if job.checkpoint.resume:
                log.info("resume = latest: no checkpoint under %s yet; starting from the store's step %d",
                         job.checkpoint_dir, status["committed_step"])
            return
        # Verified (every file's sha256) and restored, unless the store holds it already to the bit: never
        # skipped because the steps agree (a corrupt checkpoint, or another run's at the same step).
        try:
            out = self._call("restore", max(self.timeout, 3600), path=str(path), unless_held=True)
        except StoreRequestError as e:
            raise JobFailed(f"checkpoint.resume: {e}") from None
        if out.get("restored", True):
            log.info("resumed from %s (step %d)", path, out["step"])
        else:
            log.info("resume: the store already holds %s byte for byte (step %d); nothing to restore", path, out["step"])

    def _latest_checkpoint(self) -> Path | None:
        """The newest checkpoint whose files all verify; each one skipped is logged with the reason."""
        for p in reversed(ckpt.list_checkpoints(self.job.checkpoint_dir)):
            try:
                ckpt.read_record(p)
                return p
            except ckpt.CheckpointError as e:
                log.warning("resume: skipping checkpoint %s: %s", p, e)
        return None

    def _await_ack(self, what: str) -> Ack:
        assert self.agg is not None
        deadline = time.monotonic() + self.timeout * 2
        while time.monotonic() < deadline:
            if self.agg.poll(200):
                msg = recv_dealer(self.agg)
                if isinstance(msg, Ack):
                    return msg
            dead = self._dead_daemon(("aggregator", "updater"))
            if dead:
                raise JobFailed(f"{dead}; no answer from {what}")
            self._check_hosts()
        raise JobFailed(f"no answer from {what} within {self.timeout * 2:.0f} s")

    # ---- the daemons: liveness and requests -------------------------------------------------------
    def _dead_daemon(self, roles: tuple[str, ...] = daemonlock.ROLES) -> str | None:
        """How one of the store's daemons (of `roles`) died, or None while they all run.

        Our children report their exit status; daemons we found running (systemd's, a test's)
        are watched through their lock, which the kernel releases when they die."""
        for c in self.daemons:
            role = c.name.removeprefix("slidedp-")
            if role not in self._gone and not c.alive():
                self._gone[role] = _with_note(c.describe_exit(), daemonlock.exit_note(self.store, role))
        now = time.monotonic()
        if self.external and now >= self._next_lock_check:
            self._next_lock_check = now + 0.5
            for role, pid in self.external.items():
                if role not in self._gone and not daemonlock.held(self.store, role):
                    self._gone[role] = _with_note(f"slidedp-{role} (pid {pid}, not started by this launcher) is gone",
                                                  daemonlock.exit_note(self.store, role))
        return next((self._gone[r] for r in roles if r in self._gone), None)

    def _call(self, kind: str, timeout_s: float, **args) -> dict:
        """A request to the store that fails at once, naming the host-state daemon, if it dies meanwhile
        (a plain call would wait out its whole timeout: up to an hour for a checkpoint)."""

        def check() -> None:
            dead = self._dead_daemon(("hoststate",))
            if dead:
                raise JobFailed(f"{dead}; its {kind} request was not answered")
            self._check_hosts()

        return call(self.store, kind, timeout_s=timeout_s, check=check, **args)

    def _check_hosts(self) -> None:
        """On several hosts: fail at once, naming the host, when another host has failed, is lost or stalled;
        or naming this host's ranks, when they stalled behind another host's."""
        if self.hosts is None:
            return
        fault = self.hosts.fault()
        if fault:
            raise HostFault(fault)
        stall = self.hosts.stalled_here()
        if stall:
            raise RanksStalled(self._stalled_ranks(stall))

    def _ranks_progress(self) -> list[RankProgress]:
        """This host's ranks' progress files (a rank that has not made its file yet has entered nothing)."""
        rt = self.job.runtime
        return [read_progress(progress_path(self.run_dir, rt.global_rank(r))) or RankProgress(0, 0, 0)
                for r in range(self.world)]

    def _host_progress(self) -> HostProgress:
        return HostProgress.of_ranks(self._ranks_progress())

    def _stalled_ranks(self, stall: Stall) -> str:
        """The ranks of this host that have not entered the collective, in words."""
        ranks = [r for r, p in enumerate(self._ranks_progress()) if p.entered < stall.collective]
        who = ", ".join(f"{self.workers[r].name} (pid {self.workers[r].proc.pid})" for r in ranks) or "its ranks"
        return f"{who} {'has' if len(ranks) == 1 else 'have'} not entered {stall.what()}"

    def hosts_ready(self, start: int) -> None:
        """On several hosts, the barrier before the workers start: every host ready, at the same step."""
        if self.hosts is None:
            return

        def check() -> None:
            dead = self._dead_daemon()
            if dead:
                raise JobFailed(f"{dead} before the workers started")

        log.info("waiting for every host to be ready (runtime.nnodes = %d)", self.job.runtime.nnodes)
        assert self.plan is not None and self.layout is not None and self.batches is not None
        self.hosts.ready(start, check, agreement(self.job, self.layout.hash(), self.batches.state(start), self.plan.step))

    def _host0_plan(self) -> SharedPlan | None:
        """On a host other than host 0, host 0's plan once it has planned (None on host 0 and on one host)."""
        if self.hosts is None or self.job.runtime.node_rank == 0:
            return None
        log.info("waiting for host 0's plan (every host carries it out)")

        def check() -> None:
            dead = self._dead_daemon()
            if dead:
                raise JobFailed(f"{dead} while waiting for host 0's plan")

        return SharedPlan.from_json(self.hosts.host0_plan(check))

    # ---- running ---------------------------------------------------------------------------------
    def spawn_workers(self, start: int, end: int) -> None:
        job = self.job
        device = job.runtime.device
        count = self.gpus  # counted for the admission, which refuses a CUDA job without a GPU
        (self.run_dir / PROBE_FILE).unlink(missing_ok=True)  # an earlier run's probe is not this run's
        dist_file = self.run_dir / f".dist-{os.getpid()}-{time.monotonic_ns()}"
        if self.hosts is not None:  # an earlier run's counts would be taken for this one's
            for rank in range(self.world):
                progress_path(self.run_dir, job.runtime.global_rank(rank)).unlink(missing_ok=True)
        for rank in range(self.world):
            dev = f"cuda:{rank % count}" if device == "cuda" else "cpu"
            argv = [sys.executable, "-m", "slidedp.worker", "--rank", str(rank), "--job", str(self.run_dir / "job.resolved.toml"),
                    "--plan", str(self.plan_path), "--start", str(start), "--end", str(end), "--device", dev,
                    *self._data_args(), "--dist-file", str(dist_file)]
            if device == "cuda" and self.world > count:
                argv.append("--shared-device")
            if self.reserved_cpus:
                kept = numa.reserved(self.reserved_cpus)
                argv += ["--cpus", ",".join(map(str, numa.worker_cpus(kept, self.world, rank))),
                         "--kept-cpus", ",".join(map(str, kept))]
            self.workers.append(children.spawn(f"worker rank {rank}", argv, env=worker_env(),
                                               on_parent_death=signal.SIGKILL))
        if self.hosts is not None:  # published beside the heartbeat from now on: a stall is named
            self.hosts.progress_of = self._host_progress

    def _trained_tokens(self, step: int) -> int:
        if isinstance(self.batches, DocBatches):
            return self.batches.batch(step).trained_tokens
        return self.job.train.global_batch * self.job.train.seq_len

    def _data_args(self) -> list[str]:
        out = ["--docs", str(self.docs_path)] if self.docs_path else ["--tokens", str(self.tokens_path)]
        return out + (["--eval-docs", str(self.eval_path)] if self.eval_path else [])

    def follow(self, start: int, end: int, progress: Progress) -> int:
        """Run steps start..end-1; returns the last committed step + 1."""
        assert self.agg is not None and self.job_sock is not None
        poller = zmq.Poller()
        poller.register(self.agg, zmq.POLLIN)
        poller.register(self.job_sock, zmq.POLLIN)
        ledger = StepLedger(start, end, self.world, self.job.checkpoint.every)
        stop_at: int | None = None
        last_activity = time.monotonic()
        while ledger.committed < (stop_at if stop_at is not None else end):
            if self.stop_requested and stop_at is None:
                # first take all that was sent: a rank may be one step past the count so far
                self._take_messages(ledger)
                self._report_completed(ledger, progress)
                stop_at = self._tell_stop(ledger.committed, end) + 1
            if self.stop_requested > 1:
                raise JobFailed("stopped by a second interrupt; the store may be torn (restore a checkpoint)")
            if poller.poll(200) and self._take_messages(ledger):
                last_activity = time.monotonic()
            self._report_completed(ledger, progress)
            committed = ledger.committed
            self._read_network()
            self._check_hosts()
            self._check_children(committed)
            if time.monotonic() - last_activity > self.timeout * 3 and not any(w.alive() for w in self.workers):
                raise JobFailed(f"the workers exited but step {committed} was never committed")
        return ledger.committed

    def _read_network(self) -> None:
        """On several hosts, once the ranks' probe has written its file: what it measured, logged beside what the
        plan charged."""
        if self.network is not None or self.job.runtime.nnodes == 1:
            return
        self.network = read_probe(self.run_dir, gpu_links_cap(self.plan, self.world))
        if self.network is not None:
            (log.info if self.network.fit else log.warning)("%s", network_words(self.network, self.plan))

    def keep_network(self) -> None:
        """At the end of a run on several hosts: what the probe measured, in the run's record and the host's cache
        for the next plan here (learn.record_network)."""
        self._read_network()  # a run too short for the loop to see it
        probe = self.network
        if probe is None:
            return
        try:
            add_to_run_record(self.run_dir, "network", probe.to_dict())
        except OSError as e:  # the job trained; only the record of what the probe measured is lost
            log.warning("could not add the network's measurement to %s: %s", self.run_dir / "run.json", e)
        if probe.fit is not None:
            record_network(probe.fit, probe.backend, probe.measured_at, probe.nnodes, probe.ranks)

    def _take_messages(self, ledger: StepLedger) -> bool:
        """Everything the aggregator and the workers have sent so far; True if a step was committed."""
        assert self.agg is not None and self.job_sock is not None
        progressed = False
        while self.agg.poll(0):
            msg = recv_dealer(self.agg)
            if isinstance(msg, Fault):
                raise JobFailed(f"{'updater' if msg.role == 2 else 'rank'} {msg.rank} failed: {msg.text}")
            progressed |= ledger.on_message(msg)
        while self.job_sock.poll(0):
            item = recv_router(self.job_sock)
            if item:
                ledger.on_message(item[1])
        return progressed

    def _report_completed(self, ledger: StepLedger, progress: Progress) -> None:
        """Report every completed step, in order; start the checkpoints due after them."""
        while (done := ledger.complete(self._workers_gone())) is not None:
            progress.step(done.step, done.done, done.stats, lr_at(self.job.train, done.step), done.eval_loss,
                          self._trained_tokens(done.step))
            if done.checkpoint:
                self.checkpoint(ledger.committed, background=True)
                for r in range(self.world):
                    self._control(r, CONTROL_CONTINUE, done.step)

    def _tell_stop(self, committed: int, end: int) -> int:
        """The last step of a job asked to stop, told to every worker: one that no rank has started past.

        A rank may be one step ahead of the launcher's count (its forward of step s needs step s-2
        committed, whose StepDone the launcher has taken once it took all that was sent): so every
        rank can finish step committed + 1 and stop there, together (stopping after `committed`
        would leave a rank already in the next step waiting for the others' loss)."""
        last = min(end - 1, committed + 1)
        log.info("stop requested: finishing step %d, then stopping", last)
        for r in range(self.world):
            self._control(r, CONTROL_STOP, last)
        return last

    def wait_workers(self) -> None:
        """Workers write device-held state back as they finish: wait for them before the last checkpoint."""
        deadline = time.monotonic() + self.timeout
        for w in self.workers:
            while True:
                try:
                    w.proc.wait(max(0.01, min(0.2, deadline - time.monotonic())))
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() >= deadline:
                        raise JobFailed(f"{w.name} did not exit within {self.timeout:.0f} s after the last step") from None
                    self._check_hosts()
            if w.proc.returncode != 0:
                raise JobFailed(f"{w.describe_exit()} after the last step")

    def _workers_gone(self) -> bool:
        return all(not w.alive() for w in self.workers)

    def _control(self, rank: int, kind: int, step: int) -> None:
        assert self.job_sock is not None
        try:
            send(self.job_sock, Control(kind, step), to=identity("w", rank))
        except zmq.ZMQError:
            pass  # a worker that already finished

    def _check_children(self, committed: int) -> None:
        dead = self._dead_daemon()
        if dead:
            raise JobFailed(f"{dead} during step {committed}")
        for w in self.workers:
            if not w.alive() and w.proc.returncode != 0:
                raise JobFailed(f"{w.describe_exit()} during step {committed}; see its log above")

    # ---- checkpoints and teardown ------------------------------------------------------------------
    def checkpoint(self, step: int, background: bool = False) -> Path | None:
        """Checkpoint the committed step. background: the daemon writes it while training goes on
        (chunks are released as they are copied); `finish_checkpoints` collects the outcome."""
        job = self.job
        extra = {"job": job.run.name, "data": self.batches.state(step), "seed": job.train.seed}
        t0 = time.perf_counter()
        # the tokenizer's files, chat template, generation and source config go into model/ (hashed with the
        # rest) so the folder is ready to serve as is
        extra_files = [str(f) for f in self.serve_files]
        out = self._call("checkpoint", max(self.timeout, 3600), dir=str(job.checkpoint_dir), dtype=job.checkpoint.dtype,
                         keep=job.checkpoint.keep, extra=extra, extra_files=extra_files, background=background)
        if background:
            self.checkpoint_pending = True
            log.info("checkpoint of step %d started; training goes on while it is written", out["step"])
            return None
        log.info("checkpoint of step %d written to %s in %.2f s", out["step"], out["path"], time.perf_counter() - t0)
        self.last_checkpoint = Path(out["path"])
        return self.last_checkpoint

    def finish_checkpoints(self) -> None:
        """Wait for a checkpoint still being written in the background; its failure fails the job."""
        if not self.checkpoint_pending:
            return
        self.checkpoint_pending = False
        out = self._call("checkpoint_wait", max(self.timeout, 3600))
        if "path" in out:
            log.info("checkpoint of step %d is complete: %s", out["step"], out["path"])
            self.last_checkpoint = Path(out["path"])

    def teardown(self, failed: bool) -> None:
        children.stop(self.workers, timeout_s=5 if failed else 30)
        dead = self._dead_daemon(("aggregator", "updater"))
        if self.job_started and self.agg is not None and dead:
            # the aggregator would wait for the pool's acks forever; the next JobStart resets it
            log.warning("not ending the job on the daemons: %s", dead)
        elif self.job_started and self.agg is not None:
            try:
                send(self.agg, JobEnd(0, ""))
                self._await_ack("the aggregator to end the job")
            except (JobFailed, zmq.ZMQError) as e:
                log.warning("ending the job on the daemons: %s", e)
        if self.attached_token is not None:
            try:
                self._call("detach", self.timeout, token=self.attached_token)
            except (StoreRequestError, TimeoutError, JobFailed) as e:
                log.warning("detach: %s", e)
        if self.created_store and not self.job.store.persist:
            try:
                self._call("destroy", self.timeout)
                log.info("store %s destroyed (store.persist = false)", self.store)
            except (StoreRequestError, TimeoutError, JobFailed) as e:
                log.warning("could not destroy store %s: %s", self.store, e)
        for s in (self.agg, self.job_sock):
            if s is not None:
                s.close(linger=0)
        children.stop(self.daemons)
        self.ctx.term()
        daemonlock.remove_idle_run_dir(self.store)  # daemons that stopped together may each have left it to another


def _with_note(exit_text: str, note: str) -> str:
    """A daemon's exit and, where it left one, its own word on why (the updater pool names its member)."""
    return f"{exit_text}: {note}" if note else exit_text


def _write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` by a new inode: a running job's workers keep reading (or mapping) the old one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _save_npy_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.npy")
    np.save(tmp, array, allow_pickle=False)
    os.replace(tmp, path)


def host_failure(run: JobRun, e: Exception) -> str:
    """The failure in words. On several hosts it is first told to the other hosts; where it is this host's
    own (not a HostFault, which names another host already) and another host failed first, is lost, or its
    ranks stalled, that host is named: a worker in a collective with a dead or stalled peer fails too (its
    workers are stopped first, so nothing trains on while the hosts' heartbeats tell, within
    runtime.timeout_s). A host whose own ranks stalled says so, and the hosts that failed waiting for them
    name it."""
    text = str(e)
    if run.hosts is None:
        return text
    if isinstance(e, RanksStalled):  # the others name this host with it, whatever its place among the ends
        run.hosts.failed(e.detail, stalled=True)
    else:
        run.hosts.failed(text)
    if isinstance(e, HostFault):
        return text
    children.stop(run.workers, timeout_s=5)
    return run.hosts.explain(text)


def run_job(job: JobConfig, job_path: Path, progress: Progress) -> int:
    run = JobRun(job, job_path)

    def on_signal(signum, frame):
        run.stop_requested += 1
        run.stop_signal = run.stop_signal or signum
        if run.stop_requested > 1:
            log.warning("second interrupt: stopping now")

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    failed = True
    t0 = time.perf_counter()
    rt = job.runtime
    try:
        if rt.nnodes > 1:  # first: a host that never comes is named within runtime.timeout_s
            run.hosts = HostLink(rt.nnodes, rt.node_rank, rt.master_addr, rt.master_port, rt.timeout_s)
        start, end = run.prepare()
        run.hosts_ready(start)
        committed = start
        log.info("ready in %.2f s: store %s at step %d; training steps %d..%d on %d %s worker(s)",
                 time.perf_counter() - t0, run.store, start, start, end - 1, run.world, job.runtime.device)
        progress.predicted_step_s = run.plan.step.predicted_step_s
        progress.params = run.layout.num_parameters
        progress.predicted_clipped_step_s = run.plan.step.predicted_clipped_step_s
        progress.predicted_corrected_step_s = run.plan.step.predicted_corrected_step_s
        progress.planned_device_bytes = run.plan.step.planned_device_bytes
        progress.begin(start, end, run.run_dir)
        if start >= end:
            log.info("the store is already at step %d >= train.steps = %d: nothing to train", start, end)
        else:
            run.spawn_workers(start, end)
            committed = run.follow(start, end, progress)
            run.wait_workers()
            run.finish_checkpoints()
            if job.checkpoint.final or run.stop_requested:
                if job.checkpoint.every or job.checkpoint.final:
                    run.checkpoint(committed)
            # last: what the run teaches the planner matters less than the job's state
            record_training(run.plan, progress.update_busy_s, progress.device_side_s, reduce_busy_s=progress.reduce_busy_s)
            run.keep_network()
        failed = False
        if run.stop_signal:  # stopped cleanly, but not finished: a script must not take it for done
            if run.hosts is not None:
                run.hosts.failed(f"stopped by {signal.Signals(run.stop_signal).name} at step {committed}")
            log.warning("stopped by %s before train.steps = %d%s; exit status %d", signal.Signals(run.stop_signal).name,
                        end, f" (checkpoint {run.last_checkpoint})" if run.last_checkpoint else "", 128 + run.stop_signal)
            return 128 + run.stop_signal
        return 0
    except (JobFailed, StoreRequestError, TimeoutError, RuntimeError, OSError, ValueError) as e:
        log.error("job failed: %s", host_failure(run, e))
        return 1
    finally:
        progress.end()
        run.teardown(failed)
        if run.hosts is not None:
            run.hosts.close(ok=not failed and not run.stop_signal)
        text = summary(progress.records, time.perf_counter() - t0, run.last_checkpoint,
                       "stopped early" if run.stop_signal else "failed" if failed else "",
                       network=run.network.words() if run.network is not None else "")
        if text:
            print(text, file=progress.stream, flush=True)
