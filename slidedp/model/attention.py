"""Attention inside documents: per-token rope positions and a block-diagonal causal mask for packed rows.

A row that holds several documents gives each token its position in its own document (rope tables
gathered per token) and lets it attend only to earlier tokens of the same document. `DocumentRope`
carries both to `layers._attention` in place of the plain (cos, sin) tables; rows that hold one
document (or one document and its padding) keep the plain tables and SDPA's is_causal kernel.

The mask is a boolean [rows, 1, T, T] for `scaled_dot_product_attention`, on CPU and CUDA: exact (the
same softmax over the same keys as the document run alone, to float rounding). It costs T^2 bytes per
row while a layer runs, 4 MiB per row at T = 2048.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class DocumentRope(NamedTuple):
    cos: Tensor  # [rows, 1, T, head_dim]: the table at each token's position in its document
    sin: Tensor
    mask: Tensor  # [rows, 1, T, T] bool: True where the query may attend to the key


def single_segment(segments: Tensor) -> bool:
    """Every row of [rows, T] holds one segment (one document, perhaps followed by its padding)."""
    return bool((segments == segments[:, :1]).all())


def document_rope(tables: tuple[Tensor, Tensor], positions: Tensor, segments: Tensor) -> DocumentRope:
    """From the plain tables [>= T, d] and per-token positions, segments [rows, T] (on the tables' device)."""
    cos, sin = tables[0][positions].unsqueeze(1), tables[1][positions].unsqueeze(1)
    t = segments.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=segments.device).tril()
    mask = (segments[:, :, None] == segments[:, None, :]) & causal
    return DocumentRope(cos, sin, mask.unsqueeze(1))
