"""The dtypes a job names ("bf16", "fp32": plan.compute_dtype, checkpoint.dtype), as torch's."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(map(repr, DTYPES))}, got {name!r}") from None
