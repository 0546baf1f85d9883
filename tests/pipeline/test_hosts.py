"""Several hosts on one machine (docs/multi-host.md): H launchers, each with its own store, daemons and CPU
workers, meeting over loopback (Gloo), against one host with the same global batch.

Each "host" is a launcher started with --nnodes H --node-rank R --master-addr 127.0.0.1 --master-port P and a
store of its own, which holds only its part of the state (store/part.py). The ranks of every host form one process group and take the sharded and reduce_scatter
routes over it, so host R's updaters update host R's range of every chunk and nothing else: the union of
the hosts' ranges must be the one-host store's weights and moments, to float32 rounding, and every host's
logged loss and gradient norm the one host's (clipping at 0.5 crosses its threshold: the norms are ~2).
"""

from __future__ import annotations

import json
import math
import os
import socket
import stat
import subprocess
import sys

import pytest
import torch

from slidedp.config import load_job
from slidedp.planner import REFERENCE_CALIBRATION
from slidedp.planner.job import network
from slidedp.planner.netcache import measured_network, network_file
from slidedp.store import checkpoint as ckpt
from slidedp.store.part import StorePart
from slidedp.store.store import STATE_KINDS, HostStore

from data.common import write_model_folder
from data.test_equivalence import GLOBAL_BATCH, STEPS, job_sets
from pipeline.harness import TINY, checkpoint_weights, launch, metrics, rel_err, unique_store
from reliability import drop_store

transformers = pytest.importorskip("transformers")


