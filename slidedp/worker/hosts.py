"""A rank's link on several hosts: what its host's aggregator adds up must be every host's.

On H hosts (docs/multi-host.md) every rank of every host is in one process group and the routes are
sharded / reduce_scatter over it, so each host's aggregator sees its own ranks' shards of each chunk
and nothing of the others'. Three things it adds up over its ranks must cover every host:

- the loss agreement: the loss sum, the trained tokens, whether the loss is finite, and an MoE
  model's router statistics. Each rank sums them over the group first (one small all-reduce); local
  rank 0 then reports the global sums and the other local ranks zeros, so every host's aggregator
  logs the global loss, hands out the global router statistics and skips the step everywhere when any
  rank's loss is not finite;
- the gradient norm: each rank adds up the squared norms it reports (its shards, and the device-held
  units' norm on global rank 0); once its backward has reported them all it sums them over the group,
  and local rank 0 sends the total (GlobalNorm), from which the aggregator takes the verdict and the
  logged norm;
- the eval loss (feed.run_eval), summed the same way before it goes to the launcher.

Everything else (versions, slots, gradient announcements, the norm's verdict) is the host's own link.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..model.router_aux import RoutingShare
from ..protocol import GlobalNorm
from ..store.layout import Chunk
from ..transport import send
from .collectives import Group
from .link import WorkerLink


def host_sums(group: Group, values: Sequence[float], device: torch.device, local_rank: int) -> list[float]:
    """values summed over every rank of every host; what this rank reports to its host: the sums on local
    rank 0, zeros on the others (its host's aggregator adds up its ranks' reports)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    group.all_reduce(t)
    total = t.tolist()
    return total if local_rank == 0 else [0.0] * len(total)


def check_same_start(group: Group, start: int, nnodes: int, node_rank: int, local_rank: int,
                     device: torch.device) -> None:
    """Every host must start at the same step (its store's committed step, or the checkpoint it resumed from):
    hosts at different steps would train different batches against each other's weights."""
    steps = [0.0] * nnodes
    if local_rank == 0:
        steps[node_rank] = float(start)
    got = [int(x) for x in host_sums(group, steps, device, 0)]
    if len(set(got)) > 1:
        at = ", ".join(f"host {h} at step {s}" for h, s in enumerate(got))
        raise RuntimeError(f"the hosts start at different steps ({at}): their stores were trained apart; resume "
                           "every host from one checkpoint (--resume PATH on each)")


class HostsLink:
    """WorkerLink with the loss, the router statistics and the gradient norm summed over every host."""

    def __init__(self, link: WorkerLink, group: Group, device: torch.device, local_rank: int) -> None:
        self.link, self.group, self.device, self.local_rank = link, group, device, local_rank
        self._sq: dict[int, float] = {}  # step -> the squared norms this rank reported

    def __getattr__(self, name: str):  # waits, slots, the verdict, the stats: the host's own link
        return getattr(self.link, name)

    def grad_landed(self, chunk: Chunk, slot: int, sqnorm: float, step: int) -> None:
        self._sq[step] = self._sq.get(step, 0.0) + sqnorm
        self.link.grad_landed(chunk, slot, sqnorm, step)

    def device_grad(self, chunk: Chunk, sqnorm: float, step: int) -> None:
        self._sq[step] = self._sq.get(step, 0.0) + sqnorm
        self.link.device_grad(chunk, sqnorm, step)

    def norms_reported(self, step: int) -> None:
        (total,) = host_sums(self.group, [self._sq.pop(step, 0.0)], self.device, self.local_rank)
        if self.local_rank == 0:
            send(self.link.agg, GlobalNorm(step, total))

    def agree_loss(self, step: int, loss_sum: float, tokens: int, finite: bool,
                   routing: RoutingShare | None = None) -> bool:
        extra = list(routing.values) if routing is not None else []
        sums = host_sums(self.group, [loss_sum if finite else 0.0, float(tokens), 0.0 if finite else 1.0] + extra,
                         self.device, 0)  # every rank learns whether any loss is not finite
        everywhere_finite = sums[2] == 0.0
        if self.local_rank != 0:
            sums = [0.0] * len(sums)
        share = None if routing is None else RoutingShare(routing.coef, tuple(sums[3:]))
        return self.link.agree_loss(step, sums[0], int(sums[1]), everywhere_finite, share)
