"""The worker's core: one rank's engine, built from the job and the step plan, and its step loop.

Per step it slices the rank's sequences, runs the engine, writes device-held units back to the
store where a checkpoint or the end needs them there, reports the step's stats to the launcher,
and between steps holds at a checkpoint until the launcher says go on (or stop). The shell
(shell.py) owns the process: argv, CPU affinity, signals, sockets, the CUDA set-up.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .. import faults
from .. import log as slog
from ..config import JobConfig, model_config
from ..data.batches import Batches, open_batches, rank_slice
from ..data.packing import DocBatches, PackedRows, SftBatch
from ..data.stream import TokenStream
from ..jobrecord import held_unit_names
from ..model import layers as L
from ..model.family import math_for
from ..model.dtypes import torch_dtype
from ..protocol import CONTROL_STOP, EvalLoss, WorkerStats
from ..stepplan import StepPlan
from ..stopflag import StopFlag
from ..store.rings import GradRings
from ..store.store import HostStore
from ..tracing import Tracer
from ..transport import PeerTimeout
from . import feed
from .collectives import Group
from .device_state import DeviceHeld
from .engine import Engine, units_of
from .hosts import HostsLink, check_same_start, host_sums
from .link import LauncherLink, WorkerLink
from .netprobe import network_words, probe_network

log = slog.get("worker")


def profiled(fn, trace_path: Path, device: torch.device):
    """Run one step under torch.profiler; write a Chrome trace and log the top ops."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    prof.export_chrome_trace(str(trace_path))
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    log.info("profile written to %s\n%s", trace_path, prof.key_averages().table(sort_by=key, row_limit=25))
    return out


def alloc_retries(device: torch.device) -> int:
    """The caching allocator's retries so far: times a cudaMalloc met the memory cap, so the allocator
    freed its cached blocks (synchronizing the device) and tried again. 0 off CUDA."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def needs_group(plan: StepPlan, world: int) -> bool:
    """Whether the ranks talk among themselves: device-held units (their gradients are all-reduced)
    or a sharded route."""
    return world > 1 and (plan.embedding_held or plan.device_layers > 0 or plan.sharded)


def open_batches_for(job: JobConfig, vocab_size: int, tokens: Path | None, docs: Path | None = None) -> Batches:
    """The job's batches: from the launcher's rows of documents or pre-tokenized .npy, or the job's data itself."""
    if docs is not None:
        return DocBatches(PackedRows.load(docs, job.train.seq_len), job.train.global_batch, job.data.shuffle,
                          job.data.seed)
    if tokens is None:
        return open_batches(job, vocab_size)
    stream = TokenStream(np.load(tokens, mmap_mode="r", allow_pickle=False), vocab_size, str(tokens))
    return Batches(stream, job.train.seq_len, job.train.global_batch, job.data.shuffle, job.data.seed)


def check_delivery(plan: StepPlan, store: HostStore) -> None:
    """The bf16 delivery streams the store's shadow: a store made without one cannot serve it."""
    if plan.delivery == "bf16" and not store.has_shadow:
        raise RuntimeError(f"the plan delivers the bf16 shadow of the weights (delivery = 'bf16'), but store "
                           f"{store.name!r} was created without one: create it with store.shadow_bf16 = true "
                           f"(`slidedp-store create --shadow-bf16`), or run with plan.delivery = \"fp32\"")


@dataclass
class LauncherOrders:
    """What the launcher has asked between steps: the step after which every rank stops (None: not asked)."""
    stop_after: int | None = None


def await_launcher(launcher: LauncherLink, step: int, hold: bool, hold_s: float, stop: StopFlag, rank: int,
                   orders: LauncherOrders | None = None) -> bool:
    """After `step`: take the launcher's order if one is there; at a checkpoint (`hold`) wait for it,
    up to `hold_s`. True to stop: the launcher asked every rank to stop after a step this rank has
    reached (a rank behind the others runs on to it), or SIGTERM came while held."""
    orders = orders if orders is not None else LauncherOrders()
    deadline = time.monotonic() + (hold_s if hold else 0)
    while True:
        if orders.stop_after is not None and step >= orders.stop_after:
            log.info("stopping after step %d as the launcher asked", step)
            return True
        msg = launcher.control(100 if hold else 0)
        if msg is not None:
            if msg.kind == CONTROL_STOP:  # after step msg.step: every rank stops at the same step
                orders.stop_after = msg.step
                continue
            if msg.step == step:
                return False
        if not hold:
            return False
        if time.monotonic() > deadline:
            raise PeerTimeout(f"rank {rank} waited for the launcher past the checkpoint after step {step}")
        if stop.requested:
            log.info("stopping at the checkpoint after step %d (SIGTERM)", step)
            return True


