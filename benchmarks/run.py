"""The side-by-side benchmark: every system on the same model, batch and tokens, one table last.

    python -m benchmarks.run --shape qwen3-4b --batch 8 --seq 2048 --steps 8 --warmup 3 \\
        --systems slidedp,gpu_resident,gpu_resident_chunked,fsdp2_offload,deepspeed \\
        --budget-gib 24 --out benchmarks/results/NAME.json

Each system runs as its own child process (a fresh CUDA context each), one after the other,
under a per-system timeout. Whatever happens to a system (out of memory, not installed,
crashed, timed out) is a row that says so. After every system the JSON file is rewritten,
so a run cut short keeps what it measured; `--merge A.json B.json` joins runs made in
separate commands into one table. `--device cpu --shape tiny` is the CPU smoke version.
`--model-dir DIR` trains a Hugging Face folder (benchmarks.make_hf_model) instead of `--shape`
(SlideDP, hf and hf_liger; the other systems' rows say they do not support it).

`--gpus N`: N ranks at the same global batch. SlideDP runs N workers (sharing a GPU when the
machine has fewer), `slidedp_replicated` the same with the routes forced to replicated/host
(what the sharded routes buy), and the FSDP2 peers run under torchrun, one process per GPU;
ratios are then taken against GPU-resident FSDP2 (`fsdp2`).

    python -m benchmarks.run --gpus 4 --shape qwen3-4b --batch 32 --seq 2048 \
        --systems slidedp,slidedp_replicated,fsdp2,fsdp2_offload --budget-gib 24 --out ...
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.table import COLUMNS, add_ratios, format_table, ran, table_rows, workload_key
from benchmarks.teed import run_teed

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


@dataclass(frozen=True)
class Published:
    """A system whose code is not run here: its own published claims and where they are from."""

    claims: str
    source: str
    why: str  # why it is not run


@dataclass(frozen=True)
class System:
    module: str  # run as `python -m module` ("" for a published-only row)
    args: tuple[str, ...] = ()  # after the common flags, so they win (e.g. --max-grad-norm 0)
    published: Published | None = None


SLIDEFORMER = Published(
    claims=("1.40x-6.27x the throughput of offloading baselines, roughly half their CPU and GPU memory, "
            "up to 8x larger batches, 123B+ models fine-tuned on one RTX 4090, >95% of peak on NVIDIA and AMD GPUs"),
    source="Yang and Wen, An Efficient Heterogeneous Co-Design for Fine-Tuning on a Single GPU, DAC 2026, "
           "arXiv:2603.16428 (abstract)",
    why="its code is not available to this harness")

SYSTEMS: dict[str, System] = {
    "slidedp": System("benchmarks.peers.slidedp_run"),
    "slidedp_noclip": System("benchmarks.peers.slidedp_run", ("--max-grad-norm", "0")),
    # transformers' own layer modules on the streamed weights (plan.layers), where the native ones would run
    "slidedp_transformers": System("benchmarks.peers.slidedp_run", ("--set", 'plan.layers="transformers"')),
    "slidedp_replicated": System("benchmarks.peers.slidedp_run",
                                 ("--set", 'plan.param_route="replicated"', "--set", 'plan.grad_route="host"')),
    "resident_same_kernels": System("benchmarks.peers.resident_same_kernels"),
    "fsdp2": System("benchmarks.peers.fsdp2_offload", ("--no-offload",)),
    "gpu_resident": System("benchmarks.peers.gpu_resident", ("--loss", "full")),
    "gpu_resident_chunked": System("benchmarks.peers.gpu_resident", ("--loss", "chunked")),
    "hf_liger": System("benchmarks.peers.hf_liger", ("--liger",)),
    # rows of packed chat conversations (--chat DIR): each document attends only to itself
    "slidedp_packed": System("benchmarks.peers.slidedp_run"),
    "hf_liger_packed": System("benchmarks.peers.hf_liger", ("--liger", "--attn", "flex_attention")),
    "hf": System("benchmarks.peers.hf_liger", ("--no-liger",)),
    "fsdp2_offload": System("benchmarks.peers.fsdp2_offload", ("--fused",)),
    "fsdp2_offload_foreach": System("benchmarks.peers.fsdp2_offload", ("--no-fused",)),
    "deepspeed": System("benchmarks.peers.deepspeed_offload"),
    "zenflow": System("benchmarks.peers.deepspeed_offload", ("--zenflow",)),
    "torchao_offload": System("benchmarks.peers.torchao_offload"),
    "megatrain": System("benchmarks.peers.megatrain_run"),
    "slideformer": System("", published=SLIDEFORMER),
}
DEFAULT_SYSTEMS = "slidedp,slidedp_noclip,resident_same_kernels,gpu_resident,hf_liger,fsdp2_offload,deepspeed"
MULTI_RANK = ("fsdp2", "fsdp2_offload", "fsdp2_offload_foreach")  # run under torchrun with --gpus N > 1


# ---- running one system ------------------------------------------------------------------------


def peer_argv(args: argparse.Namespace, json_path: Path) -> list[str]:
    """The flags every peer takes (benchmarks.peers.common.parser)."""
    argv = ["--shape", args.shape, "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--device", args.device, "--seed", str(args.seed), "--json", str(json_path),
            "--gpus", str(args.gpus), "--max-grad-norm", format(args.max_grad_norm, "g")]
    if args.micro_batch:
        argv += ["--micro-batch", str(args.micro_batch)]
    if args.budget_gib:
        argv += ["--budget-gib", str(args.budget_gib)]
    if args.exact_init:
        argv += ["--exact-init"]
    if args.vocab:
        argv += ["--vocab", str(args.vocab)]
    if args.model_dir:
        argv += ["--model-dir", args.model_dir]
    return argv


def model_name(args: argparse.Namespace) -> str:
    """The workload's model as rows name it: --workload-label, else --model-dir's folder name, else --shape."""
    return args.workload_label or (Path(args.model_dir).name if args.model_dir else args.shape)


def workload(args: argparse.Namespace) -> dict[str, Any]:
    """The keys a row's workload is told by (every peer's row has them; rows the harness writes too)."""
    return {"shape": model_name(args), "batch": args.batch, "seq": args.seq, "gpus": args.gpus,
            "tokens_per_step": args.batch * args.seq}


def slidedp_argv(name: str, args: argparse.Namespace, log_dir: Path) -> list[str]:
    """SlideDP's own flags: where its job file, tokens and run dir go (beside the logs), its micro-batch
    (`plan`: the plan's choice where this SlideDP lets the plan choose it), and --slidedp-set keys."""
    extra = ["--workdir", str(log_dir / f"{name}-work")]
    if args.slidedp_micro_batch == "plan":
        extra.append("--plan-micro-batch")
    elif args.slidedp_micro_batch != "peers":
        extra += ["--set", f"plan.micro_batch={int(args.slidedp_micro_batch)}"]
    return [*extra, *(a for s in args.slidedp_set for a in ("--set", s))]


def system_argv(name: str, system: System, args: argparse.Namespace, log_dir: Path, json_path: Path) -> list[str] | None:
    """The child process's argv (None: the system cannot run with --gpus N > 1)."""
    if args.gpus > 1 and name in MULTI_RANK:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.gpus), "-m"]
    elif args.gpus > 1 and not name.startswith("slidedp"):
        return None
    else:
        launcher = [sys.executable, "-m"]
    extra = slidedp_argv(name, args, log_dir) if system.module == SYSTEMS["slidedp"].module else []
    if name.endswith("_packed") and args.chat:
        extra += ["--chat", args.chat]
    return [*launcher, system.module, *peer_argv(args, json_path), *system.args, *extra]


