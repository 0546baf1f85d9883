"""The network between hosts from timed collectives: the step model's formula, inverted.

The step model charges an all-gather (or reduce-scatter) of a chunk of `nbytes` over every host's R ranks
(step_model.collective_s) at

    t = nbytes * (R - 1) / R / rate + (R - 1) * latency

with rate the slower of the host's network link and, with several GPUs a host, the links among them
(Calibration.allreduce_gbps). Timed at two or more sizes, t is a line in x = nbytes * (R - 1) / R: its slope
is 1 / rate and its intercept (R - 1) ring steps of latency. `network_fit` fits that line by least squares
to every timing given (both collectives: the model charges both alike). Where the fitted rate is at the GPU
links' (within AT_CAP of it), the links bounded the collectives, not the network: the network reached at
least that rate, and the fit says so (`at_least`). Pure: no torch, no I/O (worker/netprobe.py times them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

# the file local rank 0 writes the timings and the fit to in the run directory (worker/netprobe.py), which
# the launcher reads (launch/network.py); here, away from torch, so that the launcher never imports it
PROBE_FILE = "network.json"
PROBE_SCHEMA = 1
# a fitted rate within this fraction of the GPU links' is taken as bounded by them
AT_CAP = 0.9
# a ring step's latency the fit reports at least: a negative or zero intercept is the timings' noise (no network's
# ring step takes no time), and 0 would read as "not known" (the assumed figure) in a Calibration
MIN_LATENCY_US = 0.1


class NetworkFitError(ValueError):
    pass


@dataclass(frozen=True)
class Timing:
    """One collective over every host's ranks: its kind, the chunk's bytes (the gathered tensor, or the one
    reduce-scattered) and the median of its repetitions' seconds."""

    kind: str  # "all_gather" | "reduce_scatter"
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class NetworkFit:
    """GB/s each way through one host's link and microseconds per ring step, as the step model charges them;
    at_least: the GPU links within a host bounded the collectives, so the network reached at least `gbps`."""

    gbps: float
    latency_us: float
    at_least: bool = False

    def words(self) -> str:
        return (f"{'at least ' if self.at_least else ''}{self.gbps * 8:.3g} Gb/s ({self.gbps:.3g} GB/s) each way per "
                f"host, {self.latency_us:.3g} us per ring step")


def network_fit(timings: Sequence[Timing], ranks: int, cap_gbps: float = 0.0) -> NetworkFit:
    """The rate and latency that make the step model's collective_s give `timings` (least squares) over `ranks`
    ranks of every host; cap_gbps: the GPU links' rate within a host where it has several GPUs (0: none)."""
    if ranks < 2:
        raise NetworkFitError(f"a collective over {ranks} rank(s) crosses no network")
    points = [(t.nbytes * (ranks - 1) / ranks, t.seconds) for t in timings]
    if any(not (math.isfinite(s) and s > 0) for _, s in points):
        raise NetworkFitError(f"timings must be positive finite seconds, got {[s for _, s in points]}")
    if len({x for x, _ in points}) < 2:
        raise NetworkFitError("the fit needs timings at two sizes or more")
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    if slope <= 0:
        raise NetworkFitError("the collectives did not take longer at the larger sizes: the timings are noise "
                              f"({', '.join(f'{t.kind} {t.nbytes} B {t.seconds * 1e6:.0f} us' for t in timings)})")
    intercept = my - slope * mx
    gbps = 1.0 / slope / 1e9
    latency_us = max(intercept / (ranks - 1) * 1e6, MIN_LATENCY_US)
    return NetworkFit(gbps, latency_us, at_least=cap_gbps > 0 and gbps >= AT_CAP * cap_gbps)
