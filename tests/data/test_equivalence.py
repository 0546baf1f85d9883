"""N ranks x M micro-batches on packed (and padded) chat data with loss masks give the weights of a
plain transformers + AdamW reference that runs each document on its own.

fp32 on CPU, real processes (daemons, workers), shared memory and sockets. A global batch of 24
rows of 64 positions, shuffled, clipping on in some cases; the trained-token counts of the
micro-batches differ several-fold, so a per-micro-batch mean would not match."""

from __future__ import annotations

import pytest

from slidedp.config import load_job, model_config
from slidedp.reference import step_documents
from slidedp.schedule import lr_at
from slidedp.worker.feed import rank_tensors
from slidedp.data.setup import open_training

from pipeline.harness import TINY, checkpoint_weights, launch, metrics, rel_err, store_segments, unique_store
from data.common import CHAT, CHAT_TOKENIZER, hf_reference, write_model_folder

GLOBAL_BATCH, STEPS, SEQ_LEN = 24, 3, 64

# (ranks, micro-batches per rank, packing, clipping): the default suite covers each N and each M and
# both packings (with clipping: one reference per packing); the full grid, clipping on and off, runs
# with -m slow.
FAST = [(1, 2, "packed", 0.5), (2, 4, "packed", 0.5), (3, 1, "packed", 0.5), (2, 1, "padded", 0.5)]
GRID = [(n, m, p, 0.5 if (n + m) % 2 else 0.0) for p in ("packed", "padded") for n in (1, 2, 3) for m in (1, 2, 4)]
SLOW = [c for c in GRID if c not in FAST]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return write_model_folder(tmp_path_factory.mktemp("hf") / "qwen3-chat")


def job_sets(folder, workers: int, micro: int, packing: str, clip: float, store: str, run_dir) -> list[str]:
    return [
        'model.source="hf"', f'model.path="{folder}"', "model.vocab_size=0",
        f'data.path="{CHAT / "train.jsonl"}"', f'data.tokenizer="{CHAT_TOKENIZER}"', 'data.kind="chat"',
        f'data.packing="{packing}"', "data.shuffle=true", "data.seed=5",
        f"train.steps={STEPS}", f"train.global_batch={GLOBAL_BATCH}", f"train.seq_len={SEQ_LEN}",
        f"plan.micro_batch={GLOBAL_BATCH // (workers * micro)}", f"train.max_grad_norm={clip}",
        "train.warmup_steps=1", "train.weight_decay=0.1", 'plan.compute_dtype="fp32"', "train.lr=3e-3",
        f"runtime.workers={workers}", f'store.name="{store}"', f'run.dir="{run_dir}"', 'checkpoint.dtype="fp32"',
    ]


_refs: dict = {}


def reference(folder, sets):
    key = tuple(s for s in sets if s.startswith(("data.", "train.max_grad_norm")))
    if key not in _refs:
        job = load_job(TINY, sets)
        batches = open_training(job, model_config(job).vocab_size)
        docs = [step_documents(batches, s) for s in range(STEPS)]
        _refs[key] = hf_reference(folder, docs, job.train, lambda s: lr_at(job.train, s))
    return _refs[key]


def check_case(tmp_path, model_folder, workers, micro, packing, clip):
    store, run_dir = unique_store("sft"), tmp_path / "run"
    sets = job_sets(model_folder, workers, micro, packing, clip, store, run_dir)
    proc = launch(TINY, *sets, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses, norms, state = reference(model_folder, sets)
    got = metrics(run_dir)
    assert [m["step"] for m in got] == list(range(STEPS))
    for m, want in zip(got, losses):
        assert abs(m["loss"] - want) <= 1e-5 * abs(want), (m["loss"], want)
    for m, want in zip(got, norms):
        assert abs(m["grad_norm"] - want) <= 1e-5 * want, (m["grad_norm"], want)
    weights = checkpoint_weights(run_dir / "checkpoints" / f"step-{STEPS:08d}")
    worst = max((rel_err(weights[n], state[n]), n) for n in weights)
    assert worst[0] < 1e-5, worst
    assert store_segments(store) == []


@pytest.mark.parametrize("workers,micro,packing,clip", FAST)
def test_matches_transformers_reference(tmp_path, model_folder, workers, micro, packing, clip):
    check_case(tmp_path, model_folder, workers, micro, packing, clip)


@pytest.mark.slow
@pytest.mark.parametrize("workers,micro,packing,clip", SLOW)
def test_matches_transformers_reference_full_grid(tmp_path, model_folder, workers, micro, packing, clip):
    check_case(tmp_path, model_folder, workers, micro, packing, clip)


def test_micro_batches_hold_uneven_trained_counts(model_folder, tmp_path):
    """The cases above are not trivially equal: the micro-batches' trained-token counts differ widely,
    so a mean taken per micro-batch (or per rank) would give other gradients."""
    job = load_job(TINY, job_sets(model_folder, 2, 4, "packed", 0.0, "x", tmp_path))
    batches = open_training(job, model_config(job).vocab_size)
    for step in range(STEPS):
        counts = []
        for rank in range(2):
            targets = rank_tensors(batches.batch(step), rank, 2, 4, 3)[1]
            counts += [int((targets[i] != -100).sum()) for i in range(4)]
        assert max(counts) >= 1.5 * min(counts), counts
        assert sum(counts) == batches.batch(step).trained_tokens
    rows = batches.stream
    assert rows.num_sequences(SEQ_LEN) < len(rows.docs)  # several documents per row


@pytest.mark.slow
def test_our_reference_matches_transformers(model_folder, tmp_path):
    """slidedp.reference on document rows (our layers, each document alone) equals the transformers one."""
    from slidedp.reference import initial_params, train_reference

    sets = job_sets(model_folder, 1, 1, "packed", 0.5, "x", tmp_path)
    job = load_job(TINY, sets)
    batches = open_training(job, model_config(job).vocab_size)
    ours = train_reference(job, initial_params(job), batches, steps=STEPS)
    losses, norms, state = reference(model_folder, sets)
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(ours.losses, losses)), (ours.losses, losses)
    worst = max(rel_err(ours.params[n], state[n]) for n in ours.params)
    assert worst < 1e-5
