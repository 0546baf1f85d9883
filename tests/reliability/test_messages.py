"""Garbage, truncated, oversized and wrong-version ZeroMQ messages sent straight to each daemon's socket.

A DEALER connects to the host-state daemon's ROUTER (`control`) and the aggregator's (`agg`)
and sends raw bytes. Each daemon must log and drop what it cannot decode, stay up (same pid),
and keep serving: `status` answers, the aggregator answers a JobStart, and a job trains to the
end while more garbage arrives -- on the launcher's own `job` socket too.
"""

from __future__ import annotations

import json
import os
import random
import struct
import time
from pathlib import Path

import pytest
import zmq

from slidedp.faults import ENV as HOLD_ENV
from slidedp.paths import socket_address
from slidedp.protocol import (_REGISTRY, MAX_TEXT, MAX_VALUES, Ack, Grad, JobStart, ProtocolError, Reply, Request, Routing,
                              decode, request)
from slidedp.store.client import call
from slidedp.transport import recv_dealer, send

from pipeline.harness import attached_job_record

from . import (TINY, RunningJob, daemon_pids, drop_store, fast_sets, start_daemons, stop_daemons, unique_store,
               wait_marker)

_EXAMPLES = {  # one valid instance of each message type with fixed fields, for truncating and padding
    t: cls(*[("{}" if f == "text" else (1.0, 2.0) if f == "values" else 1) for f in cls.__dataclass_fields__])
    for t, cls in _REGISTRY.items()
}


def undecodable(rng: random.Random) -> list[bytes]:
    """Payloads that protocol.decode must reject: garbage, truncated, oversized and from another protocol version."""
    out = [b"", b"\x00", bytes([255]) + b"\x01" * 31]
    while len(out) < 60:  # random garbage that happens not to be a valid message
        p = rng.randbytes(rng.randint(1, 200))
        try:
            decode(p)
        except ProtocolError:
            out.append(p)
    for msg in _EXAMPLES.values():
        raw = msg.encode()
        out.append(raw[: rng.randint(1, len(raw) - 1)])  # truncated
        out.append(raw + b"\x00\x00\x00\x00")  # a newer layout with an extra field
    text = b"x" * (MAX_TEXT + 1)
    out.append(bytes([Request.TYPE, 0]) + struct.pack("<I", len(text)) + text)  # text over the limit
    out.append(bytes([Request.TYPE, 4]) + struct.pack("<I", 10) + b"\xff\xfe" * 5)  # text not UTF-8
    out.append(bytes([Request.TYPE, 4]) + struct.pack("<I", 1 << 30) + b"{}")  # text length that lies
    out.append(bytes([Request.TYPE, 200]) + struct.pack("<I", 2) + b"{}")  # a request kind from the future
    out.append(Grad(-1, 0, 0, 0, 0.0).encode())  # a negative rank
    routing = Routing(0, 0, 0.1, (1.0, 2.0)).encode()
    out.append(routing[:-8] + struct.pack("<d", float("nan")))  # a statistic that is not finite
    out.append(routing[:-16] + struct.pack("<I", MAX_VALUES + 1))  # more values than allowed
    out.append(routing[:-20] + struct.pack("<I", 3) + routing[-16:])  # a count that lies
    out.append(bytes([Request.TYPE]) + os.urandom(16 << 20))  # 16 MiB
    for p in out:
        with pytest.raises(ProtocolError):
            decode(p)
    return out