def not_run_row(name: str, published: Published, args: argparse.Namespace) -> dict[str, Any]:
    return {"system": name, **workload(args), "status": f"not run: {published.why}",
            "config": f"published: {published.claims}", "published_claims": published.claims,
            "source": published.source}


def run_system(name: str, system: System, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """Run one system in a child process and return its row (a failure row if it wrote none)."""
    if system.published is not None:
        row = not_run_row(name, system.published, args)
        say(f"=== {name}: {row['status']} ({system.published.source})")
        return row
    json_path = log_dir / f"{name}.json"
    json_path.unlink(missing_ok=True)
    cmd = system_argv(name, system, args, log_dir, json_path)
    if cmd is None:
        row = {"system": name, **workload(args), "config": " ".join(system.args),
               "status": f"skipped: {name} runs on one GPU only (use fsdp2 with --gpus)"}
        say(f"=== {name}: {row['status']}")
        return row
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    say(f"=== {name}: {shlex.join(cmd)}")
    t0 = time.monotonic()
    lines: collections.deque[str] = collections.deque(maxlen=80)
    rc, timed_out = run_teed(cmd, ROOT, env, args.timeout, log_dir / f"{name}.log", lines, prefix=f"[{name}] ",
                             echo=not args.quiet)
    tail = "".join(lines)
    wall = time.monotonic() - t0
    row = _read_row(json_path)
    if timed_out and row is not None and row.get("status") == "ok":
        # it wrote its finished row; the limit only cut its exit (DeepSpeed's NCCL teardown)
        row["note"] = f"its {args.timeout:.0f} s limit stopped it after it wrote this row"
    elif row is None or timed_out:  # it wrote no row, or one from when it was stopped
        error = row["error"] if timed_out and row and row.get("error") else _last_line(tail)
        row = {**(row or {}), "status": _failure_status(rc, timed_out, args.timeout, tail), "error": error,
               "output_tail": tail[-4000:]}
        if timed_out and row.get("steps_before_stop"):
            row["status"] += f" (its figures: the {row['steps_before_stop']} steps it committed)"
    row.setdefault("config", " ".join(system.args))
    for key, value in workload(args).items():
        row.setdefault(key, value)
    if args.workload_label or args.model_dir:  # the model came from elsewhere (an HF folder): not --shape's
        row["shape"] = model_name(args)
    row["system"] = name
    row.update(command=shlex.join(cmd), exit_code=rc, wall_s=wall, log=str(log_dir / f"{name}.log"))
    say(f"=== {name}: {row['status']} in {wall:.0f} s")
    return row


# torchrun's report of a rank that a signal ended ("exitcode  : -9 (pid: 2591)")
_RANK_SIGNALLED = re.compile(r"exitcode\s*:\s*-(\d+)")


def _failure_status(rc: int | None, timed_out: bool, timeout: float, tail: str = "") -> str:
    if timed_out:
        return f"timeout after {timeout:.0f} s"
    signalled = -rc if rc is not None and rc < 0 else None
    who = "killed"
    if signalled is None:  # under torchrun: the first rank a signal ended (the others were sent SIGTERM)
        found = [int(n) for n in _RANK_SIGNALLED.findall(tail)]
        signalled = signal.SIGKILL if signal.SIGKILL in found else (found[0] if found else None)
        who = "a rank was killed"
    if signalled is not None:
        try:
            sig = signal.Signals(signalled).name
        except ValueError:
            sig = f"signal {signalled}"
        hint = " (host out of memory?)" if signalled == signal.SIGKILL else ""
        return f"failed: {who} by {sig}{hint}"
    return f"failed: exit code {rc}, no result row"


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("RESULT ")]
    return lines[-1][:500] if lines else "(no output)"


