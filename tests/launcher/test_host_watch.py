"""HostWatch (launch/hosts.py): which host the launchers of a job on several hosts name, from the time and
the heartbeats, ends and ranks' progress read. Numbers only: no store, no clock, no sleep."""

from __future__ import annotations

from slidedp.launch.host_progress import HostProgress, Stall
from slidedp.launch.hosts import Ended, HostWatch
from slidedp.rank_progress import RankProgress

T = 15.0  # runtime.timeout_s


def watch(nnodes: int = 3, rank: int = 0, began: float = 100.0) -> HostWatch:
    return HostWatch(nnodes, rank, T, began, "10.0.0.1:29500")


def test_hosts_that_beat_are_well():
    w = watch()
    for t in range(100, 200):
        w.saw(t, {1: t, 2: t}, {})
        assert w.fault(t) is None


def test_a_host_that_never_joins_is_named_after_the_timeout():
    w = watch()
    for t in range(100, 115):
        w.saw(t, {1: t - 99, 2: 0}, {})
        assert w.fault(t) is None, t
    w.saw(115, {1: 16, 2: 0}, {})
    assert w.fault(115) == ("host 2 (node rank 2) did not join within 15 s (runtime.timeout_s = 15): is its "
                            "slidedp-launch running with --master-addr/--master-port 10.0.0.1:29500?")


def test_a_host_whose_heartbeat_stops_is_named_after_the_timeout():
    w = watch()
    w.saw(100, {1: 1, 2: 1}, {})
    w.saw(110, {1: 11, 2: 7}, {})  # host 2 last advanced at 110
    for t in range(111, 125):
        w.saw(t, {1: t - 99, 2: 7}, {})
        assert w.fault(t) is None, t
    w.saw(125, {1: 26, 2: 7}, {})
    assert w.fault(125) == "host 2 (node rank 2) has not been heard from for 15 s"


def test_silence_counts_only_while_the_store_answers():
    """A launcher that could not read the store (busy, slow) does not blame the hosts it could not read."""
    w = watch(rank=0)
    w.saw(100, {1: 1, 2: 1}, {})
    w.saw(114, {1: 2, 2: 1}, {})
    assert w.fault(200) is None  # nothing read since 114: host 2 silent for 14 s as far as known
    w.saw(201, {1: 3, 2: 1}, {})
    assert w.fault(201) == "host 2 (node rank 2) has not been heard from for 101 s"


def test_the_first_host_to_fail_is_named_with_its_reason():
    w = watch()
    w.saw(100, {1: 1, 2: 1}, {2: Ended(False, 1, "slidedp-updater (pid 7) was killed by signal SIGKILL during step 3"),
                              1: Ended(False, 2, "host 2 (node rank 2) failed: ...")})
    assert w.fault(100) == ("host 2 (node rank 2) failed: slidedp-updater (pid 7) was killed by signal SIGKILL "
                            "during step 3")


def test_a_host_that_ended_well_is_never_named():
    w = watch()
    w.saw(100, {1: 1, 2: 1}, {})
    w.saw(101, {1: 2, 2: 2}, {1: Ended(True, 1)})
    for t in range(102, 300, 7):
        w.saw(t, {1: 2, 2: t}, {})
        assert w.fault(t) is None
    assert not w.all_ended() and not w.settled()
    w.saw(300, {1: 2, 2: 300}, {2: Ended(True, 2)})
    assert w.all_ended() and w.settled()


def test_host_0_is_named_when_its_store_stops_answering_or_breaks():
    w = watch(rank=1)
    w.saw(100, {0: 1, 2: 1}, {})
    assert w.fault(114) is None
    assert w.fault(115) == ("host 0 (node rank 0) has not been heard from for 15 s: its launcher's rendezvous "
                            "at 10.0.0.1:29500 does not answer")
    w = watch(rank=1)
    w.saw(100, {0: 1, 2: 1}, {})
    w.lost("Broken pipe")
    assert w.fault(100) == ("host 0 (node rank 0) is gone: its launcher's rendezvous at 10.0.0.1:29500 broke off "
                            "(Broken pipe)")


def test_host_0_closing_the_store_after_its_end_is_not_a_fault():
    w = watch(rank=1)
    w.saw(100, {0: 1, 2: 1}, {0: Ended(True, 1), 2: Ended(True, 2)})
    w.lost("Broken pipe")
    assert w.fault(500) is None


def test_host_0_ignores_the_store_itself():
    w = watch(rank=0)
    w.lost("should not happen: host 0 serves it")
    w.saw(100, {1: 1, 2: 1}, {})
    assert w.fault(100) is None