class WorkerCore:
    """One rank: the engine over the store, the step loop, the checkpoint hold."""

    def __init__(self, job: JobConfig, plan: StepPlan, rank: int, world: int, device: torch.device, store: HostStore,
                 rings: GradRings, link: WorkerLink, launcher: LauncherLink, stop: StopFlag, run_dir: Path, start: int,
                 end: int, tokens: Path | None = None, group: Group | None = None, docs: Path | None = None,
                 eval_docs: Path | None = None) -> None:
        self.job, self.plan, self.rank, self.world, self.device = job, plan, rank, world, device
        self.store, self.rings, self.link, self.launcher, self.stop = store, rings, link, launcher, stop
        self.run_dir, self.start, self.end = run_dir, start, end
        self.done_steps = start
        self.orders = LauncherOrders()  # the launcher's stop, once it has asked for one
        t, rt = job.train, job.runtime
        # the data, the process group and the shards know the rank among every host's (docs/multi-host.md);
        # the host's store, rings and aggregator know it as one of this host's `world`
        self.global_rank, self.global_world = rt.global_rank(rank), rt.world
        torch.manual_seed(t.seed + self.global_rank)
        cfg = model_config(job)
        if store.layout.model != cfg:
            raise RuntimeError(f"store {store.name!r} holds another model than the job describes")
        self.batches = open_batches_for(job, cfg.vocab_size, tokens, docs)
        self.eval_rows = PackedRows.load(eval_docs, t.seq_len) if eval_docs is not None else None
        dtype = torch_dtype(plan.compute_dtype)
        compiled = L.compiled_kernels_wanted(t.compile, device)
        math = math_for(cfg, plan.layers, device, dtype, compile=compiled,
                        router_aux=t.adds_router_aux(cfg.source()))
        if compiled:  # the native pieces, and dynamo's settings for transformers' compiled layers
            L.compile_kernels(fallback=t.compile == "auto")
            log.info("the layers' pointwise kernels go through torch.compile at first use (train.compile = %r%s)",
                     t.compile, ": eager where compiling fails" if t.compile == "auto" else "")
        check_delivery(plan, store)
        units = units_of(store.layout)
        names = held_unit_names(store.layout.model, plan)
        self.held = {n: DeviceHeld(store, units[n], device, dtype, t, self.global_rank, group) for n in names}
        self.group = group
        if rt.nnodes > 1:
            assert group is not None
            check_same_start(group, start, rt.nnodes, rt.node_rank, rank, device)
            # the network between hosts, timed before any training: the launcher reads local rank 0's file
            doc = probe_network(group, device, rt.nnodes, run_dir if rank == 0 else None)
            if rank == 0:
                log.info("the network between hosts: %s (probe %.2f s)", network_words(doc), doc["probe_s"])
            link = HostsLink(link, group, device, rank)  # type: ignore[assignment]
        self.engine = Engine(cfg, store.layout, store.flat("master"), device, dtype, link,
                             lambda slot, numel: rings.slot(rank, slot, numel), t.global_batch * t.seq_len, plan,
                             t.max_grad_norm, self.held,
                             param_group=group if plan.param_route == "sharded" else None,
                             grad_group=group if plan.grad_route == "reduce_scatter" else None,
                             shadow=store.flat("shadow") if plan.delivery == "bf16" else None, math=math,
                             rows_from_host=rt.nnodes == 1)
        self.tracer = Tracer(run_dir, f"worker{rank}", job.run.traced)
        self.engine.set_tracer(self.tracer)
        link.tracer = self.tracer
        self.micro = t.global_batch // self.global_world // plan.micro_batch
        self.profile_step = int(os.environ.get("SLIDEDP_PROFILE_STEP", "-1"))

    def run(self) -> None:
        """Steps start..end-1, or until a stop (SIGTERM, or the launcher's order)."""
        t, plan, start, end = self.job.train, self.plan, self.start, self.end
        log.info("rank %d/%d on %s: steps %d..%d, %s layers, %d micro-batch(es) of %d x %d tokens; params %s (%d ahead), "
                 "grads %s; %s, %d layer(s) offloaded; held on the device: %s; weights delivered as %s", self.rank,
                 self.world, self.device, start, end - 1, "SlideDP's" if plan.layers == "native" else "transformers'",
                 self.micro, plan.micro_batch, t.seq_len, "sharded" if self.engine.delivery.group else "replicated",
                 plan.prefetch_depth, "reduce_scatter" if self.engine.grads.group else "host",
                 f"seq tiles of {plan.seq_tile_tokens} tokens" if plan.seq_tile_tokens else "untiled",
                 plan.offload_layers, ", ".join(self.held) or "nothing",
                 "the bf16 shadow" if plan.delivery == "bf16" else "the fp32 master")
        for step in range(start, end):
            if self.stop.requested:
                log.info("stopping before step %d (SIGTERM)", step)
                return
            faults.hold("step", step)  # the message tests: the launcher reads garbage while the ranks wait here
            if self.group is not None:
                self.group.progress.at_step(step)
            self.launcher.stats(self.step(step))
            if self.between_steps(step):
                return

    def step(self, step: int) -> WorkerStats:
        """One training step; its stats for the launcher."""
        t, device, engine, link = self.job.train, self.device, self.engine, self.link
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        link.waits = dict.fromkeys(link.waits, 0.0)
        link.step = step
        h2d0, d2h0 = engine.delivery.h2d_bytes, engine.grads.d2h_bytes
        retries0 = alloc_retries(device)
        batch, mbs = self.batches.batch(step), self.plan.micro_batch
        if isinstance(batch, SftBatch):  # rows of documents: masks, positions, the global trained count
            run_step = lambda: feed.run_step(engine, batch, step, self.global_rank, self.global_world,  # noqa: E731
                                             self.micro, mbs)
        else:
            seqs = torch.from_numpy(rank_slice(batch, self.global_rank, self.global_world).astype(np.int64))
            seqs = seqs.view(self.micro, mbs, t.seq_len + 1)
            run_step = lambda: engine.run_step(step, seqs[..., :-1], seqs[..., 1:])  # noqa: E731
        if step == self.profile_step:
            times = profiled(run_step, self.run_dir / f"profile-rank{self.rank}-step{step}.json", device)
        else:
            times = run_step()
        peak = reserved = 0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            peak, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
            self.tracer.flush_device(device)  # a traced step's device spans, now that its work is done
        self.done_steps = step + 1
        if self.eval_rows is not None and ((t.eval_every and self.done_steps % t.eval_every == 0)
                                           or self.done_steps == t.steps):
            # on the weights after this step (version done_steps), before held units are written back and
            # before the stats (so the launcher has every rank's share when it records the step)
            loss_sum, count = feed.run_eval(engine, self.eval_rows, self.done_steps, self.global_rank,
                                            self.global_world, self.micro, mbs, t.global_batch)
            if self.job.runtime.nnodes > 1:  # the launcher adds up its host's ranks: report every host's
                assert self.group is not None
                loss_sum, n = host_sums(self.group, [loss_sum, count], device, self.rank)
                count = int(n)
            self.launcher.send(EvalLoss(self.rank, step, loss_sum, count))
        every, end = self.job.checkpoint.every, self.end
        write_back_s = 0.0
        if self.held and ((every and self.done_steps % every == 0) or self.done_steps == end):
            t_back = time.perf_counter()  # the store must hold them before a checkpoint
            for h in self.held.values():
                h.write_back(self.done_steps, release=self.done_steps == end)
            write_back_s = time.perf_counter() - t_back
        w = link.waits
        return WorkerStats(self.rank, step, time.perf_counter() - t0, times.forward_s, times.backward_s, w["version"],
                           w["slot"], w["loss"], engine.delivery.h2d_bytes - h2d0, peak, reserved, write_back_s,
                           engine.grads.d2h_bytes - d2h0, alloc_retries(device) - retries0)

    def between_steps(self, step: int) -> bool:
        """The launcher may hold us for a checkpoint after `step`, or tell us to stop: True to stop."""
        every = self.job.checkpoint.every
        hold = bool(every) and (step + 1) % every == 0 and step + 1 < self.end
        return await_launcher(self.launcher, step, hold, self.job.runtime.timeout_s * 10, self.stop, self.rank,
                              self.orders)

    def close(self) -> None:
        """Stopped early: leave the store at the last completed step. Then the gradient announcer ends."""
        if self.held and self.done_steps < self.end:
            for h in self.held.values():
                h.write_back(self.done_steps, release=True)
        self.tracer.close()
        self.engine.grads.close()