def _read_row(path: Path) -> dict[str, Any] | None:
    try:
        row = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return row if isinstance(row, dict) and "status" in row else None


# ---- the JSON ----------------------------------------------------------------------------------


def environment(rows: list[dict[str, Any]]) -> dict[str, Any]:
    try:
        import psutil

        ram = psutil.virtual_memory().total / GIB
    except ImportError:
        ram = None
    try:
        done = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10)
        commit = done.stdout.strip() if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        commit = None
    # a copied working tree may carry a stale .git: the session names the commit it copied
    commit = os.environ.get("SLIDEDP_CODE_COMMIT") or commit
    gpu = next((r["device_name"] for r in rows if r.get("device_name") and r.get("device") == "cuda"), None)
    torch_version = next((r["torch"] for r in rows if r.get("torch")), None)
    if torch_version is None:
        try:
            import torch

            torch_version = torch.__version__
        except ImportError:
            pass
    return {"torch": torch_version, "gpu": gpu, "host": socket.gethostname(), "cpus": os.cpu_count(),
            "host_ram_gib": ram, "python": platform.python_version(), "platform": platform.platform(),
            "git_commit": commit}


ENVIRONMENT_KEYS = ("torch", "gpu", "host", "cpus", "host_ram_gib", "python", "platform", "git_commit")


