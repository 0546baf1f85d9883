"""The gradient announcer (slidedp/worker/announcer.py): each copy announced by its own thread as soon as it
lands, in the order handed over, while the engine's thread is busy elsewhere; its failure raised to the engine."""

from __future__ import annotations

import threading

import pytest
import torch

from slidedp.store.layout import Chunk
from slidedp.worker.announcer import Announcer, AnnouncerFailed, Copy

WAIT_S = 30.0  # a bound for a hang only: nothing here is timed


class Landing:
    """Stands in for a copy's CUDA event: it lands when the test says so."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def synchronize(self) -> None:
        assert self.done.wait(WAIT_S), "the test never landed this copy"


def copy(i: int, landed: Landing | None = None) -> Copy:
    chunk = Chunk(id=i, kind="layer", layer=i, offset=4 * i, numel=4, members=())
    return Copy(chunk, slot=10 + i, step=3, sq=torch.tensor(float(i * i)), landed=landed, buf=torch.zeros(4))


class Heard:
    """What the announcer said, and a way to wait for the n-th announcement."""

    def __init__(self) -> None:
        self.said: list[tuple[int, int, float, int]] = []
        self.cond = threading.Condition()

    def __call__(self, chunk: Chunk, slot: int, sq: float, step: int) -> None:
        with self.cond:
            self.said.append((chunk.id, slot, sq, step))
            self.cond.notify_all()

    def until(self, n: int) -> list[tuple[int, int, float, int]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.said) >= n, WAIT_S)
            return list(self.said)


def test_a_copy_is_announced_once_it_lands_while_the_engine_thread_does_nothing():
    heard = Heard()
    out = Announcer(heard)
    first, second = Landing(), Landing()
    out.put(copy(1, first))
    out.put(copy(2, second))
    assert heard.said == []  # nothing has landed
    first.done.set()  # the copy lands; the engine's thread calls nothing
    assert heard.until(1) == [(1, 11, 1.0, 3)]
    second.done.set()
    assert heard.until(2) == [(1, 11, 1.0, 3), (2, 12, 4.0, 3)]
    out.close()


def test_announcements_keep_the_order_handed_over_and_wait_returns_once_all_are_out():
    heard = Heard()
    out = Announcer(heard)
    landings = [Landing() for _ in range(4)]
    for i, landed in enumerate(landings):
        out.put(copy(i, landed))
    for landed in reversed(landings):  # the later copies land first: still announced in issue order
        landed.done.set()
    out.wait()
    assert [c for c, *_ in heard.said] == [0, 1, 2, 3]
    out.put(copy(7))  # a copy already in host memory (CPU): announced without an event
    out.wait()
    assert heard.said[-1] == (7, 17, 49.0, 3)
    out.close()


def test_a_failed_announcement_is_raised_in_the_engine_thread_with_its_cause():
    def refuse(chunk: Chunk, slot: int, sq: float, step: int) -> None:
        raise OSError(f"socket closed (chunk {chunk.id})")

    out = Announcer(refuse)
    out.put(copy(5))
    with pytest.raises(AnnouncerFailed, match=r"announcing a landed gradient failed: OSError: socket closed \(chunk 5\)"):
        out.wait()
    with pytest.raises(AnnouncerFailed):  # and at the next hand-over
        out.put(copy(6))
    with pytest.raises(AnnouncerFailed):
        out.check()
    out.close()
