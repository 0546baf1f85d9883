"""Security: private segments and run directory, sockets only in it, no pickle anywhere, no path escapes.

Checked on a real job started with umask 000, so every mode is set explicitly, never inherited.
"""

from __future__ import annotations

import ast
import json
import os
import socket
import stat
from pathlib import Path

import psutil
import pytest
import torch

from slidedp import paths
from slidedp.store import checkpoint as ckpt
from slidedp.store.client import StoreRequestError, call
from slidedp.store.shm import SHM_DIR, PREFIX

from . import TINY, RunningJob, drop_store, fast_sets, unique_store
from pipeline.harness import ROOT


def _mode(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_private_segments_run_dir_and_sockets(tmp_path):
    store = unique_store("sec")
    run_dir = tmp_path / "run"
    job = RunningJob.start(TINY, fast_sets(store, run_dir, "train.steps=40"), tmp_path, store, umask=0)
    try:
        job.wait_step(2, run_dir)
        procs = [psutil.Process(job.proc.pid)] + [p for ps in job.processes().values() for p in ps]
        kinds = sorted({k for k, ps in job.processes().items() if ps})
        assert kinds == ["aggregator", "hoststate", "updater", "updater_member", "worker"]
        # segments: every one of the store's, the job's gradient rings included, is 0600 and ours
        segs = sorted(e for e in os.listdir(SHM_DIR) if e.startswith(f"{PREFIX}{store}."))
        assert [s.rsplit(".", 1)[1] for s in segs] == ["exp_avg", "exp_avg_sq", "grads", "manifest", "master", "reduce"]
        for s in segs:
            st = os.stat(os.path.join(SHM_DIR, s))
            assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o600, os.getuid()), s
        # the run dir: 0700, its lock files 0600, its sockets reachable only through it
        rd = paths.run_dir(store, create=False)
        assert _mode(rd) == 0o700 and os.stat(rd).st_uid == os.getuid()
        for entry in rd.iterdir():
            if entry.suffix == ".lock":
                assert _mode(entry) == 0o600, entry
        socks = sorted(e.name for e in rd.iterdir() if stat.S_ISSOCK(e.lstat().st_mode))
        assert socks == ["agg.sock", "control.sock", "job.sock"]
        # every socket of every process of the job: unix sockets inside the run dir (or unnamed), nothing on a network
        named = 0
        for p in procs:
            for c in p.net_connections(kind="all"):
                assert c.family == socket.AF_UNIX, f"{p.cmdline()[:4]} has a network socket: {c}"
                for addr in (c.laddr, c.raddr):
                    if addr:
                        assert Path(addr).parent == rd, f"{p.cmdline()[:4]} uses a socket outside {rd}: {addr}"
                        named += 1
        assert named >= 3  # the three listening sockets at least
    finally:
        job.cleanup()
        drop_store(store)


