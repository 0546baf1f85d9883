"""slidedp-launch --dry-run: one test per misconfiguration a real run would hit later, and nothing created."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch

from slidedp import paths
from slidedp.config import load_job
from slidedp.launch import cli, dryrun
from slidedp.model import hf
from slidedp.model.config import named_shape
from slidedp.store.layout import make_layout
from slidedp.store.shm import list_store_segments, unlink_store
from slidedp.store.store import HostStore

from pipeline.harness import TINY, unique_store
from .conftest import STEPS


def dry(tmp_path: Path, *sets: str, store: str | None = None) -> tuple[int, str]:
    """Dry-run examples/tiny.toml with overrides; asserts it created nothing."""
    store = store or unique_store("dry")
    run_dir = tmp_path / "run"
    before = list_store_segments().get(store)
    job = load_job(TINY, [f'store.name="{store}"', f'run.dir="{run_dir}"', *sets])
    out = io.StringIO()
    rc = dryrun.dry_run(job, TINY, out)
    assert list_store_segments().get(store) == before, "the dry run created or removed the store's segments"
    assert not job.run_dir.exists() or job.run_dir == run_dir.parent, "the dry run created the run directory"
    assert not paths.run_dir(store, create=False).exists(), "the dry run created the store's socket directory"
    return rc, out.getvalue()


def problems(text: str) -> list[str]:
    return [line.split("PROBLEM: ", 1)[1] for line in text.splitlines() if "PROBLEM: " in line]


def npy_data(tmp_path: Path, tokens: np.ndarray) -> list[str]:
    path = tmp_path / "tokens.npy"
    np.save(path, tokens)
    return ['data.format="npy"', f'data.path="{path}"', 'data.tokenizer=""']


@pytest.fixture
def made_store():
    """Stores made directly in shared memory (no daemon), removed afterwards."""
    names: list[str] = []

    def make(shape: str, vocab: int = 512) -> HostStore:
        name = unique_store("dry")
        names.append(name)
        return HostStore.create(name, make_layout(named_shape(shape, vocab)), {"source": f"random:{shape}"})

    yield make
    for name in names:
        unlink_store(name)


def test_a_good_job(tmp_path):
    rc, text = dry(tmp_path)
    assert rc == 0, text
    assert problems(text) == []
    lines = text.splitlines()
    assert lines[-1].startswith("dry run: no problems found (") and lines[-1].endswith("nothing was started or created")
    assert "model      random:tiny: qwen3, 2 layers, vocabulary 512, 106,880 parameters in 4 chunks" in text
    assert "60,505 tokens, 945 sequences of 64; 60 steps x 8 sequences = 0.51 epoch(s)" in text
    assert "would create store 'dry-" in text and "1.2 MiB of state (12 bytes/parameter)" in text
    assert "steps      would train steps 0..59 on 2 cpu rank(s): 2 micro-batch(es) of 2 x 64 tokens per rank" in text
    assert "would start slidedp-hoststate, slidedp-aggregator, slidedp-updater as child processes" in text
    assert "plan       CPU run: no plan needed (resident_layers=0, embedding=host, micro_batch=2, delivery=fp32)" in text


def test_exit_status_through_the_cli(tmp_path, capsys, monkeypatch):
    store = unique_store("dry")
    argv = ["--dry-run", str(TINY), "--store", store, "--set", f'run.dir="{tmp_path / "run"}"']
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("dry run: no problems found (")
    monkeypatch.setattr(dryrun, "shm_free_bytes", lambda: 2**20)
    assert cli.main(argv) == 1
    assert " of shared memory (" in (out := capsys.readouterr().out) and " but /dev/shm has only 1.0 MiB free" in out
    assert store not in list_store_segments() and not (tmp_path / "run").exists()


def test_config_error_through_the_cli(tmp_path, capsys):
    assert cli.main(["--dry-run", str(TINY), "--set", "train.global_batch=6"]) == 1
    out = capsys.readouterr().out
    assert problems(out) == [f"{TINY}: train.global_batch (6) must be divisible by runtime.workers (2) x "
                             f"plan.micro_batch (2) = 4"]


def test_every_configuration_error_at_once(tmp_path, capsys):
    """Four bad keys in three sections and an unknown one: all reported in one dry run, not one per try."""
    sets = ["train.steps=0", "train.lr=-1", "runtime.workers=0", "checkpoint.keep=0", "run.log_evry=2"]
    assert cli.main(["--dry-run", str(TINY), *[a for s in sets for a in ("--set", s)]]) == 1
    out = capsys.readouterr().out
    assert problems(out) == [f"{TINY}: train.steps must be >= 1; got 0",
                             f"{TINY}: train.lr must be > 0; got -1.0",
                             f"{TINY}: checkpoint.keep must be >= 1; got 0",
                             f"{TINY}: unknown key run.log_evry; allowed keys in [run]: name, dir, log_every, "
                             f"trace_steps, overwrite, tensorboard",
                             f"{TINY}: runtime.workers must be >= 1; got 0"]
    assert out.splitlines()[-1] == "dry run: 5 problem(s) a run would hit; nothing was started or created"
    # the same list from a real launch, one line each, before anything starts
    assert cli.main([str(TINY), *[a for s in sets for a in ("--set", s)]]) == 2
    assert capsys.readouterr().err.splitlines() == [f"slidedp-launch: error: {p}" for p in problems(out)]


def test_a_store_a_running_job_holds_is_in_use_not_torn(tmp_path, made_store):
    """Mid-step a running job's store has mixed chunk versions and leased layers: that is a job at work, not a
    torn store, and the dry run says only that the store is in use."""
    st = made_store("tiny")
    try:
        st.manifest.set_committed_step(7)
        st.manifest.versions[:] = 7
        st.manifest.versions[0] = 8  # chunk 0 already updated for step 7, the others not yet
        st.manifest.updating[1] = 2  # LEASED: held on the job's GPUs
        st.manifest.set_attached(os.getpid(), 1)
        rc, text = dry(tmp_path, store=st.name)
        assert rc == 1 and problems(text) == [f"store {st.name!r} has a job attached: '?' (launcher pid "
                                              f"{os.getpid()}); wait for it to finish or stop it"]
        assert "torn" not in text, text
    finally:
        st.close()


def test_token_outside_the_vocabulary(tmp_path):
    tokens = np.arange(2000, dtype=np.int32) % 500
    tokens[1234] = 600
    rc, text = dry(tmp_path, *npy_data(tmp_path, tokens))
    assert rc == 1
    assert problems(text) == [f"{tmp_path / 'tokens.npy'}: token id 600 at position 1234 is outside the vocabulary "
                              "[0, 512) of the model; does the data's tokenizer match the model?"]


def test_too_few_sequences_for_the_batch(tmp_path):
    rc, text = dry(tmp_path, *npy_data(tmp_path, np.arange(400, dtype=np.int32)))
    assert rc == 1
    assert problems(text) == [f"{tmp_path / 'tokens.npy'}: 400 tokens make 6 sequences of seq_len 64 (+1 target token), "
                              "fewer than train.global_batch (8); use more data or a smaller batch"]


def hf_folder(tmp_path: Path) -> Path:
    cfg = named_shape("tiny", 512)
    folder = tmp_path / "hf"
    hf.write_folder(folder, cfg, {n: torch.zeros(s) for n, s in cfg.parameter_shapes()}, dtype=torch.float32)
    return folder


def test_hf_folder_good_and_mismatched(tmp_path):
    folder = hf_folder(tmp_path)
    sets = ('model.source="hf"', f'model.path="{folder}"', "model.vocab_size=0")
    rc, text = dry(tmp_path, *sets)
    assert rc == 0, text
    assert f"model      {folder}: qwen3, 2 layers, vocabulary 512" in text
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] += 8
    (folder / "config.json").write_text(json.dumps(config))
    rc, text = dry(tmp_path, *sets)
    assert rc == 1
    [p] = problems(text)
    assert p == (f"{folder / hf.SINGLE_FILE}: tensor 'model.layers.0.mlp.gate_proj.weight' has shape (128, 64); "
                 "the config expects (136, 64)")
    assert "data       not checked: it needs the model's vocabulary" in text


def test_the_dry_run_of_a_hugging_face_job_needs_no_torch(tmp_path):
    """The launcher reads the folder's config and headers without torch (model/hf_folder.py): importing it
    costs seconds on every job's path, before any daemon starts. A fresh interpreter shows what loads."""
    folder = hf_folder(tmp_path)
    script = (
        "import io, sys\n"
        "from slidedp.config import load_job\n"
        "from slidedp.launch import dryrun\n"
        f"job = load_job({str(TINY)!r}, ['store.name=\"{unique_store('drytorch')}\"', 'run.dir=\"{tmp_path / 'run'}\"', "
        f"'model.source=\"hf\"', 'model.path=\"{folder}\"', 'model.vocab_size=0'])\n"
        "out = io.StringIO()\n"
        f"rc = dryrun.dry_run(job, {str(TINY)!r}, out)\n"
        "print(rc, 'torch' in sys.modules)\n"
        "print(out.getvalue())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    first, _, report = done.stdout.partition("\n")
    assert first == "0 False", done.stdout
    assert f"model      {folder}: qwen3, 2 layers, vocabulary 512" in report


def test_store_too_big_for_shared_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(dryrun, "shm_free_bytes", lambda: 2 * 2**20)  # a host with 2 MiB of /dev/shm free
    rc, text = dry(tmp_path)
    assert rc == 1
    assert "would create store 'dry-" in text and "1.2 MiB of state (12 bytes/parameter) + 1.3 MiB of gradient rings = 2.5 MiB" in text
    # the launcher's words (launch/host_room.py): what the store and its rings take, and what would help
    [p] = problems(text)
    assert p.startswith("the job needs 2.5 MiB of shared memory (the store's state (12 B/param) 1.2 MiB, gradient "
                        "rings 1.3 MiB, the job's processes (2 rank(s)) 2.0 GiB) but /dev/shm has only 2.0 MiB free; enlarge it"), p


def test_memory_for_the_store_but_not_for_the_ranks_beside_it(tmp_path, monkeypatch):
    """The launcher counts the job's processes beside the store and rings (launch/host_room.py): so does the
    dry run. A host with 1.5 GiB available holds the tiny job's 2.5 MiB store, not its 2 ranks' 2 GiB."""
    from types import SimpleNamespace

    monkeypatch.setattr(dryrun.psutil, "virtual_memory", lambda: SimpleNamespace(available=3 * 2**29))
    rc, text = dry(tmp_path)
    assert rc == 1
    [p] = problems(text)
    assert p.startswith("the job needs 2.0 GiB of host memory (the store's state (12 B/param) 1.2 MiB, gradient rings "
                        "1.3 MiB, the job's processes (2 rank(s)) 2.0 GiB) but the host has 1.5 GiB available: started, it would be killed for memory. What would help: "), p


def test_the_plans_offload_buffers_are_counted_as_the_launch_counts_them(tmp_path, monkeypatch):
    """The store's check runs before the plan, so it cannot count the buffers the plan's offloaded layers
    take: once planned, the launcher's decision (admission.py) asks again with the plan's, and the dry run
    refuses in its words what the launch would refuse. A host with room for the tiny job's store, rings
    and processes, and for half of the inputs of its two offloaded layers."""
    from types import SimpleNamespace

    from slidedp.launch import host_room
    from slidedp.stepplan import StepPlan

    sets = ("plan.offload_layers=2",)
    job = load_job(TINY, list(sets))
    layout = make_layout(named_shape("tiny", 512))
    need = host_room.host_need(job, layout, StepPlan(offload_layers=2), store_exists=False, shadow=False)
    offload = dict(need.items)["offloaded inputs of 2 layer(s)"]
    assert offload == 2 * 8 * 64 * 64 * 4  # two layers x 8 sequences x 64 tokens x hidden 64, fp32
    available = need.total - offload // 2
    monkeypatch.setattr(dryrun.psutil, "virtual_memory", lambda: SimpleNamespace(available=available))
    rc, text = dry(tmp_path, *sets)
    assert rc == 1
    assert problems(text) == [host_room.room_problem(job, need, available)]
    assert f"offloaded inputs of 2 layer(s) {host_room.size(offload)}" in problems(text)[0] and "plan.offload_layers" in problems(text)[0]
    # room for the buffers too: no problem
    monkeypatch.setattr(dryrun.psutil, "virtual_memory", lambda: SimpleNamespace(available=need.total))
    rc, text = dry(tmp_path, *sets)
    assert rc == 0, text


def test_store_holding_another_model(tmp_path, made_store):
    other = made_store("tiny-llama")
    other.close()
    rc, text = dry(tmp_path, store=other.name)
    assert rc == 1
    # the launch's own words (admission.py), as it would refuse the job
    assert problems(text) == [
        f"store {other.name!r} holds another model (random:tiny-llama, {other.layout.num_parameters:,} parameters) "
        f"than this job (random:tiny): family: store 'llama', job 'qwen3'; intermediate_size: store 160, job 128; "
        f"qk_norm: store False, job True; tie_word_embeddings: store False, job True; set store.name to another store, or destroy it with "
        f"`slidedp-store destroy {other.name}`"]


def test_existing_store_attached_or_torn(tmp_path, made_store):
    st = made_store("tiny")
    try:
        st.manifest.set_committed_step(7)
        st.manifest.versions[:] = 7
        rc, text = dry(tmp_path, store=st.name)
        assert rc == 0, text
        assert f"store '{st.name}' exists (1.2 MiB, same model), committed step 7" in text
        assert "would train steps 7..59" in text
        st.manifest.set_attached(os.getpid(), 1)
        rc, text = dry(tmp_path, store=st.name)
        assert problems(text) == [f"store {st.name!r} has a job attached: '?' (launcher pid {os.getpid()}); "
                                  "wait for it to finish or stop it"]
        st.manifest.set_attached(0, 0)
        st.manifest.set_torn_flag(1)
        rc, text = dry(tmp_path, store=st.name)
        assert rc == 1 and problems(text) == [
            f"store {st.name!r} is torn (a restore into it did not finish); set checkpoint.resume = \"latest\" or a "
            f"checkpoint path (or `slidedp-store restore {st.name} CHECKPOINT`)"]
        rc, text = dry(tmp_path, 'checkpoint.resume="latest"', store=st.name)
        assert rc == 1 and problems(text) == [
            f"store {st.name!r} is torn (a restore into it did not finish) and {tmp_path / 'run' / 'checkpoints'} holds "
            "no valid checkpoint to restore; destroy the store or name a checkpoint in checkpoint.resume"]
    finally:
        st.close()


def checkpoint_of(tiny_run) -> Path:
    return tiny_run.run_dir / "checkpoints" / f"step-{STEPS:08d}"


def test_resume_from_a_good_checkpoint(tmp_path, tiny_run):
    rc, text = dry(tmp_path, f'checkpoint.resume="{checkpoint_of(tiny_run)}"')
    assert rc == 0, text
    assert f"resume     {checkpoint_of(tiny_run)}: step {STEPS}, files verified; would restore it into the store" in text
    assert f"would train steps {STEPS}..59" in text


def test_resume_from_a_corrupt_checkpoint(tmp_path, tiny_run):
    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint_of(tiny_run), copy)
    state = copy / "state" / hf.SINGLE_FILE
    data = bytearray(state.read_bytes())
    data[-1] ^= 0xFF
    state.write_bytes(bytes(data))
    rc, text = dry(tmp_path, f'checkpoint.resume="{copy}"')
    assert rc == 1
    assert problems(text) == [f"checkpoint {copy}: state/{hf.SINGLE_FILE} does not match its recorded sha256 "
                              "(corrupt or modified)"]


