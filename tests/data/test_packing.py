"""Documents in rows: best-fit packing, per-document positions and attention, padding, resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slidedp.data.documents import Documents
from slidedp.data.errors import DataError
from slidedp.data.packing import DocBatches, PackedRows, eval_batch, eval_rounds, pack_rows
from slidedp.data.targets import IGNORE_INDEX
from slidedp.model import layers
from slidedp.model.attention import packed_rows, single_document
from slidedp.model.config import named_shape
from slidedp.model.init import init_params


def documents(lengths: list[int], seed: int = 0, vocab: int = 512) -> Documents:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, sum(lengths))
    trained = rng.integers(0, 2, sum(lengths)).astype(np.uint8)
    return Documents(tokens, trained, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


def test_best_fit_in_document_order():
    # positions (tokens - 1) into rows of 10: 7 opens row 0, 5 opens row 1, 3 fits row 0 (room 3, the least),
    # 4 fits row 1 (room 5), 10 opens row 2, 1 fits row 1 (room 1)
    row_docs, row_offsets = pack_rows(np.array([7, 5, 3, 4, 10, 1]), 10, packed=True)
    rows = [row_docs[a:b].tolist() for a, b in zip(row_offsets[:-1], row_offsets[1:])]
    assert rows == [[0, 2], [1, 3, 5], [4]]
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 65, 500)
    row_docs, row_offsets = pack_rows(lengths, 64, packed=True)
    assert sorted(row_docs.tolist()) == list(range(500))
    fill = [int(lengths[row_docs[a:b]].sum()) for a, b in zip(row_offsets[:-1], row_offsets[1:])]
    assert max(fill) <= 64 and len(fill) <= 0.6 * 500
    assert all(list(row_docs[a:b]) == sorted(row_docs[a:b]) for a, b in zip(row_offsets[:-1], row_offsets[1:]))
    again = pack_rows(lengths, 64, packed=True)
    assert np.array_equal(again[0], row_docs) and np.array_equal(again[1], row_offsets)
    padded = pack_rows(lengths, 64, packed=False)
    assert padded[0].tolist() == list(range(500)) and padded[1].tolist() == list(range(501))


def test_rows_restart_positions_and_mask_untrained_targets():
    docs = documents([4, 6, 3])  # positions 3, 5, 2: all in one row of 12
    rows = PackedRows.build(docs, 12, packed=True)
    assert rows.num_sequences(12) == 1 and rows.positions_used == 10
    ids, targets, positions, segments = rows.row(0)
    assert positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert segments.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2]  # padding continues the last document
    at = 0
    for d in range(3):
        tok, trained = docs.document(d)
        n = len(tok) - 1
        assert ids[at:at + n].tolist() == tok[:-1].tolist()
        assert targets[at:at + n].tolist() == [t if f else IGNORE_INDEX for t, f in zip(tok[1:], trained[1:])]
        at += n
    assert ids[at:].tolist() == [0, 0] and targets[at:].tolist() == [IGNORE_INDEX] * 2
    with pytest.raises(DataError, match="more than seq_len"):
        PackedRows.build(documents([14]), 12, packed=True)


@pytest.mark.parametrize("shape,tile", [("tiny", 0), ("tiny-llama", 7)])
def test_a_packed_row_computes_each_document_as_if_alone(shape, tile):
    """Through every layer (forward and backward, MLP tiled or not): a row of three documents gives each
    document's hidden states and input gradients as the document run alone, in fp32."""
    cfg = named_shape(shape, 512)
    params = {k: v.double().float() for k, v in init_params(cfg, 3).items()}
    docs = documents([9, 14, 6, 5])
    rows = PackedRows.build(docs, 32, packed=True)
    assert rows.num_sequences(32) == 1
    ids, _, positions, segments = (torch.from_numpy(a)[None] for a in rows.row(0))
    rope = layers.rope_tables(cfg, 32, "cpu")
    assert not single_document(segments)
    doc_rope = packed_rows(rope, positions, segments, "mask")
    x = layers.embed(params["model.embed_tokens.weight"], ids)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    grad[:, rows.positions_used:] = 0  # padding has no target: its gradient is 0 from the loss down
    h, g = x, grad
    for layer in range(cfg.num_layers):
        p = layers.layer_params(params, layer)
        with torch.no_grad():
            y = layers.layer_forward(cfg, p, h.clone(), doc_rope, tile)
        acc = {k: torch.zeros_like(v) for k, v in p.items()}
        gx = layers.layer_backward(cfg, p, h, doc_rope, g.clone(), tile, acc)
        at = 0
        for d in range(len(docs)):
            n = len(docs.document(d)[0]) - 1
            alone = h[:, at:at + n].detach().clone().requires_grad_(True)
            out = layers.decoder_layer(cfg, p, alone, layers.causal_attention(cfg, 1, n, "cpu"))
            out.backward(g[:, at:at + n])
            assert torch.allclose(y[:, at:at + n], out.detach(), atol=1e-5, rtol=1e-5)
            assert torch.allclose(gx[:, at:at + n], alone.grad, atol=1e-5, rtol=1e-5)
            at += n
        assert torch.equal(gx[:, at:], torch.zeros_like(gx[:, at:]))  # and stays 0 through every layer
        h, g = y, gx


