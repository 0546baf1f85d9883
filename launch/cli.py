"""slidedp-launch: run a fine-tuning job.

    slidedp-launch [--gpus N] [--device cuda|cpu] [--set section.key=value ...] job.toml

Starts the store's daemons as children when none run (the embedded default), otherwise
attaches to them; spawns one worker per rank; exits non-zero on failure.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from slidedp import log as slog
from slidedp.config import ConfigError, load_job

from .jobrun import run_job
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
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    slog.setup("launcher")
    try:
        job = load_job(args.job, overrides(args))
    except ConfigError as e:
        print(f"slidedp-launch: error: {e}", file=sys.stderr)
        return 2
    progress = Progress(job.store_name, job.train.global_batch * job.train.seq_len)
    return run_job(job, Path(args.job), progress)


if __name__ == "__main__":
    sys.exit(main())