def blast(store: str, socket: str, payloads: list, ident: bytes = b"intruder", keep_open: bool = False):
    """Send every payload to one of the store's sockets; with keep_open the socket is returned open (a
    ROUTER may drop what a peer sent once the peer is gone, before the owner has read it)."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, ident)
    s.setsockopt(zmq.LINGER, 5000)
    s.setsockopt(zmq.SNDHWM, 0)
    s.connect(socket_address(store, socket))
    try:
        for p in payloads:
            if isinstance(p, list):
                s.send_multipart(p)
            else:
                s.send(p)
    except BaseException:
        s.close()
        raise
    if keep_open:
        return s
    s.close()  # linger: every message delivered before we go on
    return None


def aggregator_answers(store: str, timeout: float = 30.0, record: dict | None = None) -> str:
    """The aggregator still serves: a JobStart whose record it must refuse comes back as Ack(0)."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, b"probe%d" % time.monotonic_ns())
    s.setsockopt(zmq.LINGER, 0)
    s.connect(socket_address(store, "agg"))
    try:
        bad = record or {"job": "probe", "store": store, "world": 0, "train": {}, "layout_hash": ""}
        send(s, JobStart(0, json.dumps(bad)))
        assert s.poll(int(timeout * 1000)), "the aggregator did not answer"
        msg = recv_dealer(s)
        assert isinstance(msg, Ack) and not msg.ok
        return msg.text
    finally:
        s.close()


@pytest.fixture(scope="module")
def daemons(tmp_path_factory):
    logs = tmp_path_factory.mktemp("msg-logs")
    store = unique_store("msg")
    procs = start_daemons(store, logs)
    try:
        call(store, "create", timeout_s=120, source="random", shape="tiny", vocab_size=512, init_seed=0)
        yield store, procs, logs
    finally:
        stop_daemons(procs)
        drop_store(store)


def _alive(store: str, procs, pids: dict) -> None:
    assert daemon_pids(store) == pids and all(p.poll() is None for p in procs), "a daemon died"
    st = call(store, "status", timeout_s=30)
    assert st["exists"] and st["torn"] is None and st["attached_pid"] == 0


def _count(path: Path, text: str) -> int:
    return path.read_text(errors="replace").count(text)


@pytest.mark.parametrize("socket,role", [("control", "hoststate"), ("agg", "aggregator")])
def test_undecodable_messages_are_logged_and_dropped(daemons, socket, role):
    store, procs, logs = daemons
    pids = daemon_pids(store)
    payloads = undecodable(random.Random(7))
    # Frames over the socket's MAXMSGSIZE are refused by ZeroMQ itself (the connection is dropped
    # before anything is buffered): they never reach the log, and they go last, on their own.
    oversized = [p for p in payloads if len(p) > MAX_TEXT + 4096]
    payloads = [p for p in payloads if len(p) <= MAX_TEXT + 4096]
    assert len(oversized) == 1
    before = _count(logs / f"{role}.log", "dropped a")
    blast(store, socket, payloads + [[b"a", b"b", b"c"]])  # and one of three frames
    deadline = time.monotonic() + 30
    while _count(logs / f"{role}.log", "dropped a") - before < len(payloads) + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _count(logs / f"{role}.log", "dropped a") - before == len(payloads) + 1
    blast(store, socket, oversized)
    _alive(store, procs, pids)
    assert aggregator_answers(store) == "job record: world must be >= 1, got 0"


def test_control_requests_with_bad_arguments(daemons):
    """Decodable requests whose JSON arguments are wrong: a refusal naming the problem, never a crash."""
    store, procs, _ = daemons
    pids = daemon_pids(store)
    ctx = zmq.Context.instance()
    cases = [
        (request("status", "{not json"), "Expecting property name"),
        (request("status", "[1, 2]"), "request arguments must be a JSON object"),
        (request("attach", json.dumps({"pid": 1})), "missing argument 'world'"),
        (request("checkpoint", json.dumps({"dir": "/tmp/x", "dtype": "fp64"})), "fp64"),
        (request("restore", json.dumps({"path": "/nonexistent"})), "is not a SlideDP checkpoint"),
        (request("create", json.dumps({"source": "random", "shape": "no-such-shape"})), "already exists"),
        (request("checkpoint", json.dumps({"dir": 123})), "expected str, bytes or os.PathLike object, not int"),
        (request("attach", json.dumps({"world": None, "pid": 1})), "int() argument must be"),
    ]
    for req, want in cases:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(socket_address(store, "control"))
        try:
            send(s, req)
            assert s.poll(30_000), f"no reply to {req}"
            reply = recv_dealer(s, (Reply,))
        finally:
            s.close()
        assert isinstance(reply, Reply) and reply.ok == 0 and want in reply.text, (req, reply)
    _alive(store, procs, pids)


