"""slidedp-store: every command with no daemon (served in the CLI's process) and through a running daemon process.

The command sequence runs `main()` in the test process (one torch import instead of one per
command keeps it fast on a loaded 2-core box); the refusals run the CLI as its own process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from slidedp.launch import store_cli
from slidedp.launch.store_cli import human_bytes
from slidedp.model.config import named_shape
from slidedp.store.client import call
from slidedp.store.layout import make_layout
from slidedp.store.shm import Segment, shm_free_bytes
from slidedp.store.store import HostStore, segment_sizes

from . import ROOT, WAIT_S, Daemon, bits, cleanup_store, shm_entries, unique_store


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slidedp.launch.store_cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=4 * WAIT_S)


def ok(*args: str) -> str:
    r = cli(*args)
    assert r.returncode == 0 and r.stderr == "", (args, r.returncode, r.stdout, r.stderr)
    return r.stdout


class InProcess:
    """slidedp-store's main() in this process, its output captured."""

    def __init__(self, capsys) -> None:
        self.capsys = capsys

    def __call__(self, *args: str, fails: bool = False) -> str:
        self.capsys.readouterr()
        rc = store_cli.main(list(args))
        out, err = self.capsys.readouterr()
        if fails:  # exit status 1, the error on stderr: returned after what went to stdout
            assert rc == 1 and err.startswith("slidedp-store: error: "), (args, rc, out, err)
            return out + err
        assert rc == 0 and err == "", (args, rc, out, err)
        return out


# random:tiny as `status` shows it (layout: 106,880 parameters in 107,072 aligned floats per state segment).
def tiny_status(name: str, daemon: str, job: str) -> str:
    return f"""store {name}
  daemons         {daemon}
  model           random:tiny (qwen3), 106,880 parameters, 4 chunks
  segment manifest      12.0 KiB  (12,288 bytes)
  segment master       418.2 KiB  (428,288 bytes)
  segment exp_avg      418.2 KiB  (428,288 bytes)
  segment exp_avg_sq   418.2 KiB  (428,288 bytes)
  total                  1.2 MiB  (1,297,152 bytes)
  bytes/parameter 12.1365
  committed step  0
  state           clean
  attached job    {job}
"""


def session(run, name: str, ck: Path, daemon_pid: int | None) -> list[str]:
    """Every command once, asserting each output; returns the transcript with what may differ masked."""
    # only the host-state daemon runs in this test; the others show as not running
    hoststate = f"pid {daemon_pid}" if daemon_pid else "not running"
    daemon = f"hoststate {hoststate}, aggregator not running, updater not running"
    transcript = []

    out = run("create", name, "--model", "random:tiny")
    first, rest = out.split("\n", 1)
    assert re.fullmatch(rf"created store {name} in \d+\.\d\d s \(page touch \d+\.\d\d GB/s\)", first), first
    assert rest == tiny_status(name, daemon, "none")
    transcript.append(rest.replace(daemon, "DAEMON"))

    att = call(name, "attach", job="cli-job", pid=os.getpid(), world=1)  # what a launcher does
    out = run("status", name)
    assert out == tiny_status(name, daemon, f"cli-job (launcher pid {os.getpid()})")
    transcript.append(out.replace(daemon, "DAEMON"))

    st = json.loads(run("status", name, "--json"))
    layout = make_layout(named_shape("tiny"))
    assert st["parameters"] == layout.num_parameters == 106_880
    assert st["segments"] == {"manifest": 12_288, "master": layout.total_numel * 4, "exp_avg": layout.total_numel * 4,
                              "exp_avg_sq": layout.total_numel * 4}
    assert st["bytes_per_parameter"] == round(sum(st["segments"].values()) / st["parameters"], 4) == 12.1365
    assert (st["committed_step"], st["torn"], st["attached_pid"], st["job"]["job"]) == (0, None, os.getpid(), "cli-job")
    assert st["daemon"] is bool(daemon_pid)
    call(name, "detach", token=att["token"])

    out = run("list")
    assert f"{name}\t1.2 MiB\t{'daemon' if daemon_pid else 'no daemon'}\n" in out
    transcript.append(f"{name}\t1.2 MiB")

    out = run("checkpoint", name, str(ck))
    assert out == f"checkpoint of step 0 written to {ck / 'step-00000000'}\n"
    transcript.append(out.replace(str(ck), "CK"))

    s = HostStore.attach(name)
    want = {n: bits(v) for n, v in s.tensors("master")}
    for _, v in s.tensors("master"):
        v.fill_(float("nan"))  # damage the weights; the restore must bring them back
    s.close()
    out = run("restore", name, str(ck / "step-00000000"))
    assert out == f"store {name} restored to step 0\n"
    transcript.append(out)
    s = HostStore.attach(name)
    assert all(torch.equal(bits(v), want[n]) for n, v in s.tensors("master"))
    s.close()

    out = run("destroy", name)
    assert out == f"store {name} destroyed (4 segments removed)\n"
    assert shm_entries(name) == []
    transcript.append(out)
    out = run("status", name, fails=True)  # a store that does not exist: exit status 1, for scripts
    assert out == (f"slidedp-store: error: store {name!r} does not exist (`slidedp-store list` shows the stores; "
                   f"`slidedp-store create {name} --model ...` makes it)\n")
    transcript.append(out)
    return transcript


