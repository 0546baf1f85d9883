"""What the planner plans for (`Workload`: the model, the batch, the ranks) and the space it
chooses in (`Choices`: everything the step-time model needs besides the workload)."""

from __future__ import annotations

from dataclasses import dataclass

from slidedp.model.config import ModelConfig
from slidedp.planner import costs


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


@dataclass(frozen=True)
class Choices:
    """What the planner decides; everything `predict_step` needs besides the workload."""

    activations: str = "keep"  # "keep" on the GPU | "offload" to pinned host memory
    embedding: str = "host"  # "host" (rows gathered, host update) | "device" (held there, AdamW on the device)
    delivery: str = "fp32"  # what crosses PCIe to the GPU: fp32 master | bf16 shadow
    prefetch_depth: int = 1
    resident_layers: int = 0  # last layers kept on the GPU from forward to backward
    device_layers: int = 0  # first layers held on the GPU with their AdamW state (no copies, GPU AdamW)
    micro_batch: int | None = None  # None: the workload's (which must name one)
    chunk_rows: int | None = None  # None: as many rows as one decoder layer has parameters
    loss_chunk_tokens: int = 1024
    offload_layers: int | None = None  # with activations = "offload": the first layers offloaded (None: all)
    seq_tile_tokens: int = 0  # MLP/norm/head tile along the sequence; 0: untiled
    param_route: str = "replicated"  # | "sharded": 1/N per rank over PCIe, all-gathered over the GPU links
    grad_route: str = "host"  # | "reduce_scatter": summed on the GPUs, 1/N per rank over PCIe

    def __post_init__(self) -> None:
        if self.activations not in ("keep", "offload"):
            raise ValueError(f"activations must be 'keep' or 'offload', got {self.activations!r}")
        if self.param_route not in ("replicated", "sharded"):
            raise ValueError(f"param_route must be 'replicated' or 'sharded', got {self.param_route!r}")
        if self.grad_route not in ("host", "reduce_scatter"):
            raise ValueError(f"grad_route must be 'host' or 'reduce_scatter', got {self.grad_route!r}")
        if self.embedding not in ("host", "device"):
            raise ValueError(f"embedding must be 'host' or 'device', got {self.embedding!r}")
        costs.delivery_bytes(self.delivery)
        if not 1 <= self.prefetch_depth <= 8:
            raise ValueError(f"prefetch_depth must be between 1 and 8, got {self.prefetch_depth}")
        if self.seq_tile_tokens < 0:
            raise ValueError(f"seq_tile_tokens must be >= 0, got {self.seq_tile_tokens}")
        if self.device_layers < 0:
            raise ValueError(f"device_layers must be >= 0, got {self.device_layers}")

    def offloaded(self, num_layers: int) -> int:
        """How many layers' inputs wait in host memory."""
        if self.activations == "keep":
            return 0
        return num_layers if self.offload_layers is None else min(self.offload_layers, num_layers)

