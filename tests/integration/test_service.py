"""SlideDP run as a service: the three daemons started as the systemd units start them, jobs that come and go.

The daemons run as separate processes with the units' ExecStart lines (`/usr/bin/env slidedp-ROLE --store NAME`,
the console scripts found through PATH), the environment systemd gives a `Type=notify` unit with
`RuntimeDirectory=slidedp/%i` and `WatchdogSec=` ($NOTIFY_SOCKET, $WATCHDOG_USEC, $WATCHDOG_PID,
$RUNTIME_DIRECTORY), and a datagram socket of the test standing in for systemd's notify socket (it
reads the sender's pid, as systemd does for NotifyAccess=main). The clients (`slidedp-store`,
`slidedp-launch` and its workers) run as a user would start them by hand: without SLIDEDP_RUN_ROOT,
finding the daemons through slidedp/paths.py alone ($XDG_RUNTIME_DIR/slidedp/NAME is the unit's
run directory, as under `systemd --user`).
"""

from __future__ import annotations

import os
import re
import select
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from slidedp.daemons import sdnotify
from slidedp.daemons.hoststate import shell as hoststate
from slidedp.protocol import KIND_OF, control
from slidedp.store.service import HostStateCore, RequestError
from slidedp.store.shm import list_store_segments, unlink_store

try:  # tests/ a package (tests.integration) or not (integration, pipeline: top-level)
    from ..pipeline.harness import TINY, checkpoint_weights, launch, metrics, rel_err, unique_store
except ImportError:
    from pipeline.harness import TINY, checkpoint_weights, launch, metrics, rel_err, unique_store

ROOT = Path(__file__).resolve().parents[2]
UNIT_DIR = ROOT / "systemd"
BIN = Path(sys.executable).parent  # the console scripts of this environment (/work/venv/bin, .venv/bin in CI)
ROLES = ("hoststate", "aggregator", "updater")
# What systemd sets per unit, or the suite sets for itself: never inherited from the test's environment.
_SCRUBBED = ("SLIDEDP_RUN_ROOT", "XDG_RUNTIME_DIR", "RUNTIME_DIRECTORY", "NOTIFY_SOCKET", "WATCHDOG_USEC",
             "WATCHDOG_PID", "SLIDEDP_LOG_LEVEL")
# Every job: the README's demo job, fp32, a constant lr, so a job of train.steps=3 followed by one of
# train.steps=6 sees the lr of one 6-step run (the schedule is a function of train.steps).
JOB_SETS = ('plan.compute_dtype="fp32"', 'train.schedule="constant"', "train.warmup_steps=0", 'checkpoint.dtype="fp32"')
TIMEOUT = 240.0


# ---- systemd's side ---------------------------------------------------------------------------------


def unit_value(role: str, key: str) -> str:
    """A [Service] setting of systemd/slidedp-ROLE@.service (single-valued keys only)."""
    values = [line.partition("=")[2].strip() for line in (UNIT_DIR / f"slidedp-{role}@.service").read_text().splitlines()
              if line.startswith(f"{key}=")]
    assert len(values) == 1, (role, key, values)
    return values[0]


def watchdog_usec(role: str) -> int:
    match = re.fullmatch(r"(\d+)s", unit_value(role, "WatchdogSec"))
    assert match, "the test reads WatchdogSec= in seconds"
    return int(match.group(1)) * 1_000_000


