"""Global batches as a pure function of the step, and each rank's share of one.

A batch depends only on (data, seq_len, global_batch, shuffle, seed, step): step s takes sequences
s*B .. s*B + B - 1 of the epoch's order (epochs wrap, shuffled per epoch when asked), so resuming at
step s is starting at step s. Rows of documents (`packing.DocBatches`) are batched by the same rules.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from .errors import DataError
from .stream import TokenStream

if TYPE_CHECKING:
    from slidedp.config import JobConfig


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
