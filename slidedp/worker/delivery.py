"""Moving chunks between the store and the device: parameters in, gradients out.

Parameters arrive as fp32 master (zero-copy DMA from registered shared memory) and are
cast to the compute dtype on the device, or, with the plan's `delivery = "bf16"`, as the
store's bf16 shadow (the updater's copy of the master, refreshed before each version is
raised): half the bytes, and nothing to cast. The shadow is the master rounded to bf16 as the
device's cast rounds it, so a bf16 compute sees the same bits either way. Gradients are
accumulated in fp32 on the device and leave it in fp32.
On CUDA, H2D runs on its own copy stream (as many units ahead of compute as the engine
prefetches: the step plan's prefetch_depth) and D2H on another; every buffer has one event.
Parameter buffers come from the compute stream's cache (copy_buffers.py).
On CPU the same calls are plain (zero-copy when the compute dtype is fp32).

Routes. `replicated`: every rank copies the whole unit in. `sharded`: each rank copies
1/N of each of its chunks and the ranks all-gather (on the copy stream, so compute waits on one event
as before). Gradients: `host` copies the whole chunk out and the aggregator sums the
ranks; `reduce_scatter` sums on the devices and each rank copies out its 1/N only.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

from .announcer import Announce, Announcer, Copy
from .collectives import Group
from .copy_buffers import drop_unread, empty_for_copy
from ..store.layout import Chunk, Unit
from ..tracing import NULL


STAGING_ELEMENTS = 32 << 20  # fp32 staging piece for the device-side cast: 128 MiB


class ParamDelivery:
    """fetch(unit, step) -> the unit's parameters on the device in the compute dtype.

    source: the flat store tensor the copies read: the fp32 master, or the bf16 shadow (which
    must then be the compute dtype: a shadow is never cast up)."""

    def __init__(self, source: torch.Tensor, device: torch.device, dtype: torch.dtype,
                 wait_ready: Callable[[Unit, int], None], group: Group | None = None) -> None:
        if source.dtype not in (torch.float32, dtype):
            raise ValueError(f"parameters delivered in {source.dtype} cannot feed a {dtype} compute: "
                             f"the bf16 shadow delivery needs compute_dtype bf16")
        self.source = source
        self.group = group  # set: the sharded route
        self.device = device
        self.dtype = dtype
        self.wait_ready = wait_ready
        self.cuda = device.type == "cuda"
        self.h2d_bytes = 0
        self.tracer = NULL
        self._inflight: dict[tuple[str, int], tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self._staging: torch.Tensor | None = None
        if self.cuda:
            self.stream = torch.cuda.Stream(device)

    def _issue(self, unit: Unit, step: int) -> None:
        key = (unit.name, step)
        if key in self._inflight:
            return
        self.wait_ready(unit, step)
        cut = _UnitShards(unit, self.group) if self.group is not None else None
        # (source start, end, where in the buffer): the whole unit, or this rank's shard of each of its chunks
        pieces = cut.pieces() if cut is not None else [(unit.offset, unit.offset + unit.numel, 0)]
        size = cut.padded if cut is not None else unit.numel
        nbytes = sum(hi - lo for lo, hi, _ in pieces) * self.source.element_size()
        self.h2d_bytes += nbytes
        t0 = time.time()
        if not self.cuda:
            if cut is None:
                src = self.source[unit.offset:unit.offset + unit.numel]
                out = src if src.dtype == self.dtype else src.to(self.dtype)
            else:
                buf = torch.empty(size, dtype=self.dtype)
                for lo, hi, at in pieces:
                    buf[at:at + hi - lo].copy_(self.source[lo:hi])
                self.group.all_gather(buf)  # type: ignore[union-attr]
                out = cut.assemble(buf)
            self._inflight[key] = (out, None)
            self.tracer.event(f"fetch {unit.name}", "h2d", step, t0, time.time(), bytes=nbytes)
            return
        out = empty_for_copy(size, self.dtype, self.device, self.stream)
        assembled = cut.empty_output(out, self.stream) if cut is not None else None
        with torch.cuda.stream(self.stream), torch.autograd.profiler.record_function(f"h2d:{unit.name}"), \
                self.tracer.device_span(f"h2d {unit.name}", "h2d", step, self.stream, bytes=nbytes):
            for lo, hi, at in pieces:
                src = self.source[lo:hi]
                if src.dtype == self.dtype:  # fp32 compute, or the bf16 shadow: straight into the buffer
                    out[at:at + hi - lo].copy_(src, non_blocking=True)
                else:  # fp32 arrives through a fixed staging piece and is cast on the device piece by piece,
                    # so a big unit (the whole embedding) never needs a second, fp32-sized device buffer
                    staging = self._staging_buffer()
                    for a in range(0, hi - lo, staging.numel()):
                        k = min(staging.numel(), hi - lo - a)
                        staging[:k].copy_(src[a:a + k], non_blocking=True)
                        out[at + a:at + a + k].copy_(staging[:k])
            if cut is not None:
                gathered = out
                self.group.all_gather(gathered)  # type: ignore[union-attr]
                out = cut.assemble(gathered, assembled)
                if assembled is not None:  # gathered is freed now, while this stream still reads it
                    gathered.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._inflight[key] = (out, event)

    def _staging_buffer(self) -> torch.Tensor:
        if self._staging is None:  # allocated on the copy stream, reused only there: ordered by it
            self._staging = torch.empty(STAGING_ELEMENTS, dtype=torch.float32, device=self.device)
        return self._staging

    def prefetch(self, unit: Unit, step: int) -> None:
        self._issue(unit, step)

    def in_flight(self) -> list[tuple[str, int]]:
        """(unit, step) of every copy started and not yet fetched, in the order started."""
        return list(self._inflight)

    def discard(self, step: int) -> None:
        """Drop the step's copies that will not be fetched (a skipped step), once the compute stream
        is ordered after them (it reuses their memory)."""
        for key in [k for k in self._inflight if k[1] == step]:
            _, event = self._inflight.pop(key)
            drop_unread(event, self.device)

    def fetch(self, unit: Unit, step: int) -> torch.Tensor:
        """The unit's flat parameters on the device (compute dtype), waited for on the compute stream."""
        self._issue(unit, step)
        out, event = self._inflight.pop((unit.name, step))
        if event is not None:  # allocated on the compute stream (copy_buffers.py): waiting is all it needs
            torch.cuda.current_stream(self.device).wait_event(event)
        return out


