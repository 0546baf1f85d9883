"""Token data: one flat token stream cut into fixed windows, batched as a pure function of the step.

Sequence i is tokens[i*L : i*L + L + 1] (inputs: its first L tokens, targets: its last L), so
consecutive windows share one boundary token and no token is wasted. A batch depends only on
(data, seq_len, global_batch, shuffle, seed, step): resuming at step s is starting at step s.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from slidedp.config import DataSection, JobConfig


class DataError(ValueError):
    pass


# End-of-text tokens of the common tokenizer families, tried in this order.
EOT_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


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

    from slidedp.sft.records import read_records  # lazy: slidedp.sft imports this module

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
    """The `text_key` string of every record (slidedp.sft.records.Record), each error naming its record."""
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


class Batches:
    """Global batches [B, L+1] as a pure function of the step (epochs wrap, optional shuffle)."""

    def __init__(self, stream: TokenStream, seq_len: int, global_batch: int, shuffle: bool = False, seed: int = 0) -> None:
        self.stream, self.seq_len, self.global_batch = stream, seq_len, global_batch
        self.shuffle, self.seed = shuffle, seed
        self.num_sequences = stream.num_sequences(seq_len)
        if self.num_sequences < global_batch:
            raise DataError(
                f"{stream.source}: {len(stream)} tokens make {self.num_sequences} sequences of seq_len {seq_len} "
                f"(+1 target token), fewer than train.global_batch ({global_batch}); use more data or a smaller batch"
            )
        self._perm = lru_cache(maxsize=2)(self._permutation)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_sequences)

    def sequence_ids(self, step: int) -> np.ndarray:
        """Indices of the step's sequences in the window table, in batch order."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        k = step * self.global_batch + np.arange(self.global_batch)
        epoch, pos = k // self.num_sequences, k % self.num_sequences
        if not self.shuffle:
            return pos
        return np.array([self._perm(int(e))[p] for e, p in zip(epoch, pos)], dtype=np.int64)

    def batch(self, step: int) -> np.ndarray:
        """The step's global batch, int64 [global_batch, seq_len + 1]."""
        return np.stack([self.stream.window(int(i), self.seq_len) for i in self.sequence_ids(step)])

    def epoch_of(self, step: int) -> int:
        """The epoch of the step's first sequence."""
        return step * self.global_batch // self.num_sequences

    def state(self, step: int) -> dict[str, int]:
        """The position where `step` starts (JSON-serializable, recorded in checkpoints)."""
        k = step * self.global_batch
        return {"epoch": k // self.num_sequences, "position": k % self.num_sequences, "seed": self.seed}

    def check_state(self, step: int, state: dict) -> None:
        """Refuse a resume whose recorded data position disagrees with this data at `step`."""
        mine = self.state(step)
        if {k: state.get(k) for k in mine} != mine:
            raise DataError(
                f"the checkpoint's data position {state} does not match {mine} for step {step} with this data; "
                "did the data, train.global_batch, train.seq_len or data.seed change?"
            )


def open_batches(job: "JobConfig", vocab_size: int) -> Batches:
    stream = TokenStream.from_section(job.data, vocab_size)
    return Batches(stream, job.train.seq_len, job.train.global_batch, job.data.shuffle, job.data.seed)


def rank_slice(batch: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Rank r's rows of a global batch: [r*B/N, (r+1)*B/N)."""
    b = batch.shape[0]
    if not 0 <= rank < world or b % world:
        raise ValueError(f"cannot give rank {rank} of {world} an equal share of a batch of {b} sequences")
    n = b // world
    return batch[rank * n : (rank + 1) * n]
