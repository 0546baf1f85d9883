"""A member of the updater pool: fused AdamW on chunks as their gradients complete.

Pinned by its pool to one NUMA node's CPUs, it runs torch's fused AdamW on zero-copy views
of the store. `UpdaterCore` is the logic (tests drive it in-process); member.py is the
member's shell (its socket and signals), pool.py and shell.py the pool that starts the members.
"""

from __future__ import annotations

import heapq
import itertools
import time

import torch

from slidedp import log as slog
from slidedp.jobrecord import JobRecord, attach_job, detach_job
from slidedp.store.layout import Shard
from slidedp.protocol import (SOURCE_NONE, SOURCE_RANK_SHARD, SOURCE_RANK_SLOT, Ack, JobEnd, JobStart, Message, Norm,
                              Update, Updated)
from slidedp.schedule import lr_at
from slidedp.store.layout import Chunk, Member
from slidedp.store.manifest import UPDATING
from slidedp.store.rings import GradRings
from slidedp.store.store import STATE_KINDS, HostStore, member_view
from slidedp.tracing import NULL

log = slog.get("updater")


def clip_coefficient(grad_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), never above 1."""
    return min(1.0, max_norm / (grad_norm + 1e-6))


class UpdaterCore:
    """AdamW on one chunk at a time, straight on the store's shared memory."""

    def __init__(self, store_name: str, index: int = 0) -> None:
        self.store_name = store_name
        self.index = index
        self.store: HostStore | None = None
        self.rings: GradRings | None = None
        self.job: JobRecord | None = None
        # A unit of work is the Updates of one chunk and step: one, or one per rank for SOURCE_RANK_SHARD.
        self.shards: dict[tuple[int, int], list[Update]] = {}  # (chunk, step) -> the ranks' shards so far
        self.pending: dict[int, list[tuple[Update, ...]]] = {}  # step -> work waiting for the step's norm
        self.ready: list[tuple[int, int, int, tuple[Update, ...]]] = []  # heap of work that may run now
        self._order = itertools.count()  # heap tie-break: work is never compared
        self.coef: dict[int, float] = {}  # step -> clip coefficient
        self.busy_s = 0.0
        self.tracer = NULL

    def start_job(self, job: JobRecord) -> None:
        self.end_job()
        self.store, self.rings, self.tracer = attach_job(self.store_name, job, f"updater{self.index}")
        self.job = job
        self.shards.clear()
        self.pending.clear()
        self.ready.clear()
        self.coef.clear()

    def end_job(self) -> None:
        self.ready.clear()  # updates of an ended job must never touch the next job's store
        self.pending.clear()
        self.shards.clear()
        detach_job(self.store, self.rings, self.tracer)
        self.store = self.rings = self.job = None
        self.tracer = NULL

    def on_update(self, msg: Update) -> None:
        assert self.job is not None, "Update before JobStart"
        work: tuple[Update, ...] = (msg,)
        if msg.source == SOURCE_RANK_SHARD:  # the chunk runs once every rank's shard is here
            got = self.shards.setdefault((msg.chunk, msg.step), [])
            got.append(msg)
            if len(got) < self.job.world:
                return
            work = tuple(self.shards.pop((msg.chunk, msg.step)))
        if msg.source != SOURCE_NONE and self.job.clip and msg.step not in self.coef:
            self.pending.setdefault(msg.step, []).append(work)
            return
        self._push(work)

    def receive(self, msg: Message | None) -> list[Message]:
        """One message from the aggregator; what to answer it (the Ack of a job's start or end)."""
        if isinstance(msg, Update):
            self.on_update(msg)
        elif isinstance(msg, Norm):
            self.on_norm(msg)
        elif isinstance(msg, JobStart):
            self.start_job(JobRecord.from_json(msg.text))
            log.info("job %s started", self.job.job if self.job else "?")
            return [Ack(1, f"updater {self.index} ready")]
        elif isinstance(msg, JobEnd):
            self.end_job()
            return [Ack(1, f"updater {self.index} done")]
        return []

    def _push(self, work: tuple[Update, ...]) -> None:
        heapq.heappush(self.ready, (work[0].step, work[0].chunk, next(self._order), work))

    def on_norm(self, msg: Norm) -> None:
        assert self.job is not None
        self.coef[msg.step] = clip_coefficient(msg.grad_norm, float(self.job.train["max_grad_norm"]))
        for old in [s for s in self.coef if s < msg.step - 4]:
            del self.coef[old]
        for work in self.pending.pop(msg.step, []):
            self._push(work)

    def next(self) -> Updated | None:
        """Apply the most urgent ready update: the oldest step, then forward order (embedding, layer 0, ...).

        The next forward needs layer 0 first and its gradient comes last, so whatever backlog the
        updater has, the chunk the GPU will ask for soonest goes first."""
        if not self.ready:
            return None
        return self.apply(*heapq.heappop(self.ready)[3])

    def drain(self) -> list[Updated]:
        out = []
        while (done := self.next()) is not None:
            out.append(done)
        return out

    def _grads(self, work: tuple[Update, ...], chunk: Chunk) -> list[tuple[int, int, torch.Tensor]]:
        """Where the chunk's gradient lies: (start, end, the elements [start, end) of the chunk's gradient)."""
        assert self.rings is not None and self.job is not None
        n = chunk.numel
        if work[0].source == SOURCE_RANK_SLOT:
            return [(0, n, self.rings.slot(work[0].rank, work[0].slot, n))]
        if work[0].source == SOURCE_RANK_SHARD:
            shards = [(Shard(n, self.job.world, u.rank), u) for u in work]
            return [(sh.start, sh.end, self.rings.slot(u.rank, u.slot, sh.end - sh.start)) for sh, u in shards]
        return [(0, n, self.rings.reduce_slot(work[0].slot, chunk))]

    def apply(self, *work: Update) -> Updated:
        """Update one chunk from `work`: its Update, or every rank's shard of it (SOURCE_RANK_SHARD)."""
        msg = work[0]
        store, job = self.store, self.job
        assert store is not None and job is not None
        if not 0 <= msg.chunk < len(store.layout.chunks):
            raise ValueError(f"Update for chunk {msg.chunk}, the store has {len(store.layout.chunks)}")
        chunk = store.layout.chunks[msg.chunk]
        m = store.manifest
        if m.versions[chunk.id] != msg.step:
            raise RuntimeError(f"chunk {chunk.id} is at version {m.versions[chunk.id]}, update is for step {msg.step}")
        t0 = time.perf_counter()
        if msg.source != SOURCE_NONE:
            m.wait_snapshot(chunk.id)  # a checkpoint written during training copies it first
            m.updating[chunk.id] = UPDATING
            self._adamw(chunk, self._grads(work, chunk), msg.step)
            m.adam_steps[chunk.id] += 1
            if store.has_shadow:
                store.refresh_shadow(chunk)
            m.updating[chunk.id] = 0
        m.versions[chunk.id] = msg.step + 1  # last: a reader that sees the version sees the weights
        busy = time.perf_counter() - t0
        self.busy_s += busy
        now = time.time()
        self.tracer.event(f"adamw chunk {chunk.id}", "adamw", msg.step, now - busy, now, chunk=chunk.id,
                          params=chunk.numel, skipped=msg.source == SOURCE_NONE)
        return Updated(chunk.id, msg.step, msg.source, msg.rank, msg.slot, self.index, busy)

    def _adamw(self, chunk: Chunk, grads: list[tuple[int, int, torch.Tensor]], step: int) -> None:
        store, job = self.store, self.job
        assert store is not None and job is not None
        train = job.train_section
        lr = lr_at(train, step)
        scale = None
        if job.clip:
            coef = self.coef[step]
            if coef < 1.0:
                scale = torch.tensor(1.0 / coef, dtype=torch.float32)  # the kernel divides grads by grad_scale
        views = [store.chunk(k, chunk) for k in STATE_KINDS]
        adam_step = torch.tensor(float(store.manifest.adam_steps[chunk.id] + 1))
        for decay in (True, False):
            blocks = [b for mb in chunk.members if mb.decay == decay for b in _blocks(mb, grads, views)]
            if not blocks:
                continue
            params, grad, exp_avg, exp_avg_sq = (list(t) for t in zip(*blocks))
            torch._fused_adamw_(
                params, grad, exp_avg, exp_avg_sq,
                [],
                [adam_step] * len(blocks),
                lr=lr, beta1=train.beta1, beta2=train.beta2,
                weight_decay=train.weight_decay if decay else 0.0, eps=train.eps,
                amsgrad=False, maximize=False, grad_scale=scale, found_inf=None,
            )


def _blocks(mb: Member, grads: list[tuple[int, int, torch.Tensor]],
            views: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """(master, grad, exp_avg, exp_avg_sq) of member `mb` where each gradient piece (start, end, the
    gradient's elements [start, end)) covers it: the member's own shape where one piece holds all
    of it, else flat slices of the part each holds."""
    master, exp_avg, exp_avg_sq = views
    lo_mb, hi_mb = mb.offset, mb.offset + mb.numel
    out = []
    for start, end, grad in grads:
        lo, hi = max(lo_mb, start), min(hi_mb, end)
        if lo >= hi:
            continue
        g = grad[lo - start:hi - start]
        if (lo, hi) == (lo_mb, hi_mb):
            out.append((member_view(master, mb), g.view(mb.shape), member_view(exp_avg, mb), member_view(exp_avg_sq, mb)))
        else:
            out.append((master[lo:hi], g, exp_avg[lo:hi], exp_avg_sq[lo:hi]))
    return out
