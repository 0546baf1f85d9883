"""Several hosts on one machine (docs/multi-host.md): H launchers, each with its own store, daemons and CPU
workers, meeting over loopback (Gloo), against one host with the same global batch.

Each "host" is a launcher started with --nnodes H --node-rank R --master-addr 127.0.0.1 --master-port P and a
store of its own, which holds only its part of the state (store/part.py). The ranks of every host form one process group and take the sharded and reduce_scatter
routes over it, so host R's updaters update host R's range of every chunk and nothing else: the union of
the hosts' ranges must be the one-host store's weights and moments, to float32 rounding, and every host's
logged loss and gradient norm the one host's (clipping at 0.5 crosses its threshold: the norms are ~2).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from slidedp.store.part import StorePart
from slidedp.store.store import STATE_KINDS, HostStore

from data.common import write_model_folder
from data.test_equivalence import GLOBAL_BATCH, STEPS, job_sets
from pipeline.harness import TINY, launch, metrics, rel_err, unique_store
from reliability import drop_store


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


def host_sets(folder, workers: int, hosts: int, store: str, run_dir) -> list[str]:
    sets = [s for s in job_sets(folder, workers, 1, "packed", 0.5, store, run_dir) if not s.startswith("plan.micro")]
    return sets + [f"plan.micro_batch={GLOBAL_BATCH // (workers * hosts)}", "store.persist=true",
                   "checkpoint.final=false"]


def launch_hosts(tmp_path, folder, hosts: int, workers: int) -> tuple[list[str], list]:
    """H launchers at once; returns (their stores, their run dirs) once all have ended well."""
    port = free_ports()
    stores = [unique_store(f"h{r}") for r in range(hosts)]
    runs = [tmp_path / f"host{r}" for r in range(hosts)]
    procs = []
    for r in range(hosts):
        argv = [sys.executable, "-m", "slidedp.launch.cli", str(TINY), "--nnodes", str(hosts), "--node-rank", str(r),
                "--master-addr", "127.0.0.1", "--master-port", str(port)]
        for s in host_sets(folder, workers, hosts, stores[r], runs[r]):
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
    """The same job on one host of 2 ranks: its metrics and its store's state."""
    tmp = tmp_path_factory.mktemp("one")
    folder = write_model_folder(tmp / "model", "qwen3", tied=False, seed=2)
    store, run_dir = unique_store("h"), tmp / "run"
    proc = launch(TINY, *host_sets(folder, 2, 1, store, run_dir), cwd=tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    try:
        yield folder, metrics(run_dir), one_host_state(store)
    finally:
        drop_store(store)


@pytest.mark.parametrize("hosts,workers", [(2, 2), (3, 1)])
def test_hosts_train_what_one_host_trains(tmp_path, one_host, hosts, workers):
    folder, want, want_state = one_host
    stores, runs = launch_hosts(tmp_path, folder, hosts, workers)
    try:
        assert all(n["grad_norm"] > 0.5 for n in want)  # clipping acts
        for run in runs:  # every host logs the global loss and norm
            got = metrics(run)
            assert [m["step"] for m in got] == list(range(STEPS))
            for g, w in zip(got, want):
                assert g["loss"] == pytest.approx(w["loss"], rel=1e-6), (g, w)
                assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5), (g, w)
        state = host_state(stores, workers)
        for k in STATE_KINDS:
            assert rel_err(state[k], want_state[k]) < 1e-5, k
    finally:
        for s in stores:
            drop_store(s)
