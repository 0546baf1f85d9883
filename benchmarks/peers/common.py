"""What every peer shares: the model as an nn.Module, the command line, timing, memory, result rows.

Every peer trains the same math as SlideDP: `DecoderLM` calls slidedp.model.layers for each
layer and slidedp.model.loss for the chunked head, so a difference in throughput is a difference in
systems, never in models. A peer process measures one configuration and writes one row (a
JSON object) with `write_row`; anything that goes wrong becomes a row with a status too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import subprocess
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from slidedp.data.batches import rank_slice
from slidedp.model.loss import chunked_cross_entropy_sum
from slidedp.model import layers
from slidedp.model.attention import Attention
from slidedp.model.config import ModelConfig, named_shape
from slidedp.model.init import INIT_STD, init_tensor_

GIB = 2**30
CHUNK_TOKENS = 4096  # chunked cross-entropy: tokens per logits chunk (as SlideDP)
LR, BETAS, EPS, WEIGHT_DECAY = 1e-5, (0.9, 0.95), 1e-8, 0.0  # the same AdamW everywhere
SHM = "/dev/shm"
_INIT_BLOCK = 1 << 26  # elements drawn per block by the fast init (256 MiB of fp32)

# ---- the model ---------------------------------------------------------------------------------


def _attr(local_name: str) -> str:
    return local_name.replace(".", "_")  # nn.Module attribute names cannot contain '.'


class DecoderLayer(nn.Module):
    """One decoder layer's parameters (under its local names, '.' -> '_') and its forward.

    Checkpointing sits inside forward, so FSDP2's hooks wrap it from outside (the torchtitan
    order): the recomputation in backward reads the parameters FSDP has already unsharded.
    """

    def __init__(self, cfg: ModelConfig, checkpointing: bool = True, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.cfg, self.checkpointing = cfg, checkpointing
        self.local_names = [name for name, _ in cfg.layer_parameter_shapes()]
        for name, shape in cfg.layer_parameter_shapes():
            self.register_parameter(_attr(name), nn.Parameter(torch.empty(shape, device=device)))

    def params(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, _attr(name)) for name in self.local_names}

    def _run(self, x: torch.Tensor, attn: Attention) -> torch.Tensor:
        return layers.decoder_layer(self.cfg, self.params(), x, attn)

    def forward(self, x: torch.Tensor, attn: Attention) -> torch.Tensor:
        if self.checkpointing and torch.is_grad_enabled():
            return checkpoint(self._run, x, attn, use_reentrant=False)
        return self._run(x, attn)


class DecoderLM(nn.Module):
    """The decoder with its loss: forward(ids [B,T], targets [B,T]) -> fp32 SUM of token losses.

    loss="chunked": slidedp.model.loss.chunked_cross_entropy_sum (never the full logits);
    loss="full": the [B*T, V] logits, upcast to fp32, F.cross_entropy (what most trainers do).
    Under autocast the head runs in the autocast dtype with autocast off, so the custom
    autograd function sees one dtype in forward and backward.
    """

    def __init__(self, cfg: ModelConfig, loss: str = "chunked", checkpointing: bool = True,
                 chunk_tokens: int = CHUNK_TOKENS, device: torch.device | str | None = None) -> None:
        super().__init__()
        if loss not in ("chunked", "full"):
            raise ValueError(f"loss must be 'chunked' or 'full', got {loss!r}")
        self.cfg, self.loss, self.chunk_tokens = cfg, loss, chunk_tokens
        h, v = cfg.hidden_size, cfg.vocab_size
        self.embed_tokens = nn.Parameter(torch.empty(v, h, device=device))
        self.layers = nn.ModuleList(DecoderLayer(cfg, checkpointing, device) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.empty(h, device=device))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Parameter(torch.empty(v, h, device=device))

    def hf_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(Hugging Face name, parameter) for every tensor, in store order."""
        yield "model.embed_tokens.weight", self.embed_tokens
        for i, layer in enumerate(self.layers):
            for name in layer.local_names:
                yield f"model.layers.{i}.{name}", getattr(layer, _attr(name))
        yield "model.norm.weight", self.norm
        if self.lm_head is not None:
            yield "lm_head.weight", self.lm_head

    def init_weights(self, seed: int = 0, on: str = "") -> None:
        """Random weights by SlideDP's rules (init_named_)."""
        init_named_(self.hf_named_parameters(), seed, on)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = layers.embed(self.embed_tokens, ids)
        attn = layers.causal_attention(self.cfg, *ids.shape, x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, attn)
        x = layers.final_norm(self.cfg, self.norm, x)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        hidden, weight, tgt = x.reshape(-1, x.shape[-1]).to(dtype), head.to(dtype), targets.reshape(-1)
        with torch.autocast(x.device.type, enabled=False):
            if self.loss == "chunked":
                return chunked_cross_entropy_sum(hidden, weight, tgt, self.chunk_tokens)
            return F.cross_entropy(F.linear(hidden, weight).float(), tgt, reduction="sum")