def free_ports() -> int:
    """A port P with P + 1 free as well (the launchers' rendezvous and the ranks' process group)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65534:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two consecutive free ports")


def host_sets(folder, workers: int, hosts: int, store: str, run_dir, checkpoints, *more: str) -> list[str]:
    """The equivalence tests' job (packed chat rows, clipping at 0.5) on `hosts` hosts of `workers` ranks; a
    checkpoint after step 2 and at the end, into `checkpoints` (one directory for every host)."""
    sets = [s for s in job_sets(folder, workers, 1, "packed", 0.5, store, run_dir) if not s.startswith("plan.micro")]
    return sets + [f"plan.micro_batch={GLOBAL_BATCH // (workers * hosts)}", "store.persist=true",
                   "checkpoint.every=2", f'checkpoint.dir="{checkpoints}"', *more]


def launch_hosts(tmp_path, folder, hosts: int, workers: int, checkpoints, *more: str, name: str = "run",
                 stores: list[str] | None = None, outputs: list | None = None,
                 own: dict[int, tuple[str, ...]] | None = None) -> tuple[list[str], list]:
    """H launchers at once; returns (their stores, their run dirs) once all have ended, well unless `outputs`
    is given (it gets each launcher's (exit status, output)). own: a host's own job values, after the others."""
    port = free_ports()
    stores = stores or [unique_store(f"h{r}") for r in range(hosts)]
    runs = [tmp_path / f"{name}-host{r}" for r in range(hosts)]
    procs = []
    for r in range(hosts):
        argv = [sys.executable, "-m", "slidedp.launch.cli", str(TINY), "--nnodes", str(hosts), "--node-rank", str(r),
                "--master-addr", "127.0.0.1", "--master-port", str(port)]
        for s in host_sets(folder, workers, hosts, stores[r], runs[r], checkpoints, *more, *(own or {}).get(r, ())):
            argv += ["--set", s]
        procs.append(subprocess.Popen(argv, cwd=tmp_path, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=400)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if outputs is not None:
        outputs += [(p.returncode, out) for p, out in zip(procs, outs)]
        return stores, runs
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"host {r}:\n{out[-6000:]}"
    return stores, runs


def host_state(stores: list[str], workers: int) -> dict[str, torch.Tensor]:
    """Every kind of state, each chunk's host range taken from the host that owns it; asserts that no host
    touched the moments outside its ranges (they are still zero there: the update is sharded)."""
    hosts = len(stores)
    opened = [HostStore.attach(s) for s in stores]
    try:
        layout = opened[0].layout
        assert [st.part for st in opened] == [StorePart(hosts, r, workers) for r in range(hosts)]
        out = {k: torch.empty(layout.total_numel) for k in STATE_KINDS}
        for c in layout.chunks:
            size = -(-c.numel // (hosts * workers))  # a rank's shard; a host owns `workers` of them side by side
            for r, st in enumerate(opened):
                lo, hi = min(r * workers * size, c.numel), min((r + 1) * workers * size, c.numel)
                for k in STATE_KINDS:
                    out[k][c.offset + lo:c.offset + hi] = st.chunk(k, c)[lo:hi]
                moments = st.chunk("exp_avg_sq", c)
                assert hi > lo, (r, c.id)
                others = torch.cat([moments[:lo], moments[hi:]])
                assert others.numel() == 0 or float(others.abs().max()) == 0.0, (r, c.id)
        return out
    finally:
        for st in opened:
            st.close()


def one_host_state(store: str) -> dict[str, torch.Tensor]:
    st = HostStore.attach(store)
    try:
        return {k: st.flat(k).clone() for k in STATE_KINDS}
    finally:
        st.close()


@pytest.fixture(scope="module")
def one_host(tmp_path_factory):
    """The same job on one host of 2 ranks: its model folder, metrics, store state and checkpoints."""
    tmp = tmp_path_factory.mktemp("one")
    folder = write_model_folder(tmp / "model", "qwen3", tied=False, seed=2)
    store, run_dir = unique_store("h"), tmp / "run"
    proc = launch(TINY, *host_sets(folder, 2, 1, store, run_dir, tmp / "checkpoints"), cwd=tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    try:
        yield folder, metrics(run_dir), one_host_state(store), tmp / "checkpoints"
    finally:
        drop_store(store)


def check_metrics(runs, want) -> None:
    assert all(n["grad_norm"] > 0.5 for n in want)  # clipping acts
    for run in runs:  # every host logs the global loss and norm
        got = metrics(run)
        assert [m["step"] for m in got] == [w["step"] for w in want][-len(got):]
        for g, w in zip(got, want[-len(got):]):
            assert g["loss"] == pytest.approx(w["loss"], rel=1e-6), (g, w)
            assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5), (g, w)


@pytest.fixture(scope="module")
def two_hosts(one_host, tmp_path_factory):
    """The job on 2 hosts of 2 ranks, with its checkpoints: (stores, run dirs, checkpoint folder, state)."""
    tmp = tmp_path_factory.mktemp("two")
    stores, runs = launch_hosts(tmp, one_host[0], 2, 2, tmp / "checkpoints")
    try:
        yield stores, runs, tmp / "checkpoints", host_state(stores, 2)
    finally:
        for s in stores:
            drop_store(s)


def check_hosts(one_host, stores, runs, checkpoints, hosts: int, workers: int) -> None:
    """Every host logs the one-host job's loss and norm, the hosts' parts are its state, and its checkpoints
    exist whole under their names, their Hugging Face folders the one host's (fp32 here), loading in
    transformers."""
    _, want, want_state, want_checkpoints = one_host
    check_metrics(runs, want)
    state = host_state(stores, workers)
    for k in STATE_KINDS:
        assert rel_err(state[k], want_state[k]) < 1e-5, k
    got = ckpt.list_checkpoints(checkpoints)
    assert [p.name for p in got] == ["step-00000002", f"step-{STEPS:08d}"]
    assert not list(checkpoints.glob(".step-*"))  # no part left outside a checkpoint
    for path in got:
        record = ckpt.read_record(path)  # every file's sha256, the parts' included
        assert (record["parts"], record["ranks"]) == (hosts, workers)
        assert sorted(d.name for d in path.glob("host-*")) == [f"host-{r}-of-{hosts}" for r in range(hosts)]
        theirs = checkpoint_weights(want_checkpoints / path.name)
        for n, w in checkpoint_weights(path).items():
            assert rel_err(w, theirs[n]) < 1e-5, (path.name, n)
    model = transformers.AutoModelForCausalLM.from_pretrained(got[-1] / "model", dtype=torch.float32)
    assert model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False).shape[1] >= 4


def test_two_hosts_train_and_checkpoint_what_one_host_does(one_host, two_hosts):
    stores, runs, checkpoints, _ = two_hosts
    check_hosts(one_host, stores, runs, checkpoints, 2, 2)


def test_the_ranks_measure_the_network_and_the_host_keeps_it_for_the_next_plan(two_hosts):
    """Each host's local rank 0 wrote the probe's file before training; its launcher put the fit in the run's record
    and this machine's cache (the suite's SLIDEDP_CACHE_DIR), under Gloo's figures, which a plan on several hosts
    then charges. Loopback is not a network: the figures are Gloo's copies through host memory on this machine."""
    _, runs, _, _ = two_hosts
    for run in runs:
        probe = json.loads((run / "network.json").read_text())
        assert stat.S_IMODE((run / "network.json").stat().st_mode) == 0o600
        assert (probe["backend"], probe["nnodes"], probe["ranks"]) == ("gloo", 2, 4), probe
        kept = json.loads((run / "run.json").read_text())["network"]
        for key in ("gbps", "latency_us"):
            assert math.isfinite(kept[key]) and kept[key] > 0, kept
        assert not kept["at_least"] and kept["measured_at"] == probe["measured_at"]
        print(f"{run.name}: {kept['gbps']:.2f} GB/s, {kept['latency_us']:.0f} us per ring step, "
              f"probe {kept['probe_s']:.2f} s")
    cached = json.loads(network_file().read_text())["backends"]["gloo"]
    assert {(r["nnodes"], r["ranks"]) for r in cached} >= {(2, 4)}
    measured = measured_network("gloo")
    assert measured is not None and measured.gbps > 0 and measured.latency_us > 0
    job = load_job(TINY, ['runtime.device="cuda"', "runtime.workers=2", "runtime.nnodes=2", 'runtime.master_addr="h0"'])
    calib = network(job, REFERENCE_CALIBRATION, measured)
    assert (calib.internode_gbps, calib.internode_latency_us) == (measured.gbps, measured.latency_us)
    assert f"each way per host, {measured.source}; latency" in calib.network_words()


