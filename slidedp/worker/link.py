"""The worker's links to the other processes: the aggregator (versions, gradient slots, loss
agreement, the global norm) and the launcher (per-step stats, the hold at a checkpoint).

`WorkerLink` is what the engine waits on; any wait that runs past runtime.timeout_s raises an
error naming the peer it was waiting for, and a stop asked for meanwhile ends it at once.
"""

from __future__ import annotations

import time
from typing import Callable

import zmq

from .. import log as slog
from ..model.router_aux import RoutingShare
from ..protocol import (SLOT_DEVICE, Control, Credit, Go, Grad, Loss, Message, Norm, Ready, Routing, RoutingTotal,
                        WorkerStats)
from ..stopflag import StopFlag
from ..store.layout import Chunk, Unit
from ..store.rings import GradRings
from ..store.store import HostStore
from ..transport import PeerTimeout, recv_dealer, send
from ..tracing import NULL

log = slog.get("worker")


class WorkerStopped(RuntimeError):
    """SIGTERM arrived while the worker waited on a peer: stop now rather than after the wait."""


class WorkerLink:
    """The engine's view of the rest of the system: versions, slots, gradient announcements, loss agreement."""

    def __init__(self, store: HostStore, rings: GradRings, rank: int, agg: zmq.Socket, timeout_s: float,
                 grads: zmq.Socket | None = None) -> None:
        self.store, self.rings, self.rank, self.agg = store, rings, rank, agg
        # the announcer's thread sends each landed gradient's Grad on a socket of its own (announcer.py)
        self.grads = grads if grads is not None else agg
        self.timeout_s = timeout_s
        self.free_slots = list(range(rings.slots))
        self.go: dict[int, Go] = {}
        self.norms: dict[int, float] = {}
        self.routing: dict[int, tuple[float, ...]] = {}  # step -> the ranks' summed router statistics
        self.waits = {"version": 0.0, "slot": 0.0, "loss": 0.0}
        self.tracer = NULL
        self.step = -1
        self.stop = StopFlag()  # the shell's: SIGTERM sets it

    def pump(self, timeout_ms: int) -> None:
        if not self.agg.poll(timeout_ms):
            return
        while True:
            msg = recv_dealer(self.agg, (Credit, Go, Ready, Norm, RoutingTotal))
            if isinstance(msg, Credit):
                if msg.rank != self.rank or msg.slot >= self.rings.slots or msg.slot in self.free_slots:
                    log.warning("dropped a bad credit %s", msg)
                else:
                    self.free_slots.append(msg.slot)
            elif isinstance(msg, Go):
                self.go[msg.step] = msg
            elif isinstance(msg, Norm):
                self.norms[msg.step] = msg.grad_norm
            elif isinstance(msg, RoutingTotal):
                self.routing[msg.step] = msg.values
            if not self.agg.poll(0):
                return

    def _wait(self, done, what: str, kind: str, while_waiting: Callable[[], None] | None = None) -> None:
        t0 = time.perf_counter()
        wall0 = time.time()
        deadline = time.monotonic() + self.timeout_s
        while not done():
            if self.stop.requested:
                raise WorkerStopped(f"rank {self.rank} stopped (SIGTERM) while waiting for {what}")
            if time.monotonic() > deadline:
                raise PeerTimeout(f"rank {self.rank} waited {self.timeout_s:.0f} s for {what}; "
                                  f"raise runtime.timeout_s if the host is merely slow")
            if while_waiting is not None:
                while_waiting()
            self.pump(20)
        self.waits[kind] += time.perf_counter() - t0
        self.tracer.event(f"wait {kind}", "wait", self.step, wall0, time.time(), what=what)

    def wait_ready(self, unit: Unit, step: int) -> None:
        versions = self.store.manifest.versions
        ids = [c.id for c in unit.chunks]

        def ready() -> bool:
            return all(versions[i] >= step for i in ids)

        if not ready():
            self._wait(ready, f"{unit.name} (chunks {ids[0]}..{ids[-1]}) to reach version {step} "
                              f"(the updater pool, slidedp-updater, has not updated it)", "version")

    def acquire_slot(self, while_waiting: Callable[[], None] = lambda: None) -> int:
        if not self.free_slots:
            self._wait(lambda: bool(self.free_slots),
                       "a free gradient slot (the aggregator, slidedp-aggregator, returned none)", "slot", while_waiting)
        return self.free_slots.pop(0)

    def grad_landed(self, chunk: Chunk, slot: int, sqnorm: float, step: int) -> None:
        """Called from the announcer's thread only: its own socket."""
        send(self.grads, Grad(self.rank, chunk.id, step, slot, sqnorm))

    def device_grad(self, chunk: Chunk, sqnorm: float, step: int) -> None:
        send(self.agg, Grad(self.rank, chunk.id, step, SLOT_DEVICE, sqnorm))

    def wait_norm(self, step: int) -> float:
        self._wait(lambda: step in self.norms, f"the global gradient norm of step {step} (from the aggregator)", "slot")
        return self.norms.pop(step)

    def norms_reported(self, step: int) -> None:
        """One host: the aggregator's sum of the reported norms is the step's (HostsLink adds the hosts')."""

    def agree_loss(self, step: int, loss_sum: float, tokens: int, finite: bool,
                   routing: RoutingShare | None = None) -> bool:
        if routing is not None:  # before the Loss: the aggregator has every rank's when the last Loss comes
            send(self.agg, Routing(self.rank, step, routing.coef, routing.values))
        send(self.agg, Loss(self.rank, step, loss_sum if finite else 0.0, tokens, int(finite)))
        self._wait(lambda: step in self.go, f"the other ranks' loss of step {step} (via the aggregator)", "loss")
        return bool(self.go.pop(step).skip)

    def routing_total(self, step: int) -> tuple[float, ...]:
        """The router statistics of every rank, summed: they came just before the step's Go."""
        values = self.routing.pop(step, None)
        if values is None:
            raise RuntimeError(f"rank {self.rank}: the aggregator sent step {step}'s Go without the ranks' router "
                               "statistics (an aggregator of an older SlideDP?)")
        return values


class LauncherLink:
    """The worker's socket to the launcher: per-step stats out, stop/continue orders in."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock

    def stats(self, stats: WorkerStats) -> None:
        send(self.sock, stats)

    def send(self, msg: Message) -> None:
        """Anything else for the launcher (an EvalLoss before the step's stats)."""
        send(self.sock, msg)

    def control(self, timeout_ms: int) -> Control | None:
        """The launcher's next order, if one arrives within `timeout_ms`."""
        if not self.sock.poll(timeout_ms):
            return None
        msg = recv_dealer(self.sock, (Control,))
        return msg if isinstance(msg, Control) else None
