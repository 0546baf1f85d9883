"""The launchers of a job on several hosts watching each other (docs/multi-host.md, Faults).

The launchers meet in torch.distributed's TCPStore at master_addr:master_port, which host 0's launcher
serves (nothing else listens: the ranks' process group is torch.distributed's too, at the next port).
Each launcher keeps there, from a thread:

- `hb/<R>`: its heartbeat, a counter it raises about every second from the moment it joins;
- `pr/<R>`: its ranks' progress through the collectives, read from their progress files at each beat
  (launch/host_progress.py; empty until its workers start);
- `end/<R>`: how it ended, once it has: `done <seq>`, `failed <seq> <why>` or `stalled <seq> <why>` (its
  own ranks stalled), where seq orders the ends of every host (`ends`, a shared counter): the first host to
  fail is the one whose fault it was, unless another host's ranks stalled and it failed waiting for them;
- `plan`: host 0's plan, which every host carries out (host_plan.py: their collectives must match);
- `ready/<R>`: the step it starts training at and what its job must share with the others' (host_plan.py),
  once its store and daemons are ready (the barrier before the workers start: every host's ranks then join
  their process group together).

`HostWatch` decides, from the time and what was read, which host to name: one that failed (the first),
one that never joined or whose heartbeat has not advanced for runtime.timeout_s, one whose ranks stalled
outside the collectives the others' ranks wait in (host_progress.py), or host 0 when the store stops
answering; and whether this host's own ranks stalled. It does no I/O and reads no clock; `HostLink` is the
thin part that talks to the store.
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
from .host_progress import HostProgress, Laggards, Stall, host_name

log = logging.getLogger("slidedp.launcher")

BEAT_S = 1.0  # how often a launcher raises its heartbeat and reads the others'
LIVE_S = 3 * BEAT_S  # a host heard from this recently is alive: one silent longer is named silent, not stalled


@dataclass(frozen=True)
class Ended:
    """How a host's launcher ended, as it wrote in `end/<R>`."""

    ok: bool
    seq: int  # its place among every host's ends: the first failure is the cause of the others
    text: str = ""
    stalled: bool = False  # its own ranks stalled: the cause of the failures of the hosts that waited for them

    def encode(self) -> str:
        kind = "done" if self.ok else "stalled" if self.stalled else "failed"
        return f"{kind} {self.seq} {self.text}".rstrip()

    @classmethod
    def decode(cls, raw: str) -> "Ended":
        kind, seq, *text = raw.split(" ", 2)
        return cls(kind == "done", int(seq), text[0] if text else "", kind == "stalled")