@pytest.mark.slow  # 22-31 s on CI's 2 cores; two hosts check the exchange by default
def test_three_hosts_train_and_checkpoint_what_one_host_does(tmp_path, one_host):
    stores, runs = launch_hosts(tmp_path, one_host[0], 3, 1, tmp_path / "checkpoints")
    try:
        check_hosts(one_host, stores, runs, tmp_path / "checkpoints", 3, 1)
    finally:
        for s in stores:
            drop_store(s)


def test_a_resume_on_several_hosts_is_bit_identical_and_on_one_host_too(tmp_path, one_host, two_hosts):
    """Two fresh hosts resumed from the two hosts' checkpoint after step 2 train step 2 again to the same bits
    of every host's part; one host of 2 ranks resumed from it trains what the one-host job trained, to float32
    rounding (the checkpoint of H hosts is the flat state, whatever H reads it)."""
    folder, want, want_state, _ = one_host
    _, _, checkpoints, first = two_hosts
    step2 = checkpoints / "step-00000002"
    stores, runs = launch_hosts(tmp_path, folder, 2, 2, tmp_path / "again", f'checkpoint.resume="{step2}"',
                                name="resumed")
    try:
        check_metrics(runs, want)
        assert [m["step"] for m in metrics(runs[0])] == [2]
        again = host_state(stores, 2)
        for k in STATE_KINDS:
            assert torch.equal(again[k], first[k]), k
    finally:
        for s in stores:
            drop_store(s)
    store, run_dir = unique_store("h1"), tmp_path / "one-resumed"
    proc = launch(TINY, *host_sets(folder, 2, 1, store, run_dir, tmp_path / "one", f'checkpoint.resume="{step2}"'),
                  cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    try:
        state = one_host_state(store)
        for k in STATE_KINDS:
            assert rel_err(state[k], want_state[k]) < 1e-5, k
    finally:
        drop_store(store)


@pytest.mark.slow  # 10 s on 2 cores; the links' refusal itself: tests/launcher/test_host_link.py
def test_hosts_at_different_steps_are_refused_naming_them(tmp_path, one_host, two_hosts):
    """Host 0's store trained to step 3 beside a fresh store for host 1: the launchers stop before any worker
    starts, naming each host's step (launch/hosts.py; the ranks would check it again); neither store moves."""
    folder = one_host[0]
    trained, fresh = two_hosts[0][0], unique_store("h1")
    try:
        outputs: list = []
        launch_hosts(tmp_path, folder, 2, 2, tmp_path / "more", "train.steps=5", name="apart",
                     stores=[trained, fresh], outputs=outputs)
        for status, out in outputs:
            assert status != 0, out[-3000:]
            assert ("the hosts' stores are at different steps: host 0 (node rank 0) at step 3, host 1 (node rank 1) "
                    "at step 0" in out), out[-3000:]
        held = [HostStore.attach(s) for s in (trained, fresh)]
        try:
            assert [st.manifest.committed_step for st in held] == [3, 0]
        finally:
            for st in held:
                st.close()
    finally:
        drop_store(fresh)


@pytest.mark.slow
def test_a_host_whose_job_differs_is_refused_naming_the_difference(tmp_path, one_host):
    """Host 1's job file has another learning rate: both launchers stop at the ready barrier, before any worker
    starts, naming it with both values (launch/host_plan.py); neither store trains."""
    outputs: list = []
    stores, _ = launch_hosts(tmp_path, one_host[0], 2, 1, tmp_path / "ck", name="differ", outputs=outputs,
                             own={1: ("train.lr=0.002",)})
    try:
        for status, out in outputs:
            assert status == 1, out[-3000:]
            assert "host 1 (node rank 1)'s job differs from host 0's: train.lr 0.002 (host 0: " in out, out[-3000:]
            assert "worker rank" not in out, out[-3000:]
        held = [HostStore.attach(s) for s in stores]
        try:
            assert [st.manifest.committed_step for st in held] == [0, 0]
        finally:
            for st in held:
                st.close()
    finally:
        for s in stores:
            drop_store(s)
