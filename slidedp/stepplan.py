"""The step plan: how every rank runs a step, as one record from the planner to the engine.

The planner makes it (slidedp/planner/job.py:plan_for: its choices on CUDA, the CPU defaults
elsewhere, and the job file's [plan] values, whose keys are the choices here, CHOICES), the launcher
writes it beside job.resolved.toml as `plan.json`, and every worker reads that file and carries it
out; `slidedp-report` shows it. It lives outside slidedp/planner/ because the workers read it and
import nothing of the planner. The fields are plain values, so the file reads as it is and grows by
adding a field with a default.

Words: a layer or unit is "held" (device-held) when it stays on the device for the whole job with
its AdamW state; "resident" when it stays from its forward to its backward; "offloaded" when its
saved input waits in pinned host memory until backward.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

PLAN_FILE = "plan.json"

PARAM_ROUTES = ("replicated", "sharded")
GRAD_ROUTES = ("host", "reduce_scatter")
PLACES = ("host", "device")
DELIVERIES = ("fp32", "bf16")
COMPUTE_DTYPES = ("bf16", "fp32")
LAYERS = ("native", "transformers")


class StepPlanError(ValueError):
    """A plan that cannot run: the message names the field."""


@dataclass(frozen=True)
class StepPlan:
    # the batch
    micro_batch: int = 1  # sequences per forward/backward pass on one rank
    compute_dtype: str = "bf16"  # what the layers compute in ("bf16" | "fp32"); master and gradients stay fp32
    layers: str = "native"  # whose layers run the model: SlideDP's own | transformers' (model/family.py)
    # parameters in
    param_route: str = "replicated"  # | "sharded": each rank copies 1/N of a unit in, the ranks all-gather it
    delivery: str = "fp32"  # what crosses PCIe: the fp32 master (cast on the device) | the bf16 shadow
    prefetch_depth: int = 1  # layer copies running ahead of the compute (one device buffer each)
    chunk_rows: int = 0  # rows per embedding/head chunk; 0: the store's default (one layer chunk's parameters)
    layer_chunk_numel: int = 0  # the store's layout: layers cut into chunks of at most this many elements; 0: whole
    # activations
    resident_layers: int = 0  # the last layers kept on the device from forward to backward (no re-fetch)
    offload_layers: int = 0  # the first layers whose saved inputs wait in pinned host memory until backward
    seq_tile_tokens: int = 0  # MLP halves and the final norm + head run over tiles of this many tokens; 0: untiled
    loss_chunk_tokens: int = 4096  # tokens per logits chunk of the loss
    # held on the devices for the whole job, updated there
    device_layers: int = 0  # the first decoder layers
    embedding: str = "host"  # "host" (rows gathered, host update) | "device" (with an untied head)
    # gradients out
    grad_route: str = "host"  # | "reduce_scatter": summed on the devices, 1/N per rank over PCIe
    # what the planner predicted (None: no planner ran, as on CPU, or the job file overrode its choices)
    predicted_step_s: float | None = None  # the plan's step time (kept where the job file overrode a choice)
    predicted_clipped_step_s: float | None = None  # exact clipping: of a step after a clipped one (None: off)
    predicted_corrected_step_s: float | None = None  # exact clipping: of a step that speculated, then clipped
    planned_device_bytes: int | None = None  # the plan's device memory peak per rank (None where overridden)
    planned_by: str = "job file"  # "planner" | "job file"

    def __post_init__(self) -> None:
        for name, options in (("param_route", PARAM_ROUTES), ("grad_route", GRAD_ROUTES), ("embedding", PLACES),
                              ("delivery", DELIVERIES), ("compute_dtype", COMPUTE_DTYPES),
                              ("layers", LAYERS)):
            if getattr(self, name) not in options:
                raise StepPlanError(f"plan: {name} must be one of {', '.join(map(repr, options))}, "
                                    f"got {getattr(self, name)!r}")
        for name in ("resident_layers", "offload_layers", "seq_tile_tokens", "device_layers", "chunk_rows",
                     "layer_chunk_numel"):
            if getattr(self, name) < 0:
                raise StepPlanError(f"plan: {name} must be >= 0, got {getattr(self, name)}")
        if self.micro_batch < 1 or self.loss_chunk_tokens < 1:
            raise StepPlanError(f"plan: micro_batch and loss_chunk_tokens must be >= 1, "
                                f"got {self.micro_batch} and {self.loss_chunk_tokens}")
        if self.delivery == "bf16" and self.compute_dtype != "bf16":
            raise StepPlanError("plan: delivery 'bf16' (the store's bf16 shadow) needs compute_dtype 'bf16': "
                                f"a {self.compute_dtype} compute would train on weights rounded to bf16")
        if not 1 <= self.prefetch_depth <= 8:
            raise StepPlanError(f"plan: prefetch_depth must be between 1 and 8, got {self.prefetch_depth}")

    @property
    def sharded(self) -> bool:
        """Whether the ranks talk among themselves on a route (and need a process group for it)."""
        return self.param_route == "sharded" or self.grad_route == "reduce_scatter"

    @property
    def embedding_held(self) -> bool:
        return self.embedding == "device"

    @property
    def activations(self) -> str:
        """"keep" (every saved layer input on the device) | "offload" (the first offload_layers' in host memory)."""
        return "offload" if self.offload_layers else "keep"

    def offloaded(self, num_layers: int) -> int:
        """How many of a model's num_layers layers have their inputs waiting in host memory."""
        return min(self.offload_layers, num_layers)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, d: Any) -> "StepPlan":
        if not isinstance(d, dict):
            raise StepPlanError("plan: expected a JSON object")
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise StepPlanError(f"plan: unknown field(s) {', '.join(unknown)} (written by another SlideDP version?)")
        try:
            return cls(**d)
        except TypeError as e:
            raise StepPlanError(f"plan: {e}") from None

    @classmethod
    def from_json(cls, text: str) -> "StepPlan":
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise StepPlanError(f"plan: not JSON: {e}") from None

    @classmethod
    def read(cls, path: Path) -> "StepPlan":
        try:
            return cls.from_json(Path(path).read_text())
        except StepPlanError as e:
            raise StepPlanError(f"{path}: {e}") from None


# The fields that are choices (the planner's, or the job file's [plan] section's); the rest say what the
# planner predicted and who chose
CHOICES = tuple(f.name for f in fields(StepPlan) if not f.name.startswith(("predicted_", "planned_")))