def test_cli_same_results_with_and_without_daemon(tmp_path, capsys):
    name = unique_store("cli")  # the same name in both modes: the transcripts compare line for line
    d = None
    try:
        alone = session(InProcess(capsys), name, tmp_path / "ck-alone", None)
        d = Daemon(name, tmp_path / "hoststate.log")
        d.wait_serving()
        served = session(InProcess(capsys), name, tmp_path / "ck-daemon", d.pid)
        assert served == alone
        r = cli("status", name, "--json")  # as a process too
        assert r.returncode == 1 and r.stdout == json.dumps({"store": name, "exists": False, "daemon_pid": d.pid,
                                                             "daemon": True}, indent=1) + "\n", r
        for what in ("creating store", "checkpoint of step 0 written to", "restored", f"store {name} destroyed"):
            assert what in d.text(), what
        assert d.proc.poll() is None
        # Same seed, same store: the two checkpoints hold the same bytes.
        for rel in ("model/model.safetensors", "state/model.safetensors"):
            assert ((tmp_path / "ck-alone/step-00000000" / rel).read_bytes()
                    == (tmp_path / "ck-daemon/step-00000000" / rel).read_bytes()), rel
    finally:
        if d is not None:
            assert d.stop() == 0
        cleanup_store(name)


def test_cli_refuses_a_store_too_big_for_dev_shm():
    name = unique_store("big")
    try:
        layout = make_layout(named_shape("qwen3-14b"))
        meta = {"source": "random:qwen3-14b", "init_seed": 0, "shadow": False, "created": time.time()}
        needed = sum(segment_sizes(layout, meta, False).values())
        if needed <= shm_free_bytes():
            pytest.skip("qwen3-14b fits in /dev/shm here")
        r = cli("create", name, "--model", "random:qwen3-14b")
        assert r.returncode == 1 and r.stdout == ""
        m = re.fullmatch(
            rf"slidedp-store: error: store '{name}' \(14\.768 B parameters\) needs (\d+\.\d\d) GiB of shared memory "
            r"but /dev/shm has only (\d+\.\d\d) GiB free; enlarge it \(e\.g\. `mount -o remount,size=<N>G /dev/shm`\) "
            r"or choose a smaller model/store\n", r.stderr)
        assert m, r.stderr
        assert m[1] == f"{needed / 2**30:.2f}" and float(m[2]) < float(m[1])
        assert shm_entries(name) == []
    finally:
        cleanup_store(name)


def test_cli_names_a_corrupt_store_and_destroys_it():
    name = unique_store("bad")
    try:
        call(name, "create", source="random", shape="tiny")
        seg = Segment.open(f"/slidedp.{name}.manifest")
        seg.mm[0:8] = b"GARBAGE!"
        seg.close()
        r = cli("status", name)
        reason = f"manifest /slidedp.{name}.manifest is corrupt: bad magic b'GARBAGE!' (expected b'SLIDEDP\\x01')"
        assert (r.returncode, r.stdout) == (1, "")
        assert r.stderr == f"slidedp-store: error: {reason} (`slidedp-store destroy {name}` removes it)\n"
        assert ok("destroy", name) == (f"store {name} could not be read ({reason}); removed its segments anyway\n"
                                       f"store {name} destroyed (4 segments removed)\n")
        assert shm_entries(name) == []
    finally:
        cleanup_store(name)


@pytest.mark.parametrize("n,text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (12_288, "12.0 KiB"),
                                    (428_288, "418.2 KiB"), (2**20 * 11 // 2, "5.5 MiB"),
                                    (7_152_652_288, "6.66 GiB"), (3 * 2**40, "3.00 TiB")])
def test_human_bytes(n, text):
    assert human_bytes(n) == text
