"""What the planner plans for (`Workload`: the model, the batch, the ranks). What it chooses is a
`StepPlan` (slidedp/stepplan.py): everything the step-time model needs besides the workload."""

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