def test_job_record_from_another_version(daemons):
    """A JobStart whose record has a field this version does not know (or lacks one): refused, not fatal."""
    store, procs, _ = daemons
    pids = daemon_pids(store)
    future = {"job": "j", "store": store, "world": 1, "train": {}, "layout_hash": "h", "field_from_the_future": 1}
    assert aggregator_answers(store, record=future).startswith(
        "job record does not match this SlideDP's (another version?): ")
    assert aggregator_answers(store, record={"job": "j"}).startswith("job record does not match this SlideDP's")
    _alive(store, procs, pids)


def test_a_job_trains_through_garbage(daemons, tmp_path):
    """Garbage on all three sockets while a job runs: every step is committed, nothing dies."""
    store, procs, logs = daemons
    pids = daemon_pids(store)
    run_dir = tmp_path / "run"
    marker = tmp_path / "held"
    # the ranks hold before step 2 (slidedp/faults.py) while the launcher goes on reading its sockets: the
    # garbage reaches a job mid-way, and the launcher has logged it before the job may end, whatever the
    # machine's speed (held, the launcher itself could end the job before its socket had the garbage)
    run = RunningJob.start(TINY, fast_sets(store, run_dir, "train.steps=4"), tmp_path, store,
                           env={HOLD_ENV: f"step@2:{marker}"})
    senders = []
    try:
        wait_marker(run, marker)
        payloads = undecodable(random.Random(11))[:80]
        for socket in ("job", "agg", "control"):  # open until the job ends: a ROUTER drops a gone peer's messages
            senders.append(blast(store, socket, payloads, keep_open=True))
        deadline = time.monotonic() + 120.0  # bounds a hang only: the wait ends once the launcher logs it
        while "dropped a bad message" not in run.output:  # the launcher's job socket logged them
            assert run.proc.poll() is None and time.monotonic() < deadline, run.output[-4000:]
            time.sleep(0.02)
        marker.unlink()
        assert run.wait_exit(240) == 0, run.output[-4000:]
    finally:
        for s in senders:
            s.close(linger=0)
        run.cleanup()
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    st = call(store, "status", timeout_s=30)
    assert (st["committed_step"], st["torn"], st["attached_pid"]) == (4, None, 0)
    assert daemon_pids(store) == pids


# ---- decodable messages with fields out of range, driven through the daemons' cores ----------------------
def test_aggregator_rejects_a_grad_slot_outside_the_ring():
    from slidedp.daemons.aggregator.core import AggregatorCore

    store = unique_store("msgslot")
    try:
        record = attached_job_record(store, world=1, clip=True)
        core = AggregatorCore(store)
        core.start_job(record, 1)
        try:
            with pytest.raises(ValueError):  # what serve() logs and drops
                core.on_grad(Grad(0, 1, 0, 999, 0.0))
        finally:
            core.end_job()
    finally:
        drop_store(store)


def test_updater_drops_queued_updates_when_the_job_ends():
    from slidedp.daemons.updater.core import UpdaterCore
    from slidedp.protocol import SOURCE_NONE, Update

    store = unique_store("msgend")
    try:
        record = attached_job_record(store, world=1, clip=False)
        core = UpdaterCore(store, 0)
        core.start_job(record)
        core.on_update(Update(0, 0, SOURCE_NONE, 0, 0))  # ready to run...
        core.end_job()  # ...when the launcher ends the job (it failed elsewhere)
        assert core.next() is None
    finally:
        drop_store(store)


def test_router_statistics_travel_bit_for_bit():
    """A Routing's values are float64 on the wire: counts past 2**24 and sums of probabilities come back exact."""
    values = (float(2**40 + 1), 0.1, 1 / 3, 16_777_217.0, 5e-324)
    raw = Routing(3, 7, 0.001, values).encode()
    assert len(raw) == 1 + struct.calcsize("<iqd") + 4 + 8 * len(values)
    assert decode(raw) == Routing(3, 7, 0.001, values)
    assert decode(Routing(0, 0, 0.0, ()).encode()).values == ()
