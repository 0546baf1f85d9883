"""SlideDP itself, measured through its launcher exactly as a user runs it.

Writes a job file (model: random weights of the shape, or --model-dir's folder as model.source = "hf";
data: a .npy of the peers' one batch of random token ids, common.batch_stream, read again at every
step as the peers do; no final checkpoint; a store that does not persist), runs `python -m slidedp.launch.cli JOB`
as a child process, then reduces `<run dir>/metrics.jsonl` (one JSON object per step) like
the other peers: the median of the steps after warm-up. A failed launch is a row carrying
the tail of the launcher's output.

    python -m benchmarks.peers.slidedp_run --shape qwen3-4b --batch 8 --seq 2048 --steps 6 --warmup 2 --json OUT
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import signal
import statistics
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.peers import common
from benchmarks.teed import run_teed
from slidedp import config
from slidedp.config import ConfigError, MemorySection
from slidedp.model.config import ModelConfig
from slidedp import old_names
from slidedp.step_records import timed_steps, write_backs

ROOT = Path(__file__).resolve().parents[2]
METRIC_KEYS = ("step", "step_s", "tokens", "tokens_per_s", "device_peak_bytes", "host_rss_bytes", "shm_bytes",
               "predicted_step_s")


class Terminated(Exception):
    pass


def has_plan_section() -> bool:
    """Whether this SlideDP's job file has the [plan] section (before it, the plan's keys sat in [train],
    [memory] and [runtime])."""
    return "plan" in config.SECTIONS


def plan_picks_micro_batch() -> bool:
    """Whether this SlideDP lets the plan choose the micro-batch: plan.micro_batch = "auto", or before the
    [plan] section train.micro_batch = 0 where it accepted that."""
    if has_plan_section():
        return True
    try:
        config.TrainSection(steps=1, global_batch=1, micro_batch=0, seq_len=1, lr=1.0).validate()
    except (ConfigError, ZeroDivisionError, ValueError, TypeError):
        return False
    return True


def job_micro_batch(args: argparse.Namespace) -> int:
    """The job's micro-batch: 0 (the plan's choice) with --plan-micro-batch where SlideDP accepts it, else the
    peers'."""
    return 0 if args.plan_micro_batch and plan_picks_micro_batch() else args.micro_batch


def plan_keys(micro_batch: int, dtype: str) -> dict[str, dict[str, Any]]:
    """The job's micro-batch (0: the plan's choice) and compute dtype, as this SlideDP's job file spells them."""
    if has_plan_section():
        return {"plan": {"micro_batch": micro_batch or "auto", "compute_dtype": dtype}}
    return {"train": {"micro_batch": micro_batch, "compute_dtype": dtype}}


def job_dict(args: argparse.Namespace, data: Path, run_dir: Path, name: str) -> dict[str, dict[str, Any]]:
    """The job file as sections (slidedp/config.py's schema), before --set overrides."""
    dtype = args.compute_dtype or ("bf16" if args.device == "cuda" else "fp32")
    planned = plan_keys(job_micro_batch(args), dtype)
    job: dict[str, dict[str, Any]] = {
        "model": ({"source": "hf", "path": str(Path(args.model_dir).resolve())} if args.model_dir else
                  {"source": "random", "shape": args.shape, "init_seed": args.seed,
                   **({"vocab_size": args.vocab} if args.vocab else {})}),
        "data": chat_data(args) if args.chat else {"path": str(data), "format": "npy"},
        # The peers' optimizer: constant lr, no weight decay, the peers' clipping (--max-grad-norm).
        "train": {"steps": args.steps, "global_batch": args.batch, "seq_len": args.seq, "lr": common.LR,
                  "schedule": "constant", "weight_decay": common.WEIGHT_DECAY, "beta1": common.BETAS[0],
                  "beta2": common.BETAS[1], "eps": common.EPS, "max_grad_norm": args.max_grad_norm, "seed": args.seed,
                  **planned.get("train", {})},
        **({"plan": planned["plan"]} if "plan" in planned else {}),
        "store": {"name": name, "persist": False},
        "checkpoint": {"final": False},
        "run": {"name": name, "dir": str(run_dir)},
        "runtime": {"device": args.device, "workers": args.gpus, "timeout_s": args.wait_timeout},
    }
    if args.budget_gib > 0:  # else SlideDP's own default budget
        job["memory"] = {"device_budget_gib": args.budget_gib}
    for item in args.set:
        key, eq, raw = item.partition("=")
        try:
            value = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw.strip()
        name, value = old_names.job_setting(key.strip(), value) if has_plan_section() else (key.strip(), value)
        section, dot, field = name.partition(".")
        if not (eq and dot and section and field):
            raise SystemExit(f"--set {item!r}: expected section.key=value, e.g. store.shadow_bf16=true")
        job.setdefault(section, {})[field] = value
    return job


