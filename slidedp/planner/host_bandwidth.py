"""The host's memory bandwidth: reading, writing and copying, per NUMA node, measured in about a second.

Where the GPU budget is small the step is bound by host memory, not by the GPU: every step reads
each streamed parameter once per fetch, writes its gradient, and the updaters' AdamW reads and
writes the state (slidedp/hosttraffic.py counts the bytes). The calibration keeps what this
measures, and the step model divides the host bytes of a step by it (step_model.host_bound).

Each node is measured on its own CPUs and its own memory (first touch places the buffers there):
in this process on a host of one node, else in a subprocess per node pinned to that node's CPUs
before torch starts its threads. The host's figure is the nodes' sum: the updaters run one per
node on their node's chunks. Rates are GB/s (1e9 B/s) of bytes moved: a copy counts what it reads
and what it writes.

    python -m slidedp.planner.host_bandwidth --cpus 0-15 [--mib 256] [--reps 5]
prints one node's {"read_gbps", "write_gbps", "copy_gbps"} as a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class HostMemory:
    read_gbps: float  # the host's (every node's sum)
    write_gbps: float
    copy_gbps: float  # bytes read + bytes written per second
    node_copy_gbps: tuple[float, ...]  # each node's copy rate, measured on its own CPUs and memory

    def summary(self) -> str:
        nodes = "" if len(self.node_copy_gbps) < 2 else (
            f" ({len(self.node_copy_gbps)} NUMA nodes: " + ", ".join(f"{g:.0f}" for g in self.node_copy_gbps) + ")")
        return f"host memory read {self.read_gbps:.1f} GB/s, write {self.write_gbps:.1f}, copy {self.copy_gbps:.1f}{nodes}"


def measure_here(mib: int = 256, reps: int = 5) -> dict[str, float]:
    """This process's read, write and copy rates over buffers of `mib` MiB (past the caches), on its threads."""
    import torch

    from slidedp.planner.measure import timed

    n = (mib << 20) // 4
    src, dst = torch.ones(n), torch.empty(n)
    dst.fill_(0.0)  # first touch: the pages are this node's, and faulted in before the timing
    nothing = lambda: None  # noqa: E731
    read = timed(lambda: src.sum(), nothing, reps, warmup=1)
    write = timed(lambda: dst.fill_(1.0), nothing, reps, warmup=1)
    copy = timed(lambda: dst.copy_(src), nothing, reps, warmup=1)
    nbytes = n * 4
    return {"read_gbps": nbytes / read / 1e9, "write_gbps": nbytes / write / 1e9, "copy_gbps": 2 * nbytes / copy / 1e9}


def _measure_node(cpus: list[int], mib: int, reps: int, timeout_s: float) -> dict[str, float]:
    from slidedp.numa import format_cpulist

    out = subprocess.run([sys.executable, "-m", "slidedp.planner.host_bandwidth", "--cpus", format_cpulist(cpus),
                          "--mib", str(mib), "--reps", str(reps)], capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"measuring host memory on CPUs {format_cpulist(cpus)} failed: {out.stderr.strip()[-1500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_host_memory(nodes: list[list[int]] | None = None, quick: bool = False,
                        timeout_s: float = 120.0) -> HostMemory:
    """The host's memory rates: every NUMA node's (sysfs, or `nodes` as lists of CPUs), added up."""
    from slidedp.numa import nodes as numa_nodes

    mib, reps = (64, 3) if quick else (256, 5)
    found = nodes if nodes is not None else numa_nodes()
    allowed = set(os.sched_getaffinity(0))
    found = [c for c in ([x for x in node if x in allowed] for node in found) if c]
    if len(found) <= 1:
        per = [measure_here(mib, reps)]
    else:
        per = [_measure_node(cpus, mib, reps, timeout_s) for cpus in found]
    return HostMemory(read_gbps=sum(p["read_gbps"] for p in per), write_gbps=sum(p["write_gbps"] for p in per),
                      copy_gbps=sum(p["copy_gbps"] for p in per),
                      node_copy_gbps=tuple(p["copy_gbps"] for p in per) if len(per) > 1 else ())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slidedp.planner.host_bandwidth", description=__doc__.splitlines()[0])
    p.add_argument("--cpus", required=True, help="the node's CPUs, e.g. 0-15,32-47")
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    from slidedp.numa import parse_cpulist

    cpus = parse_cpulist(a.cpus)
    os.sched_setaffinity(0, cpus)  # before torch starts its threads: they and the buffers' pages stay here
    import torch

    torch.set_num_threads(len(cpus))
    print(json.dumps(measure_here(a.mib, a.reps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
