"""HostWatch (launch/hosts.py): which host the launchers of a job on several hosts name, from the time and
the heartbeats and ends read. Numbers only: no store, no clock, no sleep."""

from __future__ import annotations

from slidedp.launch.hosts import Ended, HostWatch

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
