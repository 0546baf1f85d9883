"""A worker: one process per device (rank). Attaches to the store, runs the engine step by step.

Spawned by the launcher: `python -m slidedp.worker --store S --rank r --world N --job RESOLVED.toml
--start S0 --end S1 [--tokens tokens.npy]`. It maps the master weights and its own gradient
ring (registered with CUDA once), talks to the aggregator (gradients, loss agreement,
credits, version wake-ups) and reports per-step stats to the launcher. Any wait that runs
past runtime.timeout_s raises an error naming the peer it was waiting for.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import zmq

from . import log as slog
from .collectives import Group, join
from .config import JobConfig, load_job, model_config
from .data import Batches, TokenStream, open_batches, rank_slice
from .delivery import Unit
from .device_state import DeviceResident
from .jobrecord import held_unit_names
from .engine import Engine, EnginePolicy, units_of
from .hostmem import Registration
from .model import layers as L
from .numa import device_cpus, format_cpulist, parse_cpulist
from .protocol import (CONTROL_STOP, ROLE_WORKER, SLOT_DEVICE, Control, Credit, EvalLoss, Go, Grad, Hello, Loss, Norm,
                       Ready, WorkerStats)
from .sft import feed
from .sft.packing import DocBatches, PackedRows, SftBatch
from .store.layout import Chunk
from .store.rings import GradRings
from .store.store import HostStore
from .tracing import NULL, Tracer
from .transport import PeerTimeout, connect_dealer, identity, recv_dealer, send

log = slog.get("worker")

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class WorkerStopped(RuntimeError):
    """SIGTERM arrived while the worker waited on a peer: stop now rather than after the wait."""


class WorkerLink:
    """The engine's view of the rest of the system: versions, slots, gradient announcements, loss agreement."""

    def __init__(self, store: HostStore, rings: GradRings, rank: int, agg: zmq.Socket, timeout_s: float) -> None:
        self.store, self.rings, self.rank, self.agg = store, rings, rank, agg
        self.timeout_s = timeout_s
        self.free_slots = list(range(rings.slots))
        self.go: dict[int, Go] = {}
        self.norms: dict[int, float] = {}
        self.waits = {"version": 0.0, "slot": 0.0, "loss": 0.0}
        self.tracer = NULL
        self.step = -1
        self.stop_flag: dict[str, bool] = {}
        self.stop_after: int | None = None

    def pump(self, timeout_ms: int) -> None:
        if not self.agg.poll(timeout_ms):
            return
        while True:
            msg = recv_dealer(self.agg, (Credit, Go, Ready, Norm))
            if isinstance(msg, Credit):
                if msg.rank != self.rank or msg.slot >= self.rings.slots or msg.slot in self.free_slots:
                    log.warning("dropped a bad credit %s", msg)
                else:
                    self.free_slots.append(msg.slot)
            elif isinstance(msg, Go):
                self.go[msg.step] = msg
            elif isinstance(msg, Norm):
                self.norms[msg.step] = msg.grad_norm
            if not self.agg.poll(0):
                return

    def _wait(self, done, what: str, kind: str, while_waiting: Callable[[], None] | None = None) -> None:
        t0 = time.perf_counter()
        wall0 = time.time()
        deadline = time.monotonic() + self.timeout_s
        while not done():
            if self.stop_flag.get("now"):
                raise WorkerStopped(f"rank {self.rank} stopped (SIGTERM) while waiting for {what}")
            if time.monotonic() > deadline:
                raise PeerTimeout(f"rank {self.rank} waited {self.timeout_s:.0f} s for {what}; "
                                  f"raise runtime.timeout_s if the host is merely slow")
            if while_waiting is not None:
                while_waiting()
            self.pump(20)
        self.waits[kind] += time.perf_counter() - t0
        self.tracer.event(f"wait {kind}", "wait", self.step, wall0, time.time(), what=what)

    def wait_ready(self, unit: Unit, step: int) -> None:
        versions = self.store.manifest.versions
        ids = [c.id for c in unit.chunks]

        def ready() -> bool:
            return all(versions[i] >= step for i in ids)

        if not ready():
            self._wait(ready, f"{unit.name} (chunks {ids[0]}..{ids[-1]}) to reach version {step} "
                              f"(the updater pool, slidedp-updater, has not updated it)", "version")

    def acquire_slot(self, while_waiting: Callable[[], None] = lambda: None) -> int:
        if not self.free_slots:
            self._wait(lambda: bool(self.free_slots),
                       "a free gradient slot (the aggregator, slidedp-aggregator, returned none)", "slot", while_waiting)
        return self.free_slots.pop(0)

    def grad_landed(self, chunk: Chunk, slot: int, sqnorm: float, step: int) -> None:
        send(self.agg, Grad(self.rank, chunk.id, step, slot, sqnorm))

    def device_grad(self, chunk: Chunk, sqnorm: float, step: int) -> None:
        send(self.agg, Grad(self.rank, chunk.id, step, SLOT_DEVICE, sqnorm))

    def wait_norm(self, step: int) -> float:
        self._wait(lambda: step in self.norms, f"the global gradient norm of step {step} (from the aggregator)", "slot")
        return self.norms.pop(step)

    def agree_loss(self, step: int, loss_sum: float, tokens: int, finite: bool) -> bool:
        send(self.agg, Loss(self.rank, step, loss_sum if finite else 0.0, tokens, int(finite)))
        self._wait(lambda: step in self.go, f"the other ranks' loss of step {step} (via the aggregator)", "loss")
        return bool(self.go.pop(step).skip)


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


