"""A daemon's wait ends at its stop signal: the signal's byte in the stop flag's wake pipe ends the poll
(`poll_or_stop`) or the socketless nap (`StopFlag.sleep`, the updater pool's), so a stop is not held up by
the rest of the wait. Real signals to this process, a real
ZeroMQ socket; what proves the wake path is the pipe found and emptied, not how long the call took (a
poll that missed it would wait out its minute and leave the byte in the pipe)."""

from __future__ import annotations

import os
import signal

import pytest
import zmq

from slidedp.daemons.loop import poll_or_stop
from slidedp.stopflag import stop_on

MINUTE_MS = 60_000


@pytest.fixture
def flag_and_socket(tmp_path):
    """stop_on(SIGUSR1) for this test (its handler and the process's wakeup fd put back after), and a
    PULL socket with a PUSH peer."""
    old_handler = signal.getsignal(signal.SIGUSR1)
    stop = stop_on(signal.SIGUSR1)
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    addr = f"ipc://{tmp_path}/s"
    pull.bind(addr)
    push.connect(addr)
    try:
        yield stop, pull, push
    finally:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGUSR1, old_handler)
        os.close(stop.wake_fd)
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


def _pipe_is_empty(fd: int) -> bool:
    try:
        os.read(fd, 1)
    except BlockingIOError:
        return True
    return False


def test_a_signal_ends_the_wait_and_sets_the_flag(flag_and_socket):
    stop, pull, _ = flag_and_socket
    assert stop.wake_fd >= 0 and not stop.requested
    os.kill(os.getpid(), signal.SIGUSR1)  # handled, and its byte written to the wake pipe, before the poll
    assert poll_or_stop(pull, stop, MINUTE_MS) is False  # no message: the signal ended the wait
    assert stop.requested
    assert _pipe_is_empty(stop.wake_fd)  # drained: the next wait does not end at once on the old byte


def test_a_message_is_still_reported_and_the_flag_left_alone(flag_and_socket):
    stop, pull, push = flag_and_socket
    push.send(b"x")
    assert poll_or_stop(pull, stop, MINUTE_MS) is True
    assert pull.recv() == b"x" and not stop.requested
    # a zero timeout is a plain poll (the member's turn with work in hand)
    assert poll_or_stop(pull, stop, 0) is False


def test_a_signal_ends_a_socketless_sleep(flag_and_socket):
    stop, _, _ = flag_and_socket
    assert stop.sleep(0) is False and not stop.requested  # nothing arrived: a plain (zero) wait
    os.kill(os.getpid(), signal.SIGUSR1)
    assert stop.sleep(MINUTE_MS / 1000) is True  # the signal ended the minute
    assert stop.requested and _pipe_is_empty(stop.wake_fd)