# ---- no pickle in the source tree ------------------------------------------------------------------
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "joblib", "marshal"}
# np.load of a user-supplied file without allow_pickle=False, waiting for its one-line fix (see the report);
# remove the entry when slidedp/worker.py passes allow_pickle=False (or uses slidedp.data.stream.read_npy).
KNOWN: set[tuple[str, str]] = set()


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def pickle_uses(source: str) -> list[tuple[int, str]]:
    """Every way a file could unpickle: imports of pickle-like modules, pickle.*, torch.load without
    weights_only=True, np.load without allow_pickle=False, allow_pickle=True anywhere."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, f"import {a.name}") for a in node.names if a.name.split(".")[0] in PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLE_MODULES:
            out.append((node.lineno, f"from {node.module} import"))
        elif isinstance(node, ast.Attribute) and _dotted(node.value) in PICKLE_MODULES:
            out.append((node.lineno, f"{_dotted(node)}"))
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            kw = {k.arg: k.value for k in node.keywords}
            const = {k: v.value for k, v in kw.items() if isinstance(v, ast.Constant)}
            if name == "torch.load" and const.get("weights_only") is not True:
                out.append((node.lineno, "torch.load without weights_only=True"))
            if name in ("np.load", "numpy.load") and const.get("allow_pickle") is not False:
                out.append((node.lineno, "np.load without allow_pickle=False"))
            if const.get("allow_pickle") is True:
                out.append((node.lineno, "allow_pickle=True"))
            if name in ("pd.read_pickle", "pandas.read_pickle"):
                out.append((node.lineno, name))
    return sorted(out)


def test_the_checker_finds_each_pattern():
    bad = ("import pickle\nfrom dill import loads\nimport torch, numpy as np\nx = pickle.loads(b'')\n"
           "torch.load('m.pt')\ntorch.load('m.pt', weights_only=False)\nnp.load('t.npy')\n"
           "np.save('t.npy', x, allow_pickle=True)\n")
    assert [w for _, w in pickle_uses(bad)] == [
        "import pickle", "from dill import", "pickle.loads", "torch.load without weights_only=True",
        "torch.load without weights_only=True", "np.load without allow_pickle=False", "allow_pickle=True"]
    good = ("import torch, numpy as np\ntorch.load('m.pt', weights_only=True)\n"
            "np.load('t.npy', mmap_mode='r', allow_pickle=False)\n'''never pickle. here'''  # pickle.loads\n")
    assert pickle_uses(good) == []


def test_no_pickle_in_the_source_tree():
    found = []
    for top in ("slidedp", "daemons", "launch", "benchmarks"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            found += [(rel, line, what) for line, what in pickle_uses(path.read_text())]
    unexpected = [f for f in found if (f[0], f[2]) not in KNOWN]
    assert unexpected == [], "\n".join(f"{f}:{line}: {what}" for f, line, what in unexpected)


# ---- checkpoints cannot reach outside their folder ------------------------------------------------------
@pytest.fixture
def tiny_checkpoint(tmp_path):
    store = unique_store("secck")
    try:
        call(store, "create", source="random", shape="tiny", vocab_size=512, init_seed=0)
        out = call(store, "checkpoint", dir=str(tmp_path / "ck"), dtype="fp32", keep=3)
        yield store, Path(out["path"])
    finally:
        drop_store(store)


def _edit_record(path: Path, edit) -> None:
    record = json.loads((path / "state.json").read_text())
    edit(record)
    (path / "state.json").write_text(json.dumps(record))


@pytest.mark.parametrize("name", ["../secret.safetensors", "model/../../secret.safetensors", "/etc/hostname",
                                  "model/link.safetensors"])
def test_read_record_rejects_files_outside_the_checkpoint(tiny_checkpoint, name):
    store, path = tiny_checkpoint
    (path.parent / "secret.safetensors").write_bytes(b"outside")
    if name == "model/link.safetensors":
        os.symlink("/etc/hostname", path / "model" / "link.safetensors")  # a link that leads out
    _edit_record(path, lambda r: r["files"].__setitem__(name, "0" * 64))
    with pytest.raises(ckpt.CheckpointError, match=rf"state\.json names a file outside the checkpoint: {name!r}"):
        ckpt.read_record(path)
    assert ckpt.latest_valid(path.parent) is None  # and resume = "latest" will not pick it
    with pytest.raises(StoreRequestError, match="names a file outside the checkpoint"):
        call(store, "restore", path=str(path))
    assert call(store, "status")["torn"] is None  # refused before anything was written


def test_master_in_cannot_point_outside(tiny_checkpoint, tmp_path):
    """state.json's master_in names where the master weights are: only "model" or "state" of this checkpoint."""
    store, path = tiny_checkpoint
    from slidedp.model import hf

    elsewhere = tmp_path / "elsewhere" / "model"  # a valid folder of the same model, outside the checkpoint
    hf.write_folder(elsewhere, hf.read_config(path / "model"), lambda n: hf.load_tensor(path / "model", n) + 1.0,
                    dtype=torch.float32)
    _edit_record(path, lambda r: r.__setitem__("master_in", "../../elsewhere/model"))
    with pytest.raises(ckpt.CheckpointError, match=r"master_in must be 'state' or 'model', got '\.\./\.\./elsewhere/model'"):
        ckpt.read_record(path)
    with pytest.raises(StoreRequestError, match="master_in must be"):
        call(store, "restore", path=str(path))
    assert call(store, "status")["torn"] is None