def test_own_failure_names_a_host_that_failed_before_it():
    w = watch(rank=0)
    w.saw(100, {1: 1, 2: 1}, {1: Ended(False, 1, "slidedp-updater (pid 7) was killed by signal SIGKILL")})
    assert w.explain(100, "worker rank 0 (pid 9) exited with code 1 during step 2", 2, 100) == (
        "host 1 (node rank 1) failed: slidedp-updater (pid 7) was killed by signal SIGKILL; on this host, after "
        "it: worker rank 0 (pid 9) exited with code 1 during step 2")


def test_own_failure_first_stands_once_the_others_have_ended():
    """This host failed first (seq 1); the others failed after it, because of it: it names itself."""
    w = watch(rank=0)
    w.saw(100, {1: 1, 2: 1}, {})
    own = "slidedp-updater (pid 7) was killed by signal SIGKILL during step 2"
    assert w.explain(100, own, 1, 100) is None  # the others may yet turn out to have failed first
    w.saw(101, {1: 2, 2: 2}, {1: Ended(False, 2, "host 0 (node rank 0) failed: ...")})
    assert w.explain(101, own, 1, 100) is None
    w.saw(102, {1: 2, 2: 3}, {2: Ended(False, 3, "host 0 (node rank 0) failed: ...")})
    assert w.explain(102, own, 1, 100) == own


def test_own_failure_waits_for_a_silent_host_then_names_it():
    """A worker in a collective with a dead host fails at once (its peer's sockets close); the launcher waits
    until the dead host's silence is known and names it, not its own worker."""
    w = watch(nnodes=2, rank=0)
    w.saw(100, {1: 50}, {})  # host 1's launcher was killed just after its beat at 100
    own = "worker rank 0 (pid 9) exited with code 1 during step 2"
    for t in range(101, 115):
        w.saw(t, {1: 50}, {})
        assert w.explain(t, own, 1, 101) is None, t
    w.saw(115, {1: 50}, {})
    assert w.explain(115, own, 1, 101) == ("host 1 (node rank 1) has not been heard from for 15 s; on this host, "
                                           "after it: " + own)


def test_own_failure_stands_after_the_bound_if_nobody_is_to_blame():
    w = watch(nnodes=2, rank=0)
    own = "worker rank 0 (pid 9) exited with code 1 during step 2"
    for t in range(100, 117):
        w.saw(t, {1: t}, {})  # host 1 beats on but never ends
        assert w.explain(t, own, 1, 100) is None, t
    w.saw(117, {1: 117}, {})
    assert w.explain(117, own, 1, 100) == own


def test_ends_round_trip():
    for e in (Ended(True, 3), Ended(False, 1, "a b: c"), Ended(False, 2)):
        assert Ended.decode(e.encode()) == e


# ---- stalls: a host whose launcher beats on but whose ranks stay behind in the collectives --------------
def P(entered: int, inside: bool = False, step: int = 1) -> HostProgress:
    return HostProgress(entered, inside, step)


def beat(w: HostWatch, t: float, progress: dict[int, HostProgress], ended: dict[int, Ended] | None = None) -> None:
    """Every host beats at t; `progress` as published (this host's own included)."""
    w.saw(t, {r: int(t) for r in w.others}, ended or {}, progress)


STALL_1 = ("host 1 (node rank 1) stalled: its ranks have not entered collective 41 (step 1), which the ranks of "
           "host 0 (node rank 0) have waited in for 15 s")


def test_a_host_whose_ranks_stay_behind_is_named_stalled_after_the_timeout():
    """Host 1's worker hangs in compute after collective 40; host 0's ranks enter 41 and wait there."""
    w = watch(nnodes=2, rank=0)
    for t in range(100, 110):  # running together
        beat(w, t, {0: P(2 * t), 1: P(2 * t)})
    for t in range(110, 125):
        beat(w, t, {0: P(41, inside=True), 1: P(40)})
        assert w.fault(t) is None, t
    beat(w, 125, {0: P(41, inside=True), 1: P(40)})
    assert w.fault(125) == STALL_1


def test_a_stall_is_named_in_place_of_this_hosts_own_failure():
    """Host 0's worker times out in collective 41 (the group's timeout) before its launcher has seen the stall
    whole: its launcher names host 1's stall, then its own failure after it."""
    w = watch(nnodes=2, rank=0)
    own = "worker rank 0 (pid 9) exited with code 1 during step 1"
    beat(w, 110, {0: P(41, inside=True), 1: P(40)})
    for t in range(111, 125):
        beat(w, t, {0: P(41, inside=True), 1: P(40)})
        assert w.explain(t, own, 1, 124) is None, t  # failed at 124 (its ranks entered at 109.5)
    beat(w, 125, {0: P(41, inside=True), 1: P(40)})
    assert w.explain(125, own, 1, 124) == f"{STALL_1}; on this host, after it: {own}"


