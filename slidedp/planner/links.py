"""What N GPUs of one host share, for the routes: their links, and the host memory they all read.

`measure_links(n)` starts n processes of this module (NCCL on GPUs, gloo on CPU) and times
- an all-gather of `mib` MiB per rank, reported as bus bandwidth the way nccl-tests does:
  (n - 1) / n x the gathered bytes / time. The planner charges it for the all-gather of
  parameters and the reduce-scatter of gradients;
- every rank copying `mib` MiB from page-locked host memory to its GPU at the same time: the
  host's total H2D rate, which N replicated ranks share (on CPU: a memcpy each).
Results travel as one JSON line on rank 0's stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def measure_links(n: int, device: str = "cuda", mib: int = 256, reps: int = 10,
                  timeout_s: float = 240.0) -> dict[str, float]:
    """{"bus_gbps": the all-gather's bus bandwidth, "h2d_total_gbps": all ranks' H2D at once}, GB/s."""
    if n < 2:
        raise ValueError(f"measuring the links needs at least 2 processes, got {n}")
    with tempfile.TemporaryDirectory(prefix="slidedp-links-") as tmp:
        rendezvous = os.path.join(tmp, "rendezvous")
        procs = [
            subprocess.Popen([sys.executable, "-m", "slidedp.planner.links", "--rank", str(r), "--world", str(n),
                              "--file", rendezvous, "--device", device, "--mib", str(mib), "--reps", str(reps)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(n)
        ]
        outs = []
        try:
            for p in procs:
                outs.append(p.communicate(timeout=timeout_s))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        for r, (p, (_, err)) in enumerate(zip(procs, outs)):
            if p.returncode != 0:
                raise RuntimeError(f"measuring the GPU links: rank {r} failed: {err.strip()[-1500:]}")
        doc = json.loads(outs[0][0].strip().splitlines()[-1])
        return {"bus_gbps": float(doc["bus_gbps"]), "h2d_total_gbps": float(doc["h2d_total_gbps"])}


def _rank_main(rank: int, world: int, rendezvous: str, device: str, mib: int, reps: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    # the workers' all-gather (worker/collectives.py): torch 2.13's name, else the older one it replaced
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        shard = torch.ones((mib << 20) // 2 // world, dtype=torch.bfloat16, device=dev)
        out = torch.empty(shard.numel() * world, dtype=torch.bfloat16, device=dev)

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize(dev)

        all_gather_single(out, shard)  # warm up: communicator, buffers
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            all_gather_single(out, shard)
        sync()
        seconds = (time.perf_counter() - t0) / reps
        bus = (world - 1) / world * out.numel() * 2 / seconds / 1e9
        # every rank's H2D at once, from its own page-locked buffer; the slowest rank's time counts
        host = torch.ones(mib << 18, dtype=torch.float32, pin_memory=cuda)
        dev_buf = torch.empty_like(host, device=dev)
        dev_buf.copy_(host, non_blocking=True)
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            dev_buf.copy_(host, non_blocking=True)
        sync()
        mine = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=dev if cuda else "cpu")
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        h2d_total = world * host.numel() * 4 * reps / float(mine) / 1e9
        return {"bus_gbps": bus, "h2d_total_gbps": h2d_total}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slidedp.planner.links", description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--file", required=True, help="rendezvous file")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--reps", type=int, default=10)
    a = p.parse_args(argv)
    rates = _rank_main(a.rank, a.world, a.file, a.device, a.mib, a.reps)
    if a.rank == 0:
        print(json.dumps(rates))
    return 0


if __name__ == "__main__":
    sys.exit(main())