def gpu_bus_id(device: torch.device) -> str | None:
    """The GPU's PCI address as sysfs spells it ("0000:1b:00.0"), when this torch reports it."""
    props = torch.cuda.get_device_properties(device)
    try:
        return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except AttributeError:
        return None


def join_group(args: argparse.Namespace, device: torch.device, rank: int, world: int, timeout_s: float) -> Group | None:
    """The workers' process group, when something needs one: device-held units or a sharded route."""
    sharded = args.param_route == "sharded" or args.grad_route == "reduce_scatter"
    if world == 1 or not (args.embedding == "device" or args.device_layers > 0 or sharded):
        return None
    if not args.dist_file:
        raise RuntimeError("--dist-file is required when ranks talk among themselves (device-held units, sharded routes)")
    return join(rank, world, device, args.shared_device, args.dist_file, timeout_s)


def hold_units(args: argparse.Namespace, store: HostStore, device: torch.device, dtype: torch.dtype,
               train, rank: int, group: Group | None) -> dict[str, DeviceResident]:
    """Lease the plan's device-held units (the first layers, the embedding and an untied head) to the devices."""
    units = units_of(store.layout)
    names = held_unit_names(store.layout.model, args.embedding == "device", args.device_layers)
    return {n: DeviceResident(store, units[n], device, dtype, train, rank, group) for n in names}


