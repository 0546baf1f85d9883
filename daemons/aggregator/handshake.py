"""The job's start and end between the launcher, the aggregator and the updater pool.

A job starts when every member of the pool has mapped it: the launcher's `JobStart` waits until
the pool's members have said hello (they tell the pool's size), goes to each of them, and once
each has acknowledged, the aggregator maps the job itself (`AggregatorCore.start_job`) and
acknowledges the launcher; a pool that does not answer within the timeout is reported to the
launcher by name. `JobEnd` goes the same way. `JobHandshake` is that state; `route` hands every
message to the handshake or to the core. Both return what to send (an Outbox), never send.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slidedp import log as slog
from slidedp.daemons.aggregator.core import AggregatorCore, Outbox
from slidedp.jobrecord import JobRecord
from slidedp.protocol import (ROLE_LAUNCHER, ROLE_UPDATER, Ack, Fault, GlobalNorm, Grad, Hello, JobEnd, JobStart, Loss, Message,
                              Routing, Updated)
from slidedp.transport import identity

log = slog.get("aggregator")

# What a malformed or out-of-place message raises in the core: logged and dropped.
DROPPED = (ValueError, TypeError, IndexError, RuntimeError, AssertionError, FileNotFoundError)


@dataclass
class _PendingStart:
    launcher: bytes
    record: JobRecord
    deadline: float
    acks: set[int] = field(default_factory=set)
    sent: bool = False
    pool: int = 0


@dataclass
class _PendingEnd:
    launcher: bytes
    acks: set[int] = field(default_factory=set)


class JobHandshake:
    """Job start and end with the updater pool; `now` is time.monotonic() as the shell reads it."""

    def __init__(self, core: AggregatorCore, store_name: str, timeout_s: float) -> None:
        self.core, self.store_name, self.timeout_s = core, store_name, timeout_s
        self.pool = 0  # the updater pool's size, learned from its members' Hello
        self.present: set[int] = set()
        self.starting: _PendingStart | None = None
        self.ending: _PendingEnd | None = None

    def _to_pool(self, msg: Message) -> Outbox:
        return [(identity("u", i), msg) for i in range(self.pool)]

    def tick(self, now: float) -> Outbox:
        """Hand a waiting JobStart to the pool once all of it is here; report a pool that never answered."""
        out: Outbox = []
        p = self.starting
        if p is not None and not p.sent and self.pool and len(self.present) >= self.pool:
            out += self._to_pool(JobStart(0, p.record.to_json()))
            p.sent, p.pool = True, self.pool
        if p is not None and now > p.deadline:
            out.append((p.launcher, Ack(0, f"updater pool not ready: {len(p.acks)} of {self.pool or '?'} "
                                           f"updater process(es) answered within {self.timeout_s:.0f} s "
                                           f"(is `slidedp-updater --store {self.store_name}` running?)")))
            self.starting = None
        return out

    def on_hello(self, peer: bytes, msg: Hello) -> Outbox:
        if msg.role == ROLE_UPDATER:
            self.pool = msg.size
            self.present.add(msg.rank)
        elif msg.role == ROLE_LAUNCHER:
            self.core.launcher = peer
        return []

    def on_job_start(self, peer: bytes, msg: JobStart, now: float) -> Outbox:
        self.core.launcher = peer
        self.starting = _PendingStart(peer, JobRecord.from_json(msg.text), deadline=now + self.timeout_s)
        return []

    def refuse_start(self, peer: bytes, reason: str) -> Outbox:
        self.starting = None
        return [(peer, Ack(0, reason))]

    def on_job_end(self, peer: bytes) -> Outbox:
        self.core.end_job()
        if not self.pool:
            self.ending = None
            return [(peer, Ack(1, "job ended"))]
        self.ending = _PendingEnd(peer)
        return self._to_pool(JobEnd(0, ""))

    def on_updater_ack(self, index: int, msg: Ack) -> Outbox:
        launcher = self.core.launcher
        if not msg.ok:
            log.error("updater %d failed: %s", index, msg.text)
            return [(launcher, Fault(ROLE_UPDATER, index, msg.text))] if launcher is not None else []
        p = self.starting
        if p is not None and p.sent:
            p.acks.add(index)
            if len(p.acks) < p.pool:
                return []
            self.starting = None
            try:
                self.core.start_job(p.record, p.pool)
            except (RuntimeError, ValueError, OSError) as e:  # the launcher reports why
                log.error("job %s not started: %s", p.record.job, e)
                return [(p.launcher, Ack(0, f"aggregator: {e}"))]
            log.info("job %s started: %d rank(s), %d updater(s)", p.record.job, p.record.world, p.pool)
            return [(p.launcher, Ack(1, f"job started with {p.pool} updater(s)"))]
        e = self.ending
        if e is not None:
            e.acks.add(index)
            if len(e.acks) == self.pool:
                self.ending = None
                return [(e.launcher, Ack(1, "job ended"))]
        return []

    def on_fault(self, peer: bytes, msg: Fault) -> Outbox:
        log.error("fault from %r: %s", peer, msg.text)
        return [(self.core.launcher, msg)] if self.core.launcher is not None else []


def route(core: AggregatorCore, handshake: JobHandshake, peer: bytes, msg: Message, now: float) -> Outbox:
    """What one message from `peer` makes the aggregator send. A message the core cannot take is
    logged and dropped (a JobStart is refused to its sender, with the reason)."""
    try:
        if isinstance(msg, Grad):
            return core.on_grad(msg)
        if isinstance(msg, Updated):
            return core.on_updated(msg)
        if isinstance(msg, Loss):
            return core.on_loss(msg)
        if isinstance(msg, Routing):
            return core.on_routing(msg)
        if isinstance(msg, GlobalNorm):
            return core.on_global_norm(msg)
        if isinstance(msg, Hello):
            return handshake.on_hello(peer, msg)
        if isinstance(msg, JobStart):
            return handshake.on_job_start(peer, msg, now)
        if isinstance(msg, JobEnd):
            return handshake.on_job_end(peer)
        if isinstance(msg, Ack) and peer.startswith(b"u"):
            return handshake.on_updater_ack(int(peer[1:]), msg)
        if isinstance(msg, Fault):
            return handshake.on_fault(peer, msg)
        return []
    except DROPPED as e:
        log.warning("dropped %s from %r: %s", type(msg).__name__, peer, e)
        return handshake.refuse_start(peer, str(e)) if isinstance(msg, JobStart) else []
