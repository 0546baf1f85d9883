"""HostLink (launch/hosts.py) over a real TCPStore on loopback, two "launchers" in one process: the barrier
before the workers, a failure told to the other host, the ends, and a stall named from the progress each
publishes. Every wait is bounded; none is measured."""

from __future__ import annotations

import threading
import time

from slidedp.launch.host_progress import HostProgress
from slidedp.launch.hosts import HostLink, StepsDiffer

from pipeline.test_hosts import free_ports


def links(timeout_s: float = 20.0) -> tuple[HostLink, HostLink]:
    port = free_ports()
    zero = HostLink(2, 0, "127.0.0.1", port, timeout_s)
    return zero, HostLink(2, 1, "127.0.0.1", port, timeout_s)


def on_both(a: HostLink, b: HostLink, fn) -> list:
    """fn(i, link) on both links at once, each from its thread: what each returned, or what it raised."""
    out: list = [None, None]

    def run(i: int, link: HostLink) -> None:
        try:
            out[i] = fn(i, link)
        except Exception as e:  # noqa: BLE001
            out[i] = e

    threads = [threading.Thread(target=run, args=(i, link)) for i, link in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def both_ready(a: HostLink, b: HostLink, steps: tuple[int, int]) -> list:
    return on_both(a, b, lambda i, link: link.ready(steps[i], lambda: None) or "ready")


def until(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("not within the bound")


def test_ready_then_a_failure_is_named_on_the_other_host_and_both_close():
    zero, one = links()
    assert both_ready(zero, one, (3, 3)) == ["ready", "ready"]
    assert zero.fault() is None and one.fault() is None
    one.failed("slidedp-updater (pid 7) was killed by signal SIGKILL during step 3")
    assert until(zero.fault) == "host 1 (node rank 1) failed: slidedp-updater (pid 7) was killed by signal SIGKILL " \
                                "during step 3"
    assert one.fault() is None  # a host that failed itself blames nobody else
    zero.failed("host 1 (node rank 1) failed: ...")
    assert one.explain("slidedp-updater ...") == "slidedp-updater ..."  # it was first; the other ended after it
    one.close(ok=False)
    zero.close(ok=False)  # host 1 has ended: host 0 closes the store at once


def test_stores_at_different_steps_are_refused_naming_each_host():
    zero, one = links()
    try:
        out = both_ready(zero, one, (3, 5))
        for e in out:
            assert isinstance(e, StepsDiffer), out
            assert str(e).startswith("the hosts' stores are at different steps: host 0 (node rank 0) at step 3, "
                                     "host 1 (node rank 1) at step 5"), str(e)
    finally:
        one.close(ok=True)
        zero.close(ok=True)


def test_host_0_gone_is_named_by_host_1():
    zero, one = links()
    zero._stop.set()  # host 0's launcher dies: no more heartbeats, and its store goes with it
    zero.thread.join(5)
    zero.store = None
    assert until(one.fault).startswith("host 0 (node rank 0) is gone: its launcher's rendezvous at 127.0.0.1:")
    one.failed("worker rank 0 (pid 9) exited with code 1 during step 2")  # the store is gone: told to nobody
    assert one.explain("worker rank 0 (pid 9) exited with code 1 during step 2").startswith(
        "host 0 (node rank 0) is gone: ")
    one.close(ok=False)


def test_progress_is_published_beside_the_heartbeat_and_a_stall_is_named_on_both_hosts():
    """Host 1's ranks stay at collective 40 while host 0's wait in 41: host 0 names host 1, host 1 its own ranks."""
    zero, one = links(timeout_s=3.0)
    try:
        zero.progress_of = lambda: HostProgress(41, True, 1)
        one.progress_of = lambda: HostProgress(40, False, 1)
        assert until(zero.fault).startswith("host 1 (node rank 1) stalled: its ranks have not entered collective 41 "
                                            "(step 1), which the ranks of host 0 (node rank 0) have waited in for ")
        stall = until(one.stalled_here)
        assert (stall.host, stall.collective, stall.step, stall.ahead) == (1, 41, 1, (0,))
        assert one.fault() is None  # host 1 blames nobody else
    finally:
        one.close(ok=True)
        zero.close(ok=True)
