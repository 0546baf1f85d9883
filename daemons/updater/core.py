"""A member of the updater pool: fused AdamW on chunks as their gradients complete.

Pinned by its pool to one NUMA node's CPUs, it runs AdamW on zero-copy views of the store (the
bf16 shadow's cast and the clipping inside the pass: slidedp/adamw.py) and settles speculative
updates in one pass (slidedp/clipping/rollback.py). `UpdaterCore` is the logic (tests drive it
in-process); member.py is the member's shell (its socket and signals), pool.py and shell.py the
pool that starts the members.
"""

from __future__ import annotations

import heapq
import itertools
import time

import torch

from slidedp import faults
from slidedp import log as slog
from slidedp.clipping import Verdict
from slidedp.adamw import step_
from slidedp.clipping import rollback
from slidedp.jobrecord import JobRecord, attach_job, detach_job
from slidedp.protocol import (SOURCE_NONE, SOURCE_RANK_SHARD, SOURCE_RANK_SLOT, Ack, JobEnd, JobStart, Message, Norm,
                              Update, Updated)
from slidedp.schedule import lr_at
from slidedp.store.layout import Chunk, Member
from slidedp.store.manifest import SPECULATIVE, UPDATING
from slidedp.store.rings import GradRings
from slidedp.store.store import STATE_KINDS, HostStore
from slidedp.tracing import NULL

log = slog.get("updater")

