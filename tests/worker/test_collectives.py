"""The sharded routes' collectives among real gloo ranks: uneven shards, no deprecated calls, and each
collective counted in the rank's progress file (slidedp/rank_progress.py) as it enters and returns.

torch 2.13 deprecated `all_gather_into_tensor` / `reduce_scatter_tensor` with a FutureWarning on
every call, which filled each job's log; the ranks here run with FutureWarnings as errors.
"""

from __future__ import annotations

import stat
import subprocess
import sys
import textwrap

from slidedp.rank_progress import RankProgress, progress_path, read_progress

RANK = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from pathlib import Path
    from slidedp.rank_progress import ProgressFile, progress_path
    from slidedp.worker.collectives import Group
    rank, world, rendezvous = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    group = Group(rank, world, "gloo", ProgressFile(progress_path(Path(rendezvous).parent, rank)))
    group.progress.at_step(4)
    shard = group.shard(7)  # 7 elements over 3 ranks: shards of 3, 3 and 1 (+2 padding)
    padded = torch.zeros(shard.padded)
    padded[shard.start:shard.end] = torch.arange(shard.start, shard.end, dtype=torch.float32) + 1
    group.all_gather(padded)
    assert padded[:7].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], padded
    summed = group.reduce_scatter(torch.arange(shard.padded, dtype=torch.float32) * (rank + 1))
    want = [float(i * sum(range(1, world + 1))) for i in range(rank * shard.size, (rank + 1) * shard.size)]
    assert summed.tolist() == want, (summed, want)
    total = torch.tensor([float(rank)])
    group.all_reduce(total)
    assert total.item() == sum(range(world)), total
    group.progress.close()
    dist.destroy_process_group()
    print("rank", rank, "ok")
""")


def test_all_gather_and_reduce_scatter_over_uneven_shards_without_deprecated_calls(tmp_path):
    world = 3
    procs = [subprocess.Popen([sys.executable, "-W", "error::FutureWarning", "-c", RANK, str(r), str(world),
                               str(tmp_path / "rendezvous")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = [p.communicate(timeout=120) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r}: {err[-2000:]}"
        assert out.strip() == f"rank {r} ok"
        path = progress_path(tmp_path, r)
        assert read_progress(path) == RankProgress(3, 3, 4)  # an all-gather, a reduce-scatter, an all-reduce
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
