"""The job record: what the daemons need to know of a job, sent as JSON in JobStart.

Each daemon takes only its own part: the updater the [train] hyper-parameters, the
aggregator the world size and the reduction policy.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from .config import TrainSection
from .protocol import GRAD_SLOTS, REDUCE_SLOTS
from .stepplan import StepPlan
from .store.layout import Shard, unit_name


@dataclass(frozen=True)
class JobRecord:
    job: str
    store: str
    world: int
    train: dict[str, Any]  # the [train] section, as in the resolved job file
    layout_hash: str
    grad_slots: int = GRAD_SLOTS
    reduce_slots: int = REDUCE_SLOTS
    device_chunks: tuple[int, ...] = ()  # chunks the workers hold on their devices (their AdamW runs there)
    run_dir: str = ""  # where the daemons write their trace events
    trace_steps: tuple[int, ...] = ()
    grad_route: str = "host"  # "host": ranks' whole gradients summed here | "reduce_scatter": each rank sends its summed shard
    nnodes: int = 1  # hosts in the job: this host's `world` ranks are ranks node_rank * world.. of nnodes * world
    node_rank: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "device_chunks", tuple(self.device_chunks))
        object.__setattr__(self, "trace_steps", tuple(self.trace_steps))
        if self.world < 1:
            raise ValueError(f"job record: world must be >= 1, got {self.world}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"job record: node_rank {self.node_rank} is not one of {self.nnodes} hosts")
        if self.nnodes > 1 and self.grad_route != "reduce_scatter":
            raise ValueError("job record: several hosts take the reduce_scatter route")
        if self.grad_route not in ("host", "reduce_scatter"):
            raise ValueError(f"job record: grad_route must be 'host' or 'reduce_scatter', got {self.grad_route!r}")
        TrainSection(**self.train)  # validates

    def shard(self, numel: int, rank: int) -> Shard:
        """Local rank `rank`'s shard of a chunk of `numel` elements on the reduce_scatter route: its part of
        the cut among every rank of every host."""
        return Shard(numel, self.nnodes * self.world, self.node_rank * self.world + rank)

    @property
    def train_section(self) -> TrainSection:
        return TrainSection(**self.train)

    @property
    def clip(self) -> bool:
        """Exact clipping: every chunk's gradient is kept until the step's global norm has validated (or
        corrected) its update (slidedp/clipping)."""
        return float(self.train["max_grad_norm"]) > 0

    @property
    def full_reduce(self) -> bool:
        """The reduction space is a full-model buffer (see gradient_space)."""
        return self.clip and sums_on_host(self.world, self.grad_route)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "JobRecord":
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("job record must be a JSON object")
        try:
            return cls(**d)
        except TypeError as e:  # unknown or missing fields: a launcher of another version
            raise ValueError(f"job record does not match this SlideDP's (another version?): {e}") from None


def held_unit_names(model, plan: StepPlan) -> list[str]:
    """The units a plan holds on the devices: its first `device_layers` decoder layers (their grads
    come last in backward and the next forward needs them first: on the host they are the tail),
    and the embedding (plus an untied head) where the plan puts it on the device."""
    held = plan.device_layers
    if not 0 <= held <= model.num_layers:
        raise ValueError(f"device_layers must be between 0 and the model's {model.num_layers} layers, got {held}")
    names = [f"layer.{i}" for i in range(held)]
    if plan.embedding_held:
        names += ["embed"] + ([] if model.tie_word_embeddings else ["head"])
    return names


def held_chunk_ids(layout, names: list[str]) -> tuple[int, ...]:
    """The chunk ids of held units by name ("layer.3", "embed", "head"), for the job record."""
    return tuple(c.id for c in layout.chunks if unit_name(c) in names)


def sums_on_host(world: int, grad_route: str) -> bool:
    """Whether the aggregator sums several ranks' whole gradients (beside the updaters, in host memory)."""
    return world > 1 and grad_route == "host"


def reduction_slots(world: int, grad_route: str) -> int:
    """Chunk-sized slots the aggregator sums into (without clipping, which uses a full-model buffer):
    REDUCE_SLOTS where it sums several ranks' whole gradients on the host; none for one rank or for
    reduce-scattered gradients, which the updaters read where they lie."""
    return REDUCE_SLOTS if sums_on_host(world, grad_route) else 0


def ring_slots(grad_slots: int, num_layers: int) -> int:
    """Gradient slots per rank: store.grad_slots, or auto (0): a third of the layers, 3..16, so the
    backward can run ahead of the updaters by that many chunks."""
    return grad_slots or max(GRAD_SLOTS, min(16, num_layers // 3))


def gradient_space(layout, world: int, grad_route: str, clip: bool, grad_slots: int,
                   device_chunks: tuple[int, ...] = ()) -> tuple[int, int, bool]:
    """(slots per rank, reduction slots, full-model reduction space) of a job's gradient space.

    Exact clipping keeps every chunk's gradient of a step until the step's norm has validated or
    corrected its update. Where the aggregator sums several ranks' whole gradients, it sums them into
    a full-model reduction space (4 B/param) and the ranks' slots go back at once. Otherwise (one
    rank, or reduce-scattered shards) the gradient stays where the worker put it: each rank's ring has
    one slot per host chunk, about one fp32 copy of the model over the ranks together, and the
    aggregator copies nothing (it would have to copy the whole model into a reduction space)."""
    if clip and not sums_on_host(world, grad_route):
        host_chunks = sum(1 for c in layout.chunks if c.id not in set(device_chunks))
        return max(2, host_chunks), 0, False
    return ring_slots(grad_slots, layout.model.num_layers), reduction_slots(world, grad_route), clip


def attach_job(store_name: str, job: JobRecord, process: str):
    """What a daemon maps for a job: the store (checked against the job's layout), its gradient
    rings, and a tracer for the job's traced steps. Returns (store, rings, tracer)."""
    from .store.rings import GradRings
    from .store.store import HostStore
    from .tracing import Tracer

    store = HostStore.attach(store_name)
    try:
        if store.layout.hash() != job.layout_hash:
            raise RuntimeError(f"store {store_name!r} layout does not match the job's")
        rings = GradRings.open(store_name)
    except BaseException:
        store.close()
        raise
    return store, rings, Tracer(job.run_dir or None, process, job.trace_steps)


def detach_job(store, rings, tracer) -> None:
    if tracer is not None:
        tracer.close()
    if rings is not None:
        rings.close()
    if store is not None:
        store.close()
