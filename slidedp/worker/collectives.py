"""The workers' own collectives for the sharded routes: all-gather of parameters, reduce-scatter of gradients.

A flat range of `numel` elements is cut into `world` equal shards of ceil(numel / world)
elements; the last shard may be short or empty, so buffers handed to a collective are
padded to `world * shard` elements and callers slice the real range back out.

NCCL runs when every rank has its own GPU. Ranks that share one GPU, or run on CPU, use
gloo; gloo's CUDA support is partial, so a CUDA tensor crosses it through host memory
(correct, slow: only for testing N ranks on one GPU).

On several hosts every collective is counted in the rank's progress file (slidedp/rank_progress.py) as it
enters and as it returns, so its launcher can tell the other hosts which collective its ranks have reached.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..rank_progress import NO_PROGRESS, NoProgress, ProgressFile
from ..store.layout import Shard

# torch 2.13 renamed the tensor collectives and warns (FutureWarning) on every call of the old
# names; torch 2.11, on the GPU hosts we measure on, has only the old ones.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Group:
    """The job's process group as the routes use it."""

    def __init__(self, rank: int, world: int, backend: str, progress: ProgressFile | NoProgress = NO_PROGRESS) -> None:
        self.rank, self.world, self.backend = rank, world, backend
        self.bounce = backend == "gloo"  # gloo: CUDA tensors go through host memory
        self.progress = progress  # every collective below enters and leaves it (several hosts; else a no-op)

    def shard(self, numel: int) -> Shard:
        return Shard(numel, self.world, self.rank)

    def all_gather(self, padded: torch.Tensor) -> None:
        """Each rank's shard `padded[r*size:(r+1)*size]` filled in, in place, on every rank."""
        size = padded.numel() // self.world
        self.progress.enter()
        if not self.bounce:  # NCCL gathers in place
            all_gather_single(padded, padded[self.rank * size:(self.rank + 1) * size])
            self.progress.leave()
            return
        host = padded.cpu() if padded.is_cuda else padded
        all_gather_single(host, host[self.rank * size:(self.rank + 1) * size].clone())
        self.progress.leave()
        if host is not padded:
            padded.copy_(host)

    def reduce_scatter(self, padded: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the element-wise sum of every rank's `padded` (a new tensor)."""
        size = padded.numel() // self.world
        if self.bounce and padded.is_cuda:
            out = torch.empty(size, dtype=padded.dtype)
            host = padded.cpu()
            self.progress.enter()
            reduce_scatter_single(out, host)
            self.progress.leave()
            return out.to(padded.device)
        out = torch.empty(size, dtype=padded.dtype, device=padded.device)
        self.progress.enter()
        reduce_scatter_single(out, padded)
        self.progress.leave()
        return out

    def all_reduce(self, tensor: torch.Tensor) -> None:
        if self.bounce and tensor.is_cuda:
            host = tensor.cpu()
            self.progress.enter()
            dist.all_reduce(host)
            self.progress.leave()
            tensor.copy_(host)
            return
        self.progress.enter()
        dist.all_reduce(tensor)
        self.progress.leave()


def join(rank: int, world: int, device: torch.device, shared_device: bool, init_method: str,
         timeout_s: float, progress: ProgressFile | NoProgress = NO_PROGRESS) -> Group:
    """Join the job's process group (NCCL for one GPU per rank, else gloo) at init_method (one host: a
    rendezvous file, file://...; several: tcp://host 0's address and port). A collective that waits longer
    than timeout_s (runtime.timeout_s) for a rank fails instead of hanging. progress: where its collectives
    are counted (several hosts)."""
    backend = "nccl" if device.type == "cuda" and not shared_device else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return Group(rank, world, backend, progress)


def rendezvous(runtime, dist_file: str) -> str:
    """Where the ranks' process group meets: the launcher's file on one host; on several, host 0 at the port
    after the launchers' (runtime.master_port + 1), served by global rank 0."""
    if runtime.nnodes > 1:
        return f"tcp://{runtime.master_addr}:{runtime.master_port + 1}"
    if not dist_file:
        raise RuntimeError("--dist-file is required when ranks talk among themselves (device-held units, "
                           "sharded routes)")
    return f"file://{dist_file}"
