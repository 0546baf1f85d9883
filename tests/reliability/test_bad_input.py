"""Bad input of every kind: a clear error naming what to fix, and the store and its daemons unharmed.

The daemons here are started by the test (as systemd would), so a launcher that fails cannot
take them down with it; after each failure they must still run (same pids) and the store must
be as it was. Launches that fail before training run in this process (`run_job`, fast); the
command-line exit codes are checked once with a real `slidedp-launch`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from slidedp.config import ConfigError, load_job
from slidedp.launch.jobrun import run_job
from slidedp.launch.planning import plan_job
from slidedp.launch.progress import Progress
from slidedp.model import hf
from slidedp.model.config import named_shape
from slidedp.planner import Calibration, PlanError
from slidedp.store.client import StoreRequestError, call
from slidedp.store.shm import list_store_segments

from . import PY, TINY, RunningJob, daemon_pids, drop_store, fast_sets, start_daemons, stop_daemons, unique_store

TINY_CFG = named_shape("tiny", 512)  # examples/tiny.toml's model


# ---- fixtures: daemons started by the test -------------------------------------------------------
class Served:
    """A store served by daemons the test started; `check()` asserts they and the store are unharmed."""

    def __init__(self, store: str, procs, status: dict | None) -> None:
        self.store, self.procs, self.status = store, procs, status
        self.pids = daemon_pids(store)

    def check(self) -> None:
        assert daemon_pids(self.store) == self.pids, "a daemon of the store died"
        assert all(p.poll() is None for p in self.procs)
        st = call(self.store, "status", timeout_s=30)
        if self.status is None:
            assert not st["exists"] and not list_store_segments().get(self.store), "a failed create left segments"
        else:
            keep = ("committed_step", "torn", "attached_pid", "layout_hash", "generation", "segments")
            assert {k: st[k] for k in keep} == {k: self.status[k] for k in keep}


@pytest.fixture(scope="module")
def served():
    """Store S (the tiny model, created) with its three daemons."""
    store = unique_store("bad")
    procs = start_daemons(store)
    try:
        call(store, "create", timeout_s=120, source="random", shape="tiny", vocab_size=512, init_seed=0)
        yield Served(store, procs, call(store, "status", timeout_s=30))
    finally:
        stop_daemons(procs)
        drop_store(store)


@pytest.fixture(scope="module")
def unserved_store_daemons():
    """Daemons for a store that does not exist yet: bad models fail while the host-state daemon creates it."""
    store = unique_store("badnew")
    procs = start_daemons(store)
    try:
        yield Served(store, procs, None)
    finally:
        stop_daemons(procs)
        drop_store(store)


def run_inprocess(sets: list[str], caplog, job: Path = TINY) -> tuple[int, str]:
    """run_job in this process (the launcher minus its CLI): (exit code, the launcher's log)."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    caplog.clear()
    try:
        with caplog.at_level(logging.INFO, logger="slidedp.launcher"):
            cfg = load_job(job, sets)
            rc = run_job(cfg, job, Progress(cfg.store_name, 1, stream=open(os.devnull, "w")))
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    return rc, "\n".join(r.getMessage() for r in caplog.records)


def tiny_hf(folder: Path, cfg=TINY_CFG) -> Path:
    gen = torch.Generator().manual_seed(0)
    hf.write_folder(folder, cfg, {n: torch.randn(s, generator=gen) * 0.02 for n, s in cfg.parameter_shapes()},
                    dtype=torch.float32)
    return folder


def rewrite_header(path: Path, edit) -> None:
    """Edit a safetensors header in place (same length, padded with spaces), data untouched."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n
    path.write_bytes(raw[:8] + new + b" " * (n - len(new)) + raw[8 + n:])


# ---- the job file ----------------------------------------------------------------------------------
JOB_FILE_ERRORS = [
    # (text appended to / replacing the job file, expected message)
    ("[train\nsteps = 3", r"tiny-bad\.toml: malformed TOML: "),
    ("steps = 'ten'", r"train\.steps must be an integer, got 'ten' \(str\)"),
    ("steps = 0", r"train\.steps must be >= 1; got 0"),
    ("lr = -1.0", r"train\.lr must be > 0; got -1\.0"),
    ("beta2 = 1.0", r"train\.beta2 must be in \[0, 1\); got 1\.0"),
    ("compute_dtype = 'fp64'", r"plan\.compute_dtype must be one of 'auto', 'bf16', 'fp32'; got 'fp64'"),
    ("lr_typo = 1.0", r"unknown key train\.lr_typo; allowed keys in \[train\]: steps, "),
    ("micro_batch = 3", r"plan\.micro_batch \(3\) must divide train\.global_batch \(8\)"),
]


@pytest.mark.parametrize("edit,message", JOB_FILE_ERRORS, ids=[m[:22] for _, m in JOB_FILE_ERRORS])
def test_job_file_errors(tmp_path, edit, message):
    text = TINY.read_text()
    key = edit.split(" = ")[0]
    if edit.startswith("[train\n"):
        text = text.replace("[train]", edit.split("\n")[0])
    elif re.search(rf"^{key} = .*$", text, re.M):
        text = re.sub(rf"^{key} = .*$", edit, text, flags=re.M)
    else:
        text = text.replace("[train]\n", f"[train]\n{edit}\n")
    path = tmp_path / "tiny-bad.toml"
    path.write_text(text.replace('"data/', f'"{TINY.parent}/data/'))
    with pytest.raises(ConfigError, match=message):
        load_job(path)


@pytest.mark.parametrize("sets,message", [
    (['runtime.workers=3'], r"train\.global_batch \(8\) must be divisible by runtime\.workers \(3\) x plan\.micro_batch \(2\)"),
    (['runtime.timeout_s=0'], r"runtime\.timeout_s must be > 0; got 0\.0"),
    (['model.source="hf"', 'model.path="/nonexistent/model"', "model.vocab_size=0"],
     r"model\.path: model folder '/nonexistent/model' does not exist"),
    (['data.path="missing.jsonl"'], r"data\.path: data file '.*/missing\.jsonl' does not exist"),
    (['store.name="../escape"'], r"store\.name: store name '\.\./escape' is not allowed"),
    (['checkpoint.resume="/nonexistent/step-00000002"'], r"checkpoint\.resume: checkpoint '/nonexistent/step-00000002' does not exist"),
    (["train.warmup_steps=-1"], r"train\.warmup_steps must be >= 0; got -1"),
    (["train.lr=nan"], r"train\.lr must be > 0; got nan"),
    (['checkpoint.resume="soonest"'], r"checkpoint\.resume: checkpoint '.*/soonest' does not exist"),
])
def test_override_errors(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_job(TINY, sets)


def test_model_folder_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"model\.path: '.*/empty' has no config\.json; is it a Hugging Face checkpoint folder\?"):
        load_job(TINY, ['model.source="hf"', f'model.path="{empty}"', "model.vocab_size=0"])
    garbage = tiny_hf(tmp_path / "garbage")
    (garbage / "config.json").write_bytes(b"\xff\xfe{not json")
    job = load_job(TINY, ['model.source="hf"', f'model.path="{garbage}"', "model.vocab_size=0"])
    from slidedp.config import model_config

    with pytest.raises(hf.CheckpointError, match=r"config\.json is not valid JSON"):
        model_config(job)
    if os.geteuid() != 0:  # root reads anything: only an ordinary user can have an unreadable folder
        locked = tiny_hf(tmp_path / "locked")
        os.chmod(locked / "config.json", 0)
        with pytest.raises((ConfigError, hf.CheckpointError, PermissionError)):
            model_config(load_job(TINY, ['model.source="hf"', f'model.path="{locked}"', "model.vocab_size=0"]))


def test_command_line_exit_codes(tmp_path):
    """A job-file error exits 2 naming the key; a failure at run time exits 1 with `job failed:`."""
    bad = tmp_path / "bad.toml"
    bad.write_text(TINY.read_text().replace("steps = 60", "steps = -5").replace('"data/', f'"{TINY.parent}/data/'))
    p = subprocess.run([PY, "-m", "slidedp.launch.cli", str(bad)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 2
    assert p.stderr.strip().endswith("bad.toml: train.steps must be >= 1; got -5"), p.stderr


# ---- models -------------------------------------------------------------------------------------
def _hf_sets(store: str, folder: Path, tmp_path: Path) -> list[str]:
    return fast_sets(store, tmp_path / "run", 'model.source="hf"', f'model.path="{folder}"', "model.vocab_size=0")


def test_unsupported_architecture(tmp_path, caplog, unserved_store_daemons):
    folder = tiny_hf(tmp_path / "gpt2")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, architectures=["GPT2LMHeadModel"], model_type="gpt2")))
    rc, logs = run_inprocess(_hf_sets(unserved_store_daemons.store, folder, tmp_path), caplog)
    assert rc == 1
    # read as a transformers family (its tensors are named as SlideDP's layout reads them), then refused
    # before any store is made: transformers' GPT-2 has other tensors
    assert re.search(r"job failed: the gpt2 model transformers builds from this config\.json \(GPT2LMHeadModel\) does "
                     r"not have the folder's tensors: it has, the folder lacks \['transformer\.h\.0\.attn\.c_attn\.bias'",
                     logs), logs
    assert "creating store" not in logs
    unserved_store_daemons.check()


def _truncate(folder: Path) -> str:
    f = folder / hf.SINGLE_FILE
    size = f.stat().st_size
    os.truncate(f, size // 2)
    return rf"{re.escape(str(f))} is truncated: tensor '[^']+' needs bytes up to \d+ but the file has {size // 2} bytes"


def _shape_lie(folder: Path) -> str:
    def edit(h):
        h["model.embed_tokens.weight"]["shape"] = [64, 512]  # right size, transposed

    rewrite_header(folder / hf.SINGLE_FILE, edit)
    return r"tensor 'model\.embed_tokens\.weight' has shape \(64, 512\); the config expects \(512, 64\)"


def _size_lie(folder: Path) -> str:
    def edit(h):
        h["model.norm.weight"]["shape"] = [65]  # does not fit its byte range

    rewrite_header(folder / hf.SINGLE_FILE, edit)
    return (r"the header of tensor 'model\.norm\.weight' is inconsistent: dtype F32 x shape \[65\] = 260 bytes, "
            r"but data_offsets \[\d+, \d+\] span 256 bytes")


def _dtype_lie(folder: Path) -> str:
    def edit(h):
        h["model.norm.weight"]["dtype"] = "F16"

    rewrite_header(folder / hf.SINGLE_FILE, edit)
    return r"the header of tensor 'model\.norm\.weight' is inconsistent: dtype F16 x shape \[64\] = 128 bytes"


def _int_dtype(folder: Path) -> str:
    def edit(h):
        h["model.norm.weight"]["dtype"] = "I32"

    rewrite_header(folder / hf.SINGLE_FILE, edit)
    return r"tensor 'model\.norm\.weight' has dtype I32; expected one of F64, F32, F16, BF16"


@pytest.mark.parametrize("damage", [_truncate, _shape_lie, _size_lie, _dtype_lie, _int_dtype],
                         ids=["truncated", "shape-lie", "size-lie", "dtype-lie", "int-dtype"])
def test_damaged_safetensors(tmp_path, caplog, unserved_store_daemons, damage):
    """Found while the host-state daemon creates the store; it refuses, leaves no segment, and serves on."""
    folder = tiny_hf(tmp_path / "model")
    want = damage(folder)
    rc, logs = run_inprocess(_hf_sets(unserved_store_daemons.store, folder, tmp_path), caplog)
    assert rc == 1
    assert re.search(r"job failed: " + ".*" + want, logs), (want, logs)
    unserved_store_daemons.check()


def test_shm_too_small(tmp_path, caplog, unserved_store_daemons):
    """random:qwen3-14b needs ~165 GiB of shared memory: refused before anything is created."""
    rc, logs = run_inprocess(fast_sets(unserved_store_daemons.store, tmp_path / "run", 'model.shape="qwen3-14b"',
                                       "model.vocab_size=0"), caplog)
    assert rc == 1
    m = re.search(r"job failed: the job needs (\d+\.\d+) GiB of shared memory \(the store's state \(12 B/param\) "
                  r"165\.0 GiB, gradient rings .*\) but /dev/shm has only (\d+\.\d+) GiB free; enlarge it \(e\.g\. "
                  r"`mount -o remount,size=<N>G /dev/shm`\) or choose a smaller model/store", logs)
    assert m and float(m.group(1)) > float(m.group(2)), logs
    unserved_store_daemons.check()


def test_gpu_budget_too_small():
    """No plan fits 1 GiB for Qwen3-14B: the planner says the smallest budget that would and what to turn."""
    job = load_job(TINY, ['runtime.device="cuda"', 'model.shape="qwen3-14b"', "model.vocab_size=0",
                          "memory.device_budget_gib=1.0", 'train.compute_dtype="bf16"'])
    cal = Calibration(host="test", device_name="H200 (synthetic)", h2d_gbps=50.0, d2h_gbps=50.0, bidir_gbps=80.0,
                      adamw_params_per_s=2e9, adamw_threads=32, reduce_gbps=20.0, device_tflops=400.0,
                      device_mem_bytes=140 * 2**30)
    with pytest.raises(PlanError, match=r"^no plan fits the GPU memory budget of 1\.00 GiB: the smallest plan needs "
                                        r"(\d+\.\d+) GiB \(.*\) and its largest item is .*\. Raise the budget to at "
                                        r"least \1 GiB, "):
        plan_job(job, cal)
    with pytest.raises(PlanError, match=r"the GPU memory budget \(200\.00 GiB\) exceeds the memory of H200 \(synthetic\) "
                                        r"\(140\.00 GiB\): lower the budget"):
        plan_job(load_job(TINY, ['runtime.device="cuda"', "memory.device_budget_gib=200"]), cal)


# ---- data and store mismatches against a served store ------------------------------------------------
def test_token_ids_outside_vocab(tmp_path, caplog, served):
    tokens = np.arange(10_000, dtype=np.int64) % 512
    tokens[4321] = 600
    np.save(tmp_path / "tokens.npy", tokens)
    rc, logs = run_inprocess(fast_sets(served.store, tmp_path / "run", 'data.format="npy"',
                                       f'data.path="{tmp_path / "tokens.npy"}"', 'data.tokenizer=""'), caplog)
    assert rc == 1
    assert (f"job failed: {tmp_path / 'tokens.npy'}: token id 600 at position 4321 is outside the vocabulary [0, 512) "
            f"of the model; does the data's tokenizer match the model?") in logs, logs
    served.check()


class _Payload:
    """Unpickling this creates a file: proof that a token file was (or was not) unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_pickled_npy_is_refused(tmp_path, caplog, served):
    marker = tmp_path / "unpickled"
    np.save(tmp_path / "tokens.npy", np.array([_Payload(marker)], dtype=object), allow_pickle=True)
    rc, logs = run_inprocess(fast_sets(served.store, tmp_path / "run", 'data.format="npy"',
                                       f'data.path="{tmp_path / "tokens.npy"}"', 'data.tokenizer=""'), caplog)
    assert rc == 1
    assert re.search(r"job failed: .*tokens\.npy: not a readable \.npy token file: ", logs), logs
    assert not marker.exists(), "the token file was unpickled"
    served.check()


def test_model_does_not_match_the_store(tmp_path, caplog, served):
    rc, logs = run_inprocess(fast_sets(served.store, tmp_path / "run", 'model.shape="tiny-llama"'), caplog)
    assert rc == 1
    assert (f"job failed: store '{served.store}' holds another model (random:tiny, 106,880 parameters) than this job "
            f"(random:tiny-llama): family: store 'qwen3', job 'llama'; intermediate_size: store 128, job 160; qk_norm: "
            f"store True, job False; tie_word_embeddings: store True, job False; set store.name to another store, or "
            f"destroy it with `slidedp-store destroy {served.store}`") in logs, logs
    # the daemon's own check, for a client that skips the launcher's
    with pytest.raises(StoreRequestError, match=r"the job's model does not match store .*: the store holds random:tiny "
                                                r"\(qwen3, 106,880 parameters, layout [0-9a-f]{12}\), the job asks for "
                                                r"layout 0123456789ab"):
        call(served.store, "attach", timeout_s=30, job="x", pid=os.getpid(), layout_hash="0123456789abcdef", world=1)
    served.check()


def test_model_mismatch_names_the_fields_that_differ(tmp_path, caplog, served):
    """The same named shape with another vocabulary: the refusal says which field differs, not the name twice."""
    rc, logs = run_inprocess(fast_sets(served.store, tmp_path / "run", "model.vocab_size=1024"), caplog)
    assert rc == 1
    assert re.search(r"holds another model \(random:tiny, 106,880 parameters\) than this job \(random:tiny\): "
                     r"vocab_size: store 512, job 1024; set store.name", logs), logs
    served.check()


def test_resume_with_other_data_is_refused(tmp_path, caplog, served):
    """A checkpoint records where in the data it stopped; resuming it with other data (here data.seed) would
    silently train on other batches, so it is refused naming the keys to check, and the store is untouched."""
    pos = {"epoch": 0, "position": 0, "seed": 0}
    call(served.store, "checkpoint", timeout_s=60, dir=str(tmp_path / "ck"), dtype="fp32", keep=2,
         extra={"data": pos})
    rc, logs = run_inprocess(fast_sets(served.store, tmp_path / "run", f'checkpoint.dir="{tmp_path / "ck"}"',
                                       'checkpoint.resume="latest"', "data.shuffle=true", "data.seed=5"), caplog)
    assert rc == 1
    assert re.search(r"job failed: cannot resume from .*/ck/step-\d{8}: the checkpoint's data position "
                     r"\{'epoch': 0, 'position': 0, 'seed': 0\} does not match \{'epoch': 0, 'position': 0, 'seed': 5\} "
                     r"for step \d+ with this data; did the data, train.global_batch, train.seq_len or data.seed change\?",
                     logs), logs
    served.check()


def test_second_launcher_is_refused_and_the_store_still_trains(tmp_path, caplog, served):
    """While a job runs on the store, a second launcher (same job file, same run dir) is refused and
    changes nothing; the first job -- after every bad input above -- trains to the end."""
    run_dir = tmp_path / "run"
    sets = fast_sets(served.store, run_dir, "train.steps=12")
    first = RunningJob.start(TINY, sets, tmp_path, served.store)
    try:
        first.wait_step(2, run_dir)
        rc, logs = run_inprocess(sets, caplog)
        assert rc == 1
        assert re.search(rf"job failed: store '{served.store}' already has a job attached: 'tiny' \(launcher pid "
                         rf"{first.proc.pid}\); wait for it to finish or stop it", logs), logs
        assert first.wait_exit(240) == 0, first.output[-4000:]
    finally:
        first.cleanup()
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(12))
    st = call(served.store, "status", timeout_s=30)
    assert (st["committed_step"], st["torn"], st["attached_pid"]) == (12, None, 0)
    assert daemon_pids(served.store) == served.pids
    served.status = st  # the new state every later check compares with
