"""The aggregator's job start/end handshake, driven in-process: no socket, no clock.

JobHandshake is the state between the launcher's JobStart/JobEnd and the updater pool's Acks;
`route` hands it (and the core) each message. Every step is checked by what it returns to send.
A real store and real rings back the job (AggregatorCore.start_job maps them).
"""

from __future__ import annotations

import pytest

from slidedp.daemons.aggregator.core import AggregatorCore
from slidedp.daemons.aggregator.handshake import JobHandshake, route
from slidedp.protocol import ROLE_LAUNCHER, ROLE_UPDATER, Ack, Fault, Grad, Hello, JobEnd, JobStart
from slidedp.transport import identity

from pipeline.harness import attached_job_record, unique_store
from reliability import drop_store

LAUNCHER = b"launcher0"


@pytest.fixture
def job():
    store = unique_store("hs")
    try:
        yield store, attached_job_record(store, 1, clip=False)
    finally:
        drop_store(store)


def _handshake(store: str, timeout_s: float = 30.0) -> tuple[AggregatorCore, JobHandshake]:
    core = AggregatorCore(store)
    return core, JobHandshake(core, store, timeout_s)


def _send(core, hs, peer: bytes, msg, now: float = 0.0):
    return route(core, hs, peer, msg, now)


def _pool_says_hello(core, hs, size: int) -> None:
    for i in range(size):
        assert _send(core, hs, identity("u", i), Hello(ROLE_UPDATER, i, size, 100 + i)) == []


def test_a_job_starts_once_every_updater_has_acknowledged(job):
    store, record = job
    core, hs = _handshake(store)
    try:
        assert _send(core, hs, LAUNCHER, Hello(ROLE_LAUNCHER, 0, 1, 1)) == []
        assert _send(core, hs, LAUNCHER, JobStart(0, record.to_json())) == []
        assert hs.tick(1.0) == []  # the pool has not said hello yet: nothing goes out
        _pool_says_hello(core, hs, 2)
        out = hs.tick(1.0)
        assert [(to, type(m).__name__) for to, m in out] == [(b"u0", "JobStart"), (b"u1", "JobStart")]
        assert out[0][1].text == record.to_json()
        assert hs.tick(2.0) == []  # sent once
        assert _send(core, hs, b"u1", Ack(1, "updater 1 ready")) == []
        assert core.job is None  # one of two: the aggregator has not mapped the job
        out = _send(core, hs, b"u0", Ack(1, "updater 0 ready"))
        assert out == [(LAUNCHER, Ack(1, "job started with 2 updater(s)"))]
        assert core.job == record and core.owner and max(core.owner) <= 1
        assert hs.starting is None
    finally:
        core.end_job()


def test_a_pool_that_never_answers_is_named_to_the_launcher(job):
    store, record = job
    core, hs = _handshake(store, timeout_s=5.0)
    _send(core, hs, LAUNCHER, JobStart(0, record.to_json()), now=10.0)
    _pool_says_hello(core, hs, 2)
    hs.tick(11.0)
    _send(core, hs, b"u0", Ack(1, "updater 0 ready"))
    assert hs.tick(14.9) == []
    out = hs.tick(15.1)
    assert len(out) == 1 and out[0][0] == LAUNCHER and not out[0][1].ok
    assert out[0][1].text == (f"updater pool not ready: 1 of 2 updater process(es) answered within 5 s "
                              f"(is `slidedp-updater --store {store}` running?)")
    assert hs.starting is None and core.job is None
    assert _send(core, hs, b"u1", Ack(1, "updater 1 ready")) == []  # a late Ack starts nothing


def test_a_record_from_another_version_is_refused_to_its_sender(job):
    store, _ = job
    core, hs = _handshake(store)
    out = _send(core, hs, LAUNCHER, JobStart(0, '{"job": "j"}'))
    assert len(out) == 1 and out[0][0] == LAUNCHER and not out[0][1].ok
    assert out[0][1].text.startswith("job record does not match this SlideDP's (another version?)")
    assert hs.starting is None


def test_a_job_the_aggregator_cannot_map_is_refused_after_the_pool_acknowledged(job):
    store, record = job
    core, hs = _handshake(store)
    other = record.__class__(**{**record.__dict__, "layout_hash": "not-this-store"})
    _send(core, hs, LAUNCHER, JobStart(0, other.to_json()))
    _pool_says_hello(core, hs, 1)
    hs.tick(0.0)
    out = _send(core, hs, b"u0", Ack(1, "updater 0 ready"))
    assert out == [(LAUNCHER, Ack(0, f"aggregator: store {store!r} layout does not match the job's"))]
    assert core.job is None and hs.starting is None


def test_a_job_ends_once_every_updater_has_acknowledged(job):
    store, record = job
    core, hs = _handshake(store)
    _pool_says_hello(core, hs, 2)
    core.start_job(record, 2)
    out = _send(core, hs, LAUNCHER, JobEnd(0, ""))
    assert out == [(b"u0", JobEnd(0, "")), (b"u1", JobEnd(0, ""))]
    assert core.job is None  # unmapped at once: the pool's acks only tell the launcher
    assert _send(core, hs, b"u0", Ack(1, "updater 0 done")) == []
    assert _send(core, hs, b"u1", Ack(1, "updater 1 done")) == [(LAUNCHER, Ack(1, "job ended"))]
    assert hs.ending is None


def test_without_a_pool_a_job_end_is_acknowledged_at_once(job):
    store, _ = job
    core, hs = _handshake(store)
    assert _send(core, hs, LAUNCHER, JobEnd(0, "")) == [(LAUNCHER, Ack(1, "job ended"))]


def test_an_updater_failure_reaches_the_launcher_as_a_fault(job):
    store, _ = job
    core, hs = _handshake(store)
    assert _send(core, hs, b"u1", Ack(0, "updater 1: boom")) == []  # no launcher known yet: logged only
    _send(core, hs, LAUNCHER, Hello(ROLE_LAUNCHER, 0, 1, 1))
    assert _send(core, hs, b"u1", Ack(0, "updater 1: boom")) == [(LAUNCHER, Fault(ROLE_UPDATER, 1, "updater 1: boom"))]
    fault = Fault(0, 3, "rank 3 failed")
    assert _send(core, hs, b"w3", fault) == [(LAUNCHER, fault)]


def test_a_message_outside_a_job_is_dropped(job):
    store, _ = job
    core, hs = _handshake(store)
    assert _send(core, hs, b"w0", Grad(0, 0, 0, 0, 1.0)) == []  # no job: logged and dropped
    assert _send(core, hs, b"ux", Ack(1, "?")) == []  # not an updater index
