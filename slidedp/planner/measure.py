"""The GPU work of a step, measured: one decoder layer and the loss, timed at the job's shapes.

At plan time on CUDA the planner times the blocks a step is made of on the job's GPU, through the
engine's own code: one decoder layer's forward (no grad) and its recompute + backward with the fp32
gradient accumulation (`layers.layer_forward` / `layers.layer_backward` over the fused views of
one flat chunk, as `worker.engine` runs them), and the loss (`model.loss.norm_head_backward`),
each for every micro-batch / tile / loss-chunk size the plan weighs, with the pointwise pieces
compiled when the run compiles them (`train.compile`). The step model (step_model) multiplies
them by the passes per step; the GPU memory a backward and a loss pass took above their inputs
bounds the plan's workspace items (plan._memory).

Measured once per host, GPU and shape: the host's cache keeps them (cache.measured_blocks), so a
second plan of the same job reads them; a plan that weighs a size not measured yet measures only that size.

`adamw_beside_copies` measures the updaters' rate in training: the fused CPU AdamW on the updater's
threads while pinned H2D and D2H copies run on every GPU of the job (the DMA shares host memory
with it), and `embedding_rows_rate` how a host-held embedding's rows reach the GPU; both are kept
with the calibration (cache.load_or_calibrate).

No torch at import: the planner's arithmetic runs anywhere; measuring imports it.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Iterable, Mapping

from slidedp import log
from slidedp.model.config import ModelConfig
from slidedp.planner.workload import DocumentLoad

_log = log.get("planner")

SCHEMA = 2  # 2: blocks timed over BLOCK_WINDOW_S windows, the median of five (1: single runs, of three)
# a timed block runs back to back for at least this long: on the H200 a layer pass of 1-5 ms timed
# alone moved by up to 20% between two machines' first plans (docs/planner.md, "How it measures")
BLOCK_WINDOW_S = 0.05
MAX_INNER = 64  # passes per window at most: a block of under 1 ms (CPU tests' tiny shapes) stays cheap to time
Size = tuple[int, int, int]  # (micro_batch, seq_tile_tokens, loss_chunk_tokens) of one rank's GPU work


class MeasureError(ValueError):
    pass


@dataclass(frozen=True)
class LayerTime:
    """One decoder layer on one micro-batch, as the engine runs it."""

    micro_batch: int
    seq_tile_tokens: int  # 0: untiled
    forward_s: float  # the forward without grad
    backward_s: float  # the recompute + backward, parameter gradients added into fp32
    workspace_bytes: int = 0  # allocator peak of the backward above its inputs (0: not measured, as on CPU)


@dataclass(frozen=True)
class LossTime:
    """The final norm + chunked cross-entropy with its backward on one micro-batch (the engine's loss)."""

    micro_batch: int
    seq_tile_tokens: int
    loss_chunk_tokens: int
    seconds: float
    workspace_bytes: int = 0  # allocator peak of the pass above its inputs (0: not measured)


def normalized(micro_batch: int, seq_len: int, tile: int) -> int:
    """A tile that spans the whole micro-batch is no tile (the engine runs it untiled)."""
    return 0 if tile <= 0 or tile >= micro_batch * seq_len else tile


@dataclass(frozen=True)
class MeasuredBlocks:
    """The measured blocks of one shape (`shape_key`) on one GPU model."""

    shape: str
    device_name: str
    layers: tuple[LayerTime, ...] = ()
    losses: tuple[LossTime, ...] = ()
    measured_s: float = 0.0  # what this plan spent measuring (0: every block came from the cache)

    def layer(self, micro_batch: int, seq_tile_tokens: int) -> LayerTime | None:
        return next((t for t in self.layers if (t.micro_batch, t.seq_tile_tokens) == (micro_batch, seq_tile_tokens)),
                    None)

    def loss(self, micro_batch: int, seq_tile_tokens: int, loss_chunk_tokens: int) -> LossTime | None:
        return next((t for t in self.losses if (t.micro_batch, t.seq_tile_tokens, t.loss_chunk_tokens)
                     == (micro_batch, seq_tile_tokens, loss_chunk_tokens)), None)

    def has(self, size: Size) -> bool:
        m, tile, chunk = size
        return self.layer(m, tile) is not None and self.loss(m, tile, chunk) is not None

    def merged(self, other: "MeasuredBlocks") -> "MeasuredBlocks":
        """These blocks with `other`'s added (other's win where both measured a size)."""
        layers = {(t.micro_batch, t.seq_tile_tokens): t for t in (*self.layers, *other.layers)}
        losses = {(t.micro_batch, t.seq_tile_tokens, t.loss_chunk_tokens): t for t in (*self.losses, *other.losses)}
        return replace(self, layers=tuple(layers[k] for k in sorted(layers)),
                       losses=tuple(losses[k] for k in sorted(losses)))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "MeasuredBlocks":
        try:
            blocks = cls(shape=str(d["shape"]), device_name=str(d["device_name"]),
                         layers=tuple(LayerTime(**t) for t in d.get("layers", ())),
                         losses=tuple(LossTime(**t) for t in d.get("losses", ())),
                         measured_s=float(d.get("measured_s", 0.0)))
        except (KeyError, TypeError, ValueError) as e:
            raise MeasureError(f"measured blocks: {e}") from None
        for t in (*blocks.layers, *blocks.losses):
            times = (t.forward_s, t.backward_s) if isinstance(t, LayerTime) else (t.seconds,)
            if not all(isinstance(s, (int, float)) and 0 < s < float("inf") for s in times):
                raise MeasureError(f"measured blocks: {t} has a time that is not a positive number")
        return blocks


def shape_key(model: ModelConfig, seq_len: int, compute_dtype: str, compiled: bool,
              documents: DocumentLoad | None = None, layers: str = "native") -> str:
    """What a layer's and the loss's GPU time depend on: the layer's and the head's dimensions, the
    sequence length (and, for rows of packed documents, their lengths), the compute dtype and whether
    the pointwise pieces are compiled; and whose layers run (transformers': the model's own config and
    table, by hash)."""
    m = model
    window = m.window_of(0)
    if layers != "native":
        import hashlib

        table = json.dumps([m.source_config or m.to_hf(), m.to_dict().get("layer_tables")], sort_keys=True)
        return (f"{m.family} transformers layers {hashlib.sha256(table.encode()).hexdigest()[:12]} "
                f"h{m.hidden_size} {m.num_layers} layers vocab {m.vocab_size}; seq {seq_len}"
                f"{f', {documents.key}' if documents is not None else ''}; {compute_dtype}; "
                f"{'compiled' if compiled else 'eager'}")
    return (f"{m.family} h{m.hidden_size} i{m.intermediate_size} heads {m.num_heads}/{m.num_kv_heads}x{m.head_dim}"
            f"{' qk-norm' if m.qk_norm else ''}{' bias' if m.attention_bias else ''} vocab {m.vocab_size}; "
            f"seq {seq_len}{f' window {window}' if window is not None and window < seq_len else ''}"
            f"{f', {documents.key}' if documents is not None else ''}; {compute_dtype}; "
            f"{'compiled' if compiled else 'eager'}")


# --------------------------------------------------------------------------------------
# the engine's work, as callables (benchmarks/layer_bench.py times the same ones)

def timed(fn: Callable[[], None], sync: Callable[[], None], repeat: int, warmup: int = 2,
          min_window_s: float = 0.0) -> float:
    """Median seconds of fn over `repeat` runs after `warmup` runs (compiles happen there). With
    min_window_s, each timed run repeats fn back to back until the window is at least that long (at
    most MAX_INNER times) and counts one fn's share: a window of a few milliseconds is timer and
    scheduler noise as much as GPU work."""
    for _ in range(warmup):
        fn()
    sync()
    inner = 1
    if min_window_s > 0:
        t0 = time.perf_counter()
        fn()
        sync()
        inner = max(1, min(MAX_INNER, math.ceil(min_window_s / max(time.perf_counter() - t0, 1e-9))))
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        out.append((time.perf_counter() - t0) / inner)
    return max(statistics.median(out), 1e-9)


def fused_adamw(params: list, grads: list, m: list, v: list, steps: list) -> None:
    """One step of the fused AdamW over the tensors (the kernel the updater runs) at fixed hyper-parameters."""
    import torch

    torch._fused_adamw_(
        params, grads, m, v, [], steps, lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
        amsgrad=False, maximize=False,
    )


def flat_layer(cfg: ModelConfig, dtype, device, layer: int = 0) -> tuple[Any, Any, dict[str, Any]]:
    """A layer of the model as the engine holds a streamed layer: one flat chunk and its named views
    (1-D tensors 1, matrices N(0, 0.02))."""
    import torch

    from slidedp.store.layout import make_layout, unit_tensors, units_of

    unit = units_of(make_layout(cfg))[f"layer.{layer}"]
    flat = torch.empty(unit.numel, dtype=dtype, device=device).normal_(0, 0.02)
    views = unit_tensors(flat, unit, strip=f"model.layers.{layer}.")
    for t in views.values():
        if t.dim() == 1:
            t.fill_(1.0)
    return flat, unit, views


def pass_attention(cfg: ModelConfig, micro_batch: int, seq_len: int, passes: int, device, dtype,
                   documents: DocumentLoad | None = None, math=None, layer: int = 0) -> list:
    """Each pass's attention as the engine builds it: plain causal rows, or the sampled rows of packed
    documents in turn (the layer's window, if it has one); on the tables of `math` (None: native)."""
    return [attn for attn, _, _ in pass_rows(cfg, micro_batch, seq_len, passes, device, dtype, documents, math, layer)]


def pass_rows(cfg: ModelConfig, micro_batch: int, seq_len: int, passes: int, device, dtype,
              documents: DocumentLoad | None = None, math=None, layer: int = 0) -> list[tuple]:
    """(attention, positions, document numbers) of each pass (positions and numbers None for plain rows)."""
    import torch

    from slidedp.model import attention as A
    from slidedp.model import layers as L

    tables = math.rope(seq_len) if math is not None else L.rope_tables(cfg, seq_len, torch.device(device), dtype)
    window = cfg.window_of(layer)
    windowed = window is not None and window < seq_len
    if documents is None:
        backend = A.choose_backend(torch.device(device), dtype, cfg.head_dim, False, windowed)
        return [(A.plain_rows(tables, micro_batch, seq_len, backend).at_window(window), None, None)] * passes
    if any(sum(lengths) != seq_len for lengths in documents.sample):
        raise MeasureError(f"the sampled rows of documents do not fill rows of {seq_len} positions")
    out, rows = [], itertools.cycle(documents.sample)
    for _ in range(passes):
        positions = torch.empty(micro_batch, seq_len, dtype=torch.long)
        numbers = torch.empty(micro_batch, seq_len, dtype=torch.long)
        for r in range(micro_batch):
            lengths = next(rows)
            at = 0
            for d, n in enumerate(lengths):
                positions[r, at:at + n], numbers[r, at:at + n] = torch.arange(n), d
                at += n
        backend = A.choose_backend(torch.device(device), dtype, cfg.head_dim, True, windowed)
        out.append((A.packed_rows(tables, positions, numbers, backend).at_window(window), positions, numbers))
    return out


def _native(cfg: ModelConfig, device, dtype):
    import torch

    from slidedp.model.family import NativeMath

    return NativeMath(cfg, torch.device(device), dtype)


def layer_work(cfg: ModelConfig, micro_batch: int, seq_len: int, passes: int, tile: int, device, dtype,
               fuse: bool = True, documents: DocumentLoad | None = None, math=None,
               layer: int = 0) -> tuple[Callable[[], None], Callable[[], None]]:
    """The engine's work of one layer for `passes` micro-batches of `micro_batch` x `seq_len` tokens:
    (the forward without grad, the recompute + backward into an fp32 gradient), through `math` (the
    model's layers, model/family.py; None: the native ones, fused where `fuse`)."""
    import torch

    from slidedp.store.layout import unit_tensors

    math = math or _native(cfg, device, dtype)
    _, unit, views = flat_layer(cfg, dtype, device, layer)
    p = math.prepare(layer, views) if fuse else views
    acc = unit_tensors(torch.zeros(unit.numel, dtype=torch.float32, device=device), unit,
                       strip=f"model.layers.{layer}.")
    acc = math.prepare(layer, acc) if fuse else acc
    ctxs = [math.batch_context(a, pos, numbers)
            for a, pos, numbers in pass_rows(cfg, micro_batch, seq_len, passes, device, dtype, documents, math, layer)]
    xs = [torch.randn(micro_batch, seq_len, cfg.hidden_size, device=device, dtype=dtype) for _ in range(passes)]
    gys = [torch.randn_like(x) * 1e-3 for x in xs]

    def forward() -> None:
        with torch.no_grad():
            for x, ctx in zip(xs, ctxs):
                math.layer_forward(layer, p, x, ctx, tile)

    def backward() -> None:
        for x, gy, ctx in zip(xs, gys, ctxs):
            math.layer_backward(layer, p, x, ctx, gy.clone(), tile, acc)

    return forward, backward


def loss_work(cfg: ModelConfig, micro_batch: int, seq_len: int, passes: int, tile: int, chunk: int, device,
              dtype, math=None) -> Callable[[], None]:
    """The engine's loss for `passes` micro-batches: final norm + chunked cross-entropy and its backward,
    the head's gradient added into fp32, through `math` (None: the native layers' loss)."""
    import torch

    math = math or _native(cfg, device, dtype)
    h, v = cfg.hidden_size, cfg.vocab_size
    head = torch.empty(v, h, device=device, dtype=dtype).normal_(0, 0.02)
    norm_p = {n: torch.ones(shape, device=device, dtype=dtype) for n, shape in cfg.norm_parameter_shapes()}
    xs = [torch.randn(micro_batch, seq_len, h, device=device, dtype=dtype) for _ in range(passes)]
    targets = [torch.randint(0, v, (micro_batch, seq_len), device=device) for _ in range(passes)]
    norm_acc = {n: torch.zeros(t.shape, device=device) for n, t in norm_p.items()}
    head_acc = torch.zeros(v, h, device=device)
    scale = 1.0 / (passes * micro_batch * seq_len)

    def run() -> None:
        for x, t in zip(xs, targets):
            math.loss_and_backward(x.clone(), t, norm_p, head, scale, tile, chunk, norm_acc, head_acc)

    return run


# --------------------------------------------------------------------------------------
# measuring

def _device_tools(device: str) -> tuple[Callable[[], None], Callable[[Callable[[], None]], int]]:
    """(synchronize, the allocator's peak of a call above what was allocated before it; 0 on CPU)."""
    import torch

    if not device.startswith("cuda"):
        return (lambda: None), (lambda fn: (fn(), 0)[1])
    dev = torch.device(device)

    def sync() -> None:
        torch.cuda.synchronize(dev)

    def peak_of(fn: Callable[[], None]) -> int:
        sync()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        fn()
        sync()
        return max(0, torch.cuda.max_memory_allocated(dev) - base)

    return sync, peak_of


def measure_blocks(model: ModelConfig, seq_len: int, compute_dtype: str, compiled: bool, sizes: Iterable[Size],
                   local_batch: int, device: str = "cuda", repeat: int = 5, compile_fallback: bool = True,
                   device_name: str = "", documents: DocumentLoad | None = None, layers: str = "native") -> MeasuredBlocks:
    """Time one layer's forward, its recompute + backward and the loss at each size, on `device`, with
    the engine's code (`layers`: SlideDP's or transformers' layers; compiled pointwise pieces where
    `compiled`). Each time is per micro-batch pass, averaged over the passes of one rank's step
    (local_batch / micro_batch of them); where layers differ (hybrid models: full and linear attention,
    sliding and global) one layer of each structure is timed and the layer's time is their mean over the
    model's layers, its workspace the largest."""
    import torch

    from slidedp.model import layers as L
    from slidedp.model.family import math_for

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[compute_dtype]
    sync, peak_of = _device_tools(device)
    sizes = sorted({(m, normalized(m, seq_len, tile), chunk) for m, tile, chunk in sizes})
    if compiled:
        L.compile_kernels(fallback=compile_fallback)
    math = math_for(model, layers, torch.device(device), dtype, compile=compiled)
    structures = math.structures()  # a layer of each structure -> how many layers have it
    layer_times: dict[tuple[int, int], LayerTime] = {}
    losses: list[LossTime] = []
    try:
        for m, tile, chunk in sizes:
            if local_batch % m:
                raise MeasureError(f"micro_batch {m} does not divide the {local_batch} sequences per rank")
            passes = local_batch // m
            if (m, tile) not in layer_times:
                fwd = bwd = 0.0
                peak = 0
                for layer, count in structures.items():
                    forward, backward = layer_work(model, m, seq_len, passes, tile, device, dtype, documents=documents,
                                                   math=math, layer=layer)
                    fwd += count * timed(forward, sync, repeat, min_window_s=BLOCK_WINDOW_S)
                    bwd += count * timed(backward, sync, repeat, min_window_s=BLOCK_WINDOW_S)
                    peak = max(peak, peak_of(backward))
                    del forward, backward
                n = model.num_layers
                layer_times[(m, tile)] = LayerTime(m, tile, fwd / n / passes, bwd / n / passes, peak)
            run = loss_work(model, m, seq_len, passes, tile, chunk, device, dtype, math)
            losses.append(LossTime(m, tile, chunk, timed(run, sync, repeat, min_window_s=BLOCK_WINDOW_S) / passes,
                                   peak_of(run)))
            del run
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    finally:
        if compiled:
            L.compile_kernels(False)
    return MeasuredBlocks(shape_key(model, seq_len, compute_dtype, compiled, documents, layers), device_name or device,
                          tuple(layer_times[k] for k in sorted(layer_times)), tuple(losses))


def adamw_beside_copies(threads: int, device: str = "cuda", gpus: int = 1, params: int = 64 << 20,
                        copy_mib: int = 256, repeat: int = 5, state: tuple | None = None) -> float:
    """The fused CPU AdamW's rate (params/s) on `threads` threads while every one of `gpus` GPUs copies
    pinned host memory in and out without pause: the updaters' rate in training, where the DMA
    shares host memory with them. On CPU (device="cpu") the copies are memcpys. `state`: the
    (param, grad, exp_avg, exp_avg_sq) tensors to update (e.g. in shared memory, as the store's are);
    else `params` fresh ones."""
    import torch

    cuda = device.startswith("cuda")
    stop = threading.Event()
    errors: list[BaseException] = []
    running = threading.Semaphore(0)

    def copies(dev_index: int) -> None:
        try:
            copy_loop(dev_index)
        except BaseException as e:  # noqa: BLE001 - handed to the measuring thread
            errors.append(e)
        finally:
            running.release()  # a loop that failed must not keep the measurement waiting

    def copy_loop(dev_index: int) -> None:
        n = copy_mib << 20
        first = True
        if cuda:
            dev = torch.device("cuda", dev_index)
            host_in = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            host_out = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            on_dev = torch.empty(n, dtype=torch.uint8, device=dev)
            back = torch.empty(n, dtype=torch.uint8, device=dev)
            s_in, s_out = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
            while not stop.is_set():
                with torch.cuda.stream(s_in):
                    on_dev.copy_(host_in, non_blocking=True)
                with torch.cuda.stream(s_out):
                    host_out.copy_(back, non_blocking=True)
                s_in.synchronize()
                s_out.synchronize()
                if first:
                    running.release()
                    first = False
        else:
            src, dst = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
            while not stop.is_set():
                dst.copy_(src)
                if first:
                    running.release()
                    first = False

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    if state is None:
        p, g = torch.rand(params), torch.rand(params)
        m, v = torch.zeros(params), torch.zeros(params)
    else:
        p, g, m, v = state
        params = p.numel()
    step = torch.ones(())
    workers = [threading.Thread(target=copies, args=(i,), daemon=True) for i in range(max(1, gpus) if cuda else 1)]
    try:
        for w in workers:
            w.start()
        for _ in workers:  # every copy loop has copied once (or failed)
            running.acquire()
        if not errors:
            seconds = timed(lambda: fused_adamw([p], [g], [m], [v], [step]), lambda: None, repeat, warmup=1)
    finally:
        stop.set()
        for w in workers:
            w.join()
        torch.set_num_threads(before)
    if errors:
        raise MeasureError(f"the copies beside the AdamW measurement failed: {errors[0]}") from errors[0]
    return params / seconds


def lockable_bytes() -> int | None:
    """This process's locked-memory limit (RLIMIT_MEMLOCK, what cudaHostRegister may pin), None: unlimited."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def embedding_rows_rate(device: str = "cuda", quick: bool = False, repeat: int = 5) -> tuple[str, float]:
    """How a GPU rank gets a batch's rows of a host-held embedding to the GPU, and how fast (bytes of
    the fp32 table per second): through the worker's own HostRows, on a table registered as a worker
    registers the store. Where the driver maps that memory for the GPU, the GPU reads the rows in
    place ("device"); else the rank's RANK_THREADS CPU threads gather them and copy them from pageable
    memory ("cpu"), the GPU waiting. Random ids over a 512 MiB table: a batch's tokens touch rows all
    over a vocabulary's table, far past the host's caches. ("", 0.0): not measured, the table could not
    be registered (the locked-memory limit: a worker's store could not be either, and the worker says so)."""
    import torch

    from slidedp.store.host_rows import RANK_THREADS, HostRows
    from slidedp.store.hostmem import HostRegisterError, Registration

    dev = torch.device(device)
    rows_n, hidden, tokens = (8192, 1024, 2048) if quick else (32768, 4096, 16384)
    limit = lockable_bytes()
    if dev.type == "cuda" and limit is not None and limit < rows_n * hidden * 4:
        # registering would fail, and a failed cudaHostRegister leaves an error for the next kernel launch
        _log.warning("the embedding's rows were not measured: the locked-memory limit (%d bytes) is below the "
                     "probe's table; raise it (`ulimit -l unlimited`, LimitMEMLOCK=infinity)", limit)
        return "", 0.0
    table = torch.randn(rows_n, hidden)
    ids = torch.randint(0, rows_n, (tokens,))
    registration = Registration()
    before = torch.get_num_threads()
    try:
        try:
            registration.register(table, "the calibration's embedding table")
        except HostRegisterError as e:  # a worker could not register the store either: nothing to measure
            _log.warning("the embedding's rows were not measured: %s", e)
            return "", 0.0
        torch.set_num_threads(RANK_THREADS)
        gather = HostRows(table, dev, torch.bfloat16)
        ids_dev = ids.to(dev)
        sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
        seconds = timed(lambda: gather.rows(ids, ids_dev), sync, max(1, repeat), warmup=1)
    finally:
        torch.set_num_threads(before)
        registration.unregister()
    return ("device" if gather.on_device else "cpu"), tokens * hidden * 4 / seconds
