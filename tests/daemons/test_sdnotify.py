"""sd_notify against a real AF_UNIX datagram socket standing in for systemd."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import pytest

from slidedp.daemons import sdnotify

_ENV_KEYS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")

# A daemon-like child: readiness, then a watchdog loop for 0.5 s plus one call after it,
# which is at least one period after the first ping, so at least two pings are sent.
_CHILD = """
import sys, time
from slidedp.daemons import sdnotify
assert sdnotify.notify("READY=1", "STATUS=x")
wd = sdnotify.Watchdog()
start = time.monotonic()
while time.monotonic() < start + 0.5:
    wd.maybe_ping()
    time.sleep(0.005)
wd.maybe_ping()
print(wd.period, time.monotonic() - start)
"""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in _ENV_KEYS:
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def path_socket(tmp_path: Path):
    """A bound datagram socket and its path (kept under the 108-byte sun_path limit)."""
    directory = tmp_path if len(str(tmp_path)) < 90 else Path(tempfile.mkdtemp(prefix="sdn"))
    path = str(directory / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.setblocking(False)
    yield sock, path
    sock.close()


@pytest.fixture
def abstract_socket():
    name = f"slidedp-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.setblocking(False)
    yield sock, "@" + name
    sock.close()


def drain(sock: socket.socket) -> list[bytes]:
    out = []
    while True:
        try:
            out.append(sock.recv(4096))
        except BlockingIOError:
            return out


def run_child(notify_socket: str, **env: str) -> tuple[float | None, float]:
    """Run _CHILD; returns its Watchdog period (None when disabled) and its loop's duration."""
    child_env = {k: v for k, v in os.environ.items() if k not in _ENV_KEYS}
    child_env.update(NOTIFY_SOCKET=notify_socket, **env)
    done = subprocess.run([sys.executable, "-c", _CHILD], env=child_env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    period, elapsed = done.stdout.split()
    return (None if period == "None" else float(period)), float(elapsed)


@pytest.mark.parametrize("kind", ["path", "abstract"])
def test_child_daemon_reports_ready_and_pings_watchdog(kind, path_socket, abstract_socket) -> None:
    sock, address = path_socket if kind == "path" else abstract_socket
    period, elapsed = run_child(address, WATCHDOG_USEC="200000")
    assert period == 0.1
    # Datagrams from the exited child are all queued already: read them without waiting.
    messages = drain(sock)
    assert messages[0] == b"READY=1\nSTATUS=x"
    pings = messages[1:]
    assert set(pings) == {b"WATCHDOG=1"}
    # At least two pings, and never more often than every period (interval / 2).
    assert 2 <= len(pings) <= int(elapsed / period) + 1


def test_child_with_foreign_watchdog_pid_does_not_ping(path_socket) -> None:
    # What an updater-pool child sees: WATCHDOG_PID names its parent, the one systemd watches.
    sock, address = path_socket
    period, _ = run_child(address, WATCHDOG_USEC="200000", WATCHDOG_PID=str(os.getpid()))
    assert period is None
    assert drain(sock) == [b"READY=1\nSTATUS=x"]


def test_notify_sends_one_datagram(path_socket, monkeypatch: pytest.MonkeyPatch) -> None:
    sock, address = path_socket
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    assert sdnotify.notify("STATUS=attached to store demo, step 7") is True
    assert sdnotify.notify("STOPPING=1") is True
    assert drain(sock) == [b"STATUS=attached to store demo, step 7", b"STOPPING=1"]


def test_unset_notify_socket_returns_false(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="slidedp.daemons.sdnotify"):
        assert sdnotify.notify("READY=1") is False
    assert caplog.records == []


def test_unreachable_socket_returns_false_with_warning(tmp_path: Path, monkeypatch, caplog) -> None:
    missing = str(tmp_path / "gone.sock")
    monkeypatch.setenv("NOTIFY_SOCKET", missing)
    with caplog.at_level(logging.WARNING, logger="slidedp.daemons.sdnotify"):
        assert sdnotify.notify("READY=1") is False
    assert len(caplog.records) == 1
    assert caplog.records[0].getMessage().startswith(f"could not notify systemd at NOTIFY_SOCKET={missing!r}: ")


def test_unsupported_address_returns_false(monkeypatch, caplog) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")
    with caplog.at_level(logging.WARNING, logger="slidedp.daemons.sdnotify"):
        assert sdnotify.notify("READY=1") is False
    assert caplog.records[0].getMessage() == (
        "NOTIFY_SOCKET='vsock:2:1234' is neither a path nor an '@' abstract name; not notifying systemd"
    )


def test_bad_states_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"^notify\(\) needs at least one state, e.g. notify\('READY=1'\)$"):
        sdnotify.notify()
    with pytest.raises(ValueError) as err:
        sdnotify.notify("READY=1", "STATUS=two\nlines")
    assert str(err.value) == "sd_notify state 'STATUS=two\\nlines' must be one line of the form KEY=VALUE"
    with pytest.raises(ValueError, match="must be one line of the form KEY=VALUE"):
        sdnotify.notify("READY")