# What a unit of work does: an update with the step's verdict known (or no clipping), a speculative
# (unclipped) update before the verdict, or the settling of a speculative one once the verdict is in.
APPLY, SPECULATE, SETTLE = 0, 1, 2


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
        self.ready: list[tuple[int, int, int, int, tuple[Update, ...]]] = []  # heap of work that may run now
        self._order = itertools.count()  # heap tie-break: work is never compared
        self.verdicts: dict[int, Verdict] = {}  # step -> what its global norm says (exact clipping)
        self.speculated: dict[tuple[int, int], tuple[tuple[Update, ...], float]] = {}  # (chunk, step) -> work, busy s
        self.busy_s = 0.0
        self.tracer = NULL

    def start_job(self, job: JobRecord) -> None:
        self.end_job()
        self.store, self.rings, self.tracer = attach_job(self.store_name, job, f"updater{self.index}")
        self.job = job
        rollback.warm_up()
        self.shards.clear()
        self.pending.clear()
        self.ready.clear()
        self.verdicts.clear()
        self.speculated.clear()

    def end_job(self) -> None:
        self.ready.clear()  # updates of an ended job must never touch the next job's store
        self.pending.clear()
        self.shards.clear()
        self.speculated.clear()  # speculated and never settled: their chunks stay marked, the store torn
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
        if msg.speculative:
            if not self.job.clip or msg.source == SOURCE_NONE:
                raise ValueError(f"speculative Update for chunk {msg.chunk} step {msg.step} outside exact clipping")
            self._push(SPECULATE, work)
        elif msg.source != SOURCE_NONE and self.job.clip and msg.step not in self.verdicts:
            self.pending.setdefault(msg.step, []).append(work)
        else:
            self._push(APPLY, work)

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

    def _push(self, kind: int, work: tuple[Update, ...]) -> None:
        heapq.heappush(self.ready, (work[0].step, work[0].chunk, next(self._order), kind, work))

    def on_norm(self, msg: Norm) -> None:
        """The step's verdict: its waiting updates may run, its speculated chunks settle (in forward order)."""
        assert self.job is not None
        self.verdicts[msg.step] = Verdict.of(msg.grad_norm, float(self.job.train["max_grad_norm"]))
        for old in [s for s in self.verdicts if s < msg.step - 4]:
            del self.verdicts[old]
        for work in self.pending.pop(msg.step, []):
            self._push(APPLY, work)
        for key in sorted(k for k in self.speculated if k[1] == msg.step):
            self._push(SETTLE, self.speculated[key][0])

    def next(self) -> Updated | None:
        """Run the most urgent ready work: the oldest step, then forward order (embedding, layer 0, ...).
        Returns the chunk's Updated once its new weights are final (None after a speculative update).

        The next forward needs layer 0 first and its gradient comes last, so whatever backlog the
        updater has, the chunk the GPU will ask for soonest goes first; corrections of speculated
        chunks (the last layers: their gradients come first) thus run beside the next forward."""
        if not self.ready:
            return None
        step, _, _, kind, work = heapq.heappop(self.ready)
        if kind == SPECULATE:
            self.speculate(*work)
            if step in self.verdicts:  # the norm came before this speculation ran: settle it now
                self._push(SETTLE, work)
            return None
        if kind == SETTLE:
            return self.settle(*work)
        return self.apply(*work)

    def drain(self) -> list[Updated]:
        out = []
        while self.ready:
            done = self.next()
            if done is not None:
                out.append(done)
        return out

    def _grads(self, work: tuple[Update, ...], chunk: Chunk) -> list[tuple[int, int, torch.Tensor]]:
        """Where the chunk's gradient lies: (start, end, the elements [start, end) of the chunk's gradient)."""
        assert self.rings is not None and self.job is not None
        n = chunk.numel
        if work[0].source == SOURCE_RANK_SLOT:
            return [(0, n, self.rings.slot(work[0].rank, work[0].slot, n))]
        if work[0].source == SOURCE_RANK_SHARD:
            shards = [(self.job.shard(n, u.rank), u) for u in work]
            return [(sh.start, sh.end, self.rings.slot(u.rank, u.slot, sh.end - sh.start)) for sh, u in shards]
        return [(0, n, self.rings.reduce_slot(work[0].slot, chunk))]

    def _chunk(self, msg: Update) -> Chunk:
        store = self.store
        assert store is not None
        if not 0 <= msg.chunk < len(store.layout.chunks):
            raise ValueError(f"Update for chunk {msg.chunk}, the store has {len(store.layout.chunks)}")
        chunk = store.layout.chunks[msg.chunk]
        if store.manifest.versions[chunk.id] != msg.step:
            raise RuntimeError(f"chunk {chunk.id} is at version {store.manifest.versions[chunk.id]}, "
                               f"update is for step {msg.step}")
        return chunk

    def _done(self, chunk: Chunk, msg: Update, t0: float, what: str, spent: float = 0.0, corrected: bool = False,
              skipped: bool = False) -> Updated:
        """The chunk's weights for step + 1 are final: its version (first: a crash before the flag is
        cleared leaves the store torn, never clean at a wrong state), then the flag; and the Updated."""
        m = self.store.manifest  # type: ignore[union-attr]
        m.versions[chunk.id] = msg.step + 1  # a reader that sees the version sees the weights
        m.updating[chunk.id] = 0
        busy = time.perf_counter() - t0
        self.busy_s += busy
        now = time.time()
        self.tracer.event(f"{what} chunk {chunk.id}", "adamw", msg.step, now - busy, now, chunk=chunk.id,
                          params=chunk.numel, skipped=skipped)
        return Updated(chunk.id, msg.step, msg.source, msg.rank, msg.slot, self.index, spent + busy,
                       int(corrected), busy if corrected else 0.0)

    def apply(self, *work: Update) -> Updated:
        """Update one chunk from `work`: its Update, or every rank's shard of it (SOURCE_RANK_SHARD),
        clipped by the step's verdict (skipped, with nothing applied, when its norm is not finite)."""
        msg = work[0]
        store, job = self.store, self.job
        assert store is not None and job is not None
        chunk = self._chunk(msg)
        m = store.manifest
        verdict = self.verdicts.get(msg.step) if job.clip else None
        skip = msg.source == SOURCE_NONE or (verdict is not None and verdict.skip)
        t0 = time.perf_counter()
        if not skip:
            m.wait_snapshot(chunk.id)  # a checkpoint written during training copies it first
            m.updating[chunk.id] = UPDATING
            self._adamw(chunk, self._grads(work, chunk), msg.step, verdict.coef if verdict is not None else 1.0)
            m.adam_steps[chunk.id] += 1
        return self._done(chunk, msg, t0, "adamw", skipped=skip)

    def speculate(self, *work: Update) -> None:
        """The unclipped update, before the step's norm is known. The chunk stays marked SPECULATIVE and at
        its version until the verdict settles it: no forward reads it, and a crash leaves the store torn."""
        msg = work[0]
        store = self.store
        assert store is not None
        chunk = self._chunk(msg)
        m = store.manifest
        t0 = time.perf_counter()
        m.wait_snapshot(chunk.id)
        m.updating[chunk.id] = SPECULATIVE
        self._adamw(chunk, self._grads(work, chunk), msg.step, 1.0)
        m.adam_steps[chunk.id] += 1
        busy = time.perf_counter() - t0
        self.busy_s += busy
        self.speculated[(chunk.id, msg.step)] = (work, busy)
        now = time.time()
        self.tracer.event(f"speculate chunk {chunk.id}", "adamw", msg.step, now - busy, now, chunk=chunk.id,
                          params=chunk.numel)

    def settle(self, *work: Update) -> Updated:
        """A speculated chunk once the verdict is in: kept as it is (no clipping), redone with the clipped
        gradient, or undone (the step is skipped: nothing applied, the AdamW step not counted)."""
        msg = work[0]
        store, job = self.store, self.job
        assert store is not None and job is not None
        _, spent = self.speculated.pop((msg.chunk, msg.step))
        verdict = self.verdicts[msg.step]
        chunk = self._chunk(msg)
        m = store.manifest
        t0 = time.perf_counter()
        if not verdict.clipped and not verdict.skip:
            return self._done(chunk, msg, t0, "validate", spent)
        m.updating[chunk.id] = UPDATING
        self._settle(chunk, self._grads(work, chunk), msg.step, None if verdict.skip else verdict.coef)
        if verdict.skip:
            m.adam_steps[chunk.id] -= 1
        return self._done(chunk, msg, t0, "undo" if verdict.skip else "correct", spent, corrected=True,
                          skipped=verdict.skip)

    def _hyper(self, chunk: Chunk, step: int) -> dict:
        train = self.job.train_section  # type: ignore[union-attr]
        return dict(lr=lr_at(train, step), beta1=train.beta1, beta2=train.beta2, eps=train.eps,
                    step=int(self.store.manifest.adam_steps[chunk.id]) + 1)  # type: ignore[union-attr]

    def _groups(self, chunk: Chunk, grads: list[tuple[int, int, torch.Tensor]]):
        """(weight decay, [(master, grad, exp_avg, exp_avg_sq, bf16 shadow or None) of each member piece])
        for decay and no decay."""
        store, train = self.store, self.job.train_section  # type: ignore[union-attr]
        views = [store.chunk(k, chunk) for k in STATE_KINDS]  # type: ignore[union-attr]
        views.append(store.chunk("shadow", chunk) if store.has_shadow else None)  # type: ignore[union-attr]
        for decay in (True, False):
            blocks = [b for mb in chunk.members if mb.decay == decay for b in _blocks(mb, grads, views)]
            if blocks:
                yield (train.weight_decay if decay else 0.0), blocks

    def _adamw(self, chunk: Chunk, grads: list[tuple[int, int, torch.Tensor]], step: int, coef: float) -> None:
        """AdamW over the chunk, clipped by coef, its bf16 shadow (if any) cast in the same pass."""
        hyper = self._hyper(chunk, step)
        for wd, blocks in self._groups(chunk, grads):
            step_(blocks, weight_decay=wd, coef=coef, **hyper)

    def _settle(self, chunk: Chunk, grads: list[tuple[int, int, torch.Tensor]], step: int, coef: float | None) -> None:
        """Correct the chunk's speculative step (its AdamW count not yet taken back) to the one clipped by
        coef, in one pass; undo it when coef is None (the step is skipped). The shadow follows."""
        hyper = self._hyper(chunk, step)
        hyper["step"] -= 1  # the count the speculative update used
        for wd, blocks in self._groups(chunk, grads):
            for param, grad, exp_avg, exp_avg_sq, shadow in blocks:
                rollback.settle_(param, grad, exp_avg, exp_avg_sq, shadow=shadow, weight_decay=wd, coef=coef, **hyper)
                faults.hold("correct", step, chunk=chunk.id)  # the crash tests: half-way through a correction


def _blocks(mb: Member, grads: list[tuple[int, int, torch.Tensor]],
            views: list[torch.Tensor | None]) -> list[tuple[torch.Tensor | None, ...]]:
    """(master, grad, exp_avg, exp_avg_sq, shadow or None) of member `mb` where each gradient piece (start,
    end, the gradient's elements [start, end)) covers it: flat slices (the kernels are elementwise)."""
    master, exp_avg, exp_avg_sq, shadow = views
    lo_mb, hi_mb = mb.offset, mb.offset + mb.numel
    out = []
    for start, end, grad in grads:
        lo, hi = max(lo_mb, start), min(hi_mb, end)
        if lo >= hi:
            continue
        out.append((master[lo:hi], grad[lo - start:hi - start], exp_avg[lo:hi], exp_avg_sq[lo:hi],
                    shadow[lo:hi] if shadow is not None else None))
    return out