@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_mid_epoch_gives_the_same_rows(tmp_path, shuffle):
    rows = PackedRows.build(documents(list(np.random.default_rng(2).integers(2, 30, 90))), 32, packed=True)
    n = rows.num_sequences(32)
    assert n % 4  # an epoch is not a whole number of steps
    run = DocBatches(rows, 4, shuffle=shuffle, seed=3)
    steps = 3 * n // 4
    uninterrupted = [run.batch(s) for s in range(steps)]
    rows.save(tmp_path / "rows")  # what a resumed run's workers map
    resumed = DocBatches(PackedRows.load(tmp_path / "rows", 32), 4, shuffle=shuffle, seed=3)
    mid = n // 4 + 2  # inside the second epoch
    resumed.check_state(mid, run.state(mid))
    for s in range(mid, steps):
        a, b = resumed.batch(s), uninterrupted[s]
        assert all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("ids", "targets", "positions", "segments"))
    if shuffle:  # each epoch its own order, every row once per epoch
        epoch = np.concatenate([run.sequence_ids(s) for s in range(n)])[:n * 4].reshape(4, n)
        assert all(sorted(e.tolist()) == list(range(n)) for e in epoch) and epoch[0].tolist() != epoch[1].tolist()
    other = DocBatches(PackedRows.build(documents([5] * 40, seed=9), 32, packed=True), 4, shuffle=shuffle, seed=3)
    with pytest.raises(DataError, match="does not match"):
        other.check_state(mid, run.state(mid))


def test_eval_rounds_cover_every_row_once():
    rows = PackedRows.build(documents([20] * 11), 32, packed=False)
    assert eval_rounds(rows, 4) == 3
    batches = [eval_batch(rows, i, 4) for i in range(3)]
    assert all(b.ids.shape == (4, 32) for b in batches)
    assert sum(b.trained_tokens for b in batches) == sum(rows.rows_batch(np.arange(11)).trained_tokens for _ in [0])
    assert batches[-1].targets[3:].tolist() == [[IGNORE_INDEX] * 32]  # the filler row trains nothing


def test_eval_of_a_text_stream_is_its_windows():
    """With raw text streamed (packing = "stream"), the held-out rows are the eval file's windows."""
    from slidedp.config import load_job
    from slidedp.data.setup import open_eval
    from slidedp.data.stream import TokenStream
    from slidedp.data.text import read_jsonl

    from pipeline.harness import TINY

    job = load_job(TINY)
    job = load_job(TINY, [f'data.eval_path="{job.data.path}"'])
    rows = open_eval(job, 512)
    L = job.train.seq_len
    tokens = TokenStream(read_jsonl(job.data.path, job.data.tokenizer), 512).tokens
    assert rows.num_sequences(L) == (len(tokens) - 1) // L
    for r in (0, 7, rows.num_sequences(L) - 1):
        ids, targets, positions, segments = rows.row(r)
        assert ids.tolist() == tokens[r * L:r * L + L].tolist()
        assert targets.tolist() == tokens[r * L + 1:r * L + L + 1].tolist()
        assert positions.tolist() == list(range(L)) and not segments.any()