def chat_data(args: argparse.Namespace) -> dict[str, Any]:
    """The [data] section of the packed chat workload (common.chat_batches makes the peers' rows the same way)."""
    folder = Path(args.chat).resolve()
    return {"path": str(folder / "chat.jsonl"), "format": "jsonl", "tokenizer": str(folder / "tokenizer.json"),
            "kind": "chat", "packing": "packed", "overlong": "truncate", "shuffle": False}


def to_toml(job: dict[str, dict[str, Any]]) -> str:
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)  # a JSON string is a valid TOML basic string
        raise TypeError(f"cannot write {v!r} to TOML")

    out = []
    for section, table in job.items():
        out.append(f"[{section}]")
        out += [f"{k} = {value(v)}" for k, v in table.items()]
        out.append("")
    return "\n".join(out)


def write_tokens(path: Path, cfg: ModelConfig, batch: int, seq: int, seed: int) -> None:
    """The peers' batch (common.batch_stream) as the job's data: one batch, so every step reads it again."""
    np.save(path, common.batch_stream(cfg, batch, seq, seed).numpy().astype(np.int32), allow_pickle=False)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The per-step records (objects with step and step_s), in step order; other lines are skipped."""
    records = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "step" in rec and "step_s" in rec:
            records.append(old_names.current(rec))  # an older SlideDP's run, too
    return sorted(records, key=lambda r: r["step"])


def reduce_metrics(records: list[dict[str, Any]], warmup: int, row: dict[str, Any]) -> None:
    """Fill the row from per-step records as the other peers fill theirs. Steps after which the workers
    wrote device-held units back to the store (the job's end, a checkpoint) are left out of the median
    while others remain, as the peers time no saving of their state: the write-back is kept apart."""
    if len(records) <= warmup:
        raise RuntimeError(f"metrics.jsonl has {len(records)} step records; none after the {warmup} warm-up steps")
    measured, backs = timed_steps(records, warmup), write_backs(records, warmup)
    if backs:
        row["write_back_s"] = backs
    step_s = statistics.median(float(r["step_s"]) for r in measured)
    tokens = int(measured[-1].get("tokens") or row["tokens_per_step"])
    row.update(step_s=step_s, tokens_per_step=tokens, tokens_per_s=tokens / step_s,
               step_times_s=[float(r["step_s"]) for r in records],
               losses=[r.get("loss") for r in records])
    predicted = [float(r["predicted_step_s"]) for r in measured if r.get("predicted_step_s") is not None]
    if predicted:
        row["predicted_step_s"] = statistics.median(predicted)
    # Host memory comes from the harness's own sampling of the launcher's process tree (as for
    # every peer); the launcher's view is kept beside it.
    for key, out in (("device_peak_bytes", "gpu_peak_gib"), ("device_reserved_peak_bytes", "gpu_reserved_peak_gib"),
                     ("planned_device_bytes", "planned_gpu_gib"), ("host_rss_bytes", "metrics_host_rss_gib"),
                     ("shm_bytes", "metrics_shm_gib")):
        values = [float(r[key]) for r in records if r.get(key) is not None]
        if values:
            row[out] = max(values) / common.GIB
    skipped = sum(1 for r in records if r.get("skipped"))
    if skipped:
        row["skipped_steps"] = skipped  # non-finite loss: SlideDP skipped the update
    missing = [k for k in METRIC_KEYS if k not in measured[-1]]
    if missing:
        row["metrics_missing_keys"] = missing


def _reduce_what_ran(metrics: Path, warmup: int, row: dict[str, Any]) -> None:
    """A stopped run's figures from the steps it committed (more than the warm-up), marked as such."""
    records = read_metrics(metrics) if metrics.is_file() else []
    if len(records) > warmup:
        reduce_metrics(records, warmup, row)
        row["steps_before_stop"] = len(records)


def remove_leftover_segments(store: str) -> list[str]:
    """This job's store segments still in /dev/shm after the launcher exited (persist = false)."""
    left = sorted(glob.glob(f"{common.SHM}/slidedp.{store}.*"))
    for path in left:
        try:
            os.unlink(path)
        except OSError:
            pass
    return [os.path.basename(p) for p in left]


def measure(args: argparse.Namespace, row: dict[str, Any], host: common.HostMemory) -> None:
    cfg = common.shape_of(args)
    # Absolute: the launcher runs in the work dir, where a relative job-file path would not resolve.
    work = Path(args.workdir).resolve() if args.workdir else Path(tempfile.mkdtemp(prefix="slidedp-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    name = f"bench-{os.getpid()}"  # unique: never attaches to a stale store of an earlier run
    # A fresh run dir per run: the launcher appends to metrics.jsonl, and a reused --workdir must not mix runs.
    data, run_dir, job_path = work / "tokens.npy", work / name, work / f"{name}.toml"
    if not args.chat:
        write_tokens(data, cfg, args.batch, args.seq, args.seed)
    job_path.write_text(to_toml(job_dict(args, data, run_dir, name)))
    init = f"the folder's weights ({args.model_dir})" if args.model_dir else f"SlideDP store (random, seed {args.seed})"
    row.update(job_file=str(job_path), run_dir=str(run_dir), init=init)
    # Run from the work dir with the repo root LAST on the path: an installed slidedp (with its
    # slidedp.launch and slidedp.daemons) wins over the source tree, whose launch/ is outside slidedp/.
    env = dict(os.environ)
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    env["PYTHONPATH"] = os.pathsep.join([*path, str(ROOT)])
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-m", args.launcher, *args.launch_arg, str(job_path)]
    row["command"] = " ".join(cmd)
    common.log(f"running {row['command']} (in {work})")
    lines: collections.deque[str] = collections.deque(maxlen=60)
    try:
        rc, timed_out = run_teed(cmd, work, env, args.timeout, work / "launcher.log", lines, grace_s=20.0)
        rc, tail = (None if timed_out else rc), "".join(lines)
    except Terminated:
        row["output_tail"] = "".join(lines)
        _reduce_what_ran(run_dir / "metrics.jsonl", args.warmup, row)  # steps committed before the stop count
        raise Terminated(f"stopped by SIGTERM; the launcher's last output: {common.last_line(''.join(lines))}") from None
    finally:  # a store that outlived its job would hold host RAM through the next systems' runs
        leftovers = remove_leftover_segments(name)
        if leftovers:
            row["leftover_segments_removed"] = leftovers
    row["launcher_exit_code"] = rc
    metrics = run_dir / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.is_file() else []
    if records:
        try:
            reduce_metrics(records, args.warmup, row)
        except RuntimeError:
            pass  # too few steps: the failure below says why
    row["output_tail"] = tail
    last = common.last_line(tail)
    if rc is None:
        raise TimeoutError(f"the launcher ran past --timeout {args.timeout:.0f} s: {last}")
    if rc != 0:
        oom = "out of memory: " if common.is_oom(RuntimeError(tail)) else ""  # run_peer makes it an OOM row
        raise RuntimeError(f"{oom}the launcher exited with code {rc}: {common.failure_line(tail)}")
    if not records:
        raise RuntimeError(f"the launcher exited 0 but {metrics} has no step records: {last}")
    reduce_metrics(records, args.warmup, row)
    row["metrics_file"] = str(metrics)
    host.fill(row)
    # the harness counts /dev/shm above its level at start: a persistent store attached from an
    # earlier run was already there, so the store's own count is its footprint
    row["shm_gib"] = max(row["shm_gib"], row.get("metrics_shm_gib", 0.0))


def run(argv: list[str] | None = None) -> int:
    """Parse the flags, measure, write the row; the exit code (main without the signal handler)."""
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--compute-dtype", choices=("", "bf16", "fp32"), default="",
                   help="plan.compute_dtype ('' = bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a job-file key (repeatable), e.g. --set store.shadow_bf16=true")
    p.add_argument("--launch-arg", action="append", default=[], help="extra argument for the launcher (repeatable)")
    p.add_argument("--launcher", default="slidedp.launch.cli", help="module run as `python -m MODULE [ARGS] JOB`")
    p.add_argument("--workdir", default="", help="where the job file, tokens and run dir go (default: a new temp dir)")
    p.add_argument("--timeout", type=float, default=3000.0, help="seconds before the launcher is stopped")
    p.add_argument("--wait-timeout", type=float, default=600.0, help="runtime.timeout_s of the job (every wait)")
    p.add_argument("--plan-micro-batch", action="store_true",
                   help="let the plan choose the micro-batch (plan.micro_batch = \"auto\") where this SlideDP accepts "
                        "that; else --micro-batch")
    args = p.parse_args(argv)
    sets = {old_names.job_key(k): v for k, _, v in (s.replace(" ", "").partition("=") for s in args.set)}
    micro = sets.get("plan.micro_batch", sets.get("train.micro_batch"))  # the second: a SlideDP before [plan]
    if micro is not None:  # a micro-batch set for SlideDP is the one its row reports
        args.plan_micro_batch = micro.strip('"') in ("auto", "0")
        args.micro_batch = args.micro_batch if args.plan_micro_batch else int(micro)
    common.check_args(args)
    budget = args.budget_gib if args.budget_gib > 0 else MemorySection().device_budget_gib
    budget = f"budget {budget:g} GiB" + ("" if args.budget_gib > 0 else " (SlideDP's default)")
    if "memory.device_budget_gib" in sets:
        budget = "budget as set below"
    planned = job_micro_batch(args) == 0
    if planned:
        batch = f"{args.batch}x{args.seq} (micro-batch: the plan's)" + (f" on {args.gpus} ranks" if args.gpus > 1 else "")
    else:
        batch = common.batch_text(args) + (" (micro-batch named: this SlideDP's plan cannot choose it)"
                                           if args.plan_micro_batch else "")
    config = (f"{batch}, {args.gpus} worker(s), {budget}, {common.clip_text(args.max_grad_norm)}"
              + "".join(f", {s}" for s in args.set))
    # local_gpu=False: this process must not open a CUDA context of its own beside SlideDP's workers.
    def body(row: dict[str, Any], host: common.HostMemory) -> None:
        if planned:
            row["micro_batch"] = "plan"
        measure(args, row, host)

    return common.run_peer("slidedp", config, args, body, needs_cuda=False, local_gpu=False, model_dir_ok=True)


def _on_sigterm(signum: int, frame: object) -> None:
    raise Terminated("SIGTERM (the harness's per-system timeout?)")


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _on_sigterm)  # run.py's timeout: the finally blocks stop the launcher too
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