@torch.no_grad()
def init_named_(named: Iterable[tuple[str, torch.Tensor]], seed: int = 0, on: str = "") -> None:
    """Random weights by SlideDP's rules: norms 1, biases 0, matrices N(0, INIT_STD), for
    (Hugging Face name, tensor) pairs.

    on="" draws every matrix exactly as slidedp.model.init does (same values, same seed):
    one CPU generator, about 0.1 G values/s, minutes for 4 B parameters. on="cuda" draws
    the same distribution with a CUDA generator (seconds), in blocks so no big temporary
    lands on the GPU; timings do not depend on which values the weights hold.
    """
    gen = torch.Generator(device=on).manual_seed(seed) if on else None
    for name, p in named:
        if gen is None or p.dim() < 2:
            init_tensor_(name, p, seed)
        elif p.device.type == on:
            p.normal_(0.0, INIT_STD, generator=gen)
        else:
            flat = p.view(-1)
            for start in range(0, flat.numel(), _INIT_BLOCK):
                block = flat[start : start + _INIT_BLOCK]
                block.copy_(torch.empty(block.shape, device=on).normal_(0.0, INIT_STD, generator=gen))


def batch_stream(cfg: ModelConfig, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    """The benchmark's token stream: batch x seq + 1 random ids, int64. Sequence i is
    stream[i*seq : i*seq + seq + 1], the window slidedp.data.stream cuts; SlideDP reads this stream from a
    .npy of exactly one batch, so every step of every system trains on the same batch."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch * seq + 1,), generator=g)


def random_batch(cfg: ModelConfig, batch: int, seq: int, device: str, seed: int = 0, rank: int = 0,
                 world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s rows of the global batch of batch_stream (as slidedp.data.batches.rank_slice gives a
    SlideDP rank its rows), [B/world, T] inputs and next-token targets."""
    rows = rank_slice(batch_stream(cfg, batch, seq, seed).unfold(0, seq + 1, seq), rank, world)
    return rows[:, :-1].contiguous().to(device), rows[:, 1:].contiguous().to(device)


def micro_batches(ids: torch.Tensor, targets: torch.Tensor, micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(zip(ids.split(micro), targets.split(micro)))


# ---- command line ------------------------------------------------------------------------------


def parser(description: str) -> argparse.ArgumentParser:
    """The flags every peer takes (run.py passes the same ones to each)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--shape", default="qwen3-4b", help="slidedp named shape (tiny, qwen3-1.7b, qwen3-4b, qwen3-8b, ...)")
    p.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--micro-batch", type=int, default=0, help="sequences per forward/backward (0 = --batch)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps in all, warm-up included")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--budget-gib", type=float, default=0.0, help="cap GPU memory (set_per_process_memory_fraction); 0 = none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpus", type=int, default=1, help="ranks (one per GPU; SlideDP may share one GPU among them)")
    p.add_argument("--exact-init", action="store_true",
                   help="draw weights with slidedp.model.init's CPU generator (slow) even on CUDA")
    p.add_argument("--max-grad-norm", type=float, default=1.0,
                   help="clip the global gradient norm to this (one norm per step, as SlideDP's default); 0 = off")
    p.add_argument("--json", default="", help="write the result row here")
    p.add_argument("--vocab", type=int, default=0, help="the shape with this vocabulary size (0: the shape's own)")
    p.add_argument("--chat", default="", metavar="DIR",
                   help="train on rows of packed chat conversations from DIR (benchmarks.chat_data) instead of "
                        "random tokens; needs --vocab 512, the conversations' tokenizer")
    p.add_argument("--model-dir", default="", metavar="DIR",
                   help="train this Hugging Face model folder (python -m benchmarks.make_hf_model) instead of "
                        "--shape; the random tokens use its vocabulary")
    return p


def check_args(args: argparse.Namespace) -> None:
    args.micro_batch = args.micro_batch or args.batch // max(1, args.gpus)
    if min(args.batch, args.seq, args.steps) < 1 or args.warmup < 0:
        raise SystemExit("--batch, --seq and --steps must be >= 1 and --warmup >= 0")
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}): no step would be measured")
    if args.batch % args.micro_batch:
        raise SystemExit(f"--micro-batch ({args.micro_batch}) must divide --batch ({args.batch})")
    if args.max_grad_norm < 0:
        raise SystemExit(f"--max-grad-norm ({args.max_grad_norm}) must be >= 0 (0 = no clipping)")
    if getattr(args, "model_dir", "") and (args.vocab or args.chat):
        raise SystemExit("--model-dir sets the model and its vocabulary: --vocab and --chat do not apply")
    if args.gpus < 1 or args.batch % (args.gpus * args.micro_batch):
        raise SystemExit(f"--batch ({args.batch}) must be a multiple of --gpus ({args.gpus}) x --micro-batch "
                         f"({args.micro_batch})")


def shape_of(args: argparse.Namespace) -> ModelConfig:
    """The workload's model: --model-dir's folder as SlideDP reads it, else the named --shape."""
    if getattr(args, "model_dir", ""):
        from slidedp.model.hf import read_config

        return read_config(args.model_dir)
    return named_shape(args.shape, getattr(args, "vocab", 0) or None)


def model_name(args: argparse.Namespace) -> str:
    """The rows' shape: --model-dir's folder name, else --shape."""
    return Path(args.model_dir).name if getattr(args, "model_dir", "") else args.shape


def model_dir_config(args: argparse.Namespace) -> dict[str, Any]:
    """--model-dir's config.json."""
    return json.loads((Path(args.model_dir) / "config.json").read_text())


def chat_batches(args: argparse.Namespace, cfg: ModelConfig):
    """The packed chat rows of --chat as SlideDP's launcher makes them for this job (the same conversations,
    tokenizer, truncation at seq_len + 1 tokens, best-fit packing, no shuffle): DocBatches of --batch rows."""
    from slidedp.data.documents import DocumentSpec, read_documents
    from slidedp.data.packing import DocBatches, PackedRows
    from slidedp.data.tokenizer import TokenizerBundle

    folder = Path(args.chat)
    bundle = TokenizerBundle.load(folder / "tokenizer.json", "")
    spec = DocumentSpec("chat", overlong="truncate")
    docs = read_documents([str(folder / "chat.jsonl")], "jsonl", spec, bundle, args.seq, cfg.vocab_size)
    return DocBatches(PackedRows.build(docs, args.seq, packed=True, source=str(folder)), args.batch)


def init_on(args: argparse.Namespace) -> str:
    """The `on` argument of DecoderLM.init_weights: a CUDA generator unless asked for the exact one."""
    return "cuda" if args.device == "cuda" and not args.exact_init else ""


# ---- measuring ---------------------------------------------------------------------------------


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Stopwatch:
    """Wall time of CUDA-synchronized sections, accumulated per label within a step."""

    def __init__(self, device: str) -> None:
        self.device, self.totals = device, {}

    def section(self, label: str) -> "_Section":
        return _Section(self, label)


class _Section:
    def __init__(self, watch: Stopwatch, label: str) -> None:
        self.watch, self.label = watch, label

    def __enter__(self) -> None:
        sync(self.watch.device)
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        sync(self.watch.device)
        self.watch.totals[self.label] = self.watch.totals.get(self.label, 0.0) + time.perf_counter() - self.t0


def timed_steps(step: Callable[[Stopwatch], float | None], steps: int, device: str,
                log: Callable[[str], None] | None = None) -> tuple[list[float], list[dict[str, float]], list[float]]:
    """Run `step` `steps` times: (wall s per step, per-step section totals, per-step losses).

    `step(watch)` runs one optimizer step, may time parts of it with watch.section(label), and
    returns the step's loss (a float) or None. Each step is timed between two synchronizations.
    """
    times, sections, losses = [], [], []
    profile_step, _, profile_path = os.environ.get("BENCH_PROFILE", "").partition(":")
    for i in range(steps):
        watch = Stopwatch(device)
        sync(device)
        t0 = time.perf_counter()
        prof = None
        if profile_path and i == int(profile_step):  # BENCH_PROFILE=STEP:PATH writes that step's trace
            with torch.profiler.profile() as prof:
                loss = step(watch)
                sync(device)
        else:
            loss = step(watch)
        sync(device)
        times.append(time.perf_counter() - t0)
        if prof is not None:  # written after the step's time is taken
            prof.export_chrome_trace(profile_path)
        sections.append(watch.totals)
        losses.append(float("nan") if loss is None else float(loss))
        if log:
            extra = "".join(f" {k} {v:.3f} s" for k, v in watch.totals.items())
            # the host's memory in use, so a peer the kernel kills for memory leaves its climb in the log
            log(f"step {i}: {times[-1]:.3f} s loss {losses[-1]:.4f}{extra} host {host_used() / GIB:.1f} GiB in use")
    return times, sections, losses


def train_resident(args: argparse.Namespace, row: dict[str, Any], host: "HostMemory", model: nn.Module,
                   loss_of: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor], opt: Any,
                   autocast: bool = True, clip: bool = True, time_optimizer: bool = False) -> None:
    """The step loop of the peers whose model lives on the device: every micro-batch's loss (the
    step's token-mean, `loss_of(ids, targets, step_tokens)`) under bf16 autocast, backward, one
    clipped (--max-grad-norm) optimizer step; timed, and the row filled."""
    device = args.device
    ids, targets = random_batch(shape_of(args), args.batch, args.seq, device, args.seed)
    batches, n_tokens = micro_batches(ids, targets, args.micro_batch), ids.numel()
    amp = torch.autocast(device, dtype=torch.bfloat16, enabled=autocast)
    row["parameters"] = sum(p.numel() for p in model.parameters())

    def step(watch: Stopwatch) -> float:
        total = torch.zeros((), device=device)
        for mb_ids, mb_targets in batches:
            with amp:
                loss = loss_of(mb_ids, mb_targets, n_tokens)
            loss.backward()
            total += loss.detach().float()
        with watch.section("optimizer") if time_optimizer else contextlib.nullcontext():
            if clip:
                clip_gradients(model.parameters(), args.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return total.item()

    times, sections, losses = timed_steps(step, args.steps, device, log)
    fill_measurements(row, times, sections, losses, args.warmup)
    fill_memory(row, device, host)


def median_after_warmup(values: list[float], warmup: int) -> float:
    return statistics.median(values[warmup:])


class HostMemory:
    """Peak host memory while a system runs, sampled in a background thread.

    rss: private resident memory (RSS minus file-backed and shared pages) summed over this
    process and its children (SlideDP's launcher, daemons and workers), so shared memory
    mapped by several processes is not counted once per process; shm: /dev/shm used above
    the level at start (counted once); used: the host's total - available above the level
    at start, which also catches memory that RSS misses (pinned CUDA host allocations).
    """

    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self.shm_base, self.used_base = shm_used(), host_used()
        self.rss_peak = self.shm_peak = self.used_peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="host-memory", daemon=True)

    def start(self) -> "HostMemory":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self.sample()

    def _loop(self) -> None:
        while not self._done.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        self.rss_peak = max(self.rss_peak, tree_private_rss())
        self.shm_peak = max(self.shm_peak, shm_used() - self.shm_base)
        self.used_peak = max(self.used_peak, host_used() - self.used_base)

    def fill(self, row: dict[str, Any]) -> None:
        self.sample()
        row.update(host_rss_gib=self.rss_peak / GIB, shm_gib=self.shm_peak / GIB, host_used_gib=self.used_peak / GIB)


def tree_private_rss() -> int:
    try:
        import psutil
    except ImportError:
        return 0
    me = psutil.Process()
    total = 0
    for proc in (me, *me.children(recursive=True)):
        try:
            info = proc.memory_info()
            total += info.rss - getattr(info, "shared", 0)
        except psutil.Error:
            pass  # exited meanwhile
    return total


def host_used() -> int:
    try:
        import psutil
    except ImportError:
        return 0
    vm = psutil.virtual_memory()
    return vm.total - vm.available


def shm_used() -> int:
    try:
        return shutil.disk_usage(SHM).used
    except OSError:
        return 0


def apply_gpu_budget(budget_gib: float, device: str) -> float | None:
    """Cap this process's caching allocator at budget_gib; returns the fraction set (None: no cap)."""
    if device != "cuda" or budget_gib <= 0:
        return None
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, budget_gib * GIB / total)
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    return fraction