def test_a_stalled_hosts_end_names_it_whatever_its_place():
    """Host 1's launcher saw its own ranks stall first and ended after host 0's failure: host 0 names host 1."""
    w = watch(nnodes=2, rank=0)
    own = "worker rank 0 (pid 9) exited with code 1 during step 1"
    beat(w, 110, {0: P(41, inside=True), 1: P(40)})
    stalled = Ended(False, 2, "worker rank 0 (pid 7) has not entered collective 41 (step 1), which the ranks of "
                              "host 0 (node rank 0) have waited in for 15 s", stalled=True)
    beat(w, 120, {0: P(41, inside=True), 1: P(40)}, {1: stalled})
    assert w.explain(120, own, 1, 119) == ("host 1 (node rank 1) stalled: its worker rank 0 (pid 7) has not entered "
                                           "collective 41 (step 1), which the ranks of host 0 (node rank 0) have "
                                           f"waited in for 15 s; on this host, after it: {own}")


def test_the_stalled_host_blames_its_own_ranks_not_the_host_that_waited_for_them():
    w = watch(nnodes=2, rank=1)
    beat(w, 110, {0: P(41, inside=True), 1: P(40)})
    waited = Ended(False, 1, "worker rank 0 (pid 9) exited with code 1 during step 1")
    for t in range(111, 125):
        beat(w, t, {0: P(41, inside=True), 1: P(40)}, {0: waited} if t >= 120 else {})
        assert w.fault(t) is None, t  # host 0 failed waiting for this host's ranks: not its fault
        assert w.stalled_here(t) is None, t
    beat(w, 125, {0: P(41, inside=True), 1: P(40)})
    assert w.fault(125) is None
    assert w.stalled_here(125) == Stall(1, 41, 1, 15.0, (0,))
    own = "this host's ranks stalled: worker rank 0 (pid 7) has not entered ..."
    assert w.explain(125, own, 2, 125) == own  # host 0 has ended: nobody else to blame


def test_a_host_that_failed_while_ahead_is_named_once_the_others_catch_up():
    """Host 0's updater was killed while its ranks were one collective ahead of this host's (momentarily): it
    is not named while this host's ranks might have been its cause, and is as soon as they move on."""
    w = watch(nnodes=2, rank=1)
    killed = Ended(False, 1, "slidedp-updater (pid 7) was killed by signal SIGKILL during step 1")
    beat(w, 110, {0: P(41, inside=True), 1: P(40)}, {0: killed})
    assert w.fault(110) is None
    beat(w, 111, {0: P(41, inside=True), 1: P(41, inside=True)})
    assert w.fault(111) == "host 0 (node rank 0) failed: " + killed.text


def test_hosts_whose_counts_differ_while_they_move_are_never_named():
    """In normal running one host's ranks enter a collective before another's: the one behind keeps moving."""
    w = watch(nnodes=3, rank=0)
    for t in range(100, 400):
        beat(w, t, {0: P(3 * t + 2), 1: P(3 * t, inside=True), 2: P(3 * t + 1)})  # always behind, never still
        assert w.fault(t) is None and w.stalled_here(t) is None, t
    for t in range(400, 500):  # a slow host: behind, its count moving every 10 s only
        beat(w, t, {0: P(2000, inside=True), 1: P(2000, inside=True), 2: P(1990 + (t - 400) // 10)})
        assert w.fault(t) is None, t


def test_hosts_all_waiting_in_the_same_collective_name_nobody():
    """A network stall: every host's ranks wait in collective 41, for ever: nobody is behind."""
    for rank in (0, 1):
        w = watch(nnodes=3, rank=rank)
        for t in range(100, 300):
            beat(w, t, {0: P(41, inside=True), 1: P(41, inside=True), 2: P(41, inside=True)})
            assert w.fault(t) is None and w.stalled_here(t) is None, t


def test_a_silent_host_behind_is_named_silent_not_stalled():
    """A host whose launcher was killed while its ranks were behind: its heartbeat stops too."""
    w = watch(nnodes=2, rank=0)
    w.saw(100, {1: 1}, {}, {0: P(41, inside=True), 1: P(40)})
    for t in range(101, 115):
        w.saw(t, {1: 1}, {}, {0: P(41, inside=True)})
        assert w.fault(t) is None, t
    w.saw(115, {1: 1}, {}, {0: P(41, inside=True)})
    assert w.fault(115) == "host 1 (node rank 1) has not been heard from for 15 s"


def test_progress_round_trips_and_a_host_counts_its_slowest_rank():
    for p in (P(0), P(41, inside=True, step=3)):
        assert HostProgress.decode(p.encode()) == p
    assert HostProgress.decode("") is None
    ranks = [RankProgress(41, 40, 1), RankProgress(40, 40, 1), RankProgress(42, 41, 2)]
    assert HostProgress.of_ranks(ranks) == HostProgress(40, True, 1)
    assert Ended.decode(Ended(False, 2, "worker rank 0 ...", stalled=True).encode()) == Ended(False, 2,
                                                                                            "worker rank 0 ...", True)
