"""slidedp-launch: run a fine-tuning job.

    slidedp-launch [--gpus N] [--device cuda|cpu] [--set section.key=value ...] job.toml
    slidedp-launch --dry-run job.toml   # check everything a run needs, start and create nothing

Starts the store's daemons as children when none run (the embedded default), otherwise
attaches to them; spawns one worker per rank; exits non-zero on failure.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from slidedp import log as slog
from slidedp.config import ConfigError, load_job
from slidedp.lifetime import skip_collection_at_exit

from .jobrun import run_job
from .planning import document_load, plan_job
from .preflight import cuda_problem
from .progress import Progress


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="slidedp-launch", description="Run a SlideDP fine-tuning job.")
    p.add_argument("job", help="the job file (TOML)")
    p.add_argument("--gpus", type=int, default=0, help="number of ranks on CUDA devices (sets runtime.workers and device)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="sets runtime.device")
    p.add_argument("--workers", type=int, default=0, help="number of ranks (sets runtime.workers)")
    p.add_argument("--store", help="attach to this store (sets store.name)")
    p.add_argument("--resume", help="'latest' or a checkpoint path (sets checkpoint.resume)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a job-file value")
    hosts = p.add_argument_group("several hosts (docs/multi-host.md; torchrun's flags, or its NNODES, NODE_RANK, "
                                 "MASTER_ADDR, MASTER_PORT environment variables)")
    hosts.add_argument("--nnodes", type=int, help="hosts in the job (sets runtime.nnodes)")
    hosts.add_argument("--node-rank", type=int, help="this host's rank among them, 0 first (sets runtime.node_rank)")
    hosts.add_argument("--master-addr", help="host 0's address (sets runtime.master_addr)")
    hosts.add_argument("--master-port", type=int, help="the rendezvous port on host 0 (sets runtime.master_port)")
    p.add_argument("--plan", action="store_true", help="print the plan (chunking, memory, predicted step time) and exit")
    p.add_argument("--dry-run", action="store_true",
                   help="check the job file, model, data, store space, resume checkpoint and plan; start nothing; "
                        "exit 0 if a run would start cleanly, 1 otherwise")
    return p.parse_args(argv)


def overrides(args: argparse.Namespace) -> list[str]:
    out = list(args.set)
    if args.gpus:
        out += [f"runtime.workers={args.gpus}", 'runtime.device="cuda"']
    if args.workers:
        out.append(f"runtime.workers={args.workers}")
    if args.device:
        out.append(f'runtime.device="{args.device}"')
    if args.store:
        out.append(f'store.name="{args.store}"')
    if args.resume:
        out.append(f'checkpoint.resume="{args.resume}"')
    return out + host_overrides(args, os.environ)


def host_overrides(args: argparse.Namespace, env) -> list[str]:
    """The several-hosts flags as runtime keys; where a flag is absent, torchrun's environment variable."""
    out = []
    for flag, var, key, quote in (("nnodes", "NNODES", "nnodes", False), ("node_rank", "NODE_RANK", "node_rank", False),
                                  ("master_addr", "MASTER_ADDR", "master_addr", True),
                                  ("master_port", "MASTER_PORT", "master_port", False)):
        value = getattr(args, flag, None)
        if value is None:
            value = env.get(var)
        if value is not None and value != "":
            out.append(f'runtime.{key}="{value}"' if quote else f"runtime.{key}={value}")
    return out


def print_plan(job) -> int:
    from slidedp.planner import PlanError

    try:
        documents = None
        if job.runtime.device == "cuda":  # the planner charges rows of packed documents by their lengths
            from slidedp.config import model_config
            from slidedp.data.setup import open_training

            documents = document_load(open_training(job, model_config(job).vocab_size))
        run_plan = plan_job(job, documents=documents)
    except (PlanError, RuntimeError, ValueError) as e:  # ValueError: the data (DataError)
        print(f"slidedp-launch: no plan: {e}", file=sys.stderr)
        return 1
    if run_plan.plan is None:
        print("CPU run: no GPU plan; " + ", ".join(f"{k}={v}" for k, v in run_plan.step.to_dict().items()))
    else:
        print(run_plan.plan.describe())
        if job.runtime.nnodes > 1:
            print(hosts_memory_line(job, run_plan))
    return 0


def hosts_memory_line(job, run_plan) -> str:
    """Several hosts: what the planned job takes of each host's memory, its part of the state included
    (docs/multi-host.md): the launcher's own count (host_room.host_need) for a store the job creates."""
    from slidedp.config import model_config

    from .admission import job_layout
    from .host_room import host_need, size

    rt = job.runtime
    need = host_need(job, job_layout(job, model_config(job)), run_plan.step, False, run_plan.shadow)
    return (f"host memory per host (host {rt.node_rank} of {rt.nnodes}: its part, 1/{rt.nnodes} of the state): "
            f"{size(need.total)} ({need.describe()})")


def _asked_for_cuda(args: argparse.Namespace) -> str:
    if args.gpus:
        return f"--gpus {args.gpus}"
    if args.device == "cuda":
        return "--device cuda"
    return f'runtime.device = "cuda" in {args.job}'


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    slog.setup("launcher")
    try:
        job = load_job(args.job, overrides(args))
    except ConfigError as e:
        if args.dry_run:  # every problem of the job file, each on its line
            lines = "".join(f"{'':<11}PROBLEM: {p}\n" for p in e.problems)
            print(f"job        {args.job}\n{lines}dry run: {len(e.problems)} problem(s) a run would hit; nothing "
                  f"was started or created")
            return 1
        for p in e.problems:
            print(f"slidedp-launch: error: {p}", file=sys.stderr)
        return 2
    if args.dry_run:
        from .dryrun import dry_run

        return dry_run(job, Path(args.job))
    problem = cuda_problem(job, _asked_for_cuda(args))  # before any store, daemon or plan
    if problem:
        print(f"slidedp-launch: error: {problem}", file=sys.stderr)
        return 1
    if args.plan:
        return print_plan(job)
    progress = Progress(job.store_name, job.train.global_batch * job.train.seq_len, log_every=job.run.log_every,
                        tensorboard=job.run.tensorboard)
    return run_job(job, Path(args.job), progress)


if __name__ == "__main__":
    code = main()
    skip_collection_at_exit()  # here, not in main(): tests call main() in their own process
    sys.exit(code)
