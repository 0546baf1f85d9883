"""A worker waiting for a gradient slot keeps announcing the gradients that land meanwhile.

Slots come back as credits only after the aggregator has every rank's gradient of a chunk, and
a gradient is announced only once its copy has landed; a rank that waited for a slot without
announcing would wait for credits that its own unannounced gradients hold back.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import zmq

from slidedp.transport import PeerTimeout
from slidedp.worker.link import WorkerLink


@pytest.fixture
def idle_socket():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)  # connected to nothing: no credit ever arrives through it
    yield sock
    sock.close(linger=0)
    ctx.term()


def test_slot_wait_runs_the_callback_until_a_slot_frees(idle_socket):
    link = WorkerLink(store=None, rings=SimpleNamespace(slots=3), rank=0, agg=idle_socket, timeout_s=10.0)
    link.free_slots = []
    calls = []

    def announce() -> None:  # what the engine does: flush landed gradients; here the 3rd call frees slot 2
        calls.append(1)
        if len(calls) == 3:
            link.free_slots.append(2)

    assert link.acquire_slot(announce) == 2
    assert len(calls) == 3 and link.waits["slot"] > 0


def test_slot_wait_names_the_peer_when_nothing_frees(idle_socket):
    link = WorkerLink(store=None, rings=SimpleNamespace(slots=3), rank=1, agg=idle_socket, timeout_s=0.2)
    link.free_slots = []
    with pytest.raises(PeerTimeout, match=r"rank 1 waited 0 s for a free gradient slot \(the aggregator"):
        link.acquire_slot(lambda: None)
