"""The launchers of a job on several hosts watching each other (docs/multi-host.md, Faults).

The launchers meet in torch.distributed's TCPStore at master_addr:master_port, which host 0's launcher
serves (nothing else listens: the ranks' process group is torch.distributed's too, at the next port).
Each launcher keeps there, from a thread:

- `hb/<R>`: its heartbeat, a counter it raises about every second from the moment it joins;
- `end/<R>`: how it ended, once it has: `done <seq>` or `failed <seq> <why>`, where seq orders the ends
  of every host (`ends`, a shared counter): the first host to fail is the one whose fault it was;
- `plan`: host 0's plan, which every host carries out (host_plan.py: their collectives must match);
- `ready/<R>`: the step it starts training at and what its job must share with the others' (host_plan.py),
  once its store and daemons are ready (the barrier before the workers start: every host's ranks then join
  their process group together).

`HostWatch` decides, from the time and what was read, which host to name: one that failed (the first),
one that never joined or whose heartbeat has not advanced for runtime.timeout_s, or host 0 when the store
stops answering. It does no I/O and reads no clock; `HostLink` is the thin part that talks to the store.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .host_plan import differences

log = logging.getLogger("slidedp.launcher")

BEAT_S = 1.0  # how often a launcher raises its heartbeat and reads the others'


def host_name(rank: int) -> str:
    return f"host {rank} (node rank {rank})"


@dataclass(frozen=True)
class Ended:
    """How a host's launcher ended, as it wrote in `end/<R>`."""

    ok: bool
    seq: int  # its place among every host's ends: the first failure is the cause of the others
    text: str = ""

    def encode(self) -> str:
        return f"{'done' if self.ok else 'failed'} {self.seq} {self.text}".rstrip()

    @classmethod
    def decode(cls, raw: str) -> "Ended":
        kind, seq, *text = raw.split(" ", 2)
        return cls(kind == "done", int(seq), text[0] if text else "")


@dataclass
class HostWatch:
    """Who of the other hosts is dead, from their heartbeats and ends: sans-IO, the time is passed in.

    A host is named when it failed (the first to fail, by its end's seq), when it has not joined
    `timeout_s` after this launcher began watching, or when its heartbeat has not advanced for
    `timeout_s` while the store answered. A host that ended well is never named. The store itself
    not answering for `timeout_s` (or its connection broken) names host 0, whose launcher serves it."""

    nnodes: int
    node_rank: int
    timeout_s: float
    began: float  # when this launcher began watching (a host not joined by began + timeout_s is named)
    rendezvous: str = ""  # "addr:port", for the messages
    beats: dict[int, int] = field(default_factory=dict)  # host -> the last heartbeat read
    changed: dict[int, float] = field(default_factory=dict)  # host -> when its heartbeat last advanced
    ended: dict[int, Ended] = field(default_factory=dict)
    answered: float = 0.0  # when the store last answered
    broken: str = ""  # the store's connection broke: the error (it is not retried)

    def __post_init__(self) -> None:
        self.answered = max(self.answered, self.began)

    @property
    def others(self) -> list[int]:
        return [r for r in range(self.nnodes) if r != self.node_rank]

    def saw(self, now: float, beats: dict[int, int], ended: dict[int, Ended]) -> None:
        """What one round of reading the store gave: every other host's heartbeat (0: not joined yet)
        and the ends written so far."""
        self.answered = now
        for r, value in beats.items():
            if value and value != self.beats.get(r):
                self.beats[r], self.changed[r] = value, now
        self.ended.update(ended)

    def lost(self, error: str) -> None:
        """The store's connection broke (the launcher serving it is gone): host 0 is named at once."""
        self.broken = self.broken or error

    def fault(self, now: float, before: int | None = None) -> str | None:
        """The other host to blame for the job's failure, in words; None while every host is well.
        before: only a failure ended before this seq counts (this host failed with it: a later failure of
        another host is one this host caused)."""
        failed = sorted((e.seq, r) for r, e in self.ended.items()
                        if not e.ok and r != self.node_rank and (before is None or e.seq < before))
        if failed:
            r = failed[0][1]
            return f"{host_name(r)} failed: {self.ended[r].text}"
        if self.node_rank != 0 and 0 not in self.ended:  # host 0 closes the store once it has ended
            if self.broken:
                return f"{host_name(0)} is gone: its launcher's rendezvous at {self.rendezvous} broke off ({self.broken})"
            if now - self.answered >= self.timeout_s:
                return (f"{host_name(0)} has not been heard from for {now - self.answered:.0f} s: its launcher's "
                        f"rendezvous at {self.rendezvous} does not answer")
        for r in self.others:
            if r in self.ended:
                continue
            last = self.changed.get(r)
            if last is None and self.answered - self.began >= self.timeout_s:
                return (f"{host_name(r)} did not join within {self.answered - self.began:.0f} s (runtime.timeout_s = "
                        f"{self.timeout_s:g}): is its slidedp-launch running with --master-addr/--master-port "
                        f"{self.rendezvous}?")
            if last is not None and self.answered - last >= self.timeout_s:
                return f"{host_name(r)} has not been heard from for {self.answered - last:.0f} s"
        return None

    def all_ended(self) -> bool:
        return all(r in self.ended for r in self.others)

    def settled(self) -> bool:
        """Every other host has ended or is lost (never joined, or silent for timeout_s): host 0 may close
        the store."""
        return all(r in self.ended or self.answered - self.changed.get(r, self.began) >= self.timeout_s
                   for r in self.others)

    def explain(self, now: float, own: str, seq: int | None, failed_at: float) -> str | None:
        """This host failed (`own`, its end's `seq`; None where the store could not take it) at `failed_at`:
        the job's failure in words once known, naming another host where one failed first or is dead
        (a worker blocked in a collective with a dead peer fails too), else `own`; None while it may still
        turn out to be another host's fault (bounded: timeout_s and a little after `failed_at`)."""
        other = self.fault(now, before=seq)
        if other:
            return f"{other}; on this host, after it: {own}"
        if self.all_ended() or now - failed_at >= self.timeout_s + 2 * BEAT_S:
            return own
        return None


