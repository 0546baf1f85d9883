"""Which chunks of a step are updated speculatively, and the step's verdict once its norm is known.

The aggregator adds each chunk's squared gradient norm in one fixed order (`norm_order`: the
order the engine sends the chunks in, then the device-held ones), whatever order the ranks'
messages arrive in: a chunk that arrives early waits for those before it. A chunk whose partial
norm (every chunk up to it in that order, itself included) is finite and would not clip is
updated at once, unclipped; the partial norm only grows, so once it would clip (or is not
finite) every later chunk of the step waits for the global norm.

Before any of that, a step speculates at all only if the last committed step's norm neither clipped
nor was non-finite (`speculates_after`; the first step of a store speculates): norms move slowly, so
a step after a clipped one would most likely clip too, and its speculation would only be undone and
redone after the backward. Such a step defers every update, as clipping did before speculation.
Every decision is a function of the gradients and the committed state alone (the last verdict is
in the manifest and in checkpoints), never of timing, so a resumed run decides as the uninterrupted
one did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from slidedp.store.layout import Layout, unit_name
from slidedp.store.manifest import CLIPPED, KEPT, SKIPPED


def clip_coefficient(grad_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), never above 1."""
    return min(1.0, max_norm / (grad_norm + 1e-6))


@dataclass(frozen=True)
class Verdict:
    """What a step's global gradient norm says: keep the unclipped update, clip by `coef`, or skip."""

    norm: float
    coef: float  # 1.0: the update is the unclipped one; nan when the step is skipped

    @classmethod
    def of(cls, norm: float, max_norm: float) -> "Verdict":
        if not math.isfinite(norm):
            return cls(norm, math.nan)
        return cls(norm, clip_coefficient(norm, max_norm))

    @property
    def skip(self) -> bool:
        """A non-finite gradient the loss check missed: nothing of the step is applied, on any rank."""
        return not math.isfinite(self.norm)

    @property
    def clipped(self) -> bool:
        return not self.skip and self.coef < 1.0


def speculates_after(history: int) -> bool:
    """Whether a step speculates, given the last committed step's verdict (store.manifest KEPT / CLIPPED /
    SKIPPED; KEPT too for a store's first step and for a checkpoint from before the verdict was kept)."""
    return history == KEPT


def history_of(verdict: "Verdict | None") -> int:
    """What a committed step leaves for the next one to decide from (None: skipped before any gradient)."""
    if verdict is None or verdict.skip:
        return SKIPPED
    return CLIPPED if verdict.clipped else KEPT


def would_clip(sqnorm: float, max_norm: float) -> bool:
    """Whether a (partial) squared norm rules out the unclipped update: it clips, or it is not finite."""
    return not math.isfinite(sqnorm) or Verdict.of(math.sqrt(sqnorm), max_norm).coef < 1.0


def norm_order(layout: Layout, device_chunks: frozenset[int] | set[int] = frozenset()) -> tuple[int, ...]:
    """Every chunk in the order the partial norm adds them: the host chunks as the engine sends their
    gradients (the final norm, an untied head, the layers last to first, the embedding), then the
    chunks held on the devices, whose norms come after the backward."""
    nl = layout.model.num_layers

    def rank(c) -> tuple[int, int]:
        name = unit_name(c)
        if name == "norm":
            pos = 0
        elif name == "head":
            pos = 1
        elif name == "embed":
            pos = nl + 2
        else:
            pos = 2 + (nl - 1 - c.layer)
        return (1 if c.id in device_chunks else 0, pos)

    return tuple(c.id for c in sorted(layout.chunks, key=lambda c: (rank(c), c.id)))


@dataclass
class StepNorm:
    """One step's partial norm and decisions (the aggregator keeps one per step in flight)."""

    order: tuple[int, ...]
    max_norm: float
    device_chunks: frozenset[int] = frozenset()
    speculate: bool = True  # the step may speculate at all (speculates_after the last committed step)
    sqnorm: float = 0.0  # over order[:added]
    added: int = 0
    speculating: bool = True  # False from the first chunk whose partial norm would clip (or from the start,
    # when the step follows a clipped one: speculates_after): the rest wait
    speculated: list[int] = field(default_factory=list)
    deferred: list[int] = field(default_factory=list)
    _arrived: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.speculating = self.speculating and self.speculate

    def add(self, chunk: int, sqnorm: float) -> list[tuple[int, bool]]:
        """A chunk's squared norm is in: (chunk, speculate) for every host chunk now decided, in order
        (device-held chunks only add to the norm: the workers update them after the verdict)."""
        if chunk in self._arrived or chunk in self.order[:self.added]:
            raise ValueError(f"chunk {chunk}'s gradient norm added twice")
        self._arrived[chunk] = sqnorm
        out = []
        while self.added < len(self.order) and self.order[self.added] in self._arrived:
            c = self.order[self.added]
            self.sqnorm += self._arrived.pop(c)
            self.added += 1
            if c in self.device_chunks:
                continue
            if self.speculating and would_clip(self.sqnorm, self.max_norm):
                self.speculating = False
            (self.speculated if self.speculating else self.deferred).append(c)
            out.append((c, self.speculating))
        return out

    @property
    def complete(self) -> bool:
        return self.added == len(self.order)

    def verdict(self) -> Verdict:
        if not self.complete:
            raise RuntimeError(f"the step's norm is not complete: {self.added} of {len(self.order)} chunks added")
        return Verdict.of(math.sqrt(self.sqnorm), self.max_norm)
