"""NUMA placement from sysfs: updater CPUs per node, and each GPU worker near its GPU."""

from __future__ import annotations

import os
from pathlib import Path

from slidedp import numa


def fake_sysfs(root: Path, nodes: dict[int, str], gpus: dict[str, int]) -> tuple[Path, Path]:
    node_dir, pci_dir = root / "node", root / "pci"
    for n, cpus in nodes.items():
        (node_dir / f"node{n}").mkdir(parents=True)
        (node_dir / f"node{n}" / "cpulist").write_text(cpus + "\n")
    for bus, n in gpus.items():
        (pci_dir / bus).mkdir(parents=True)
        (pci_dir / bus / "numa_node").write_text(f"{n}\n")
    return node_dir, pci_dir


def test_parse_cpulist():
    assert numa.parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert numa.parse_cpulist("") == []
    assert numa.format_cpulist([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert numa.format_cpulist([]) == "" and numa.format_cpulist([5]) == "5"
    assert numa.parse_cpulist(numa.format_cpulist(list(range(27)) + [29])) == list(range(27)) + [29]


def test_a_worker_runs_on_its_gpus_node_preferring_the_cpus_kept_from_updaters(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    node_dir, pci_dir = fake_sysfs(tmp_path, {0: "0-3", 1: "4-7"}, {"0000:1b:00.0": 0, "0000:9a:00.0": 1,
                                                                   "0000:c0:00.0": -1})
    kw = dict(node_sysfs=str(node_dir), pci_sysfs=str(pci_dir))
    # the reserved CPUs 3 and 7: one on each node; each GPU's worker gets the one on its node
    assert numa.device_cpus("0000:1B:00.0", [3, 7], **kw) == [3]  # sysfs spells the address in lower case
    assert numa.device_cpus("0000:9a:00.0", [3, 7], **kw) == [7]
    # the worker's own share is on the other node: the kept CPUs of its GPU's node, not the updaters'
    assert numa.device_cpus("0000:9a:00.0", [3], kept=[3, 6, 7], **kw) == [6, 7]
    # no reserved CPU on the GPU's node: the node's CPUs
    assert numa.device_cpus("0000:9a:00.0", [2, 3], **kw) == [4, 5, 6, 7]
    assert numa.device_cpus("0000:9a:00.0", [2, 3], kept=[2, 3], **kw) == [4, 5, 6, 7]
    # sysfs does not say (-1, or no such device): the CPUs as given
    assert numa.device_cpus("0000:c0:00.0", [2, 3], **kw) == [2, 3]
    assert numa.device_cpus("0000:ff:00.0", [2, 3], **kw) == [2, 3]
    assert numa.pci_node("0000:9a:00.0", str(pci_dir)) == 1 and numa.pci_node("0000:c0:00.0", str(pci_dir)) is None


def test_each_gpu_worker_gets_cores_of_its_own():
    # the 2-GPU host of the benchmark: 32 cores, one node; before, both workers shared CPUs 29-31
    kept = list(range(32 - numa.reserved_count(32, 2), 32))
    assert kept == [27, 28, 29, 30, 31]
    assert [numa.worker_cpus(kept, 2, r) for r in range(2)] == [[27, 28], [29, 30]]  # 31: the daemons
    # one GPU on 16 cores: two for the worker, one for the daemons, 13 for the updaters
    assert numa.reserved_count(16, 1) == 3 and numa.worker_cpus([13, 14, 15], 1, 0) == [13, 14]
    # 8 GPUs on 128 cores: 17 kept, two each
    kept = list(range(111, 128))
    shares = [numa.worker_cpus(kept, 8, r) for r in range(8)]
    assert all(len(s) == 2 for s in shares) and len({c for s in shares for c in s}) == 16 and 127 not in shares[-1]
    # too few cores: half of them at most, one each, round robin
    assert numa.reserved_count(6, 4) == 3
    assert [numa.worker_cpus([3, 4, 5], 4, r) for r in range(4)] == [[3], [4], [5], [3]]


def test_gpus_are_counted_from_sysfs_for_an_updater_started_as_a_service(tmp_path):
    """slidedp-updater run by systemd, before any job, keeps CPUs for a job on every GPU; it counts
    NVIDIA display and 3D controllers in sysfs (no CUDA in the updater)."""
    pci = tmp_path / "pci"
    for bus, vendor, klass in (("0000:1b:00.0", "0x10de", "0x030200"), ("0000:9a:00.0", "0x10de", "0x030000"),
                               ("0000:1c:00.0", "0x10de", "0x068000"),  # an NVSwitch bridge: not a GPU
                               ("0000:00:02.0", "0x8086", "0x030000")):  # another vendor's display controller
        (pci / bus).mkdir(parents=True)
        (pci / bus / "vendor").write_text(vendor + "\n")
        (pci / bus / "class").write_text(klass + "\n")
    (pci / "0000:00:1f.0").mkdir()  # unreadable: skipped
    assert numa.gpu_count(str(pci)) == 2
    assert numa.gpu_count(str(tmp_path / "none")) == 0
