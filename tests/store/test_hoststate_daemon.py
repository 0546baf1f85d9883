"""The host-state daemon as a real process: kill -9 and re-attach, one daemon per store, corrupt stores, refusals."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
import zmq

from slidedp.daemonlock import holder_pid
from slidedp.model.config import named_shape
from slidedp.paths import run_dir
from slidedp.protocol import Reply, request
from slidedp.store.client import StoreRequestError, call, daemon_running
from slidedp.store.layout import make_layout
from slidedp.store.shm import Segment, shm_free_bytes
from slidedp.store.store import STATE_KINDS, HostStore, segment_sizes
from slidedp.transport import request as zmq_request

from . import WAIT_S, Daemon, bits, cleanup_store, shm_entries, unique_store

KINDS_4 = ["exp_avg", "exp_avg_sq", "manifest", "master"]


def over_socket(store: str, kind: str, **args) -> dict:
    """A request on the daemon's socket itself (never the in-process fallback of client.call)."""
    reply = zmq_request(zmq.Context.instance(), store, request(kind, json.dumps(args)), WAIT_S, (Reply,))
    if not reply.ok:
        raise StoreRequestError(reply.text)
    return json.loads(reply.text)


@pytest.fixture
def store(tmp_path):
    """A store name, its daemons (started by the test through `start`), and cleanup of both."""
    name = unique_store("hs")
    daemons: list[Daemon] = []

    def start() -> Daemon:
        d = Daemon(name, tmp_path / f"hoststate-{len(daemons)}.log")
        daemons.append(d)
        return d

    try:
        yield name, start
    finally:
        for d in daemons:
            d.stop()
        cleanup_store(name)


def test_kill9_daemon_reattaches_and_loses_nothing(store):
    name, start = store
    a = start()
    a.wait_serving()
    assert daemon_running(name) and holder_pid(name, "hoststate") == a.pid
    sock = run_dir(name) / "control.sock"
    assert stat.S_IMODE(sock.stat().st_mode) & 0o077 == 0  # the socket is private too

    # A refusal leaves the daemon serving and /dev/shm untouched.
    big = make_layout(named_shape("qwen3-14b"))
    if sum(segment_sizes(big, {}, False).values()) > shm_free_bytes():
        with pytest.raises(StoreRequestError, match=r"needs 16\d\.\d\d GiB of shared memory but /dev/shm has only"):
            over_socket(name, "create", source="random", shape="qwen3-14b")
        assert shm_entries(name) == []

    st = over_socket(name, "create", source="random", shape="tiny", init_seed=3)
    assert st["committed_step"] == 0 and st["torn"] is None and st["touch_gbps"] > 0
    assert "page touch" in a.text() and f"store {name} created in" in a.text()

    # Make the state look trained: non-trivial moments, versions and a committed step.
    s = HostStore.attach(name)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for kind in STATE_KINDS:
            s.flat(kind).add_(torch.randn(s.layout.total_numel, generator=gen))
    s.manifest.adam_steps[:] = 4
    s.manifest.versions[:] = 4
    s.manifest.set_committed_step(4)
    want = {k: bits(s.flat(k)) for k in STATE_KINDS}
    s.close()
    att = over_socket(name, "attach", job="soak", pid=os.getpid(), world=2)
    before = over_socket(name, "status")
    assert before["daemon_pid"] == a.pid and before["attached_pid"] == os.getpid() and before["job"]["job"] == "soak"
    segments = shm_entries(name)
    assert len(segments) > 4  # the job's gradient rings too

    a.kill9()
    assert not daemon_running(name)
    assert shm_entries(name) == segments  # a killed daemon unlinks nothing

    b = start()
    b.wait_serving()
    assert f"re-attached to store {name}: committed step 4, clean" in b.text()
    after = over_socket(name, "status")
    assert after["daemon_pid"] == b.pid
    same = ("store", "model", "family", "parameters", "chunks", "segments", "bytes_per_parameter", "committed_step",
            "generation", "layout_hash", "torn", "attached_pid", "job")
    assert {k: after[k] for k in same} == {k: before[k] for k in same}
    assert after["model"] == "random:tiny" and after["committed_step"] == 4 and after["torn"] is None

    s = HostStore.attach(name)
    try:
        for kind in STATE_KINDS:
            assert torch.equal(bits(s.flat(kind)), want[kind]), f"{kind} changed across the restart"
        assert s.manifest.adam_steps.tolist() == [4] * len(s.layout.chunks)
    finally:
        s.close()

    # The job attached before the kill detaches from the new daemon with its token.
    assert over_socket(name, "detach", token=att["token"]) == {"committed_step": 4, "torn": None}
    assert shm_entries(name) == [f"slidedp.{name}.{k}" for k in KINDS_4]

    # SIGTERM: a clean stop that leaves the store in place for the next daemon.
    assert b.stop() == 0
    assert f"stopped; store {name} left in place" in b.text()
    assert shm_entries(name) == [f"slidedp.{name}.{k}" for k in KINDS_4]


def test_second_daemon_for_a_store_is_refused(store):
    name, start = store
    a = start()
    a.wait_serving()
    b = start()
    assert b.proc.wait(timeout=WAIT_S) == 1
    assert (f"another slidedp-hoststate already serves store {name!r} (pid {a.pid}); refusing to start a second"
            in b.text())
    assert "serving store" not in b.text()
    assert over_socket(name, "ping") == {"pid": a.pid, "store": name, "exists": False}  # the first one is unharmed
    assert holder_pid(name, "hoststate") == a.pid
    # ... and it serves a store that does not exist yet with clear answers.
    assert over_socket(name, "status") == {"store": name, "exists": False, "daemon_pid": a.pid}
    with pytest.raises(StoreRequestError) as e:
        over_socket(name, "checkpoint", dir="/nonexistent")
    assert str(e.value) == f"store {name!r} does not exist; create it first (`slidedp-store create {name} ...`)"


def test_daemon_names_a_corrupt_manifest_and_touches_nothing(store):
    name, start = store
    call(name, "create", source="random", shape="tiny")  # in this process: no daemon yet
    seg = Segment.open(f"/slidedp.{name}.manifest")
    seg.mm[0:1] = b"X"
    seg.close()
    before = {e: os.stat(f"/dev/shm/{e}").st_size for e in shm_entries(name)}
    d = start()
    assert d.proc.wait(timeout=WAIT_S) != 0
    want = f"manifest /slidedp.{name}.manifest is corrupt: bad magic b'XLIDEDP\\x01' (expected b'SLIDEDP\\x01')"
    assert want in d.text()
    assert "serving store" not in d.text()
    assert {e: os.stat(f"/dev/shm/{e}").st_size for e in shm_entries(name)} == before
    assert not daemon_running(name)