@dataclass
class HostWatch:
    """Who of the other hosts is dead, from their heartbeats and ends: sans-IO, the time is passed in.

    A host is named when it failed (the first to fail, by its end's seq), when it has not joined
    `timeout_s` after this launcher began watching, when its heartbeat has not advanced for
    `timeout_s` while the store answered, or when its heartbeat beats on but its ranks have stayed
    behind the others' in the collectives for `timeout_s` (a stall: host_progress.py). A host that
    ended well is never named. The store itself not answering for `timeout_s` (or its connection
    broken) names host 0, whose launcher serves it.

    A host that failed while another host's ranks (or this host's) were behind its own is not named
    at once: it may have failed waiting in a collective for them (the group's timeout is `timeout_s`
    too). Their stall names them, or they catch up and it is named; either is known within `timeout_s`."""

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
    laggards: Laggards = field(init=False)  # every host's ranks' progress through the collectives, this one's too

    def __post_init__(self) -> None:
        self.answered = max(self.answered, self.began)
        self.laggards = Laggards(self.timeout_s)

    @property
    def others(self) -> list[int]:
        return [r for r in range(self.nnodes) if r != self.node_rank]

    def saw(self, now: float, beats: dict[int, int], ended: dict[int, Ended],
            progress: dict[int, HostProgress] | None = None) -> None:
        """What one round of reading the store gave: every other host's heartbeat (0: not joined yet),
        the ends written so far, and the progress of every host that has published it (this one's too)."""
        self.answered = now
        for r, value in beats.items():
            if value and value != self.beats.get(r):
                self.beats[r], self.changed[r] = value, now
        self.ended.update(ended)
        if progress:
            self.laggards.saw(now, progress)

    def lost(self, error: str) -> None:
        """The store's connection broke (the launcher serving it is gone): host 0 is named at once."""
        self.broken = self.broken or error

    def fault(self, now: float, before: int | None = None) -> str | None:
        """The other host to blame for the job's failure, in words; None while every host is well.
        before: only a failure ended before this seq counts (this host failed with it: a later failure of
        another host is one this host caused)."""
        failed = sorted((e.seq, r) for r, e in self.ended.items()  # a stall is the cause, whenever it was told
                        if not e.ok and r != self.node_rank and (e.stalled or before is None or e.seq < before))
        if failed:
            r = failed[0][1]
            if self.ended[r].stalled:
                return f"{host_name(r)} stalled: its {self.ended[r].text}"
            if not self._waited_for(r):
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
            stall = self.laggards.stall(r, now)
            if stall is not None and last is not None and self.answered - last < LIVE_S:
                return stall.describe()
        return None

    def stalled_here(self, now: float) -> Stall | None:
        """This host's own ranks stalled: they have stayed behind another host's in the collectives, not
        moving, for timeout_s (that host's ranks waited for them; it may have failed of it already)."""
        return self.laggards.stall(self.node_rank, now)

    def _waited_for(self, failed: int) -> bool:
        """A host still running (or this one) is behind the `failed` host's ranks: it may have failed waiting
        in a collective for that host's, which then is to blame once its stall is known."""
        return any(self.laggards.behind(r, of=failed)
                   for r in range(self.nnodes) if r != failed and (r == self.node_rank or r not in self.ended))

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
        # this host's ranks' progress, read at each beat once its workers run (set by the launcher)
        self.progress_of: Callable[[], HostProgress | None] | None = None
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
            own = self.progress_of() if self.progress_of is not None else None
            try:
                self.store.set(f"pr/{self.node_rank}", own.encode() if own else "")  # before the first beat: a
                self.store.add(f"hb/{self.node_rank}", 1)  # host that has joined has a pr/<R> to read
                beats = {r: self.store.add(f"hb/{r}", 0) for r in self.watch.others}
                ended = {r: Ended.decode(self.store.get(f"end/{r}").decode())
                         for r in self.watch.others if r not in self.watch.ended and self.store.check([f"end/{r}"])}
                joined = [r for r in self.watch.others if beats[r]]
                raw = self.store.multi_get([f"pr/{r}" for r in joined]) if joined else []
            except Exception as e:  # noqa: BLE001 (DistNetworkError: broken; DistStoreError: timed out)
                error = str(e).splitlines()[0] if str(e) else type(e).__name__
                if not _timed_out(error):  # a broken connection: TCPStore does not reconnect
                    self.watch.lost(error)
                return
            progress = {r: p for r, v in zip(joined, raw) if (p := HostProgress.decode(v.decode())) is not None}
            if own is not None:
                progress[self.node_rank] = own
            self.watch.saw(self.clock(), beats, ended, progress)

    # ---- the launcher's questions ---------------------------------------------------------------
    def fault(self) -> str | None:
        """Another host to blame, in words, while this host has not failed itself."""
        with self.lock:
            return None if self.own else self.watch.fault(self.clock())

    def stalled_here(self) -> Stall | None:
        """This host's own ranks stalled behind another host's, while this host has not failed otherwise."""
        with self.lock:
            return None if self.own else self.watch.stalled_here(self.clock())

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

    def failed(self, text: str, stalled: bool = False) -> None:
        """This host failed: say so in `end/<R>` (the others name it at once), with its place among the ends.
        stalled: its own ranks stalled (`text` names them), which the others name whatever its place."""
        seq = self._end(False, text, stalled)
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

    def _end(self, ok: bool, text: str, stalled: bool = False) -> int | None:
        with self.lock:
            if self.watch.broken:
                return None
            try:
                seq = int(self.store.add("ends", 1))
                self.store.set(f"end/{self.node_rank}", Ended(ok, seq, text.replace("\n", " "), stalled).encode())
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