class _UnitShards:
    """A unit on the sharded route: each of its chunks cut among the group's ranks as the reduce_scatter
    route cuts its gradient (so on several hosts a rank reads only the range its own host updates), this
    rank's shards of them side by side in its segment of the gathered buffer [world, sum of shard sizes]."""

    def __init__(self, unit: Unit, group: Group) -> None:
        self.unit, self.world, self.rank = unit, group.world, group.rank
        self.shards = [group.shard(c.numel) for c in unit.chunks]
        self.at = [0]
        for sh in self.shards:
            self.at.append(self.at[-1] + sh.size)
        self.segment = self.at[-1]
        self.padded = self.segment * self.world

    def pieces(self) -> list[tuple[int, int, int]]:
        base = self.rank * self.segment
        return [(c.offset + sh.start, c.offset + sh.end, base + a)
                for c, sh, a in zip(self.unit.chunks, self.shards, self.at)]

    def empty_output(self, gathered: torch.Tensor, copy_stream: torch.cuda.Stream) -> torch.Tensor | None:
        """assemble's output for a unit of several chunks, allocated as the gathered buffer is."""
        if len(self.shards) == 1:
            return None
        return empty_for_copy(self.unit.numel, gathered.dtype, gathered.device, copy_stream)

    def assemble(self, gathered: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The unit's flat parameters from the gathered buffer (a view of it where the unit is one chunk),
        into `out` where given."""
        if len(self.shards) == 1:
            return gathered[:self.unit.numel]
        if out is None:
            out = torch.empty(self.unit.numel, dtype=gathered.dtype, device=gathered.device)
        rows = gathered.view(self.world, self.segment)
        for c, sh, a in zip(self.unit.chunks, self.shards, self.at):
            start = c.offset - self.unit.offset
            out[start:start + c.numel].copy_(rows[:, a:a + sh.size].reshape(-1)[:c.numel])
        return out


class GradOut:
    """Copies a chunk's fp32 gradient (or, reduce-scattered, this rank's shard of the ranks' sum)
    from the device into a host slot; reports it once it has landed."""

    def __init__(self, device: torch.device, slot_view: Callable[[int, int], torch.Tensor], announce: Announce,
                 group: Group | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.slot_view = slot_view
        self.group = group  # set: the reduce_scatter route
        self.announcer = Announcer(announce)  # each copy announced as it lands (announcer.py)
        self.d2h_bytes = 0  # gradients written into host memory
        self.tracer = NULL
        if self.cuda:
            self.stream = torch.cuda.Stream(device)

    def _payload(self, chunk: Chunk, grad: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(what leaves the device, where it lands): the whole gradient, or this rank's shard of the sum
        (at the start of the slot: slots are sized for shards on this route)."""
        if self.group is None:
            return grad, self.slot_view(slot, chunk.numel)
        shard = self.group.shard(chunk.numel)
        padded = grad if shard.padded == grad.numel() else F.pad(grad, (0, shard.padded - grad.numel()))
        part = self.group.reduce_scatter(padded)[:shard.end - shard.start]
        return part, self.slot_view(slot, shard.end - shard.start)

    def send(self, chunk: Chunk, grad: torch.Tensor, slot: int, step: int = -1) -> None:
        t0 = time.time()
        if not self.cuda:
            part, dst = self._payload(chunk, grad, slot)
            dst.copy_(part)
            self.d2h_bytes += part.numel() * part.element_size()
            self.announcer.put(Copy(chunk, slot, step, torch.dot(part, part), None, grad))
            self.tracer.event(f"grad chunk {chunk.id}", "d2h", step, t0, time.time(), chunk=chunk.id, slot=slot)
            return
        self.announcer.check()
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream), torch.autograd.profiler.record_function(f"d2h:chunk{chunk.id}"):
            self.stream.wait_event(ready)
            with self.tracer.device_span(f"d2h chunk {chunk.id}", "d2h", step, self.stream, chunk=chunk.id, slot=slot):
                part, dst = self._payload(chunk, grad, slot)
                sq = torch.dot(part, part)
                dst.copy_(part, non_blocking=True)
                self.d2h_bytes += part.numel() * part.element_size()
                sq_host = sq.to("cpu", non_blocking=True)
            done = torch.cuda.Event(blocking=True)  # the announcer sleeps on it rather than spin
            done.record(self.stream)
        grad.record_stream(self.stream)
        self.announcer.put(Copy(chunk, slot, step, sq_host, done, part))

    def check(self) -> None:
        """Raise the announcer's failure, if it had one."""
        self.announcer.check()

    def wait_announced(self) -> None:
        """Until every gradient sent so far has landed and been announced."""
        self.announcer.wait()

    def close(self) -> None:
        self.announcer.close()
