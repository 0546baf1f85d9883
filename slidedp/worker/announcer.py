"""Announcing each gradient copy the moment it lands, from a thread of the worker's own.

A chunk's gradient leaves the device on the copy-out stream; the updaters may start on it once the
copy has landed and the aggregator has heard so (`Grad`). The engine's thread cannot say so in time:
it is queueing the next layer's kernels ahead of the GPU, or blocked in a launch or a synchronize,
and would look at the copies only at its next send, while the updaters wait with nothing to do.
So a thread waits for each copy in issue order (a blocking-sync event: it sleeps, it does not
spin on the worker's few CPUs) and announces it through a socket of its own; the engine's thread
only hands copies over, and at the step's end waits until every one is announced.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from ..store.layout import Chunk

Announce = Callable[[Chunk, int, float, int], None]  # (chunk, slot, squared norm, step)


@dataclass
class Copy:
    """A gradient copy on its way to a host slot: its squared norm lands with it."""

    chunk: Chunk
    slot: int
    step: int
    sq: torch.Tensor  # on the host once `landed` has completed
    landed: torch.cuda.Event | None  # None: already in host memory (CPU)
    buf: torch.Tensor  # the device gradient, kept alive until the copy has read it


class AnnouncerFailed(RuntimeError):
    """The announcing thread stopped on an error: the step cannot complete."""


class Announcer:
    """Runs `announce` for each copy handed over, in the order handed over, once its copy has landed."""

    def __init__(self, announce: Announce) -> None:
        self._announce = announce
        self._copies: deque[Copy | None] = deque()
        self._outstanding = 0  # handed over and not yet announced
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="grad-announcer", daemon=True)
        self._thread.start()

    def put(self, copy: Copy) -> None:
        with self._cond:
            self.check()
            self._outstanding += 1
            self._copies.append(copy)
            self._cond.notify_all()

    def check(self) -> None:
        """Raise the thread's failure, if it had one."""
        if self._error is not None:
            raise AnnouncerFailed(f"announcing a landed gradient failed: {type(self._error).__name__}: "
                                  f"{self._error}") from self._error

    def wait(self) -> None:
        """Until every copy handed over so far has landed and been announced."""
        with self._cond:
            while self._outstanding and self._error is None:
                self._cond.wait()
            self.check()

    def close(self, timeout_s: float = 10.0) -> None:
        """End the thread once it has announced what it holds (a copy that never lands: it is left, a daemon)."""
        with self._cond:
            self._copies.append(None)
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._copies:
                    self._cond.wait()
                copy = self._copies.popleft()
            if copy is None:
                return
            try:
                if copy.landed is not None:
                    copy.landed.synchronize()  # sleeps without the GIL until the copy is in host memory
                self._announce(copy.chunk, copy.slot, float(copy.sq), copy.step)
            except BaseException as e:  # the engine's thread raises it at its next hand-over or wait
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            del copy  # the device buffer may be reused once nothing holds it
            with self._cond:
                self._outstanding -= 1
                self._cond.notify_all()