@pytest.mark.parametrize(
    "usec, pid, expected",
    [
        (None, None, None),
        ("30000000", None, 30.0),
        ("200000", "self", 0.2),
        ("200000", "parent", None),
        ("200000", "garbage", None),
        ("0", None, None),
        ("-5", None, None),
        ("1.5", None, None),
    ],
)
def test_watchdog_interval(usec, pid, expected, monkeypatch: pytest.MonkeyPatch) -> None:
    if usec is not None:
        monkeypatch.setenv("WATCHDOG_USEC", usec)
    if pid is not None:
        monkeypatch.setenv("WATCHDOG_PID", {"self": str(os.getpid()), "parent": str(os.getppid())}.get(pid, pid))
    assert sdnotify.watchdog_interval() == expected


def test_watchdog_pings_at_half_interval(path_socket, monkeypatch: pytest.MonkeyPatch) -> None:
    sock, address = path_socket
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    monkeypatch.setenv("WATCHDOG_USEC", "500000")
    clock = [0.0]
    monkeypatch.setattr(sdnotify.time, "monotonic", lambda: clock[0])
    wd = sdnotify.Watchdog()
    assert wd.enabled and wd.period == 0.25
    sent = []
    # Binary-exact times: first call pings, then a ping once a full period has passed.
    for now in (100.0, 100.125, 100.25, 100.375, 100.4375, 100.5, 103.0, 103.125, 103.25):
        clock[0] = now
        wd.maybe_ping()
        sent.append(drain(sock))
    assert sent == [[b"WATCHDOG=1"], [], [b"WATCHDOG=1"], [], [], [b"WATCHDOG=1"], [b"WATCHDOG=1"], [], [b"WATCHDOG=1"]]


def test_watchdog_disabled_without_usec(path_socket, monkeypatch: pytest.MonkeyPatch) -> None:
    sock, address = path_socket
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    wd = sdnotify.Watchdog()
    assert not wd.enabled and wd.period is None
    wd.maybe_ping()
    assert drain(sock) == []


def test_keepalive_pings_from_a_thread_until_the_body_ends(path_socket, monkeypatch: pytest.MonkeyPatch) -> None:
    sock, address = path_socket
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    monkeypatch.setenv("WATCHDOG_USEC", "20000")  # pings every 10 ms
    wd = sdnotify.Watchdog()
    sock.settimeout(30)  # bounds a hang only; the pings come every period
    with wd.keepalive():
        # A long operation that never calls maybe_ping(): the thread pings for it.
        received = [sock.recv(64) for _ in range(3)]
        assert "slidedp-watchdog" in {t.name for t in threading.enumerate()}
    assert received == [b"WATCHDOG=1"] * 3
    assert "slidedp-watchdog" not in {t.name for t in threading.enumerate()}
    sock.setblocking(False)
    drain(sock)
    wd.maybe_ping()  # the loop resumes: its first call pings at once
    assert drain(sock) == [b"WATCHDOG=1"]


def test_keepalive_without_watchdog_starts_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    wd = sdnotify.Watchdog()
    before = threading.active_count()
    with wd.keepalive():
        assert threading.active_count() == before
