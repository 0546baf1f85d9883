"""Fault-injection trials, black box: kill -9 each kind of process of a running job, then `--resume latest`.

    .venv/bin/python scripts/fault_trials.py --trials 3 --out /tmp/trials.json

The job is examples/tiny.toml as a user runs it (2 CPU workers, store.persist = false, so a dead
launcher leaks its store) with a checkpoint every 2 steps written in the background. Each trial
starts the job, waits for a random number of committed steps plus a random fraction of a step,
kills one process of the kind with SIGKILL, and then looks only at what a user sees: the
launcher's exit status and last words, the processes left, `slidedp-store status`, and the run
directory. It then runs the same command with `--resume latest` (every other trial after
flipping a byte of the newest checkpoint) and compares the final checkpoint, tensor by tensor
and bit for bit, with an uninterrupted run's.

Counted per trial: detected (the launcher exited non-zero naming the killed process, or, for
the launcher, every child exited), orphans (processes of the store alive 30 s after the job
ended), run dirs left under the socket root, stores misreported (status says clean, or a job
attached, where the store is not; a store left by the dead job not flagged), silent adoptions
(the resume trained on a store left behind without saying so), corrupt checkpoints accepted,
and resumes bit-identical.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.toml"
PY = sys.executable
KINDS = ("worker", "aggregator", "updater", "updater_member", "hoststate", "launcher")
MODULES = {"slidedp.worker": "worker", "slidedp.daemons.hoststate": "hoststate",
           "slidedp.daemons.aggregator": "aggregator", "slidedp.daemons.updater": "updater",
           "slidedp.daemons.updater_member": "updater_member", "slidedp.daemons.updater.member": "updater_member"}


def kind_of(p: psutil.Process) -> str | None:
    try:
        cmd = p.cmdline()
    except psutil.Error:
        return None
    return MODULES.get(cmd[cmd.index("-m") + 1]) if "-m" in cmd and cmd.index("-m") + 1 < len(cmd) else None


def job_args(store: str, run_dir: Path, steps: int, *extra: str) -> list[str]:
    sets = [f'store.name="{store}"', f'run.dir="{run_dir}"', f"train.steps={steps}", "checkpoint.every=2",
            "checkpoint.keep=3", 'checkpoint.dtype="fp32"', "runtime.timeout_s=30"]
    return [PY, "-m", "slidedp.launch.cli", str(TINY), *[a for s in sets for a in ("--set", s)], *extra]


class Job:
    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        self.out = open(log, "w")
        self.proc = subprocess.Popen(argv, stdout=self.out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1", SLIDEDP_LOG_LEVEL="INFO"))
        self.seen: dict[int, float] = {}

    def note(self) -> None:
        try:
            for c in psutil.Process(self.proc.pid).children(recursive=True):
                try:
                    self.seen.setdefault(c.pid, c.create_time())
                except psutil.Error:
                    pass
        except psutil.Error:
            pass

    def of_kind(self, kind: str) -> psutil.Process | None:
        try:
            procs = [c for c in psutil.Process(self.proc.pid).children(recursive=True) if kind_of(c) == kind]
        except psutil.Error:
            return None
        return sorted(procs, key=lambda p: p.cmdline())[0] if procs else None

    def text(self) -> str:
        self.out.flush()
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


def committed_lines(run_dir: Path) -> int:
    p = run_dir / "metrics.jsonl"
    return p.read_text().count("\n") if p.exists() else 0


def alive(pids: dict[int, float]) -> list[int]:
    out = []
    for pid, created in pids.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out


def store_processes(store: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "--store" in cmd and store in cmd and p.pid != os.getpid():
            out.append(p)
    return out


def status(store: str) -> tuple[int, dict]:
    r = subprocess.run([PY, "-m", "slidedp.launch.store_cli", "status", store, "--json"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    try:
        return r.returncode, json.loads(r.stdout)
    except ValueError:
        return r.returncode, {}


def segments(store: str) -> list[str]:
    return [e for e in os.listdir("/dev/shm") if e.startswith(f"slidedp.{store}.")]


def tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    out = {}
    for sub in ("model", "state"):
        for f in sorted((checkpoint / sub).glob("*.safetensors")):
            out.update({f"{sub}/{k}": v for k, v in load_file(f).items()})
    return out


def bit_identical(a: Path, b: Path) -> bool:
    ta, tb = tensors(a), tensors(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k].view(torch.int32) if ta[k].dtype == torch.float32 else ta[k],
                                                      tb[k].view(torch.int32) if tb[k].dtype == torch.float32 else tb[k])
                                          for k in ta)


def store_state(store: str) -> tuple[int, list[int]] | None:
    """(committed step, chunk versions) straight from the manifest, for judging what status says."""
    from slidedp.store.store import HostStore

    try:
        st = HostStore.attach(store)
    except Exception:  # noqa: BLE001 (a store torn down to nothing is judged by its segments)
        return None
    try:
        return st.manifest.committed_step, st.manifest.versions.tolist()
    finally:
        st.close()


def flip_newest(run_dir: Path) -> Path | None:
    cks = sorted((run_dir / "checkpoints").glob("step-*"))
    if not cks:
        return None
    f = cks[-1] / "state" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-64] ^= 0x01
    f.write_bytes(bytes(data))
    return cks[-1]


def trial(kind: str, rng: random.Random, work: Path, steps: int, reference: Path, corrupt: bool) -> dict:
    store = f"ft-{kind[:6]}-{uuid.uuid4().hex[:6]}"
    run_dir = work / store
    out: dict = {"kind": kind, "store": store, "corrupted_newest": corrupt}
    job = Job(job_args(store, run_dir, steps), work / f"{store}.log")
    at = rng.randint(2, steps - 6)
    deadline = time.monotonic() + 300
    while committed_lines(run_dir) < at:
        if job.proc.poll() is not None or time.monotonic() > deadline:
            out["error"] = f"job ended ({job.proc.returncode}) before step {at}"
            return out
        job.note()
        time.sleep(0.02)
    victim = psutil.Process(job.proc.pid) if kind == "launcher" else job.of_kind(kind)
    if victim is None:
        out["error"] = f"no {kind} process"
        job.proc.kill()
        return out
    job.note()
    time.sleep(rng.uniform(0.0, 0.3))
    out["at_step"] = committed_lines(run_dir)
    t0 = time.monotonic()
    victim.kill()
    rc = job.wait(120)
    out["exit"] = rc
    text = job.text()
    if kind == "launcher":
        gone = time.monotonic() + 30
        while alive(job.seen) and time.monotonic() < gone:
            time.sleep(0.05)
        out["detected"] = rc == -9 and not alive(job.seen)
    else:
        m = re.search(r"job failed: (.*)", text)
        out["message"] = m.group(1)[:300] if m else None
        out["detected"] = rc == 1 and m is not None and f"pid {victim.pid}" in m.group(1)
    out["detect_s"] = round(time.monotonic() - t0, 2)
    time.sleep(1.0)
    gone = time.monotonic() + 30
    while store_processes(store) and time.monotonic() < gone:
        time.sleep(0.1)
    orphans = store_processes(store)
    out["orphans"] = len(orphans)
    for p in orphans:
        try:
            p.kill()
        except psutil.Error:
            pass
    run_root = Path(os.environ["SLIDEDP_RUN_ROOT"])
    out["run_dir_left"] = (run_root / store).exists()
    # what a user is told about the store now
    misreported = []
    if segments(store):
        code, st = status(store)
        truth = store_state(store)
        if code != 0 or not st.get("exists"):
            misreported.append(f"status exit {code}")
        if st.get("attached_pid"):
            misreported.append(f"a job attached ({st['attached_pid']}) though none runs")
        if truth is not None and st.get("torn") is None and truth[1] != [truth[0]] * len(truth[1]):
            misreported.append(f"clean, but chunk versions {truth[1]} at committed step {truth[0]}")
        if truth is not None and st.get("torn") is None:
            ref = reference / "checkpoints" / f"step-{truth[0]:08d}"
            from slidedp.store.store import HostStore
            h = HostStore.attach(store)
            try:
                want = load_file(ref / "state" / "model.safetensors")
                bad = [n for n, t in h.tensors("master") if not torch.equal(t, want[f"master.{n}"])]
            finally:
                h.close()
            if bad:
                misreported.append(f"clean at step {truth[0]}, but its weights differ from the run's at that step")
        if st.get("persist", True) is not False:
            misreported.append("a store the job made with store.persist = false not reported as such")
        out["store_left"] = {"committed_step": st.get("committed_step"), "torn": st.get("torn")}
    out["misreported"] = misreported
    # resume
    corrupted = flip_newest(run_dir) if corrupt else None
    out["corrupted"] = str(corrupted) if corrupted else None
    leaked = bool(segments(store))
    res = Job(job_args(store, run_dir, steps, "--resume", "latest"), work / f"{store}.resume.log")
    rc2 = res.wait(600)
    text2 = res.text()
    out["resume_exit"] = rc2
    out["silent_adoption"] = leaked and "was left behind by" not in text2
    m = re.search(r"resumed from (\S+) \(step (\d+)\)", text2)
    out["resumed_from"] = m.group(1) if m else None
    out["accepted_corrupt"] = corrupted is not None and m is not None and m.group(1) == str(corrupted)
    final = run_dir / "checkpoints" / f"step-{steps:08d}"
    out["bit_identical"] = rc2 == 0 and final.is_dir() and bit_identical(final, reference / "checkpoints" /
                                                                          f"step-{steps:08d}")
    res.note()
    gone = time.monotonic() + 30
    while store_processes(store) and time.monotonic() < gone:
        time.sleep(0.1)
    out["orphans_after_resume"] = len(store_processes(store))
    out["left_after_resume"] = {"segments": len(segments(store)), "run_dir": (run_root / store).exists()}
    for e in segments(store):  # nothing of a trial outlives it
        os.unlink(f"/dev/shm/{e}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=2, help="trials per process kind")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write every trial and the totals here (JSON)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="slidedp-trials-"))
    os.environ["SLIDEDP_RUN_ROOT"] = str(work / "run-root")
    rng = random.Random(args.seed)
    ref_store = f"ft-ref-{uuid.uuid4().hex[:6]}"
    reference = work / ref_store
    t0 = time.monotonic()
    ref = Job(job_args(ref_store, reference, args.steps, "--set", "checkpoint.every=1", "--set",
                       f"checkpoint.keep={args.steps + 1}"), work / "reference.log")
    if ref.wait(900) != 0:
        print(ref.text()[-3000:], file=sys.stderr)
        return 1
    print(f"reference run: {args.steps} steps in {time.monotonic() - t0:.0f} s", flush=True)
    trials = []
    n = 0
    for i in range(args.trials):
        for kind in args.kinds.split(","):
            t = trial(kind, rng, work, args.steps, reference, corrupt=n % 2 == 1)
            n += 1
            trials.append(t)
            print(json.dumps(t), flush=True)
    ok = [t for t in trials if "error" not in t]
    totals = {
        "trials": len(trials), "errors": len(trials) - len(ok),
        "detected": sum(bool(t["detected"]) for t in ok),
        "max_detect_s": max((t["detect_s"] for t in ok), default=None),
        "orphans": sum(t["orphans"] + t["orphans_after_resume"] for t in ok),
        "run_dirs_left": sum(bool(t["run_dir_left"]) or t["left_after_resume"]["run_dir"] for t in ok),
        "stores_misreported": sum(bool(t["misreported"]) for t in ok),
        "stores_left_by_the_kill": sum("store_left" in t for t in ok),
        "silent_adoptions": sum(bool(t["silent_adoption"]) for t in ok),
        "corrupt_checkpoints_planted": sum(bool(t["corrupted"]) for t in ok),
        "corrupt_checkpoints_accepted": sum(bool(t["accepted_corrupt"]) for t in ok),
        "resumes_ok": sum(t["resume_exit"] == 0 for t in ok),
        "resumes_bit_identical": sum(bool(t["bit_identical"]) for t in ok),
        "seconds": round(time.monotonic() - t0),
    }
    print("totals " + json.dumps(totals), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"totals": totals, "trials": trials, "command": sys.argv}, indent=1))
    return 0 if totals["detected"] == len(ok) and totals["resumes_bit_identical"] == len(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
