"""Raw text -> one token stream: each document tokenized without special tokens, joined with end-of-text.

The text comes from records (`records.read_records`), one string per record under `data.text_key`;
the end-of-text token is the first of the common families' that the tokenizer knows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import DataError
from .records import read_records

# End-of-text tokens of the common tokenizer families, tried in this order.
EOT_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


def eot_id(tokenizer) -> int:
    """The tokenizer's end-of-text id: the first of EOT_TOKENS in its vocabulary."""
    for tok in EOT_TOKENS:
        i = tokenizer.token_to_id(tok)
        if i is not None:
            return i
    raise DataError(f"the tokenizer has none of the end-of-text tokens {', '.join(EOT_TOKENS)}")


def read_jsonl(path: str | Path, tokenizer_path: str | Path, text_key: str = "text") -> np.ndarray:
    """Tokenize each line's `text_key` (no special tokens) and join documents with end-of-text."""
    from tokenizers import Tokenizer  # lazy: only text needs it

    try:
        tok = Tokenizer.from_file(str(tokenizer_path))
    except Exception as e:  # the Rust side raises plain Exception subclasses
        raise DataError(f"{tokenizer_path}: cannot load tokenizer: {e}") from None
    try:
        eot_id(tok)
    except DataError as e:
        raise DataError(f"{tokenizer_path}: {e}") from None
    return join_texts(record_texts(read_records([str(path)], "jsonl"), text_key), tok, str(path))


def record_texts(records, text_key: str) -> list[str]:
    """The `text_key` string of every record (records.Record), each error naming its record."""
    texts: list[str] = []
    for rec in records:
        doc = rec.value
        if not isinstance(doc, dict) or text_key not in doc:
            raise DataError(f"{rec.where}: no key {text_key!r} (data.text_key) in this record")
        if not isinstance(doc[text_key], str):
            raise DataError(f"{rec.where}: {text_key!r} is {type(doc[text_key]).__name__}, expected a string")
        texts.append(doc[text_key])
    return texts


def join_texts(texts: list[str], tokenizer, source: str) -> np.ndarray:
    """The texts tokenized without special tokens, joined with the tokenizer's end-of-text token."""
    if not texts:
        raise DataError(f"{source}: no documents")
    eot = eot_id(tokenizer)
    ids: list[int] = []
    for i, enc in enumerate(tokenizer.encode_batch(texts, add_special_tokens=False)):
        if i:
            ids.append(eot)
        ids.extend(enc.ids)
    return np.asarray(ids, dtype=np.int64)