def test_resume_from_another_models_checkpoint(tmp_path, tiny_run):
    rc, text = dry(tmp_path, f'checkpoint.resume="{checkpoint_of(tiny_run)}"', 'model.shape="tiny-llama"')
    assert rc == 1
    assert problems(text) == [f"checkpoint {checkpoint_of(tiny_run)} was taken from another model or chunking than "
                              "this job's (qwen3); choose a checkpoint of this model"]


def test_run_dir_that_cannot_be_created(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    job = load_job(TINY, [f'store.name="{unique_store("dry")}"', f'run.dir="{blocker / "run"}"'])
    out = io.StringIO()
    assert dryrun.dry_run(job, TINY, out) == 1
    assert problems(out.getvalue()) == [
        f"{blocker} is not a directory, so {blocker / 'run'} cannot be created; set run.dir to a writable directory",
        f"{blocker} is not a directory, so {blocker / 'run' / 'checkpoints'} cannot be created; set checkpoint.dir to "
        "a writable directory"]


def test_no_disk_space_for_a_checkpoint(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(dryrun.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    rc, text = dry(tmp_path)
    assert rc == 1
    [p] = problems(text)
    assert p.startswith("one checkpoint needs about 1.2 MiB but ") and p.endswith(
        "has 0.0 MiB free; free space or set checkpoint.dir elsewhere")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a host without CUDA")
def test_cuda_without_a_gpu(tmp_path):
    rc, text = dry(tmp_path, 'runtime.device="cuda"')
    assert rc == 1
    assert problems(text) == ['runtime.device = "cuda" but no CUDA device is visible to this process']


def test_traced_steps_outside_the_run_warn(tmp_path):
    rc, text = dry(tmp_path, 'run.trace_steps="3,70"')
    assert rc == 0, text
    assert "would trace step(s) 3, 70 into" in text
    assert "warning: run.trace_steps [70] are outside the steps this run trains (0..59): nothing is traced for them" in text
    assert text.splitlines()[-1].startswith("dry run: no problems found, 1 warning(s) (")


def test_an_existing_stores_rings_leave_out_what_the_job_file_holds_on_the_devices(tmp_path, made_store):
    """With exact clipping on one rank the rings keep a slot per chunk on the host: a layer the job file
    holds on the device (plan.device_layers) keeps its gradient there, and the dry run counts it so,
    in slots and in bytes, as the launcher does (host_room.unplanned_need)."""
    from slidedp.launch import host_room

    st = made_store("tiny")
    name = st.name
    st.close()
    texts = {}
    for held in (0, 1):
        sets = (f'store.name="{name}"', "runtime.workers=1", f"plan.device_layers={held}")
        rc, texts[held] = dry(tmp_path, *sets, store=name)
        assert rc == 0, texts[held]
        job = load_job(TINY, list(sets))
        need = host_room.unplanned_need(job, make_layout(named_shape("tiny", 512)), store_exists=True)
        slots = 4 - held  # the tiny model's 4 chunks, one a layer's
        assert (f"would attach and add gradient rings of {host_room.size(need.rings)} (1 rank(s) x {slots} slots, one "
                f"per chunk: exact clipping keeps each gradient until the step's norm)") in texts[held], texts[held]
