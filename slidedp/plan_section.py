"""The job file's [plan] section: the step plan's choices, each "auto" or the job's own value.

Its keys are `StepPlan`'s choices, field for field (slidedp/stepplan.py: CHOICES), so what a job
file fixes is what the ranks carry out. "auto" leaves a choice to the planner on CUDA, and on CPU,
where no planner runs, to the CPU default; a value fixes it: the planner plans the rest around it
(micro_batch, compute_dtype, the routes, delivery, prefetch_depth, device_layers, embedding), or
carries it out over its own choice (resident_layers, offload_layers, seq_tile_tokens,
loss_chunk_tokens: the plan's memory table then no longer describes the run).
slidedp/planner/job.py reads it. Job files of older versions set these keys in [train], [memory]
and [runtime]: slidedp/old_names.py moves them here, with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from slidedp.section import Section, show
from slidedp.stepplan import COMPUTE_DTYPES, DELIVERIES, GRAD_ROUTES, LAYERS, PARAM_ROUTES, PLACES

AUTO = "auto"

# the integer keys: the least value each takes, and the most where there is one
INTEGERS: dict[str, tuple[int, int | None]] = {
    "micro_batch": (1, None), "prefetch_depth": (1, 8), "chunk_rows": (1, None), "resident_layers": (0, None),
    "offload_layers": (0, None), "seq_tile_tokens": (0, None), "loss_chunk_tokens": (1, None),
    "device_layers": (0, None), "layer_chunk_numel": (0, None)}
WORDS: dict[str, tuple[str, ...]] = {
    "compute_dtype": COMPUTE_DTYPES, "layers": LAYERS, "param_route": PARAM_ROUTES, "delivery": DELIVERIES, "embedding": PLACES,
    "grad_route": GRAD_ROUTES}


@dataclass(frozen=True)
class PlanSection(Section):
    _name: ClassVar[str] = "plan"
    micro_batch: int | str = AUTO  # sequences per forward/backward pass on one rank (a divisor of the rank's)
    compute_dtype: str = AUTO  # what the layers compute in: "bf16" | "fp32"; auto: bf16
    layers: str = AUTO  # whose layers run the model: "native" (SlideDP's) | "transformers"; auto: native where
    # they model it (Llama, Mistral, Qwen2, Qwen3), else transformers'
    param_route: str = AUTO  # "replicated" | "sharded" (1/N per rank, all-gathered)
    delivery: str = AUTO  # what crosses PCIe: "fp32" (the master) | "bf16" (the store's bf16 shadow)
    prefetch_depth: int | str = AUTO  # layer copies running ahead of the compute, 1-8
    chunk_rows: int | str = AUTO  # rows per embedding/head chunk: the store's layout's, so "auto" only
    layer_chunk_numel: int | str = AUTO  # the store's layout: layers larger than this many elements are cut into
    # chunks of at most that many (experts whole); 0: one chunk a layer; auto: Mixture-of-Experts layers at their
    # active parameters (store/layout.py:default_layer_chunk_numel)
    resident_layers: int | str = AUTO  # the last layers kept on the device from forward to backward
    offload_layers: int | str = AUTO  # the first layers whose saved inputs wait in host memory
    seq_tile_tokens: int | str = AUTO  # tokens per MLP/norm/head tile; 0: untiled
    loss_chunk_tokens: int | str = AUTO  # tokens per logits chunk of the loss
    device_layers: int | str = AUTO  # the first layers held on the devices with their AdamW state
    embedding: str = AUTO  # "host" | "device" (the embedding and an untied head held on the devices)
    grad_route: str = AUTO  # "host" (summed by the aggregator) | "reduce_scatter" (summed on the devices)

    def validate(self) -> None:
        for name, (lo, hi) in INTEGERS.items():
            value = getattr(self, name)
            if value != AUTO and (isinstance(value, str) or value < lo or (hi is not None and value > hi)):
                allowed = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
                self._report(f"{self._key(name)} must be \"auto\" or {allowed}; got {show(value)}")
            elif name == "chunk_rows" and value != AUTO:
                self._report(f"plan.chunk_rows must be \"auto\": the store's layout sets the rows of an embedding "
                             f"or head chunk (one decoder layer's parameters' worth); got {show(value)}")
        for name, options in WORDS.items():
            self._choice(name, (AUTO, *options))

    def chosen(self, name: str) -> Any:
        """The job's value of a key, or None where it is "auto"."""
        value = getattr(self, name)
        return None if value == AUTO else value

    @property
    def dtype(self) -> str:
        """The compute dtype the job runs in: its own, or bf16 where it says "auto"."""
        return "bf16" if self.compute_dtype == AUTO else self.compute_dtype
