"""From the [data] keys to what a run trains on: the token stream (raw text, as before) or rows of documents.

`open_training` is called by the launcher, the dry run and the reference; it reads and tokenizes the
data once. The launcher saves the rows (`PackedRows.save`) for the workers, which map them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .batches import Batches
from .documents import Documents, DocumentSpec, read_documents
from .errors import DataError
from .packing import DocBatches, PackedRows
from .records import read_records
from .stream import TokenStream
from .text import join_texts, record_texts
from .tokenizer import TokenizerBundle

if TYPE_CHECKING:
    from slidedp.config import JobConfig

log = logging.getLogger("slidedp.data")

TOKEN_FORMATS = ("npy", "bin")


def tokenizer_path(job: "JobConfig") -> Path | None:
    """data.tokenizer, else the model folder's tokenizer.json (None for token files without a tokenizer)."""
    if job.data.tokenizer:
        return Path(job.data.tokenizer)
    if job.model.source == "hf" and (Path(job.model.path) / "tokenizer.json").is_file():
        return Path(job.model.path) / "tokenizer.json"
    return None


def load_tokenizer(job: "JobConfig") -> TokenizerBundle:
    path = tokenizer_path(job)
    if path is None:
        where = f"model.path {job.model.path!r} has no tokenizer.json" if job.model.source == "hf" else \
            "model.source = 'random' has no tokenizer"
        raise DataError(f"data.tokenizer is empty and {where}; set data.tokenizer to a tokenizer.json")
    return TokenizerBundle.load(path, job.data.chat_template)


def spec_of(job: "JobConfig") -> DocumentSpec:
    d = job.data
    return DocumentSpec(d.kind, d.text_key, d.messages_key, d.prompt_key, d.completion_key, d.train_on_prompt,
                        d.overlong)


def resolved_mode(job: "JobConfig") -> tuple[str, str]:
    """(kind, packing) with "auto" settled: the first record says the kind; raw text streams by default."""
    d = job.data
    if d.format in TOKEN_FORMATS:
        return "text", "stream"
    kind = d.kind
    if kind == "auto":
        first = next(read_records(list(d.paths), d.format), None)
        if first is None:
            raise DataError(f"{', '.join(list(d.paths))}: no records")
        kind = spec_of(job).resolve(first)
    packing = d.packing if d.packing != "auto" else ("stream" if kind == "text" else "packed")
    if packing == "stream" and kind != "text":
        raise DataError(f"data.packing = 'stream' joins raw text only; this data is {kind} "
                        f"(use 'packed' or 'padded')")
    return kind, packing


def text_stream(job: "JobConfig", paths: list[str], bundle: TokenizerBundle) -> np.ndarray:
    """Raw text documents joined with end-of-text (no special tokens), the stream the windows cut."""
    texts = record_texts(read_records(paths, job.data.format), job.data.text_key)
    return join_texts(texts, bundle.tokenizer, ", ".join(paths))


def open_training(job: "JobConfig", vocab_size: int) -> Batches:
    """The training batches: `Batches` of token windows (stream) or `DocBatches` of document rows."""
    d, t = job.data, job.train
    if d.format in TOKEN_FORMATS:
        return Batches(TokenStream.from_section(d, vocab_size), t.seq_len, t.global_batch, d.shuffle, d.seed)
    bundle = load_tokenizer(job)
    kind, packing = resolved_mode(job)
    paths = list(d.paths)
    if packing == "stream":
        stream = TokenStream(text_stream(job, paths, bundle), vocab_size, ", ".join(paths))
        return Batches(stream, t.seq_len, t.global_batch, d.shuffle, d.seed)
    rows = document_rows(job, paths, bundle, vocab_size, packing == "packed")
    return DocBatches(rows, t.global_batch, d.shuffle, d.seed)


def document_rows(job: "JobConfig", paths: list[str], bundle: TokenizerBundle, vocab_size: int,
                  packed: bool) -> PackedRows:
    docs = read_documents(paths, job.data.format, spec_of(job), bundle, job.train.seq_len, vocab_size)
    return PackedRows.build(docs, job.train.seq_len, packed, ", ".join(paths))


def open_eval(job: "JobConfig", vocab_size: int) -> PackedRows | None:
    """The held-out rows of data.eval_path (None without one), read like the training data: documents
    packed or padded the same way, or, for a raw text stream, its windows one per row."""
    d, L = job.data, job.train.seq_len
    if not d.eval_path:
        return None
    paths = list(d.paths_of_eval)
    if d.format in TOKEN_FORMATS:
        raise DataError("data.eval_path needs text data (jsonl, parquet or arrow); token files have no documents")
    bundle = load_tokenizer(job)
    kind, packing = resolved_mode(job)
    if packing != "stream":
        return document_rows(job, paths, bundle, vocab_size, packing == "packed")
    tokens = TokenStream(text_stream(job, paths, bundle), vocab_size, ", ".join(paths)).tokens
    n = max(len(tokens) - 1, 0) // L
    if n == 0:
        raise DataError(f"{', '.join(paths)}: {len(tokens)} tokens make no window of seq_len {L} (+1 target token)")
    windows = np.concatenate([tokens[i * L:i * L + L + 1] for i in range(n)])
    docs = Documents(windows, np.ones(len(windows), dtype=np.uint8), np.arange(n + 1, dtype=np.int64) * (L + 1))
    docs.trained[docs.offsets[:-1]] = 0
    return PackedRows.build(docs, L, packed=False, source=", ".join(paths))


def describe(rows: PackedRows) -> str:
    """What the rows hold and, against one document per row, what packing saves."""
    L = rows.seq_len
    n_rows, n_docs = rows.num_sequences(L), len(rows.docs)
    used = rows.positions_used
    text = (f"{n_docs:,} documents in {n_rows:,} rows of {L} ({used / max(1, n_rows * L):.1%} of the positions "
            f"hold tokens)")
    if n_rows < n_docs:
        text += (f"; packing saves {(n_docs - n_rows) * L:,} of {n_docs * L:,} positions against one document per "
                 f"row ({1 - n_rows / n_docs:.1%})")
    return text