class NotifySocket:
    """systemd's notify socket: every datagram with the pid of its sender (SO_PASSCRED).

    A thread reads it all the time, as systemd does: a unix datagram socket queues only
    net.unix.max_dgram_qlen datagrams (10 by default) and a sender blocks while it is full.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(str(path))
        self.received: list[tuple[int, list[str]]] = []
        self._syncs = 0  # markers sent by sync()
        self._arrived = threading.Condition()
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name="notify-socket", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._closed.is_set():
            if not select.select([self.sock], [], [], 0.1)[0]:
                continue
            data, ancillary, _, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(struct.calcsize("3i")))
            pid = -1
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("3i", payload[:12])[0]
            with self._arrived:
                self.received.append((pid, data.decode().split("\n")))
                self._arrived.notify_all()

    def states(self, pid: int) -> list[str]:
        with self._arrived:
            return [s for p, states in self.received if p == pid for s in states]

    def sync(self, timeout: float = 30.0) -> None:
        """Until every datagram this process sent before has been read: a unix datagram socket keeps one
        sender's datagrams in order, so once a marker sent now is read, all earlier ones are."""
        self._syncs += 1
        marker = f"TEST_SYNC={self._syncs}"
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as out:
            out.sendto(marker.encode(), str(self.path))
        assert self.wait_for(os.getpid(), marker, 1, timeout), "the notify socket's reader fell behind"

    def wait_for(self, pid: int, state: str, count: int, timeout: float) -> bool:
        """Whether `pid` sent `state` at least `count` times within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._arrived:
            while sum(s == state for p, states in self.received if p == pid for s in states) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._arrived.wait(min(left, 0.5))
        return True

    def wait(self, daemon: "Daemon", state: str, count: int = 1, timeout: float = 120.0) -> None:
        """Until `daemon`'s main process sent `state` `count` times; fails naming the daemon if it died."""
        deadline = time.monotonic() + timeout
        while not self.wait_for(daemon.pid, state, count, 0.5):
            if daemon.proc.poll() is not None:
                pytest.fail(f"{daemon.role} exited with {daemon.proc.returncode} before sending {state}:\n{daemon.log_text()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{daemon.role} sent no {state} within {timeout:.0f} s; it sent {self.states(daemon.pid)}:\n"
                            f"{daemon.log_text()}")

    def close(self) -> None:
        self._closed.set()
        self._reader.join()
        self.sock.close()


@dataclass
class Daemon:
    role: str
    proc: subprocess.Popen
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_text(self) -> str:
        return self.log.read_text() if self.log.exists() else "(no log)"

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.role} (pid {self.pid}) did not exit within {timeout:.0f} s:\n{self.log_text()}")


@dataclass
class Service:
    """One store served the way the units serve it."""

    store: str
    root: Path  # stands in for /run/slidedp; also $XDG_RUNTIME_DIR/slidedp of the clients
    notify: NotifySocket
    daemons: dict[str, Daemon] = field(default_factory=dict)
    started: list[Daemon] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        return self.root / self.store

    def daemon_env(self, role: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
        env.update(PATH=f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}", PYTHONUNBUFFERED="1",
                   SLIDEDP_LOG_LEVEL="INFO", NOTIFY_SOCKET=str(self.notify.path),
                   WATCHDOG_USEC=str(watchdog_usec(role)), RUNTIME_DIRECTORY=str(self.run_dir))
        return env

    def client_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
        env.update(PATH=f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}", PYTHONUNBUFFERED="1",
                   SLIDEDP_LOG_LEVEL="INFO", XDG_RUNTIME_DIR=str(self.root.parent))
        return env

    def start(self, role: str) -> Daemon:
        """ExecStart of the unit, with $WATCHDOG_PID set to the pid that execs it (as systemd does)."""
        argv = shlex.split(unit_value(role, "ExecStart").replace("%i", self.store))
        self.run_dir.mkdir(mode=0o700, exist_ok=True)  # RuntimeDirectory=, made by systemd before the start
        log = self.root.parent / f"{role}-{len(self.started)}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(["/bin/sh", "-c", 'WATCHDOG_PID=$$; export WATCHDOG_PID; exec "$@"', "sh", *argv],
                                    env=self.daemon_env(role), stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        daemon = Daemon(role, proc, log)
        self.daemons[role] = daemon
        self.started.append(daemon)
        return daemon

    def run(self, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / argv[0]), *argv[1:]], cwd=cwd, env=self.client_env(), capture_output=True,
                              text=True, timeout=TIMEOUT)

    def launch(self, run_dir: Path, steps: int, *more: str) -> subprocess.CompletedProcess:
        sets = [f'store.name="{self.store}"', "store.persist=true", f'run.dir="{run_dir}"', f"train.steps={steps}",
                *JOB_SETS, *more]
        return self.run("slidedp-launch", str(TINY), *(a for s in sets for a in ("--set", s)), cwd=run_dir.parent)

    def cleanup(self) -> None:
        """Every process started (each in its own session: the updater's members too), then the store."""
        for d in self.started:
            if d.proc.poll() is None:
                d.proc.terminate()
        for d in self.started:
            try:
                d.proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(d.pid, signal.SIGKILL)  # what is left of its process group (a pool member)
            except ProcessLookupError:
                pass
            if d.proc.poll() is None:
                d.proc.wait(15)
        unlink_store(self.store)
        self.notify.close()