class HostLink:
    """This launcher's place in the launchers' TCPStore: joins (or, on host 0, serves) it, beats and reads
    from a thread, and answers the launcher's questions from a HostWatch."""

    def __init__(self, nnodes: int, node_rank: int, addr: str, port: int, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        import torch.distributed as dist  # the launcher imports torch only on several hosts

        self.nnodes, self.node_rank, self.timeout_s, self.clock = nnodes, node_rank, timeout_s, clock
        self.where = f"{addr}:{port}"
        self.lock = threading.Lock()
        self.watch = HostWatch(nnodes, node_rank, timeout_s, clock(), self.where)
        self.own: tuple[str, int | None, float] | None = None  # this host's failure: (text, seq, when)
        self._stop = threading.Event()
        try:
            self.store = dist.TCPStore(addr, port, nnodes, node_rank == 0, datetime.timedelta(seconds=timeout_s),
                                       wait_for_workers=False)
        except Exception as e:  # noqa: BLE001 (torch's DistNetworkError, TimeoutError, RuntimeError)
            if node_rank == 0:
                raise RuntimeError(f"could not serve the launchers' rendezvous at {self.where}: {e}") from None
            raise RuntimeError(f"{host_name(0)} did not answer at {self.where} within {timeout_s:.0f} s "
                               f"(runtime.timeout_s): {e}") from None
        self.store.set_timeout(datetime.timedelta(seconds=min(timeout_s, 10.0)))
        self._beat()
        self.thread = threading.Thread(target=self._run, name="host-heartbeats", daemon=True)
        self.thread.start()
        log.info("host %d of %d: the launchers meet at %s (%s)", node_rank, nnodes, self.where,
                 "served here" if node_rank == 0 else "host 0's")

    # ---- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            self._beat()

    def _beat(self) -> None:
        with self.lock:
            if self.watch.broken:
                return
            try:
                self.store.add(f"hb/{self.node_rank}", 1)
                beats = {r: self.store.add(f"hb/{r}", 0) for r in self.watch.others}
                ended = {r: Ended.decode(self.store.get(f"end/{r}").decode())
                         for r in self.watch.others if r not in self.watch.ended and self.store.check([f"end/{r}"])}
            except Exception as e:  # noqa: BLE001 (DistNetworkError: broken; DistStoreError: timed out)
                error = str(e).splitlines()[0] if str(e) else type(e).__name__
                if not _timed_out(error):  # a broken connection: TCPStore does not reconnect
                    self.watch.lost(error)
                return
            self.watch.saw(self.clock(), beats, ended)

    # ---- the launcher's questions ---------------------------------------------------------------
    def fault(self) -> str | None:
        """Another host to blame, in words, while this host has not failed itself."""
        with self.lock:
            return None if self.own else self.watch.fault(self.clock())

    def share_plan(self, plan: str) -> None:
        """Host 0: the plan every host carries out (host_plan.SharedPlan as JSON), for the others to take."""
        with self.lock:
            self.store.set("plan", plan)

    def host0_plan(self, check: Callable[[], None]) -> str:
        """Host 0's plan (as share_plan gave it), once it has planned. Raises HostFault naming a host that fails or
        is lost meanwhile (host 0's own refusal of the job included); `check` raises on this host's own."""
        return self._wait(["plan"], check)[0]

    def ready(self, start: int, check: Callable[[], None], agreement: dict | None = None) -> None:
        """The barrier before the workers start: every host's store and daemons are ready, at the same step, with
        the same job (host_plan.agreement: the training settings, the model, the data, the plan). Raises HostFault
        naming a host that fails or is lost meanwhile, StepsDiffer or JobsDiffer where the hosts disagree;
        `check` raises on this host's own."""
        with self.lock:
            self.store.set(f"ready/{self.node_rank}", json.dumps({"step": start, "job": agreement or {}}))
        got = [json.loads(v) for v in self._wait([f"ready/{r}" for r in range(self.nnodes)], check)]
        steps = [g["step"] for g in got]
        if len(set(steps)) > 1:
            raise StepsDiffer("the hosts' stores are at different steps: " + ", ".join(
                f"{host_name(r)} at step {s}" for r, s in enumerate(steps)) + "; every host's store must "
                "be at the same committed step (restore them from the same checkpoint)")
        for r, g in enumerate(got[1:], start=1):
            differ = differences(g["job"], got[0]["job"])
            if differ:
                raise JobsDiffer(f"{host_name(r)}'s job differs from host 0's: {'; '.join(differ)}. Every host must "
                                 "run the same job file (its [train], model and data) with the same runtime.workers")

    def _wait(self, keys: list[str], check: Callable[[], None]) -> list[str]:
        """The values of `keys` in the store once all are set, watching the other hosts and this one meanwhile."""
        while True:
            fault = self.fault()
            if fault:
                raise HostFault(fault)
            check()
            with self.lock:
                try:
                    values = [v.decode() for v in self.store.multi_get(keys)] if self.store.check(keys) else None
                except Exception:  # noqa: BLE001 (the thread records a broken store)
                    values = None
            if values is not None:
                return values
            time.sleep(0.1)

    def failed(self, text: str) -> None:
        """This host failed: say so in `end/<R>` (the others name it at once), with its place among the ends."""
        seq = self._end(False, text)
        self.own = (text, seq, self.clock())

    def explain(self, text: str) -> str:
        """This host's failure in words for its log: another host's, where one failed first or is gone (waits
        up to about runtime.timeout_s to know), else `text`."""
        assert self.own is not None
        _, seq, at = self.own
        while True:
            with self.lock:
                out = self.watch.explain(self.clock(), text, seq, at)
            if out is not None:
                return out
            time.sleep(0.1)

    def close(self, ok: bool) -> None:
        """This launcher is done (ok) or has failed (already said): host 0 keeps the store up until every
        other host has ended or is lost (bounded by their heartbeats), so each can read how the others ended."""
        if ok:
            self._end(True, "")
        if self.node_rank == 0:
            deadline = self.clock() + 2 * self.timeout_s  # a guard only: the heartbeats bound the wait
            while self.clock() < deadline:
                with self.lock:
                    if self.watch.settled():
                        break
                time.sleep(0.1)
        self._stop.set()
        self.thread.join(5)

    def _end(self, ok: bool, text: str) -> int | None:
        with self.lock:
            if self.watch.broken:
                return None
            try:
                seq = int(self.store.add("ends", 1))
                self.store.set(f"end/{self.node_rank}", Ended(ok, seq, text.replace("\n", " ")).encode())
                return seq
            except Exception as e:  # noqa: BLE001
                error = str(e).splitlines()[0] if str(e) else type(e).__name__
                if not _timed_out(error):
                    self.watch.lost(error)
                log.warning("could not tell the other hosts how this one ended: %s", error)
                return None


def _timed_out(error: str) -> bool:
    """A store request that was not answered in time (the store is slow or unreachable), not a broken one."""
    return "timeout" in error.lower() or "timed out" in error.lower()


class HostFault(RuntimeError):
    """The job fails because of another host (the message names it)."""


class StepsDiffer(RuntimeError):
    """The hosts disagree (their stores' steps): nobody's fault in particular."""


class JobsDiffer(RuntimeError):
    """A host's job differs from host 0's (host_plan.agreement): the message names every difference."""