def gpu_memory(device: str) -> dict[str, float]:
    if device != "cuda" or not torch.cuda.is_available():
        return {}
    return {
        "gpu_peak_gib": torch.cuda.max_memory_allocated() / GIB,
        "gpu_reserved_peak_gib": torch.cuda.max_memory_reserved() / GIB,
    }


def is_oom(e: BaseException) -> bool:
    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)) if t)
    text = str(e).lower()
    return isinstance(e, oom_types) or any(s in text for s in (
        "out of memory", "cublas_status_alloc_failed", "can't allocate memory", "cudaerrormemoryallocation"))


# ---- result rows -------------------------------------------------------------------------------


def batch_text(args: argparse.Namespace) -> str:
    micro = args.micro_batch or args.batch
    return (f"{args.batch}x{args.seq}" + (f" (micro {micro})" if micro != args.batch else "")
            + (f" on {args.gpus} ranks" if args.gpus > 1 else ""))


def base_row(system: str, config: str, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "system": system,
        "config": config,
        "status": "running",
        "shape": model_name(args),
        **({"model_dir": args.model_dir} if getattr(args, "model_dir", "") else {}),
        "batch": args.batch,
        "micro_batch": args.micro_batch or args.batch,
        "seq": args.seq,
        "tokens_per_step": args.batch * args.seq,
        "gpus": args.gpus,
        "steps": args.steps,
        "warmup": args.warmup,
        "device": args.device,
        "gpu_budget_gib": args.budget_gib or None,
        "init": ("the folder's weights" if getattr(args, "model_dir", "") else
                 "cuda generator" if init_on(args) else "slidedp.model.init"),
        "max_grad_norm": args.max_grad_norm,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def device_name(device: str, local_gpu: bool = True) -> str:
    """The GPU's name (through nvidia-smi when this process must not touch CUDA), else the CPU's."""
    if device == "cuda" and local_gpu and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    if device == "cuda":
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=30)
            return out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            return "unknown GPU"
    return platform.processor() or platform.machine()


