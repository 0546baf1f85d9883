"""A worker's side of document rows: its share of a batch as tensors, its share of the eval set."""

from __future__ import annotations

import numpy as np
import torch

from ..data.batches import rank_slice
from ..data.packing import PackedRows, SftBatch, eval_batch, eval_rounds
from .evaluate import eval_loss


def rank_tensors(batch: SftBatch, rank: int, world: int, micro: int, mbs: int) -> list[torch.Tensor]:
    """[ids, targets, positions, segments] (int64) and real (bool) of this rank's rows, each [micro, mbs, seq_len]."""
    L = batch.ids.shape[1]
    return [torch.from_numpy(np.ascontiguousarray(rank_slice(a, rank, world))).view(micro, mbs, L).long()
            for a in (batch.ids, batch.targets, batch.positions, batch.segments)] + [
        torch.from_numpy(np.ascontiguousarray(rank_slice(batch.real, rank, world))).view(micro, mbs, L)]


def run_step(engine, batch: SftBatch, step: int, rank: int, world: int, micro: int, mbs: int):
    """One training step on document rows: the loss scale is 1 / the global batch's trained targets,
    which every rank counts alike (the batch is a pure function of the step)."""
    ids, targets, positions, segments, real = rank_tensors(batch, rank, world, micro, mbs)
    return engine.run_step(step, ids, targets, positions, segments, scale=1.0 / batch.trained_tokens, real=real)


def run_eval(engine, rows: PackedRows, version: int, rank: int, world: int, micro: int, mbs: int,
             global_batch: int) -> tuple[float, int]:
    """This rank's (summed token loss, trained targets) over the held-out rows at weights `version`."""
    total, count = 0.0, 0
    for i in range(eval_rounds(rows, global_batch)):
        ids, targets, positions, segments, _ = rank_tensors(eval_batch(rows, i, global_batch), rank, world, micro,
                                                            mbs)
        s, n = eval_loss(engine, version, ids, targets, positions, segments)
        total, count = total + s, count + n
    return total, count