@pytest.fixture
def service():
    # A short root: ipc:// socket paths must stay under the 108-byte sun_path limit.
    base = Path(tempfile.mkdtemp(prefix="sdp-svc-"))
    root = base / "slidedp"
    root.mkdir(mode=0o700)
    svc = Service(unique_store("svc"), root, NotifySocket(base / "notify"))
    try:
        yield svc
    finally:
        svc.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def status(svc: Service, tmp_path: Path) -> str:
    out = svc.run("slidedp-store", "status", svc.store, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def field_of(text: str, name: str) -> str:
    match = re.search(rf"^  {re.escape(name)} +(.+)$", text, re.M)
    assert match, f"no {name!r} line in:\n{text}"
    return match.group(1).strip()


# ---- the test the issue asks for --------------------------------------------------------------------


def test_two_jobs_on_a_service_store_across_a_hoststate_crash(service: Service, tmp_path: Path) -> None:
    svc, store = service, service.store
    before = {p.pid for p in psutil.process_iter()}

    # The daemons as their units start them: each reports READY=1 from its main process, then pings.
    for role in ROLES:
        svc.start(role)
    for role in ROLES:
        d = svc.daemons[role]
        svc.notify.wait(d, "READY=1")
        svc.notify.wait(d, "WATCHDOG=1")  # the first loop iteration pings
        # the role's lock, in $RUNTIME_DIRECTORY, names the unit's main process
        assert (svc.run_dir / f"{role}.lock").read_text() == f"{d.pid}\n"
    assert sorted(p.name for p in svc.run_dir.glob("*.lock")) == sorted(f"{r}.lock" for r in ROLES)

    created = svc.run("slidedp-store", "create", store, "--model", "random:tiny", "--vocab-size", "512", cwd=tmp_path)
    assert created.returncode == 0, created.stdout + created.stderr
    assert created.stdout.startswith(f"created store {store} in ")
    assert field_of(created.stdout, "daemons") == ", ".join(f"{r} pid {svc.daemons[r].pid}" for r in ROLES)

    # Job A: steps 0..2 on the daemons (it starts none of its own).
    run_a = tmp_path / "a"
    job_a = svc.launch(run_a, 3)
    assert job_a.returncode == 0, job_a.stdout + job_a.stderr
    for role in ROLES:
        assert f"attaching to the running slidedp-{role} of store {store} (pid {svc.daemons[role].pid})" in job_a.stderr
    assert "started slidedp-" not in job_a.stderr
    assert [m["step"] for m in metrics(run_a)] == [0, 1, 2]

    # The host-state daemon dies hard; the store does not. systemd would start it again: so do we.
    old = svc.daemons["hoststate"]
    old.proc.send_signal(signal.SIGKILL)
    assert old.wait() == -signal.SIGKILL
    kinds = {kind for kind, _ in list_store_segments().get(store, [])}
    assert {"manifest", "master", "exp_avg", "exp_avg_sq"} <= kinds, kinds
    new = svc.start("hoststate")
    svc.notify.wait(new, "READY=1")
    assert f"re-attached to store {store}: committed step 3, clean" in new.log_text()
    st = status(svc, tmp_path)
    assert field_of(st, "daemons") == ", ".join(f"{r} pid {svc.daemons[r].pid}" for r in ROLES)
    assert (field_of(st, "committed step"), field_of(st, "state"), field_of(st, "attached job")) == ("3", "clean", "none")

    # Job B continues from the store's committed step to 6.
    run_b = tmp_path / "b"
    job_b = svc.launch(run_b, 6)
    assert job_b.returncode == 0, job_b.stdout + job_b.stderr
    assert f"attaching to the running slidedp-hoststate of store {store} (pid {new.pid})" in job_b.stderr
    assert [m["step"] for m in metrics(run_b)] == [3, 4, 5]

    # A job for another model is refused, names the store and what it holds, and changes nothing.
    run_c = tmp_path / "c"
    job_c = svc.launch(run_c, 6, 'model.shape="tiny-llama"')
    assert job_c.returncode != 0
    assert (f"store '{store}' holds another model (random:tiny, 106,880 parameters) than this job (random:tiny-llama): "
            f"family: store 'qwen3', job 'llama'; intermediate_size: store 128, job 160; qk_norm: store True, job False; "
            f"tie_word_embeddings: store True, job False; set store.name to another store, or destroy it with `slidedp-store destroy {store}`") in job_c.stderr
    st = status(svc, tmp_path)
    assert field_of(st, "daemons") == ", ".join(f"{r} pid {svc.daemons[r].pid}" for r in ROLES)
    assert (field_of(st, "committed step"), field_of(st, "state"), field_of(st, "attached job")) == ("6", "clean", "none")
    assert all(d.proc.poll() is None for d in svc.daemons.values())

    # One uninterrupted 6-step run on a fresh store, embedded daemons: the same losses and weights.
    ref_store = unique_store("svcref")
    run_ref = tmp_path / "ref"
    try:
        ref = launch(TINY, f'store.name="{ref_store}"', f'run.dir="{run_ref}"', "train.steps=6", *JOB_SETS, cwd=tmp_path,
                     timeout=TIMEOUT)
        assert ref.returncode == 0, ref.stdout + ref.stderr
    finally:
        unlink_store(ref_store)
    losses = [m["loss"] for m in metrics(run_a) + metrics(run_b)]
    ref_losses = [m["loss"] for m in metrics(run_ref)]
    assert len(ref_losses) == 6
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-6, (losses, ref_losses)
    ours = checkpoint_weights(run_b / "checkpoints" / "step-00000006")
    theirs = checkpoint_weights(run_ref / "checkpoints" / "step-00000006")
    assert ours.keys() == theirs.keys()
    worst = max(rel_err(ours[k], theirs[k]) for k in ours)
    assert worst <= 1e-6, worst
    print(f"job A+B against one run: max relative weight error {worst:.3e}, "
          f"bitwise equal tensors {sum(bool((ours[k] == theirs[k]).all()) for k in ours)}/{len(ours)}")

    # systemctl stop: SIGTERM; each daemon says STOPPING=1 and exits 0; the store stays until destroyed.
    for d in svc.daemons.values():
        d.proc.terminate()
    for d in svc.daemons.values():
        assert d.wait() == 0, d.log_text()
        assert "STOPPING=1" in svc.notify.states(d.pid)
    assert {"manifest", "master"} <= {kind for kind, _ in list_store_segments().get(store, [])}
    gone = svc.run("slidedp-store", "destroy", store, cwd=tmp_path)
    assert gone.returncode == 0, gone.stdout + gone.stderr
    assert list_store_segments().get(store) is None
    leftover = [p for p in psutil.process_iter(["pid", "cmdline"])
                if p.pid not in before and store in " ".join(p.info["cmdline"] or [])]
    assert leftover == [], [p.info["cmdline"] for p in leftover]


# ---- the host-state daemon's long requests under the watchdog -----------------------------------------


class _FakeCore:
    """Stands in for HostStateCore: records whether the keepalive thread ran while it was handling."""

    name = "demo"

    def __init__(self, notify: NotifySocket, fail: bool = False) -> None:
        self.notify, self.fail = notify, fail
        self.keepalive_seen: list[bool] = []

    def handle(self, req) -> dict:
        kind = KIND_OF[type(req)]
        self.keepalive_seen.append(any(t.name == "slidedp-watchdog" and t.is_alive() for t in threading.enumerate()))
        if kind in hoststate.LONG_REQUESTS:
            # A long request: pings must keep arriving while it blocks the serve loop.
            me = os.getpid()
            pings = sum(s == "WATCHDOG=1" for s in self.notify.states(me))
            assert self.notify.wait_for(me, "WATCHDOG=1", pings + 2, 60), "no watchdog ping while a long request ran"
        if self.fail:
            raise RequestError("refused")
        return {"kind": kind}


def _request(kind: str):
    """A typed request of `kind` with its required arguments."""
    required = {"attach": {"world": 1, "pid": 1}, "checkpoint": {"dir": "/nonexistent"}, "restore": {"path": "/x"}}
    return control(kind, **required.get(kind, {}))


@pytest.fixture
def notify_here(monkeypatch: pytest.MonkeyPatch):
    """This process under a 'unit' with a 20 ms watchdog (pings every 10 ms)."""
    base = Path(tempfile.mkdtemp(prefix="sdp-wd-"))
    sock = NotifySocket(base / "notify")
    monkeypatch.setenv("NOTIFY_SOCKET", str(sock.path))
    monkeypatch.setenv("WATCHDOG_USEC", "20000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    try:
        yield sock
    finally:
        sock.close()
        shutil.rmtree(base, ignore_errors=True)


def test_long_requests_keep_the_watchdog_fed(notify_here: NotifySocket) -> None:
    watchdog = sdnotify.Watchdog()
    assert watchdog.period == pytest.approx(0.01)
    core = _FakeCore(notify_here)
    for kind in ("create", "attach", "checkpoint", "restore", "destroy"):
        assert hoststate._handle(core, watchdog, _request(kind)) == {"kind": kind}
    assert core.keepalive_seen == [True] * 5
    notify_here.sync()  # the last datagrams may still be queued for the reader thread
    statuses = [s for s in notify_here.states(os.getpid()) if s.startswith("STATUS=")]
    assert statuses[:2] == ["STATUS=create of store demo in progress", "STATUS=serving store demo"]
    assert statuses[-1] == "STATUS=serving store demo"
    # Short requests run on the loop's own pings: no thread, no STATUS change.
    count = len(statuses)
    for kind in ("ping", "status", "detach"):
        assert hoststate._handle(core, watchdog, _request(kind)) == {"kind": kind}
    assert core.keepalive_seen[5:] == [False] * 3
    notify_here.sync()
    assert len([s for s in notify_here.states(os.getpid()) if s.startswith("STATUS=")]) == count


def test_a_refused_long_request_stops_the_keepalive(notify_here: NotifySocket) -> None:
    core = _FakeCore(notify_here, fail=True)
    with pytest.raises(RequestError, match="refused"):
        hoststate._handle(core, sdnotify.Watchdog(), _request("checkpoint"))
    assert not any(t.name == "slidedp-watchdog" for t in threading.enumerate())
    notify_here.sync()
    assert [s for s in notify_here.states(os.getpid()) if s.startswith("STATUS=")][-1] == "STATUS=serving store demo"


def test_long_requests_name_real_requests() -> None:
    assert all(callable(getattr(HostStateCore, f"do_{kind}", None)) for kind in hoststate.LONG_REQUESTS)
