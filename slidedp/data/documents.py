"""Records -> documents: token ids and which of them the loss is on.

A document is one record's tokens t_0..t_{n-1} and a 0/1 flag per token: flag 1 on t_i means the
model is trained to predict t_i from t_0..t_{i-1} (the first token is never a target). Kinds:

text               BOS as the tokenizer says (its post-processor, `add_bos_token`), the text, EOS;
                   every token after the first is trained
prompt_completion  TRL's fields: prompt (BOS as above) then completion + EOS, each tokenized on its
                   own; the completion and EOS are trained. Conversational prompt/completion (lists
                   of messages) are rendered with the chat template, the completion's turns trained
chat               `messages` rendered with the model's chat template, tokenized without special
                   tokens (as `apply_chat_template` does); the assistant turns are trained

`train_on_prompt` trains every token after the first instead. A document of more than seq_len + 1
tokens is cut to its first seq_len + 1 (`overlong = "truncate"`) or left out (`"drop"`); one left
with no trained token is left out. `DocumentStats` counts each case for the run's report.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .chat import check_messages, token_mask
from .errors import DataError
from .records import Record, read_records
from .tokenizer import TokenizerBundle

KINDS = ("text", "chat", "prompt_completion")


@dataclass
class DocumentStats:
    read: int = 0
    kept: int = 0
    truncated: int = 0
    dropped_overlong: int = 0
    dropped_untrained: int = 0
    tokens: int = 0  # tokens of the kept documents
    trained: int = 0  # trained target tokens of the kept documents

    def describe(self, seq_len: int) -> str:
        parts = [f"{self.kept:,} of {self.read:,} documents kept ({self.tokens:,} tokens, {self.trained:,} trained)"]
        if self.truncated:
            parts.append(f"{self.truncated:,} longer than seq_len + 1 = {seq_len + 1} tokens truncated")
        if self.dropped_overlong:
            parts.append(f"{self.dropped_overlong:,} longer than seq_len + 1 = {seq_len + 1} tokens dropped")
        if self.dropped_untrained:
            parts.append(f"{self.dropped_untrained:,} with no trained token dropped")
        return "; ".join(parts)


@dataclass(frozen=True)
class DocumentSpec:
    """What to read and how: the [data] keys that shape documents."""

    kind: str  # "auto" or one of KINDS
    text_key: str = "text"
    messages_key: str = "messages"
    prompt_key: str = "prompt"
    completion_key: str = "completion"
    train_on_prompt: bool = False
    overlong: str = "truncate"

    def resolve(self, first: Record) -> str:
        if self.kind != "auto":
            return self.kind
        v = first.value if isinstance(first.value, dict) else {}
        if self.messages_key in v:
            return "chat"
        if self.prompt_key in v and self.completion_key in v:
            return "prompt_completion"
        return "text"


@dataclass
class Documents:
    """Flat arrays: document d is tokens[offsets[d]:offsets[d+1]], with its 0/1 trained flags."""

    tokens: np.ndarray  # int64
    trained: np.ndarray  # uint8
    offsets: np.ndarray  # int64 [D + 1]
    kind: str = "text"
    stats: DocumentStats = field(default_factory=DocumentStats)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def document(self, d: int) -> tuple[np.ndarray, np.ndarray]:
        s, e = int(self.offsets[d]), int(self.offsets[d + 1])
        return np.asarray(self.tokens[s:e], dtype=np.int64), np.asarray(self.trained[s:e], dtype=np.uint8)


def read_documents(paths: Iterable[str], fmt: str, spec: DocumentSpec, bundle: TokenizerBundle, seq_len: int,
                   vocab_size: int, batch: int = 1024) -> Documents:
    records = read_records(list(paths), fmt)
    first = next(records, None)
    if first is None:
        raise DataError(f"{', '.join(paths)}: no records")
    kind = spec.resolve(first)
    if kind == "chat" and bundle.template is None:
        raise DataError(f"{bundle.path.parent}: the tokenizer has no chat template (tokenizer_config.json "
                        f"'chat_template', chat_template.jinja or chat_template.json), but the data is chat "
                        f"({spec.messages_key!r} records); use a model folder with one or set data.chat_template")
    stats = DocumentStats()
    tokens: list[np.ndarray] = []
    flags: list[np.ndarray] = []
    pending: list[Record] = [first]

    def flush() -> None:
        for ids, mask in _tokenize(kind, pending, spec, bundle):
            stats.read += 1
            keep = _fit(ids, mask, spec, seq_len, stats)
            if keep is None:
                continue
            ids, mask = keep
            tokens.append(np.asarray(ids, dtype=np.int64))
            flags.append(np.asarray(mask, dtype=np.uint8))
        pending.clear()

    for rec in records:
        pending.append(rec)
        if len(pending) >= batch:
            flush()
    flush()
    if not tokens:
        raise DataError(f"{', '.join(paths)}: no document left to train on ({stats.describe(seq_len)})")
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    flat = np.concatenate(tokens)
    bad = (flat < 0) | (flat >= vocab_size)
    if bad.any():
        raise DataError(f"{bundle.path}: token id {int(flat[np.argmax(bad)])} is outside the vocabulary [0, "
                        f"{vocab_size}) of the model; does the tokenizer match the model?")
    stats.kept, stats.tokens = len(tokens), int(lengths.sum())
    trained = np.concatenate(flags)
    stats.trained = int(trained.sum())
    return Documents(flat, trained, np.concatenate([[0], np.cumsum(lengths)]), kind, stats)


def _fit(ids: list[int], mask: list[int], spec: DocumentSpec, seq_len: int,
         stats: DocumentStats) -> tuple[list[int], list[int]] | None:
    if spec.train_on_prompt:
        mask = [1] * len(ids)
    mask = [0] + list(mask[1:])  # nothing predicts the first token
    if len(ids) > seq_len + 1:
        if spec.overlong == "drop":
            stats.dropped_overlong += 1
            return None
        stats.truncated += 1
        ids, mask = ids[:seq_len + 1], mask[:seq_len + 1]
    if len(ids) < 2 or not any(mask):
        stats.dropped_untrained += 1
        return None
    return ids, mask


def _field(rec: Record, key: str, what: str) -> Any:
    if not isinstance(rec.value, dict):
        raise DataError(f"{rec.where}: expected an object with {key!r}, got {type(rec.value).__name__}")
    if key not in rec.value:
        raise DataError(f"{rec.where}: no key {key!r} ({what}) in this record; it has "
                        f"{', '.join(map(repr, rec.value)) or 'no keys'}")
    return rec.value[key]


def _string(rec: Record, key: str, what: str) -> str:
    v = _field(rec, key, what)
    if not isinstance(v, str):
        raise DataError(f"{rec.where}: {key!r} is {type(v).__name__}, expected a string")
    return v


def _tokenize(kind: str, recs: list[Record], spec: DocumentSpec,
              bundle: TokenizerBundle) -> Iterator[tuple[list[int], list[int]]]:
    eos = [bundle.eos_id] if bundle.eos_id is not None else []
    if kind == "text":
        texts = [_string(r, spec.text_key, "data.text_key") for r in recs]
        for ids in bundle.encode_text(texts, bos=True):
            ids = ids + eos
            yield ids, [1] * len(ids)
    elif kind == "chat":
        convs = [check_messages(_field(r, spec.messages_key, "data.messages_key"), r.where, spec.messages_key)
                 for r in recs]
        yield from _render_chats(convs, recs, bundle)
    else:
        prompts = [_field(r, spec.prompt_key, "data.prompt_key") for r in recs]
        completions = [_field(r, spec.completion_key, "data.completion_key") for r in recs]
        strings = [isinstance(p, str) and isinstance(c, str) for p, c in zip(prompts, completions)]
        pick = [i for i, ok in enumerate(strings) if ok]
        p_ids = dict(zip(pick, bundle.encode_text([prompts[i] for i in pick], bos=True)))
        c_ids = dict(zip(pick, bundle.encode_text([completions[i] for i in pick], bos=False)))
        for i, (r, p, c) in enumerate(zip(recs, prompts, completions)):
            if strings[i]:
                yield p_ids[i] + c_ids[i] + eos, [0] * len(p_ids[i]) + [1] * (len(c_ids[i]) + len(eos))
            else:
                yield _conversational(r, p, c, spec, bundle)


def _conversational(r: Record, p: Any, c: Any, spec: DocumentSpec, bundle: TokenizerBundle) -> tuple[list[int], list[int]]:
    """Prompt and completion as lists of messages: the completion's part of the rendered text is trained."""
    if isinstance(p, str) or isinstance(c, str) or not isinstance(p, list) or not isinstance(c, list):
        raise DataError(f"{r.where}: {spec.prompt_key!r} and {spec.completion_key!r} must both be strings or both "
                        f"lists of messages, got {type(p).__name__} and {type(c).__name__}")
    if bundle.template is None:
        raise DataError(f"{r.where}: conversational prompt/completion needs a chat template, and "
                        f"{bundle.path.parent} has none (set data.chat_template)")
    pm = check_messages(p, r.where, spec.prompt_key)
    cm = check_messages(c, r.where, spec.completion_key)
    prefix = bundle.template.render(pm, add_generation_prompt=True)
    full = bundle.template.render(pm + cm)
    if not full.startswith(prefix):
        raise DataError(f"{r.where}: the chat template renders the prompt differently once the completion "
                        f"follows; cannot tell the completion's tokens apart")
    enc = bundle.tokenizer.encode(full, add_special_tokens=False)
    return list(enc.ids), token_mask(enc.offsets, [(len(prefix), len(full.rstrip()))])


def _render_chats(convs: list[list[dict]], recs: list[Record],
                  bundle: TokenizerBundle) -> Iterator[tuple[list[int], list[int]]]:
    assert bundle.template is not None
    rendered = [bundle.template.render_with_spans(c, r.where) for c, r in zip(convs, recs)]
    encs = bundle.tokenizer.encode_batch([t for t, _ in rendered], add_special_tokens=False)
    for (_, spans), enc in zip(rendered, encs):
        yield list(enc.ids), token_mask(enc.offsets, spans)
