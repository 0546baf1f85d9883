"""What the planner plans for (`Workload`: the model, the batch, the ranks). What it chooses is a
`StepPlan` (slidedp/stepplan.py): everything the step-time model needs besides the workload."""

from __future__ import annotations

from dataclasses import dataclass

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

    def __post_init__(self) -> None:
        for name in ("global_batch", "seq_len", "world", "updaters"):
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
    def local_batch(self) -> int:
        return self.global_batch // self.world

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
