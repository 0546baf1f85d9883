"""A worker process: one rank on one device, spawned by the launcher.

    python -m slidedp.worker --rank r --job RUN_DIR/job.resolved.toml --plan RUN_DIR/plan.json
        --start S0 --end S1 --device cuda:0 [--tokens tokens.npy] [--dist-file F] [--cpus ...]

The shell owns the process: argv, the device and its memory cap, CPU affinity near the GPU,
signals (SIGTERM stops after the step in hand; Ctrl-C belongs to the launcher), the store's
mappings, host memory registered with CUDA, the sockets to the aggregator and the launcher,
and the process group. WorkerCore (core.py) runs the steps.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import zmq

from .. import log as slog
from ..config import load_job
from ..lifetime import end_process
from ..numa import device_cpus, format_cpulist, parse_cpulist
from ..protocol import ROLE_WORKER, Hello
from ..rank_progress import NO_PROGRESS, NoProgress, ProgressFile, progress_path
from ..stepplan import StepPlan
from ..stopflag import stop_on
from ..store.host_rows import RANK_THREADS
from ..store.hostmem import Registration
from ..store.rings import GradRings
from ..store.store import HostStore
from ..transport import connect_dealer, identity, send
from .collectives import join, rendezvous
from .core import WorkerCore, needs_group
from .link import LauncherLink, WorkerLink, WorkerStopped

log = slog.get("worker")


def device_bus_id(device: torch.device) -> str | None:
    """The GPU's PCI address as sysfs spells it ("0000:1b:00.0"), when this torch reports it."""
    props = torch.cuda.get_device_properties(device)
    try:
        return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except AttributeError:
        return None


def pin(args: argparse.Namespace, device: torch.device, world: int) -> None:
    """CPU ranks share the cores; a GPU rank needs few CPU threads, on cores the updaters leave free,
    on its GPU's NUMA node (its pinned staging and launches stay local)."""
    cpus = parse_cpulist(args.cpus) if args.cpus else sorted(os.sched_getaffinity(0))
    bus = device_bus_id(device) if device.type == "cuda" else None
    if bus:
        cpus = device_cpus(bus, cpus, kept=parse_cpulist(args.kept_cpus) if args.kept_cpus else None)
    if args.cpus or bus:
        os.sched_setaffinity(0, cpus)
        log.info("rank %d runs on CPUs %s%s", args.rank, format_cpulist(cpus), f" (near GPU {bus})" if bus else "")
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, cores // world) if device.type == "cpu" else min(RANK_THREADS, cores))


def run(args: argparse.Namespace) -> int:
    job = load_job(args.job)
    plan = StepPlan.read(args.plan)
    rank, world, store_name = args.rank, job.runtime.workers, job.store_name
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        budget = job.memory.device_budget_gib
        if budget:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget * 2**30 / total), device)
    pin(args, device, world)
    stop = stop_on(signal.SIGTERM, ignore=(signal.SIGINT,))  # the launcher owns Ctrl-C and tells us to stop
    store = HostStore.attach(store_name)
    rings = GradRings.open(store_name)
    reg = Registration()
    if device.type == "cuda":
        t0 = time.perf_counter()
        # the master (the copies stream it, or, with the bf16 delivery, device-held units are copied from
        # and written back to it at checkpoints) and the bf16 shadow the copies stream instead (delivery.py)
        # (a host's part of the state on several hosts: only its own pages, store/part.py)
        pinned = [(view, "the master weights") for view in store.owned_pages("master")]
        if plan.delivery == "bf16" and store.has_shadow:  # without one, WorkerCore says what to do
            pinned += [(view, "the bf16 shadow of the weights") for view in store.owned_pages("shadow")]
        for tensor, what in pinned:
            reg.register(tensor, what)
        reg.register(rings.rank_ring(rank), f"rank {rank}'s gradient ring")
        log.info("registered %.2f GiB of host memory with CUDA in %.2f s",
                 sum(t.numel() * t.element_size() for t, _ in pinned) / 2**30, time.perf_counter() - t0)
    ctx = zmq.Context()
    agg = connect_dealer(ctx, store_name, "agg", identity("w", rank))
    job_sock = connect_dealer(ctx, store_name, "job", identity("w", rank))
    send(agg, Hello(ROLE_WORKER, rank, world, os.getpid()))
    send(job_sock, Hello(ROLE_WORKER, rank, world, os.getpid()))
    grads = connect_dealer(ctx, store_name, "agg", identity("g", rank))  # the gradient announcer's (announcer.py)
    link = WorkerLink(store, rings, rank, agg, job.runtime.timeout_s, grads)
    link.stop = stop
    core = None
    progress: ProgressFile | NoProgress = NO_PROGRESS
    try:
        group = None
        rt = job.runtime
        if rt.nnodes > 1:  # the launcher tells the other hosts which collective this rank has reached
            progress = ProgressFile(progress_path(Path(args.job).parent, rt.global_rank(rank)))
        if needs_group(plan, world) or rt.nnodes > 1:  # several hosts: one group of every host's ranks
            group = join(rt.global_rank(rank), rt.world, device, args.shared_device,
                         rendezvous(rt, args.dist_file), rt.timeout_s, progress)
        core = WorkerCore(job, plan, rank, world, device, store, rings, link, LauncherLink(job_sock), stop,
                          Path(args.job).parent, args.start, args.end, Path(args.tokens) if args.tokens else None, group,
                          Path(args.docs) if args.docs else None, Path(args.eval_docs) if args.eval_docs else None)
        core.run()
        return 0
    finally:
        if core is not None:
            core.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        progress.close()  # the file stays: the launcher reads how far this rank came
        reg.unregister()
        agg.close(linger=2000)
        grads.close(linger=2000)
        job_sock.close(linger=2000)
        ctx.term()
        rings.close()
        store.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="slidedp-worker", description="one SlideDP rank (spawned by slidedp-launch)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--job", required=True, help="the resolved job file written by the launcher")
    p.add_argument("--plan", required=True, help="the step plan (plan.json) written by the launcher")
    p.add_argument("--start", type=int, required=True)
    p.add_argument("--end", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", default="", help="pre-tokenized .npy written by the launcher")
    p.add_argument("--docs", default="", help="a folder of document rows written by the launcher (instead of --tokens)")
    p.add_argument("--eval-docs", default="", help="a folder of held-out document rows (data.eval_path)")
    p.add_argument("--dist-file", default="", help="torch.distributed rendezvous file (device-held units or sharded routes, N > 1)")
    p.add_argument("--shared-device", action="store_true", help="ranks share one GPU (gloo instead of NCCL)")
    p.add_argument("--cpus", default="", help="pin this worker to these CPUs (its share of those kept free of updater threads)")
    p.add_argument("--kept-cpus", default="",
                   help="all CPUs kept free of updater threads: used on the GPU's NUMA node when --cpus has none there")
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
    end_process(main())  # as `python -m slidedp.worker` ends (__main__.py)
