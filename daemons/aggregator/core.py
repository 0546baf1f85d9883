"""The aggregator's core: per chunk and step, the ranks' gradients summed and handed to the chunk's updater.

It is the hub of the data plane: workers, updaters and the launcher connect to its ROUTER.
Per chunk and step it counts the ranks' gradient arrivals (no barrier, no global lock),
sums them in fp32 into the reduction space (skipped for one rank, whose slot the updater reads
directly, and for the reduce_scatter route, where the ranks summed on their devices and the
updater reads each rank's shard in its slot), returns slot credits, gathers the global gradient
norm (with exact clipping also deciding, from the partial norm, which chunks update before it
is known: slidedp/clipping), agrees with every rank on a finite loss before backward, and
commits a step once all of its chunks are updated. `AggregatorCore` is that logic, per chunk and
step; handshake.py starts and ends jobs with the updater pool; shell.py owns the socket.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from slidedp import hosttraffic, log as slog
from slidedp.clipping import StepNorm, Verdict, history_of, norm_order, speculates_after
from slidedp.jobrecord import JobRecord, attach_job, detach_job, reduction_slots
from slidedp.model.router_aux import aux_loss
from slidedp.protocol import (SLOT_DEVICE, SOURCE_NONE, SOURCE_RANK_SHARD, SOURCE_RANK_SLOT, SOURCE_REDUCE, Credit, Go,
                              GlobalNorm, Grad, Loss, Message, Norm, Ready, Routing, RoutingTotal, StepDone, Update,
                              Updated)
from slidedp.store.layout import Layout
from slidedp.store.manifest import KEPT
from slidedp.store.rings import GradRings
from slidedp.store.store import HostStore
from slidedp.tracing import NULL
from slidedp.transport import identity

log = slog.get("aggregator")

Outbox = list[tuple[bytes, Message]]


def assign_updaters(layout: Layout, count: int, device_chunks: frozenset[int] = frozenset()) -> list[int]:
    """Chunk -> updater index: contiguous ranges of about equal count of the parameters the host
    updates (NUMA locality, balance); chunks held on the devices weigh nothing, since no updater
    touches them, so holding the first layers shortens every updater's share, not the first's."""
    weight = [0 if c.id in device_chunks else c.numel for c in layout.chunks]
    total = max(1, sum(weight))
    out, acc = [], 0
    for w in weight:
        out.append(min(count - 1, acc * count // total))
        acc += w
    return out


@dataclass
class _Step:
    losses: dict[int, Loss] = field(default_factory=dict)
    routing: dict[int, Routing] = field(default_factory=dict)  # each rank's router statistics (auxiliary loss)
    global_sq: float | None = None  # several hosts: the squared norm over every host (GlobalNorm)
    done_held: bool = False  # several hosts: committed, its StepDone waiting for the global norm
    loss: float = math.nan
    skipped: bool = False
    sqnorm: float = 0.0
    reduced: int = 0
    updated: int = 0
    update_s: float = 0.0
    reduce_s: float = 0.0
    t0: float = field(default_factory=time.perf_counter)
    norm: StepNorm | None = None  # exact clipping: the partial norm and which chunks speculate
    undecided: dict[int, list[Update]] = field(default_factory=dict)  # chunk -> its Updates, held until decided
    corrected: int = 0
    correct_s: float = 0.0
    host_bytes: int = 0  # host memory the step's sums here and its updates moved (slidedp/hosttraffic.py)


class AggregatorCore:
    def __init__(self, store_name: str) -> None:
        self.store_name = store_name
        self.job: JobRecord | None = None
        self.store: HostStore | None = None
        self.rings: GradRings | None = None
        self.updaters: list[bytes] = []
        self.owner: list[int] = []
        self.arrivals: dict[tuple[int, int], list[Grad]] = {}
        self.free_reduce: list[int] = []
        self.waiting: deque[tuple[int, int, list[Grad]]] = deque()
        self.shard_slots: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (chunk, step) -> ranks' (rank, slot)
        self.steps: dict[int, _Step] = {}
        self.launcher: bytes | None = None
        self.device_chunks: frozenset[int] = frozenset()
        self.norm_order: tuple[int, ...] = ()
        self.history: dict[int, int] = {}  # step -> what its norm said (manifest.clip_history), once known
        self.tracer = NULL

    # ---- job -----------------------------------------------------------------------------
    def start_job(self, job: JobRecord, updaters: int) -> None:
        self.end_job()
        self.store, self.rings, self.tracer = attach_job(self.store_name, job, "aggregator")
        if self.rings.world != job.world:
            raise RuntimeError(f"gradient rings are for {self.rings.world} ranks, the job has {job.world}")
        if not self.rings.full_reduce and self.rings.reduce_slots < reduction_slots(job.world, job.grad_route):
            raise RuntimeError(f"the job sums {job.world} ranks' gradients here but its rings have "
                               f"{self.rings.reduce_slots} reduction slots")
        if job.clip and not self.rings.full_reduce and self.rings.slots < len(self.store.layout.chunks) - len(job.device_chunks):
            raise RuntimeError(f"exact clipping keeps every chunk's gradient in the rings until the step's norm is "
                               f"known, but they have {self.rings.slots} slots per rank for "
                               f"{len(self.store.layout.chunks) - len(job.device_chunks)} host chunks")
        self.job = job
        self.updaters = [identity("u", i) for i in range(updaters)]
        self.device_chunks = frozenset(job.device_chunks)
        self.owner = assign_updaters(self.store.layout, updaters, self.device_chunks)
        self.norm_order = norm_order(self.store.layout, self.device_chunks) if job.clip else ()
        self.free_reduce = [] if self.rings.full_reduce else list(range(self.rings.reduce_slots))
        self.arrivals.clear()
        self.waiting.clear()
        self.shard_slots.clear()
        self.steps.clear()
        # the job's first step decides from the last committed one's verdict, kept in the manifest (and checkpoints)
        self.history = {self.store.manifest.committed_step - 1: self.store.manifest.clip_history}

    def end_job(self) -> None:
        detach_job(self.store, self.rings, self.tracer)
        self.job = self.store = self.rings = None
        self.tracer = NULL

    @property
    def world(self) -> int:
        assert self.job is not None
        return self.job.world

    def _step(self, step: int) -> _Step:
        st = self.steps.get(step)
        if st is None:
            st = self.steps[step] = _Step()
            if self.norm_order:
                assert self.job is not None
                # the step before it is decided by now: each host chunk's update for this step waited for its Norm
                last = self.history.get(step - 1, self.store.manifest.clip_history)  # type: ignore[union-attr]
                st.norm = StepNorm(self.norm_order, float(self.job.train["max_grad_norm"]), self.device_chunks,
                                   speculate=speculates_after(last))
        return st

    def _to_workers(self, msg: Message) -> Outbox:
        return [(identity("w", r), msg) for r in range(self.world)]

    def _to_owner(self, chunk: int, msg: Message) -> Outbox:
        return [(self.updaters[self.owner[chunk]], msg)]

    # ---- events --------------------------------------------------------------------------
    def on_routing(self, msg: Routing) -> Outbox:
        """A rank's router statistics; they come before its Loss (one socket, in order)."""
        if self.job is None or msg.rank >= self.world:
            raise ValueError(f"Routing from rank {msg.rank} outside the job")
        self._step(msg.step).routing[msg.rank] = msg
        return []

    def _routing_total(self, step: int, st: _Step) -> RoutingTotal | None:
        """Every rank's router statistics summed (in rank order), and the auxiliary loss added to the step's
        loss as transformers logs it; None where the model adds none."""
        if not st.routing:
            return None
        shares = [st.routing.get(r) for r in range(self.world)]
        if any(m is None for m in shares) or len({(len(m.values), m.coef) for m in shares}) != 1:  # type: ignore[union-attr]
            raise ValueError(f"step {step}: router statistics from ranks {sorted(st.routing)} of {self.world}, "
                             "or of different shapes: every rank must send the same kind")
        total = tuple(math.fsum(v) for v in zip(*(m.values for m in shares)))  # type: ignore[union-attr]
        st.loss += shares[0].coef * aux_loss(total)  # type: ignore[union-attr]
        return RoutingTotal(step, total)

    def on_loss(self, msg: Loss) -> Outbox:
        if self.job is None or msg.rank >= self.world:
            raise ValueError(f"Loss from rank {msg.rank} outside the job")
        st = self._step(msg.step)
        st.losses[msg.rank] = msg
        if len(st.losses) < self.world:
            return []
        tokens = sum(m.tokens for m in st.losses.values())
        st.loss = sum(m.loss_sum for m in st.losses.values()) / max(tokens, 1)
        routing = self._routing_total(msg.step, st)
        st.skipped = not all(m.finite for m in st.losses.values()) or not math.isfinite(st.loss)
        out = self._to_workers(routing) if routing is not None else []
        out += self._to_workers(Go(msg.step, int(st.skipped), st.loss))
        if st.skipped:
            log.warning("step %d: non-finite loss on a rank; skipping the step everywhere", msg.step)
            self._decided(msg.step, history_of(None))
            assert self.store is not None
            for c in self.store.layout.chunks:
                if c.id in self.device_chunks:  # the workers skip their own update
                    out += self._chunk_updated(msg.step, 0.0)
                else:
                    out += self._to_owner(c.id, Update(c.id, msg.step, SOURCE_NONE, 0, 0))
        return out

    def on_grad(self, msg: Grad) -> Outbox:
        if self.job is None or msg.rank >= self.world or self.store is None or msg.chunk >= len(self.store.layout.chunks):
            raise ValueError(f"Grad {msg} outside the job")
        key = (msg.chunk, msg.step)
        arrived = self.arrivals.setdefault(key, [])
        if any(g.rank == msg.rank for g in arrived):
            raise ValueError(f"duplicate Grad from rank {msg.rank} for chunk {msg.chunk} step {msg.step}")
        assert self.rings is not None
        if msg.slot != SLOT_DEVICE and msg.slot >= self.rings.slots:
            raise ValueError(f"Grad slot {msg.slot} outside rank {msg.rank}'s ring of {self.rings.slots}")
        if (msg.slot == SLOT_DEVICE) != (msg.chunk in self.device_chunks):
            raise ValueError(f"Grad for chunk {msg.chunk} with slot {msg.slot}: the chunk is "
                             f"{'held on the devices' if msg.chunk in self.device_chunks else 'a host chunk'}")
        arrived.append(msg)
        if len(arrived) < self.world:
            return []
        del self.arrivals[key]
        if msg.slot == SLOT_DEVICE:  # reduced and updated on the devices; only the norm comes here
            return (self._reduced(msg.chunk, msg.step, sum(g.sqnorm for g in arrived), [])
                    + self._chunk_updated(msg.step, 0.0))
        return self._reduce(msg.chunk, msg.step, sorted(arrived, key=lambda g: g.rank))

    def _reduce(self, chunk_id: int, step: int, grads: list[Grad]) -> Outbox:
        assert self.store is not None and self.rings is not None and self.job is not None
        chunk = self.store.layout.chunks[chunk_id]
        st = self._step(step)
        out: Outbox = []
        if self.world == 1 and self.job.grad_route == "host" and not self.rings.full_reduce:  # the one rank's whole gradient
            sq = grads[0].sqnorm
            updates = [Update(chunk_id, step, SOURCE_RANK_SLOT, grads[0].rank, grads[0].slot)]
        elif self.job.grad_route == "reduce_scatter" and not self.rings.full_reduce:
            sq = sum(g.sqnorm for g in grads)  # the shards' slots go back when the updater is done
            self.shard_slots[(chunk_id, step)] = [(g.rank, g.slot) for g in grads]
            updates = [Update(chunk_id, step, SOURCE_RANK_SHARD, g.rank, g.slot) for g in grads]
        else:
            if not self.rings.full_reduce and not self.free_reduce:
                self.waiting.append((chunk_id, step, grads))
                return []
            j = 0 if self.rings.full_reduce else self.free_reduce.pop()
            t0 = time.perf_counter()
            dst = self.rings.reduce_slot(j, chunk)
            if self.job.grad_route == "reduce_scatter":  # summed on the devices: lay the shards side by side
                for g in grads:
                    shard = self.job.shard(chunk.numel, g.rank)
                    dst[shard.start:shard.end].copy_(self.rings.slot(g.rank, g.slot, shard.end - shard.start))
                sq = sum(g.sqnorm for g in grads)
                st.host_bytes += chunk.numel * hosttraffic.sum_bytes(1)
            elif len(grads) == 1:
                dst.copy_(self.rings.slot(grads[0].rank, grads[0].slot, chunk.numel))
                sq = grads[0].sqnorm
                st.host_bytes += chunk.numel * hosttraffic.sum_bytes(1)
            else:
                srcs = [self.rings.slot(g.rank, g.slot, chunk.numel) for g in grads]
                torch.add(srcs[0], srcs[1], out=dst)
                for s in srcs[2:]:
                    dst.add_(s)
                sq = float(torch.dot(dst, dst))
                st.host_bytes += chunk.numel * (hosttraffic.sum_bytes(len(grads)) + hosttraffic.FP32)  # and the norm
            busy = time.perf_counter() - t0
            st.reduce_s += busy
            now = time.time()
            what = "gather" if self.job.grad_route == "reduce_scatter" else "sum"
            self.tracer.event(f"{what} chunk {chunk_id}", "reduce", step, now - busy, now, chunk=chunk_id, ranks=len(grads))
            out = [(identity("w", g.rank), Credit(g.rank, g.slot)) for g in grads]
            updates = [Update(chunk_id, step, SOURCE_REDUCE, 0, j)]
        return out + self._reduced(chunk_id, step, sq, updates)

    def _reduced(self, chunk_id: int, step: int, sq: float, updates: list[Update]) -> Outbox:
        """A chunk's summed gradient is complete: add its norm and hand out its updates. With exact
        clipping the partial norm (in `norm_order`) decides which chunks speculate and which wait for
        the step's norm, which goes to the updaters (and to workers holding chunks) once complete."""
        assert self.store is not None and self.job is not None
        st = self._step(step)
        st.reduced += 1
        if st.norm is None:
            st.sqnorm += sq
            return [m for u in updates for m in self._to_owner(chunk_id, u)]
        if updates:
            st.undecided[chunk_id] = updates
        out: Outbox = []
        for c, speculate in st.norm.add(chunk_id, sq):
            out += [m for u in st.undecided.pop(c) for m in self._to_owner(c, replace(u, speculative=int(speculate)))]
        if not st.norm.complete or (self._hosts and st.global_sq is None):
            return out
        return out + self._verdict(step, st)

    @property
    def _hosts(self) -> bool:
        """Several hosts: this aggregator sees its host's shards; the step's norm is the workers' GlobalNorm."""
        return self.job is not None and self.job.nnodes > 1

    def _step_verdict(self, st: _Step) -> Verdict:
        assert st.norm is not None
        if self._hosts:
            assert st.global_sq is not None
            return Verdict.of(math.sqrt(st.global_sq), st.norm.max_norm)
        return st.norm.verdict()

    def on_global_norm(self, msg: GlobalNorm) -> Outbox:
        """Several hosts: the step's squared gradient norm over every host, from this host's rank 0 once its
        backward is done: the verdict (with clipping) and the logged norm come from it."""
        if not self._hosts:
            raise ValueError("GlobalNorm in a job of one host")
        st = self._step(msg.step)
        if st.global_sq is not None:
            raise ValueError(f"a second GlobalNorm for step {msg.step}")
        st.global_sq = msg.sqnorm
        out: Outbox = []
        if st.norm is not None and st.norm.complete:
            out += self._verdict(msg.step, st)
        if st.done_held:
            out += self._step_done(msg.step, st)
        return out

    def _verdict(self, step: int, st: _Step) -> Outbox:
        """The step's norm is known: the verdict to the updaters (and workers holding chunks)."""
        assert st.norm is not None
        verdict = self._step_verdict(st)
        st.sqnorm = st.global_sq if st.global_sq is not None else st.norm.sqnorm
        out: Outbox = []
        self._decided(step, history_of(verdict))
        if verdict.skip:
            st.skipped = True
            log.warning("step %d: the gradient norm is not finite (%s); skipping the step everywhere", step, verdict.norm)
        norm = Norm(step, verdict.norm)
        out += [(u, norm) for u in self.updaters]
        if self.device_chunks:
            out += self._to_workers(norm)
        return out

    def on_updated(self, msg: Updated) -> Outbox:
        if self.job is None or self.store is None:
            raise ValueError("Updated outside a job")
        out: Outbox = self._to_workers(Ready(msg.chunk, msg.step + 1))
        if msg.source == SOURCE_RANK_SLOT:
            out.append((identity("w", msg.rank), Credit(msg.rank, msg.slot)))
        elif msg.source == SOURCE_RANK_SHARD:  # one Updated for the chunk; rank/slot unused
            slots = self.shard_slots.pop((msg.chunk, msg.step), None)
            if slots is None:
                raise ValueError(f"Updated for chunk {msg.chunk} step {msg.step} from shards that were never handed out")
            out += [(identity("w", r), Credit(r, s)) for r, s in slots]
        elif msg.source == SOURCE_REDUCE and not self.rings.full_reduce:  # type: ignore[union-attr]
            self.free_reduce.append(msg.slot)
            if self.waiting:
                out += self._reduce(*self.waiting.popleft())
        st = self._step(msg.step)
        st.corrected += msg.corrected
        st.correct_s += msg.correct_s
        # the AdamW passes over the chunk: a corrected one ran speculatively and then again (redo or undo);
        # a skipped step's deferred chunks, and a step skipped for its loss (SOURCE_NONE), none
        passes = 2 if msg.corrected else 0 if st.skipped or msg.source == SOURCE_NONE else 1
        st.host_bytes += passes * self.store.layout.chunks[msg.chunk].numel * hosttraffic.update_bytes(
            self.store.has_shadow)
        return out + self._chunk_updated(msg.step, msg.busy_s)

    def _chunk_updated(self, step: int, busy_s: float) -> Outbox:
        """One more chunk of `step` holds its new weights; the last one commits the step."""
        assert self.store is not None
        st = self._step(step)
        st.updated += 1
        st.update_s += busy_s
        if st.updated < len(self.store.layout.chunks):
            return []
        self.store.manifest.set_committed_step(step + 1, self.history.get(step, KEPT) if self.norm_order else KEPT)
        now = time.time()
        self.tracer.event(f"step {step} committed", "commit", step, now, now)
        if self._hosts and st.reduced and st.global_sq is None:  # the logged norm is every host's
            st.done_held = True
            return []
        return self._step_done(step, st)

    def _step_done(self, step: int, st: _Step) -> Outbox:
        del self.steps[step]
        if st.global_sq is not None:
            st.sqnorm = st.global_sq
        if self.launcher is None:
            return []
        norm = math.sqrt(st.sqnorm) if st.reduced else math.nan  # a step skipped for its loss sent no gradient
        clip = st.norm
        clipped = clip is not None and clip.complete and self._step_verdict(st).clipped
        return [(self.launcher, StepDone(step, st.loss, norm, int(st.skipped), st.update_s, st.reduce_s, int(clipped),
                                         len(clip.speculated) if clip is not None else 0, st.corrected, st.correct_s,
                                         int(clip is not None and clip.speculate), st.host_bytes))]

    def _decided(self, step: int, history: int) -> None:
        """Step `step`'s verdict is known: what the next step decides from (and, once committed, the manifest)."""
        self.history[step] = history
        for old in [s for s in self.history if s < step - 4]:
            del self.history[old]
