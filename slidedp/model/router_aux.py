"""The routers' auxiliary load-balancing loss of a Mixture-of-Experts model, over the global batch.

transformers adds it to the loss of an MoE causal LM whose config says `output_router_logits`
(`load_balancing_loss_func`, the Switch Transformer's equations 4-6): every MoE layer's router logits are
taken together as rows of E experts, one per (layer, token), padding left out; with R the rows,
c_e the top-k selections of expert e among them and S_e its summed probability (softmax of the logits),

    aux = E * sum_e (c_e / R) * (S_e / R),        loss = cross-entropy + router_aux_loss_coef * aux

The counts come from a top-k and carry no gradient, so once the step's c and R are known the gradient of
coef * aux with respect to one layer's router logits z is that of coef * E / R^2 * sum_rows softmax(z) . c:
a term autograd adds to that layer's backward.

The layer-major step has every layer's logits only after that layer's forward over all micro-batches:
each forward adds its rows' c, S and R here (`Routing.add`), the ranks' sums are added up with the loss
(the aggregator, protocol.Routing / RoutingTotal), and the backward takes the global c and R. So a step
is the one forward of transformers over the global batch would give, whatever the micro-batches and ranks.

The router's logits are its module's output as transformers records them (the model's
`_can_record_outputs["router_logits"]`: the router class and which output), caught by forward hooks on
the layer templates' routers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn


class RouterAuxError(ValueError):
    pass


@dataclass(frozen=True)
class RoutingShare:
    """One rank's statistics of a step's forward, [R, c_0..c_{E-1}, S_0..S_{E-1}], and the coefficient."""

    coef: float
    values: tuple[float, ...]


def aux_loss(values: Sequence[float]) -> float:
    """aux from summed statistics [R, c_0..c_{E-1}, S_0..S_{E-1}] (0 where there are no rows)."""
    experts = (len(values) - 1) // 2
    rows = values[0]
    if rows <= 0:
        return 0.0
    counts, probs = values[1:1 + experts], values[1 + experts:]
    return experts * sum(c * s for c, s in zip(counts, probs)) / (rows * rows)


def _router_spec(model: nn.Module) -> tuple[type, int, str | None] | None:
    """(router class, output index, layer name) transformers records router logits from, None if none."""
    spec = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    if spec is None:
        return None
    if isinstance(spec, type):
        return spec, 0, None
    return spec.target_class, spec.index, spec.layer_name


def adds_aux_loss(model: nn.Module) -> bool:
    """Whether this transformers causal LM adds the routers' auxiliary loss to its loss (gpt-oss, Mixtral,
    OLMoE, Qwen3-MoE, Qwen3.5-MoE; not GLM-4-MoE or DeepSeek-V3, whose routers balance by a bias)."""
    import sys

    module = sys.modules.get(type(model).__module__)
    return (_router_spec(model) is not None and hasattr(model, "router_aux_loss_coef")
            and hasattr(module, "load_balancing_loss_func"))


class Routing:
    """One worker's side of the auxiliary loss: hooks on the routers, the step's statistics, the backward term."""

    def __init__(self, model: nn.Module, templates: dict[int, nn.Module], device: torch.device) -> None:
        """model: the transformers causal LM (its coefficient, expert count and top-k); templates: the
        layer modules that run every layer (their routers get the hooks)."""
        if not adds_aux_loss(model):
            raise RouterAuxError(f"{type(model).__name__} adds no router auxiliary loss in transformers (its routers "
                                 "have none, or they balance themselves); set train.router_aux_loss = \"off\"")
        cls, self._index, layer_name = _router_spec(model)  # type: ignore[misc]
        self.coef = float(model.router_aux_loss_coef)
        self.experts, self.top_k = int(model.num_experts), int(model.num_experts_per_tok)
        self.device = device
        self._sink: list[Tensor] | None = None
        routers = 0
        for template in templates.values():
            for name, m in template.named_modules():
                if isinstance(m, cls) and (layer_name is None or name.endswith(layer_name)):
                    m.register_forward_hook(self._caught)
                    routers += 1
        if not routers:
            raise RouterAuxError(f"{type(model).__name__}: no {cls.__name__} in its decoder layers to take router "
                                 "logits from")
        self.collecting = False
        self._zero()
        self._weights: Tensor | None = None  # the step's global counts x coef * E / R^2, for the backward

    def _zero(self) -> None:
        e = self.experts
        self._rows = torch.zeros((), dtype=torch.float64, device=self.device)
        self._counts = torch.zeros(e, dtype=torch.float64, device=self.device)
        self._probs = torch.zeros(e, dtype=torch.float64, device=self.device)

    def _caught(self, module: nn.Module, args, output) -> None:
        if self._sink is not None:
            self._sink.append(output[self._index] if isinstance(output, tuple) else output)

    @contextmanager
    def caught(self) -> Iterator[list[Tensor]]:
        """The router logits of the layer calls inside the block, in call order."""
        sink: list[Tensor] = []
        self._sink = sink
        try:
            yield sink
        finally:
            self._sink = None

    def forget(self) -> None:
        """Drop what the block has caught so far (a layer run again another way)."""
        if self._sink is not None:
            self._sink.clear()

    def _logits(self, caught: list[Tensor], real: Tensor | None, tokens: int) -> tuple[Tensor, Tensor | None]:
        """A layer's caught logits as [tokens, E] in token order, and the real-token mask to match."""
        z = torch.cat([t.reshape(-1, self.experts) for t in caught])
        if z.shape[0] != tokens:
            raise RouterAuxError(f"the routers scored {z.shape[0]} rows for {tokens} tokens; SlideDP cannot match "
                                 "their logits to the tokens")
        return z, None if real is None else real.reshape(-1)

    # ---- the forward: this rank's statistics --------------------------------------------------------
    def begin(self) -> None:
        """A step's forward starts: statistics from zero, collected from now on."""
        self._zero()
        self._weights = None
        self.collecting = True

    @torch.no_grad()
    def add(self, caught: list[Tensor], real: Tensor | None, tokens: int) -> None:
        """One layer's forward over one micro-batch of `tokens` tokens (real: [tokens] bool, None: all)."""
        if not caught or not self.collecting:
            return
        z, mask = self._logits(caught, real, tokens)
        probs = torch.softmax(z.float(), dim=-1)
        chosen = torch.topk(probs, self.top_k, dim=-1).indices
        ones = torch.ones_like(chosen, dtype=torch.float64)
        if mask is not None:
            ones = ones * mask[:, None]
            probs = probs * mask[:, None]
            self._rows += mask.sum()
        else:
            self._rows += z.shape[0]
        self._counts.index_add_(0, chosen.reshape(-1), ones.reshape(-1))
        self._probs += probs.sum(0, dtype=torch.float64)

    def share(self) -> RoutingShare:
        """This rank's statistics of the step's forward (what protocol.Routing carries)."""
        self.collecting = False
        return RoutingShare(self.coef, tuple(torch.cat([self._rows[None], self._counts, self._probs]).tolist()))

    # ---- the backward ------------------------------------------------------------------------------
    def set_totals(self, values: Sequence[float]) -> None:
        """The step's statistics summed over every rank, before the backward."""
        e = self.experts
        if len(values) != 1 + 2 * e:
            raise RouterAuxError(f"the routers' summed statistics hold {len(values)} values, not {1 + 2 * e}")
        rows = values[0]
        counts = torch.tensor(values[1:1 + e], dtype=torch.float32, device=self.device)
        self._weights = counts * (self.coef * e / (rows * rows)) if rows > 0 else None

    def end(self) -> None:
        self._weights = None
        self.collecting = False

    @property
    def active(self) -> bool:
        """Whether the backward adds the auxiliary loss's term (the global statistics are in)."""
        return self._weights is not None

    def backward_term(self, caught: list[Tensor], real: Tensor | None, tokens: int) -> Tensor | None:
        """coef * E / R^2 * sum over the layer's real rows of softmax(z) . c: its gradient is the auxiliary
        loss's with respect to everything before the router (None: no router in the layer)."""
        if not caught or self._weights is None:
            return None
        z, mask = self._logits(caught, real, tokens)
        per_row = torch.softmax(z.float(), dim=-1) @ self._weights
        if mask is not None:
            per_row = per_row * mask
        return per_row.sum()
