"""The ranks' probe of the network between hosts (slidedp/worker/netprobe.py) among real gloo ranks on loopback:
every rank gets the same timings, rank 0's file is private JSON with a fit, and the whole takes well under 1 s.
Loopback is not a network: the figures say what Gloo moves through host memory here, nothing of a fabric."""

from __future__ import annotations

import json
import math
import stat
import subprocess
import sys
import textwrap

RANK = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from pathlib import Path
    from slidedp.worker.collectives import Group
    from slidedp.worker.netprobe import probe_network
    rank, world, tmp = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'rendezvous'}", rank=rank, world_size=world)
    doc = probe_network(Group(rank, world, "gloo"), torch.device("cpu"), 2, tmp if rank == 0 else None)
    dist.destroy_process_group()
    print(json.dumps(doc["timings"]))
""")


def test_the_ranks_time_both_collectives_and_rank_0_writes_the_fit(tmp_path):
    world = 4  # 2 hosts x 2 ranks, as tests/pipeline/test_hosts.py runs them
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(world), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    outs = [p.communicate(timeout=120) for p in procs]
    for r, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r}: {err[-2000:]}"
    timings = [json.loads(out) for out, _ in outs]
    assert all(t == timings[0] for t in timings)  # the slowest rank's, on every rank
    path = tmp_path / "network.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    doc = json.loads(path.read_text())
    assert (doc["schema"], doc["nnodes"], doc["ranks"], doc["backend"]) == (1, 2, 4, "gloo")
    assert {(t["kind"], t["nbytes"]) for t in doc["timings"]} == {
        (k, n) for k in ("all_gather", "reduce_scatter") for n in (16 << 10, 4 << 20)}
    assert "problem" not in doc, doc
    for key in ("gbps", "latency_us"):
        assert math.isfinite(doc[key]) and doc[key] > 0, doc
    assert math.isfinite(doc["probe_s"]) and doc["probe_s"] > 0, doc  # its time is reported, not bounded here
    print(f"loopback, gloo, 4 ranks: {doc['gbps']:.2f} GB/s, {doc['latency_us']:.1f} us, probe {doc['probe_s']:.3f} s")
