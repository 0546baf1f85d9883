"""What the planner plans for (`Workload`: the model, the batch, the ranks). What it chooses is a
`StepPlan` (slidedp/stepplan.py): everything the step-time model needs besides the workload."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from slidedp.model.config import ModelConfig
from slidedp.planner import costs


@dataclass(frozen=True)
class HostRoom:
    """Host memory left for the plan's own choices once everything any plan takes is counted (the
    store's fp32 state where the job creates it, the gradient rings, the job's processes): the
    ranks' buffers for offloaded layer inputs, and the bf16 shadow of a store the job creates."""

    free_bytes: int  # may be negative: then no plan fits the host
    shadow_bytes: int = 0  # what the bf16 delivery adds (0: the store exists, or has no room to grow)


@dataclass(frozen=True)
class DocumentLoad:
    """What rows of packed documents cost attention (from the job's data, read at launch). A token attends
    to the earlier tokens of its own document, so a row's attention costs the sum of its documents' squared
    lengths, not the row's square (the variable-length kernel computes nothing else).

    attended_len: that sum over the data's rows, per token (seq_len where each row is one document);
    sample: the documents' lengths in some rows spread over the data, the rows the planner times the layer on.
    A row's padding counts to its last document (attention.py)."""

    attended_len: float
    sample: tuple[tuple[int, ...], ...]

    SAMPLE_ROWS = 32

    @classmethod
    def of(cls, lengths: Sequence[int], row_offsets: Sequence[int], sample_rows: int = SAMPLE_ROWS) -> "DocumentLoad":
        """From every row's document lengths in row order (row r: lengths[row_offsets[r]:row_offsets[r + 1]])."""
        rows = len(row_offsets) - 1
        if rows < 1:
            raise ValueError("no rows")
        square = sum(float(n) * n for n in lengths)
        tokens = sum(int(n) for n in lengths)
        k = min(rows, sample_rows)
        picks = sorted({round(i * (rows - 1) / max(1, k - 1)) for i in range(k)})
        sample = tuple(tuple(int(n) for n in lengths[row_offsets[r]:row_offsets[r + 1]]) for r in picks)
        return cls(square / tokens, sample)

    @property
    def key(self) -> str:
        """What the measured layer depends on (two significant figures: the same data's jobs share blocks)."""
        rounded = round(self.attended_len, 1 - int(math.floor(math.log10(max(self.attended_len, 1.0)))))
        return f"packed documents, {rounded:g} attended"

    def to_dict(self) -> dict[str, Any]:
        return {"attended_len": self.attended_len, "sample": [list(r) for r in self.sample]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DocumentLoad":
        return cls(float(d["attended_len"]), tuple(tuple(int(n) for n in r) for r in d["sample"]))


@dataclass(frozen=True)
class Workload:
    model: ModelConfig
    global_batch: int  # sequences per optimizer step, all ranks together
    seq_len: int
    world: int
    micro_batch: int  # sequences per forward/backward pass on one rank; 0: the plan chooses
    compute_dtype: str = "bf16"
    clip: bool = True  # exact global-norm gradient clipping (max_grad_norm > 0)
    updaters: int = 1  # CPU updater processes (K)
    compiled: bool = False  # the worker runs the layers' pointwise kernels compiled (train.compile)
    host_room: HostRoom | None = None  # None: the host's memory does not limit the plan (CPU, replays)
    documents: DocumentLoad | None = None  # rows of packed documents (None: each row is one sequence)
    layers: str = "native"  # whose layers run the model (StepPlan.layers): transformers' are never tiled
    layer_chunk_numel: int | None = None  # the job's plan.layer_chunk_numel (None: "auto", the layout's rule)
    # hosts in the job (docs/multi-host.md): `world` ranks on each, `global_batch` this host's share; the routes
    # run over every host's ranks (nnodes x world), and this host's store and updaters hold 1/nnodes of the state
    nnodes: int = 1

    def __post_init__(self) -> None:
        for name in ("global_batch", "seq_len", "world", "updaters", "nnodes"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"workload {name} must be a positive integer, got {getattr(self, name)!r}")
        if int(self.micro_batch) < 0:
            raise ValueError(f"workload micro_batch must be >= 0 (0: the plan chooses), got {self.micro_batch!r}")
        if self.global_batch % self.world:
            raise ValueError(f"global_batch ({self.global_batch}) must be a multiple of world ({self.world})")
        if self.micro_batch and self.local_batch % self.micro_batch:
            raise ValueError(
                f"micro_batch ({self.micro_batch}) must divide the sequences per rank "
                f"(global_batch / world = {self.local_batch})"
            )
        costs.dtype_bytes(self.compute_dtype)

    @property
    def layer_cut(self) -> int:
        """Where the store's layout cuts the layers into chunks (StepPlan.layer_chunk_numel; 0: whole layers)."""
        return costs.layer_cut(self.model, self.layer_chunk_numel)

    @property
    def ranks(self) -> int:
        """Ranks over every host: what the sharded routes cut each chunk among."""
        return self.world * self.nnodes

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.world

    @property
    def attended_len(self) -> float:
        """Twice the mean number of keys a token attends to: seq_len for plain causal rows."""
        return self.documents.attended_len if self.documents is not None else float(self.seq_len)

    @property
    def local_tokens(self) -> int:
        return self.local_batch * self.seq_len

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def host_offload_cap(self, delivery: str) -> int:
        """The most layers whose inputs the host has room to keep offloaded at this delivery (every
        layer where the host does not limit the plan); -1 where even none fit (the shadow does not)."""
        nl = self.model.num_layers
        if self.host_room is None:
            return nl
        free = self.host_room.free_bytes - (self.host_room.shadow_bytes if delivery == "bf16" else 0)
        if free < 0:
            return -1
        per_layer = costs.activation_bytes(self.model, self.tokens_per_step, self.compute_dtype)  # every rank's
        return min(nl, free // per_layer)
