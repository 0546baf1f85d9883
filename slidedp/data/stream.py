"""Token data: one flat token stream cut into fixed windows.

Sequence i is tokens[i*L : i*L + L + 1] (inputs: its first L tokens, targets: its last L), so
consecutive windows share one boundary token and no token is wasted. The stream is a token file
(`.npy`, or raw `.bin` of one integer dtype), memory-mapped, or raw text tokenized (`text.py`);
every id is checked against the model's vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .errors import DataError
from .text import read_jsonl

if TYPE_CHECKING:
    from slidedp.config import DataSection


def read_npy(path: str | Path) -> np.ndarray:
    """A 1-D integer .npy array, memory-mapped (never unpickled)."""
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable .npy token file: {e}") from None
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"{path}: expected a 1-D integer array of token ids, got shape {arr.shape} dtype {arr.dtype}")
    return arr


def read_bin(path: str | Path, dtype: str) -> np.ndarray:
    """A raw little-endian token file of `dtype` elements, memory-mapped."""
    dt = np.dtype(dtype).newbyteorder("<")
    size = Path(path).stat().st_size
    if size == 0 or size % dt.itemsize:
        raise DataError(
            f"{path}: size {size} bytes is not a positive multiple of {dt.itemsize} ({dtype}); is data.dtype right?"
        )
    return np.memmap(path, dtype=dt, mode="r")


class TokenStream:
    """A flat array of token ids, every id checked against the model's vocabulary."""

    def __init__(self, tokens: np.ndarray, vocab_size: int, source: str = "tokens") -> None:
        self.tokens, self.vocab_size, self.source = tokens, vocab_size, source
        _check_ids(tokens, vocab_size, source)

    @classmethod
    def from_section(cls, data: "DataSection", vocab_size: int) -> "TokenStream":
        if data.format == "npy":
            tokens = read_npy(data.path)
        elif data.format == "bin":
            tokens = read_bin(data.path, data.dtype)
        else:
            tokens = read_jsonl(data.path, data.tokenizer, data.text_key)
        return cls(tokens, vocab_size, data.path)

    def __len__(self) -> int:
        return len(self.tokens)

    def num_sequences(self, seq_len: int) -> int:
        return max(len(self.tokens) - 1, 0) // seq_len

    def window(self, i: int, seq_len: int) -> np.ndarray:
        return np.asarray(self.tokens[i * seq_len : i * seq_len + seq_len + 1], dtype=np.int64)


def _check_ids(tokens: np.ndarray, vocab_size: int, source: str, block: int = 1 << 24) -> None:
    # In blocks, so a memory-mapped file of billions of tokens is scanned without loading it whole.
    for start in range(0, len(tokens), block):
        chunk = np.asarray(tokens[start : start + block])
        bad = (chunk < 0) | (chunk >= vocab_size)
        if bad.any():
            pos = int(np.argmax(bad))
            raise DataError(
                f"{source}: token id {int(chunk[pos])} at position {start + pos} is outside the vocabulary "
                f"[0, {vocab_size}) of the model; does the data's tokenizer match the model?"
            )
