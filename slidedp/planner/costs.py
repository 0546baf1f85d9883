"""Pure cost formulas of one optimizer step: FLOPs, bytes per resource, GPU memory per item.

No torch here: every function is arithmetic on the model shape, so the planner runs (and is
tested) anywhere. Units: FLOPs, bytes, parameters; seconds appear only in `plan.py`, where a
calibration turns these counts into time.

What is counted, and what is deliberately not:
- FLOPs are matmul FLOPs (2 per multiply-add). Norms, RoPE, SwiGLU's elementwise product and
  softmax are memory-bound and small next to the matmuls; the calibration's *effective*
  TFLOP/s (measured on a whole layer, not a bare matmul) absorbs them.
- Every layer's input is saved and the layer is recomputed in backward, so a layer costs
  forward + recompute (= forward) + backward (= 2x forward) = 4x its forward FLOPs.
- The chunked cross-entropy computes each token chunk's logits once and derives the loss and
  the logits' gradient in the same pass: forward (2VH) + the two backward matmuls (4VH).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from slidedp import hosttraffic
from slidedp.model import moe_shape
from slidedp.model.config import ModelConfig
from slidedp.store import layout as store_layout

# --------------------------------------------------------------------------------------
# parameters

@functools.lru_cache(maxsize=64)  # the planner asks it for every candidate
def layer_params(model: ModelConfig) -> int:
    """Parameters of one decoder layer (the mean where layers differ, as in hybrid models)."""
    return sum(map(model.layer_numel, range(model.num_layers))) // model.num_layers


def embedding_params(model: ModelConfig) -> int:
    return model.vocab_size * model.hidden_size


def head_params(model: ModelConfig) -> int:
    """Parameters of an untied LM head; 0 when tied (the head IS the embedding)."""
    return 0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size


def gathers_rows(model: ModelConfig, embedding: str) -> bool:
    """Whether a step gathers its batch's embedding rows from the host: an untied embedding on the host
    (a tied one comes to the GPU whole, for the head, and its rows are gathered there)."""
    return embedding == "host" and not model.tie_word_embeddings


def default_chunk_rows(model: ModelConfig, layer_chunk_numel: int = 0) -> int:
    """Rows per embedding/head block: as many as fit in one decoder layer's parameter count, or where the
    layers are cut (layer_chunk_numel), in one layer chunk's (store/layout.py:default_chunk_rows)."""
    size = min(layer_chunk_numel, layer_params(model)) if layer_chunk_numel else layer_params(model)
    return max(1, min(model.vocab_size, size // model.hidden_size))


@functools.lru_cache(maxsize=64)
def layer_cut(model: ModelConfig, layer_chunk_numel: int | None = None) -> int:
    """Where the store's layout cuts the layers for the job's plan.layer_chunk_numel (None: "auto", the
    layout's rule, store/layout.py:default_layer_chunk_numel); 0: whole layers."""
    return store_layout.layer_split(model, layer_chunk_numel)


def largest_chunk(model: ModelConfig, layer_chunk_numel: int, chunk_rows: int = 0) -> int:
    """The store's largest chunk (elements): a layer, or its largest chunk where layers are cut, or an
    embedding/head row block: what a gradient slot and an aggregator's reduction slot hold."""
    layer = max(map(model.layer_numel, range(model.num_layers)))
    if layer_chunk_numel:
        big = max(range(model.num_layers), key=model.layer_numel)
        layer = max(store_layout.layer_chunk_sizes(model, big, layer_chunk_numel))
    rows = chunk_rows or default_chunk_rows(model, layer_chunk_numel)
    return max(layer, min(rows, model.vocab_size) * model.hidden_size)


@functools.lru_cache(maxsize=64)
def layer_chunk_shares(model: ModelConfig, layer_chunk_numel: int) -> tuple[float, ...]:
    """Each of a layer's chunks as a share of the layer, as the store's layout cuts its largest layer at
    layer_chunk_numel (0: one chunk, (1.0,)). The step model applies them to the mean layer."""
    if not layer_chunk_numel:
        return (1.0,)
    big = max(range(model.num_layers), key=model.layer_numel)
    sizes = store_layout.layer_chunk_sizes(model, big, layer_chunk_numel)
    return tuple(s / sum(sizes) for s in sizes)


@functools.lru_cache(maxsize=64)
def active_layer_params(model: ModelConfig) -> int:
    """Parameters a token computes with in one decoder layer (the mean over layers): all of a dense
    layer; the dense part and top_k / E of the routed experts of a Mixture-of-Experts layer
    (model/moe_shape.py). GPU time scales with these; copies, sums and AdamW with layer_params."""
    shapes = [moe_shape.layer_shape(model, i) for i in range(model.num_layers)]
    return sum(s.active for s in shapes) // model.num_layers


def row_blocks(rows: int, chunk_rows: int) -> list[int]:
    """Sizes of the row blocks of a [rows, H] matrix cut into blocks of at most chunk_rows."""
    full, rest = divmod(rows, chunk_rows)
    return [chunk_rows] * full + ([rest] if rest else [])


# --------------------------------------------------------------------------------------
# FLOPs

def layer_forward_flops_per_token(model: ModelConfig, seq_len: float) -> float:
    """Forward matmul FLOPs of one decoder layer per token.

    Projections 2*H*(q + 2*kv) + o_proj 2*q*H; causal SDPA: QK^T and AV are 2*L*q each per
    token over the full square, halved by the causal mask -> 2*L*q; SwiGLU MLP 3 * 2*H*I.
    seq_len: L, or for rows of packed documents the sum of their squared lengths per token
    (Workload.attended_len), since each document attends only to itself.
    (Qwen3-4B, L=2048: 218.6 MFLOP/token; x3 for forward+backward on 16,384 tokens = 10.7 TFLOP,
    which at the prototype's measured 26.5 ms is its 405 TFLOP/s.)
    Mixture-of-Experts layers: 2 per active parameter (active_layer_params: a token's top_k experts, not
    all E) plus the same attention term.
    """
    h, i = model.hidden_size, model.intermediate_size
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    if moe_shape.num_experts(model):
        return 2.0 * active_layer_params(model) + 2.0 * seq_len * q
    return 2.0 * h * (2 * q + 2 * kv) + 2.0 * seq_len * q + 6.0 * h * i


def layer_step_flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Forward + recompute + backward (2x forward) = 4x the forward."""
    return 4.0 * layer_forward_flops_per_token(model, seq_len)


def head_forward_flops_per_token(model: ModelConfig) -> float:
    return 2.0 * model.vocab_size * model.hidden_size


def head_step_flops_per_token(model: ModelConfig) -> float:
    """Chunked loss: logits (2VH) + grad wrt hidden (2VH) + grad wrt head (2VH)."""
    return 3.0 * head_forward_flops_per_token(model)


def step_flops(model: ModelConfig, tokens: int, seq_len: int) -> float:
    """GPU FLOPs of one step over `tokens` tokens (one rank's share if tokens is per rank)."""
    per_token = model.num_layers * layer_step_flops_per_token(model, seq_len) + head_step_flops_per_token(model)
    return per_token * tokens


# --------------------------------------------------------------------------------------
# bytes

def delivery_bytes(delivery: str) -> int:
    """Bytes per parameter on the wire host->GPU: fp32 master (default) or the bf16 shadow."""
    if delivery not in ("fp32", "bf16"):
        raise ValueError(f"delivery must be 'fp32' or 'bf16', got {delivery!r}")
    return 4 if delivery == "fp32" else 2


def dtype_bytes(dtype: str) -> int:
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"compute_dtype must be 'bf16' or 'fp32', got {dtype!r}")
    return 2 if dtype == "bf16" else 4


GRAD_BYTES = 4  # gradients leave the GPU in fp32 (cast on the GPU)


# A layer's recompute + backward with compiled pointwise kernels (train.compile) against eager
# (benchmarks.layer_bench; docs/planner.md, "The constants").
COMPILED_LAYER_SPEEDUP = 1.44
# a correction of a speculative update (the one-pass correction of clipping/rollback.py) in AdamW's of the
# chunk (benchmarks/RESULTS.md, "The updater's kernels"; the undo + redo it replaced measured 2.3)
CORRECTION_ADAMWS = 1.1


def update_bytes_per_param(delivery: str) -> int:
    """Host memory traffic of the fused CPU AdamW per parameter.

    Reads master, exp_avg, exp_avg_sq, grad (16 B) and writes master, exp_avg, exp_avg_sq (12 B)
    = 28 B; the bf16 shadow delivery's store also has its shadow refreshed (hosttraffic.update_bytes).
    """
    return hosttraffic.update_bytes(delivery == "bf16")


def reduce_traffic_factor(world: int, grad_route: str = "host", clip: bool = False) -> float:
    """Host traffic of the aggregator per gradient element, relative to the calibrated 2-input sum.

    The calibration measures out = a + b (3 buffers touched per output element); N inputs touch
    N + 1. One rank's gradient, and reduce-scattered gradients (summed on the devices), are read
    by the updaters where they lie: nothing, with exact clipping too (the gradients stay in the
    ranks' rings, a slot per chunk, until the step's norm is known). `clip` changes nothing; it
    stays for the callers that name the job's clipping."""
    if world <= 1 or grad_route == "reduce_scatter":
        return 0.0
    return (world + 1) / 3.0


def host_traffic(
    model: ModelConfig, *, tokens: int, delivery: str, embedding: str, resident_layers: int, device_layers: int,
    offloaded: int, world: int, param_route: str, grad_route: str, compute_dtype: str, summed: bool,
    nnodes: int = 1,
) -> dict[str, int]:
    """Host memory bytes one step reads and writes, all ranks together (slidedp/hosttraffic.py per element):

    fetch     the copies in: every streamed layer in forward, again in backward unless resident, the
              final norm, and with the embedding on the host its rows and the matrix for the head;
              each rank reads its own (sharded: its 1/N)
    grads     the fp32 gradients written into the rings (reduce_scatter: each rank its 1/N of the sum)
    offload   the offloaded layers' inputs, written in forward and read back in backward
    update    the updaters' AdamW over every host parameter, and the shadow refresh with bf16 delivery
    sum       the aggregator's sum of the ranks' gradients (summed: several ranks, host route), and its norm
    tokens: one rank's tokens per step. nnodes: hosts in the job (docs/multi-host.md): the routes are sharded and
    reduce_scatter over every host's ranks, so this host reads, writes and updates its 1/nnodes of every
    chunk, and an untied embedding is fetched whole (sharded) instead of its rows."""
    fb = hosttraffic.fetch_bytes(delivery)
    p_layer, nl, h = layer_params(model), model.num_layers, model.hidden_size
    held = min(device_layers, nl)
    streamed = nl - held
    refetched = streamed - min(resident_layers, streamed)
    readers = 1 if param_route == "sharded" else world  # copies of a parameter read from the host per fetch
    writers = 1 if grad_route == "reduce_scatter" else world
    fetch = ((streamed + refetched) * p_layer + h) * fb * readers
    grads = (streamed * p_layer + h) * hosttraffic.FP32 * writers
    if embedding == "host":
        vh = embedding_params(model)
        rows = tokens * world * h * fb if gathers_rows(model, embedding) and nnodes == 1 else 0
        whole = vh * fb * readers if gathers_rows(model, embedding) and nnodes > 1 else 0  # fetched whole, sharded
        fetch += rows + whole + vh * fb * readers  # the batch's rows, the head's matrix (tied: the embedding)
        grads += (vh + head_params(model)) * hosttraffic.FP32 * writers
    updated = host_updated_params(model, embedding, device_layers)
    return {
        "fetch": fetch // nnodes, "grads": grads // nnodes,
        "offload": 2 * offloaded * activation_bytes(model, tokens, compute_dtype) * world,
        "update": updated * hosttraffic.update_bytes(delivery == "bf16") // nnodes,
        "sum": updated * (hosttraffic.sum_bytes(world) + hosttraffic.FP32) if summed else 0,
    }


def activation_bytes(model: ModelConfig, tokens: int, compute_dtype: str) -> int:
    """One layer's input for `tokens` tokens (what `keep`/`offload` saves per layer)."""
    return tokens * model.hidden_size * dtype_bytes(compute_dtype)


def host_updated_params(model: ModelConfig, embedding: str, device_layers: int = 0) -> int:
    """Parameters the CPU updates per step: every layer not held on the device and the final
    norm, plus the embedding (and an untied head) when they live on the host."""
    n = (model.num_layers - min(device_layers, model.num_layers)) * layer_params(model) + model.hidden_size
    if embedding == "host":
        n += embedding_params(model) + head_params(model)
    return n


def transfer_bytes(
    model: ModelConfig, *, tokens: int, delivery: str, activations: str, embedding: str,
    resident_layers: int, compute_dtype: str = "bf16", offload_layers: int | None = None,
    world: int = 1, param_route: str = "replicated", grad_route: str = "host",
) -> dict[str, int]:
    """Bytes one rank moves over PCIe per step: {"h2d": ..., "d2h": ...}.

    tokens: the rank's tokens per step (global_batch / world * seq_len). offload_layers: how
    many layers' inputs go out and back with activations = "offload" (None: all). The sharded
    routes move 1/world of every chunk (the rest crosses the GPU links).
    """
    db = delivery_bytes(delivery)
    p_layer, nl, h = layer_params(model), model.num_layers, model.hidden_size
    act = activation_bytes(model, tokens, compute_dtype)
    p_in = 1.0 / world if param_route == "sharded" else 1.0
    g_out = 1.0 / world if grad_route == "reduce_scatter" else 1.0
    h2d = int(((2 * nl - resident_layers) * p_layer * db + h * db) * p_in)  # layers twice (fwd, re-fetch), final norm
    d2h = int((nl * p_layer * GRAD_BYTES + h * GRAD_BYTES) * g_out)
    if activations == "offload":
        k = nl if offload_layers is None else offload_layers
        h2d += k * act
        d2h += k * act
    if embedding == "host":
        vh = embedding_params(model)
        if gathers_rows(model, embedding):  # forward gathers only the batch's rows (tied: from the matrix, below)
            h2d += tokens * h * db
        h2d += int(vh * db * p_in)  # the head for the loss (tied: the embedding matrix; untied: lm_head)
        d2h += int(vh * GRAD_BYTES * g_out)  # the embedding's (tied: shared) gradient, whole matrix
        d2h += int(head_params(model) * GRAD_BYTES * g_out)  # untied head's gradient
    return {"h2d": h2d, "d2h": d2h}


# --------------------------------------------------------------------------------------
# GPU memory

MiB = 1 << 20
GiB = 1 << 30
CUDA_CONTEXT_BYTES = 512 * MiB  # CUDA context + loaded kernels: outside the allocator, still on the GPU
WORKSPACE_BYTES = 128 * MiB  # cuBLAS workspaces, SDPA scratch
NCCL_BYTES = 256 * MiB  # NCCL communicator buffers, only with more than one rank
# Caching-allocator slack on top of the peak's tensors, one rank and several (with several, blocks wait
# for the NCCL and copy streams before reuse); measured on GPU runs (docs/tuning.md, in git history).
ALLOCATOR_RESERVE = 0.10
ALLOCATOR_RESERVE_RANKS = 0.20
LOGIT_BYTES = 2 + 4 + 4  # per logit of a loss chunk: bf16 matmul output, fp32 copy, fp32 gradient


def allocator_reserve(world: int) -> float:
    return ALLOCATOR_RESERVE if world == 1 else ALLOCATOR_RESERVE_RANKS


def attention_bytes_per_token(model: ModelConfig, compute_dtype: str) -> int:
    """The attention half of a layer's recompute + backward at its peak, per token. It spans the
    whole micro-batch (attention needs every key), tiled or not. Counted in bf16 with
    saved_tensors_hooks on a Qwen3-8B layer: the graph (norm's fp32 copies, q/k/v before and after
    qk-norm and rope, SDPA's output and log-sum-exp), plus the layer input, attention output and
    gradient buffer (6H), plus the backward's dO, dq/dk/dv and flash's fp32 dq (8q + 4kv)."""
    h, nh, nkv = model.hidden_size, model.num_heads, model.num_kv_heads
    q, kv = nh * model.head_dim, nkv * model.head_dim
    if model.qk_norm:
        bf16 = 14 * h + 18 * q + 14 * kv + 8 * nh + 4 * nkv + 4
    else:
        bf16 = 14 * h + 12 * q + 8 * kv + 4 * nh + 4
    return bf16 * dtype_bytes(compute_dtype) // 2


def mlp_bytes_per_token(model: ModelConfig, compute_dtype: str) -> int:
    """The post-attention norm + MLP half, per token: saved for backward 8H + 8I (norm copies,
    gate/up/act), backward transients up to 8H + 6I (counted in bf16). With sequence tiling only
    one tile of it is live."""
    return (16 * model.hidden_size + 14 * model.intermediate_size) * dtype_bytes(compute_dtype) // 2


def workspace_bytes_per_token(model: ModelConfig, compute_dtype: str) -> int:
    """Transient tensors of one layer's recompute + backward, per token of a micro-batch (untiled)."""
    return attention_bytes_per_token(model, compute_dtype) + mlp_bytes_per_token(model, compute_dtype)


def layer_workspace_bytes(model: ModelConfig, micro_batch: int, seq_len: int, seq_tile_tokens: int,
                          compute_dtype: str) -> int:
    """One layer's recompute + backward workspace: the attention half over the whole micro-batch,
    the MLP half over one tile of `seq_tile_tokens` of its micro_batch x seq_len tokens (0: untiled)."""
    tokens = micro_batch * seq_len
    tile = tokens if seq_tile_tokens <= 0 else min(seq_tile_tokens, tokens)
    return tokens * attention_bytes_per_token(model, compute_dtype) + tile * mlp_bytes_per_token(model, compute_dtype)


STAGING_BYTES = (32 << 20) * 4  # slidedp.worker.delivery.STAGING_ELEMENTS fp32


# When an item is live, for the items that are not live the whole step. The step's peak is the
# step-long items plus the largest phase: the loss (every kept layer input and a chunk of logits),
# the backward of the last layer (every kept input, the recompute's workspace, the chunk's
# gradients) and the end of backward (the held layers' backward, whose gradients wait for the
# device AdamW after backward, and an untied embedding's gradient on its way to the host, while only
# the held layers' own saved inputs are left). Measured peaks: tests/planner/measured_peaks.json.
PHASES = ("loss", "backward", "end of backward")
LIVE_IN: dict[str, tuple[str, ...]] = {
    "saved layer inputs": ("loss", "backward"),
    "saved inputs, held layers": ("loss", "backward", "end of backward"),
    "loss chunk logits": ("loss",),
    "layer workspace": ("backward", "end of backward"),
    "chunk gradients": ("backward", "end of backward"),
    "held layers' gradients": ("end of backward",),
    # an untied head on the host: its weights for the loss, its gradient until its copy out has
    # landed (checked when the last layer's gradient is sent, after that layer's backward), the
    # embedding's gradient only once the layers are done
    "head weights (loss)": ("loss",),
    "head gradient": ("loss", "backward"),
    "embedding gradient": ("end of backward",),
}


def live_in(item: str) -> tuple[str, ...]:
    """The phases in which an item is live (every phase, unless LIVE_IN says otherwise)."""
    return LIVE_IN.get(item, PHASES)


def device_memory_items(
    model: ModelConfig, *, tokens: int, seq_len: int, micro_batch: int, world: int, delivery: str,
    activations: str, embedding: str, prefetch_depth: int, resident_layers: int, chunk_rows: int,
    loss_chunk_tokens: int, compute_dtype: str = "bf16", offload_layers: int | None = None, seq_tile_tokens: int = 0,
    device_layers: int = 0, nnodes: int = 1,
) -> list[tuple[str, int]]:
    """GPU memory of one rank, item by item, each at its largest (`device_memory_peak` adds them up
    phase by phase: not all of them are live at the same instant). tokens: the rank's tokens per step.
    nnodes > 1: an untied host embedding is fetched whole (no host holds every row) and kept for the step."""
    cb = dtype_bytes(compute_dtype)
    db = delivery_bytes(delivery)
    h, v = model.hidden_size, model.vocab_size
    p_layer = layer_params(model)
    p_chunk = max(p_layer, min(chunk_rows, v) * h)  # largest streamed chunk
    # a slot holds the chunk in the compute dtype; fp32 that must be cast arrives through one
    # fixed staging piece (slidedp/delivery.py, STAGING_ELEMENTS), not a second full-size buffer
    slot = p_chunk * cb
    staging = STAGING_BYTES if db != cb else 0
    act = activation_bytes(model, tokens, compute_dtype)
    items: list[tuple[str, int]] = [
        ("parameter slots", (prefetch_depth + 1) * slot + staging),
        ("resident layers", resident_layers * p_layer * cb),
        # one chunk accumulating in fp32, one draining over D2H, plus autograd's compute-dtype grad
        ("chunk gradients", p_chunk * (2 * GRAD_BYTES + cb)),
        # the current layer's input/output for all local micro-batches (their gradients in backward)
        ("hidden states", 2 * act),
    ]
    nl = model.num_layers
    held = min(device_layers, nl)
    offloaded = 0 if activations == "keep" else (nl if offload_layers is None else min(offload_layers, nl))
    # the inputs of layers offloaded..nl-1 stay on the GPU; those of the held layers 0..held-1 among
    # them are still there in the held layers' backward
    kept_held = max(0, held - offloaded)
    if nl - offloaded - kept_held:
        items.append(("saved layer inputs", (nl - offloaded - kept_held) * act))
    if kept_held:
        items.append(("saved inputs, held layers", kept_held * act))
    if offloaded:
        # one layer's input draining to the host in forward, one coming back ahead in backward
        items.append(("offload staging", 2 * act))
    items.append(("layer workspace", layer_workspace_bytes(model, micro_batch, seq_len, seq_tile_tokens, compute_dtype)))
    items.append(("loss chunk logits", loss_chunk_tokens * v * LOGIT_BYTES))
    if held:
        # fp32 master, moments and the compute-dtype copy for the whole job; the fp32 gradient from
        # the held layers' backward to the device AdamW that ends the step
        items.append(("device-held layers", held * p_layer * (12 + cb)))
        items.append(("held layers' gradients", held * p_layer * GRAD_BYTES))
    vh = embedding_params(model) + head_params(model)
    if embedding == "device":
        # fp32 master + exp_avg + exp_avg_sq + fp32 grad (from the loss on), and the compute-dtype copy
        items.append(("embedding/head on GPU", vh * (16 + cb)))
    elif model.tie_word_embeddings:  # fetched whole for the head; one gradient from the loss to the end
        items.append(("embedding/head weights", v * h * cb))
        items.append(("embedding/head gradient", v * h * GRAD_BYTES))
    else:
        if nnodes > 1:  # several hosts: the matrix all-gathered for the lookup, held by the engine to the step's end
            items.append(("embedding weights (fetched whole)", v * h * cb))
        items.append(("head weights (loss)", v * h * cb))
        items.append(("head gradient", v * h * GRAD_BYTES))
        items.append(("embedding gradient", v * h * GRAD_BYTES))
    items.append(("CUDA context", CUDA_CONTEXT_BYTES))
    items.append(("cuBLAS/NCCL workspace", WORKSPACE_BYTES + (NCCL_BYTES if world > 1 else 0)))
    return items


@dataclass(frozen=True)
class MemoryPeak:
    phase: str  # the phase at the peak (one of PHASES)
    tensor_bytes: int  # the allocator's tensors live then
    reserve_bytes: int  # the caching allocator's slack on top of them
    total_bytes: int  # tensors + reserve + the CUDA context: what the budget must hold


def device_memory_peak(items: list[tuple[str, int]] | tuple[tuple[str, int], ...], world: int) -> MemoryPeak:
    """The step's peak: per phase, the items live in it; the largest phase, plus the allocator's
    reserve on its tensors (allocator_reserve(world)) and the CUDA context (outside the allocator)."""
    context = sum(b for name, b in items if name == "CUDA context")
    by_phase = {ph: sum(b for name, b in items if ph in live_in(name) and name != "CUDA context") for ph in PHASES}
    phase = max(PHASES, key=lambda ph: by_phase[ph])  # the first of equal phases
    tensors = by_phase[phase]
    reserve = int(allocator_reserve(world) * tensors)
    return MemoryPeak(phase, tensors, reserve, tensors + reserve + context)