def fill_measurements(row: dict[str, Any], times: list[float], sections: list[dict[str, float]],
                      losses: list[float], warmup: int, stat: str = "median") -> None:
    """Step time, tokens/s, per-step times and losses, and each timed section, from the steps after
    warm-up: their median, or their mean (stat="mean", for a system whose steps differ by design,
    such as one that applies part of its update every few steps)."""
    reduce = median_after_warmup if stat == "median" else (lambda v, w: statistics.fmean(v[w:]))
    step_s = reduce(times, warmup)
    row.update(step_s=step_s, tokens_per_s=row["tokens_per_step"] / step_s, step_times_s=times, losses=losses)
    if stat != "median":
        row["step_stat"] = stat
    for label in sorted({k for s in sections for k in s}):
        row[f"{label}_s"] = reduce([s.get(label, 0.0) for s in sections], warmup)


def clip_gradients(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor | None:
    """Scale the gradients so their global L2 norm is at most max_norm (0: leave them); the norm
    before clipping, as a tensor on the gradients' device (no synchronization here)."""
    if max_norm <= 0:
        return None
    params = [p for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(total, "full_tensor"):  # FSDP2: the norm of sharded gradients is a DTensor (torchtitan's way)
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def clip_text(max_norm: float) -> str:
    return f"clip {max_norm:g}" if max_norm > 0 else "no clipping"


def fill_memory(row: dict[str, Any], device: str, host: HostMemory) -> None:
    row.update(gpu_memory(device))
    host.fill(row)


def write_row(row: dict[str, Any], path: str) -> None:
    """Print the row as one line and write it (atomically) where --json says."""
    text = json.dumps(row, indent=1, default=str)
    if path:
        tmp = Path(path).with_suffix(".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text + "\n")
        os.replace(tmp, path)
    short = {k: row.get(k) for k in ("system", "status", "tokens_per_s", "step_s", "gpu_peak_gib", "host_rss_gib")}
    print("RESULT " + json.dumps(short, default=str), flush=True)


def last_line(text: str) -> str:
    """The last non-empty line of some output (usually the exception that ended it)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:500] if lines else "(no output)"


def failure_line(text: str) -> str:
    """What ended a failed run: its last logged ERROR line (the launcher's refusal names what to change), else its
    last line; the log lines after an error (daemons stopping) say nothing of why."""
    errors = [ln.strip() for ln in text.splitlines() if " ERROR " in ln or ln.startswith("error:")]
    return errors[-1][:500] if errors else last_line(text)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Skip(Exception):
    """The system cannot run here (not installed, needs CUDA): a row that says why, not a failure."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_and_world() -> tuple[int, int, int]:
    """(rank, local rank, world) from torchrun's environment, or a world of one."""
    single_process_env()
    return int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])


def single_process_env() -> None:
    """torch.distributed env:// settings for a world of one (kept if the caller set them)."""
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def run_peer(system: str, config: str, args: argparse.Namespace,
             body: Callable[[dict[str, Any], HostMemory], None], needs_cuda: bool = True, local_gpu: bool = True,
             model_dir_ok: bool = False) -> int:
    """Run one measurement and always write a row: ok, skipped, out of memory or failed.

    `body(row, host)` builds the system, runs the steps and fills the row's numbers.
    local_gpu=False: the GPU work happens in child processes (SlideDP's launcher), so this
    process sets no memory cap and opens no CUDA context. model_dir_ok: the peer trains a --model-dir
    folder (the others' rows say they do not). Returns the process exit code (0 for ok and skipped rows).
    """
    row = base_row(system, config, args)
    host = HostMemory().start()
    try:
        if getattr(args, "model_dir", "") and not model_dir_ok:
            row["status"] = f"skipped: {system} is not supported with --model-dir (it builds named shapes only)"
        elif args.device == "cuda" and not torch.cuda.is_available():
            row["status"] = "skipped: CUDA is not available"
        elif args.device == "cpu" and needs_cuda:
            row["status"] = f"skipped: {system} needs CUDA"
        else:
            row["device_name"] = device_name(args.device, local_gpu)
            if local_gpu:
                row["gpu_budget_fraction"] = apply_gpu_budget(args.budget_gib, args.device)
            body(row, host)
            row["status"] = "ok"
    except Skip as e:
        row["status"] = f"skipped: {e}"
    except Exception as e:  # noqa: BLE001 -- every failure becomes a row, never a lost run
        tail = "".join(traceback.format_exception(e))[-3000:]
        row["status"] = "out of memory" if is_oom(e) else f"failed: {type(e).__name__}"
        row["error"] = str(e)[:2000] or type(e).__name__
        row["traceback"] = tail
        print(tail, file=sys.stderr, flush=True)
        try:
            fill_memory(row, args.device if local_gpu else "cpu", host)  # how far it got
        except Exception:  # noqa: BLE001
            pass
    host.stop()
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, rank 0 speaks for the job
        write_row(row, args.json)
    return 0 if row["status"] == "ok" or row["status"].startswith("skipped") else 1
