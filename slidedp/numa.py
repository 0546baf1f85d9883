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


def format_cpulist(cpus: list[int]) -> str:
    """The kernel's cpulist form of a CPU set ("0-26,28"): parse_cpulist's inverse, short in logs."""
    ranges: list[list[int]] = []
    for c in sorted(set(cpus)):
        if ranges and c == ranges[-1][1] + 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in ranges)


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


def worker_cpus(reserved_cpus: list[int], world: int, rank: int) -> list[int]:
    """Rank `rank`'s CPUs among those kept from the updaters: an equal share of all but the last one
    (the daemons' message loops), so that no two workers' launch threads share a core while there
    are cores enough; with too few, ranks take one each, round robin."""
    pool = reserved_cpus[:-1] if len(reserved_cpus) > world else reserved_cpus
    per = len(pool) // world
    return pool[rank * per:(rank + 1) * per] if per else [pool[rank % len(pool)]]


def reserved_count(cores: int, world: int) -> int:
    """CPUs to keep from the updaters for `world` GPU workers: two each where the host has 8 per GPU
    or more (a worker's launch thread and its copy and NCCL helpers), else one; plus one for the
    daemons' message loops; never more than half the cores."""
    per_worker = 2 if cores >= 8 * world else 1
    return min(world * per_worker + 1, cores // 2)


def gpu_count(pci_sysfs: str = "/sys/bus/pci/devices") -> int:
    """NVIDIA GPUs on this host, from sysfs (vendor 0x10de, a display or 3D controller), without CUDA."""
    count = 0
    for dev in Path(pci_sysfs).glob("*"):
        try:
            vendor = (dev / "vendor").read_text().strip().lower()
            klass = (dev / "class").read_text().strip().lower()
        except OSError:
            continue
        if vendor == "0x10de" and klass.startswith(("0x0300", "0x0302")):
            count += 1
    return count


def pci_node(bus_id: str, sysfs: str = "/sys/bus/pci/devices") -> int | None:
    """The NUMA node of a PCI device (a GPU's bus id, e.g. "0000:1B:00.0"); None when sysfs does not say."""
    try:
        node = int((Path(sysfs) / bus_id.lower() / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def device_cpus(bus_id: str, preferred: list[int], node_sysfs: str = "/sys/devices/system/node",
                pci_sysfs: str = "/sys/bus/pci/devices", kept: list[int] | None = None) -> list[int]:
    """Where a GPU's worker should run: its preferred CPUs (its share of those kept free of
    updaters) on the GPU's NUMA node; else the `kept` CPUs of that node; else any allowed CPU of
    that node; else the preferred CPUs as given."""
    node = pci_node(bus_id, pci_sysfs)
    if node is None:
        return preferred
    try:
        local = set(parse_cpulist((Path(node_sysfs) / f"node{node}" / "cpulist").read_text()))
    except OSError:
        return preferred
    local &= set(os.sched_getaffinity(0))
    return sorted(local & set(preferred)) or sorted(local & set(kept or [])) or sorted(local) or preferred