def merged_rows(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every row of the files in order, except that a later file's row of a system and workload takes
    the place of an earlier file's that did not run (a call that ran again the rows an earlier call
    could not finish, `ONLY=...` in sessions/headline.sh), and a later row that did not run gives way
    to an earlier one that did. Rows of one system that differ in clipping (SlideDP at 1.0 and off)
    are different rows; a failed row that never read its clipping matches either."""
    kept: list[dict[str, Any]] = []
    for doc in docs:
        earlier = len(kept)
        for row in doc["rows"]:
            same = [i for i in range(earlier) if _same_run(kept[i], row)]
            if same and not ran(kept[same[0]]):
                kept[same[0]] = row
            elif not (same and not ran(row)):
                kept.append(row)
    return kept


def _same_run(a: dict[str, Any], b: dict[str, Any]) -> bool:
    clips = a.get("max_grad_norm"), b.get("max_grad_norm")
    return ((a.get("system"), *workload_key(a)) == (b.get("system"), *workload_key(b))
            and (None in clips or clips[0] == clips[1]))


def merged_environment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """Where merged runs ran, not where they were merged: each key as its sources agree on it, or the
    list of what each source says where they differ (runs on two machines, or of two commits)."""
    env = {}
    for key in ENVIRONMENT_KEYS:
        values = [d.get(key) for d in docs]
        env[key] = values[0] if all(v == values[0] for v in values) else values
    return env


def write_json(path: Path, rows: list[dict[str, Any]], command: str, settings: dict[str, Any], complete: bool,
               env: dict[str, Any] | None = None, plot: bool = True) -> None:
    """NAME.json, and NAME.md (and NAME.png unless plot=False: the runs' last write draws it) beside it."""
    add_ratios(rows)
    doc = {
        "command": command,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "complete": complete,
        "settings": settings,
        **(env if env is not None else environment(rows)),
        "columns": list(COLUMNS),
        "table": [dict(zip(COLUMNS, cells)) for cells in table_rows(rows)],
        "table_markdown": format_table(rows),
        "rows": rows,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    report.write(path, json.loads(path.read_text()), with_plot=plot)


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Side-by-side throughput of SlideDP and its peers (one table last).")
    p.add_argument("--shape", default="qwen3-4b")
    p.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--micro-batch", type=int, default=0, help="sequences per forward/backward (0 = --batch)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per system, warm-up included")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    p.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"comma-separated, from: {', '.join(SYSTEMS)}")
    p.add_argument("--budget-gib", type=float, default=0.0, help="GPU memory cap for every system; 0 = none")
    p.add_argument("--max-grad-norm", type=float, default=1.0,
                   help="every system clips the global gradient norm to this (SlideDP's default 1.0); 0 = off")
    p.add_argument("--slidedp-micro-batch", default="plan", metavar="plan|peers|N",
                   help="SlideDP's plan.micro_batch: plan = the plan's choice where this SlideDP lets the plan "
                        "choose it (else the peers'), peers = --micro-batch, N = that many sequences")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the smoke version (--shape tiny)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=0, help="the shape with this vocabulary size (0: the shape's own)")
    p.add_argument("--chat", default="", metavar="DIR",
                   help="the packed chat conversations (python -m benchmarks.chat_data DIR) the *_packed systems "
                        "train on; they need --vocab 512")
    p.add_argument("--workload-label", default="", metavar="NAME",
                   help="the rows' shape as tables and reports name it (default --shape): a model SlideDP reads "
                        "from --slidedp-set model.path, trained on --shape's token data")
    p.add_argument("--model-dir", default="", metavar="DIR",
                   help="the model is this Hugging Face folder (python -m benchmarks.make_hf_model), not --shape: "
                        "SlideDP reads it (model.source = \"hf\"), hf/hf_liger load it with from_pretrained, other "
                        "systems give a 'not supported' row; rows are named by the folder unless --workload-label")
    p.add_argument("--gpus", type=int, default=1, help="ranks: SlideDP workers, torchrun processes for FSDP2")
    p.add_argument("--exact-init", action="store_true", help="peers draw weights with slidedp.model.init (slow)")
    p.add_argument("--slidedp-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a key of SlideDP's job file (repeatable)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per system before it is stopped")
    p.add_argument("--out", default="", help="JSON result file (default benchmarks/results/<shape>-<date>.json)")
    p.add_argument("--quiet", action="store_true", help="do not echo the systems' output (it is in the logs)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="join earlier result files into one table; runs nothing")
    args = p.parse_args(argv)
    if not args.merge:
        names = [s.strip() for s in args.systems.split(",") if s.strip()]
        unknown = [s for s in names if s not in SYSTEMS]
        if unknown or not names:
            p.error(f"unknown system(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(SYSTEMS)}")
        args.system_names = names
        packed = [s for s in names if s.endswith("_packed")]
        if packed and not args.chat:
            p.error(f"{', '.join(packed)} train packed chat rows: give --chat DIR (python -m benchmarks.chat_data DIR)")
        if args.steps <= args.warmup:
            p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
        if args.model_dir:
            if not (Path(args.model_dir) / "config.json").is_file():
                p.error(f"--model-dir {args.model_dir}: no config.json there (python -m benchmarks.make_hf_model)")
            if args.vocab or args.chat:
                p.error("--model-dir sets the model and its vocabulary: --vocab and --chat do not apply")
            args.model_dir = str(Path(args.model_dir).resolve())  # the peers run in other directories
        if args.slidedp_micro_batch not in ("plan", "peers") and not args.slidedp_micro_batch.isdigit():
            p.error(f"--slidedp-micro-batch {args.slidedp_micro_batch!r}: expected plan, peers or a number")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join([Path(sys.executable).name, "-m", "benchmarks.run", *(sys.argv[1:] if argv is None else argv)])
    if args.merge:
        docs = [json.loads(Path(path).read_text()) for path in args.merge]
        rows = merged_rows(docs)
        if args.out:
            sources = [{"file": path, "date": d.get("date"), "command": d.get("command"), "host": d.get("host"),
                        "git_commit": d.get("git_commit")} for path, d in zip(args.merge, docs)]
            write_json(Path(args.out), rows, command, {"merged_from": sources},
                       complete=all(d.get("complete", True) for d in docs), env=merged_environment(docs))
        add_ratios(rows)
        print(format_table(rows), flush=True)
        return 0
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"{model_name(args)}-{stamp}.json"
    log_dir = out.with_name(out.stem + ".logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    settings = {k: getattr(args, k) for k in ("shape", "model_dir", "batch", "micro_batch", "seq", "steps", "warmup", "budget_gib",
                                              "max_grad_norm", "slidedp_micro_batch", "device", "seed", "exact_init",
                                              "slidedp_set", "timeout")}
    settings["systems"] = args.system_names
    rows: list[dict[str, Any]] = []
    try:
        for name in args.system_names:
            rows.append(run_system(name, SYSTEMS[name], args, log_dir))
            write_json(out, rows, command, settings, complete=False, plot=False)  # a run cut short keeps what it has
    finally:
        write_json(out, rows, command, settings, complete=len(rows) == len(args.system_names))
        say(f"wrote {out} (logs in {log_dir})")
        print(format_table(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