def run(args: argparse.Namespace) -> int:
    job: JobConfig = load_job(args.job)
    rank, world = args.rank, args.world
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if args.gpu_budget_gib:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_budget_gib * 2**30 / total), device)
    # CPU ranks share the cores; a GPU rank needs few CPU threads, on cores the updaters leave free,
    # on its GPU's NUMA node (its pinned staging and launches stay local)
    cpus = parse_cpulist(args.cpus) if args.cpus else sorted(os.sched_getaffinity(0))
    bus = gpu_bus_id(device) if device.type == "cuda" else None
    if bus:
        cpus = device_cpus(bus, cpus, kept=parse_cpulist(args.kept_cpus) if args.kept_cpus else None)
    if args.cpus or bus:
        os.sched_setaffinity(0, cpus)
        log.info("rank %d runs on CPUs %s%s", rank, format_cpulist(cpus), f" (near GPU {bus})" if bus else "")
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, cores // world) if device.type == "cpu" else min(2, cores))
    torch.manual_seed(job.train.seed + rank)
    cfg = model_config(job)
    store = HostStore.attach(args.store)
    rings = GradRings.open(args.store)
    layout = store.layout
    if layout.model != cfg:
        raise RuntimeError(f"store {args.store!r} holds another model than the job describes")
    master = store.flat("master")
    reg = Registration()
    if device.type == "cuda":
        t0 = time.perf_counter()
        reg.register(master, "the master weights")
        reg.register(rings.rank_ring(rank), f"rank {rank}'s gradient ring")
        log.info("registered %.2f GiB of host memory with CUDA in %.2f s", master.numel() * 4 / 2**30, time.perf_counter() - t0)
    ctx = zmq.Context()
    agg = connect_dealer(ctx, args.store, "agg", identity("w", rank))
    job_sock = connect_dealer(ctx, args.store, "job", identity("w", rank))
    send(agg, Hello(ROLE_WORKER, rank, world, os.getpid()))
    send(job_sock, Hello(ROLE_WORKER, rank, world, os.getpid()))
    link = WorkerLink(store, rings, rank, agg, job.runtime.timeout_s)
    tokens = TokenStream(np.load(args.tokens, mmap_mode="r", allow_pickle=False), cfg.vocab_size, args.tokens) if args.tokens else None
    if args.docs:  # rows of documents the launcher packed
        batches = DocBatches(PackedRows.load(Path(args.docs), job.train.seq_len), job.train.global_batch,
                             job.data.shuffle, job.data.seed)
    else:
        batches = (Batches(tokens, job.train.seq_len, job.train.global_batch, job.data.shuffle, job.data.seed)
                   if tokens is not None else open_batches(job, cfg.vocab_size))
    eval_rows = PackedRows.load(Path(args.eval_docs), job.train.seq_len) if args.eval_docs else None
    t = job.train
    dtype = DTYPES[t.compute_dtype]
    if L.compiled_kernels_wanted(t.compile, device):
        L.compile_kernels(fallback=t.compile == "auto")
        log.info("the layers' pointwise kernels go through torch.compile at first use (train.compile = %r%s)", t.compile,
                 ": eager where compiling fails" if t.compile == "auto" else "")
    group = join_group(args, device, rank, world, job.runtime.timeout_s)
    held = hold_units(args, store, device, dtype, t, rank, group)
    policy = EnginePolicy(resident_layers=args.resident_layers, prefetch_depth=args.prefetch,
                          loss_chunk_tokens=args.loss_chunk_tokens, max_grad_norm=t.max_grad_norm,
                          seq_tile_tokens=args.seq_tile_tokens, offload_layers=args.offload_layers)
    engine = Engine(cfg, layout, master, device, dtype, link, lambda slot, numel: rings.slot(rank, slot, numel),
                    t.global_batch * t.seq_len, policy, held,
                    param_group=group if args.param_route == "sharded" else None,
                    grad_group=group if args.grad_route == "reduce_scatter" else None)
    done_steps = args.start
    tracer = Tracer(Path(args.job).parent, f"worker{rank}", job.run.traced)
    engine.set_tracer(tracer)
    link.tracer = tracer
    mbs = args.micro_batch or t.micro_batch
    micro = t.global_batch // world // mbs
    profile_step = int(os.environ.get("SLIDEDP_PROFILE_STEP", "-1"))
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda s, f: stop.update(now=True))
    link.stop_flag = stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher owns Ctrl-C and tells us to stop
    log.info("rank %d/%d on %s: steps %d..%d, %d micro-batch(es) of %d x %d tokens; params %s (%d ahead), grads %s; "
             "%s, %d layer(s) offloaded; held on the device: %s", rank, world, device, args.start, args.end - 1, micro,
             mbs, t.seq_len, "sharded" if engine.delivery.group else "replicated", policy.prefetch_depth,
             "reduce_scatter" if engine.grads.group else "host",
             f"seq tiles of {policy.seq_tile_tokens} tokens" if policy.seq_tile_tokens else "untiled",
             policy.offload_layers, ", ".join(held) or "nothing")
    try:
        for step in range(args.start, args.end):
            if stop["now"]:
                log.info("stopping before step %d (SIGTERM)", step)
                return 0
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            link.waits = dict.fromkeys(link.waits, 0.0)
            link.step = step
            h2d0 = engine.delivery.h2d_bytes
            batch = batches.batch(step)
            if isinstance(batch, SftBatch):
                run_step = lambda: feed.run_step(engine, batch, step, rank, world, micro, mbs)  # noqa: E731
            else:
                seqs = torch.from_numpy(rank_slice(batch, rank, world).astype(np.int64)).view(micro, mbs, t.seq_len + 1)
                run_step = lambda: engine.run_step(step, seqs[..., :-1], seqs[..., 1:])  # noqa: E731
            if step == profile_step:
                times = profiled(run_step, Path(args.job).parent / f"profile-rank{rank}-step{step}.json", device)
            else:
                times = run_step()
            peak = reserved = 0
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                peak, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
            done_steps = step + 1
            if eval_rows is not None and ((t.eval_every and done_steps % t.eval_every == 0) or done_steps == t.steps):
                # on the weights after this step (version done_steps), before held units are written back and
                # before the stats (so the launcher has every rank's share when it records the step)
                loss_sum, count = feed.run_eval(engine, eval_rows, done_steps, rank, world, micro, mbs, t.global_batch)
                send(job_sock, EvalLoss(rank, step, loss_sum, count))
            at_checkpoint = args.checkpoint_every and done_steps % args.checkpoint_every == 0
            write_back_s = 0.0
            if held and (at_checkpoint or done_steps == args.end):  # the store must hold them before a checkpoint
                t_back = time.perf_counter()
                for h in held.values():
                    h.write_back(done_steps, release=done_steps == args.end)
                write_back_s = time.perf_counter() - t_back
            w = link.waits
            send(job_sock, WorkerStats(rank, step, time.perf_counter() - t0, times.forward_s, times.backward_s,
                                       w["version"], w["slot"], w["loss"], engine.delivery.h2d_bytes - h2d0, peak, reserved,
                                       write_back_s))
            # Between steps: the launcher may hold us for a checkpoint or tell us to stop.
            hold = args.checkpoint_every and (step + 1) % args.checkpoint_every == 0 and step + 1 < args.end
            deadline = time.monotonic() + (job.runtime.timeout_s * 10 if hold else 0)
            while True:
                msg = recv_dealer(job_sock, (Control,)) if job_sock.poll(0 if not hold else 100) else None
                if isinstance(msg, Control):
                    if msg.kind == CONTROL_STOP:
                        log.info("stopping after step %d as the launcher asked", step)
                        return 0
                    if msg.step == step:
                        break
                if not hold:
                    break
                if time.monotonic() > deadline:
                    raise PeerTimeout(f"rank {rank} waited for the launcher past the checkpoint after step {step}")
                if stop["now"]:
                    log.info("stopping at the checkpoint after step %d (SIGTERM)", step)
                    return 0
        return 0
    finally:
        if held and done_steps < args.end:  # stopped early: leave the store at the last completed step
            for h in held.values():
                h.write_back(done_steps, release=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        tracer.close()
        reg.unregister()
        agg.close(linger=2000)
        job_sock.close(linger=2000)
        ctx.term()
        rings.close()
        store.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="slidedp-worker", description="one SlideDP rank (spawned by slidedp-launch)")
    p.add_argument("--store", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--job", required=True, help="the resolved job file written by the launcher")
    p.add_argument("--start", type=int, required=True)
    p.add_argument("--end", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", default="", help="pre-tokenized .npy written by the launcher")
    p.add_argument("--docs", default="", help="a folder of document rows written by the launcher (instead of --tokens)")
    p.add_argument("--eval-docs", default="", help="a folder of held-out document rows (train.eval_every)")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resident-layers", type=int, default=0, help="last layers kept on the device for backward")
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--loss-chunk-tokens", type=int, default=4096)
    p.add_argument("--seq-tile-tokens", type=int, default=0,
                   help="run MLPs and the final norm + head over tiles of this many tokens (0: whole sequences)")
    p.add_argument("--offload-layers", type=int, default=0,
                   help="keep the first N layers' saved inputs in pinned host memory until backward")
    p.add_argument("--embedding", choices=["host", "device"], default="host")
    p.add_argument("--device-layers", type=int, default=0, help="the first layers held on the device (updated there)")
    p.add_argument("--dist-file", default="", help="torch.distributed rendezvous file (device-held units or sharded routes, N > 1)")
    p.add_argument("--param-route", choices=["replicated", "sharded"], default="replicated",
                   help="sharded: each rank copies 1/N of a unit in and the ranks all-gather it")
    p.add_argument("--grad-route", choices=["host", "reduce_scatter"], default="host",
                   help="reduce_scatter: the ranks sum on the devices and each copies out 1/N")
    p.add_argument("--shared-device", action="store_true", help="ranks share one GPU (gloo instead of NCCL)")
    p.add_argument("--cpus", default="", help="pin this worker to these CPUs (its share of those kept free of updater threads)")
    p.add_argument("--kept-cpus", default="",
                   help="all CPUs kept free of updater threads: used on the GPU's NUMA node when --cpus has none there")
    p.add_argument("--micro-batch", type=int, default=0, help="sequences per micro-batch (0: the job's)")
    p.add_argument("--gpu-budget-gib", type=float, default=0.0, help="cap this process's GPU memory (0: no cap)")
    args = p.parse_args(argv)
    slog.setup("worker", args.rank)
    try:
        return run(args)
    except WorkerStopped as e:
        log.info("%s", e)
        return 0
    except Exception as e:
        log.exception("rank %d failed: %s", args.rank, e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
