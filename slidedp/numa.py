"""NUMA topology from sysfs: which CPUs belong to which node (one node is the common case)."""

from __future__ import annotations

import os
from pathlib import Path


def parse_cpulist(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-")
            cpus.extend(range(int(a), int(b) + 1))
        else:
            cpus.append(int(part))
    return cpus


def nodes(sysfs: str = "/sys/devices/system/node") -> list[list[int]]:
    """CPUs of each NUMA node that this process may run on; one list of all allowed CPUs without sysfs."""
    allowed = sorted(os.sched_getaffinity(0))
    found: list[list[int]] = []
    root = Path(sysfs)
    for node in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = [c for c in parse_cpulist((node / "cpulist").read_text()) if c in allowed]
        except OSError:
            continue
        if cpus:
            found.append(cpus)
    return found or [allowed]


def reserve(nodes: list[list[int]], count: int) -> list[list[int]]:
    """The nodes' CPUs without the `count` highest-numbered ones (kept for other processes); never empty."""
    if count <= 0:
        return nodes
    everything = sorted(c for node in nodes for c in node)
    keep = set(everything[:max(1, len(everything) - count)])
    out = [[c for c in node if c in keep] for node in nodes]
    return [node for node in out if node] or [everything[:1]]


def reserved(count: int) -> list[int]:
    """The `count` highest-numbered CPUs this process may use (those `reserve` leaves out)."""
    everything = sorted(os.sched_getaffinity(0))
    return everything[-count:] if 0 < count < len(everything) else everything
