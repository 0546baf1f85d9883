"""Which host's ranks stay behind the others' in the collectives of a job on several hosts (docs/multi-host.md).

Every rank counts the collectives it enters in its progress file (slidedp/rank_progress.py); its launcher
publishes, beside its heartbeat, its host's progress (`pr/<R>`: the fewest collectives any of its ranks has
entered, whether one is inside a collective, and that rank's step). A host is behind while another host's
ranks have entered more collectives than its own; it has stalled once it has stayed behind, without its
ranks entering or leaving a collective, for runtime.timeout_s (the others' ranks have waited that long in a
collective it never entered: the group's timeout). Hosts' counts differ for moments in normal running, and
hosts all waiting in the same collective (a network stall) are behind nobody: neither is a stall.

`Laggards` decides from the time and the progress read: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from slidedp.rank_progress import RankProgress


def host_name(rank: int) -> str:
    return f"host {rank} (node rank {rank})"


@dataclass(frozen=True)
class HostProgress:
    """A host's ranks' progress through the job's collectives, as its launcher publishes it in `pr/<R>`."""

    entered: int  # the fewest collectives any of its ranks has entered
    inside: bool  # one of its ranks is inside a collective
    step: int  # the step of the rank that has entered the fewest

    def encode(self) -> str:
        return f"{self.entered} {int(self.inside)} {self.step}"

    @classmethod
    def decode(cls, raw: str) -> "HostProgress | None":
        """None for an empty value (the host's workers have not started)."""
        if not raw:
            return None
        entered, inside, step = raw.split()
        return cls(int(entered), inside == "1", int(step))

    @classmethod
    def of_ranks(cls, ranks: Sequence[RankProgress]) -> "HostProgress":
        least = min(ranks, key=lambda p: p.entered)
        return cls(least.entered, any(p.inside for p in ranks), least.step)


@dataclass(frozen=True)
class Stall:
    """A host whose ranks have not entered a collective that other hosts' ranks wait in."""

    host: int
    collective: int  # the first collective its ranks have not entered (1 is the job's first)
    step: int  # the step the hosts ahead are in
    waited_s: float  # how long the hosts ahead have been ahead of it, its ranks not moving
    ahead: tuple[int, ...]  # the hosts whose ranks have entered it

    def what(self) -> str:
        """'collective N (step S), which the ranks of host H (node rank H) have waited in for W s'"""
        who = (host_name(self.ahead[0]) if len(self.ahead) == 1
               else "hosts " + ", ".join(str(h) for h in self.ahead))
        return (f"collective {self.collective} (step {self.step}), which the ranks of {who} have waited in for "
                f"{self.waited_s:.0f} s")

    def describe(self) -> str:
        """The stall as another host names it."""
        return f"{host_name(self.host)} stalled: its ranks have not entered {self.what()}"


@dataclass
class Laggards:
    """Each host's progress as last read, and since when each host has been behind another."""

    timeout_s: float
    seen: dict[int, HostProgress] = field(default_factory=dict)
    behind_since: dict[int, float] = field(default_factory=dict)  # host -> first seen behind, not moving since

    def saw(self, now: float, progress: dict[int, HostProgress]) -> None:
        """The progress read at `now` (every host that has published it, this one too)."""
        for r, p in progress.items():
            old = self.seen.get(r)
            if old is None or (old.entered, old.inside) != (p.entered, p.inside):
                self.behind_since.pop(r, None)  # its ranks moved: any wait for them starts again
            self.seen[r] = p
        for r in self.seen:
            if self.ahead_of(r):
                self.behind_since.setdefault(r, now)
            else:
                self.behind_since.pop(r, None)

    def ahead_of(self, host: int) -> list[int]:
        """The hosts whose ranks have entered more collectives than `host`'s."""
        mine = self.seen.get(host)
        if mine is None:
            return []
        return [r for r, p in sorted(self.seen.items()) if r != host and p.entered > mine.entered]

    def behind(self, host: int, of: int) -> bool:
        """`host`'s ranks have entered fewer collectives than `of`'s."""
        return host in self.seen and of in self.seen and self.seen[of].entered > self.seen[host].entered

    def stall(self, host: int, now: float) -> Stall | None:
        """`host`'s stall, once it has stayed behind without moving for timeout_s."""
        since = self.behind_since.get(host)
        if since is None or now - since < self.timeout_s:
            return None
        ahead = self.ahead_of(host)
        mine = self.seen[host].entered
        nearest = min(ahead, key=lambda r: self.seen[r].entered)
        return Stall(host, mine + 1, self.seen[nearest].step, now - since, tuple(ahead))
