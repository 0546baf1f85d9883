"""Deterministic random initialization, one tensor at a time.

Each tensor's values depend only on (seed, name): the store can fill its shared-memory
views in any order, in any process, and get the same model. Python's hash() is salted
per process, so the generator seed comes from blake2b instead.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from slidedp.model.config import ModelConfig

INIT_STD = 0.02


def _stable_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def init_tensor_(name: str, out: Tensor, seed: int) -> Tensor:
    """Fill `out` in place: norm weights -> 1, biases -> 0, matrices -> N(0, 0.02) seeded by (seed, name)."""
    module = name.split(".")[-2] if "." in name else ""
    with torch.no_grad():
        if name.endswith(".bias"):
            return out.zero_()
        if module.endswith("norm"):
            return out.fill_(1.0)
        if out.dim() < 2:
            raise ValueError(f"init_tensor_: no rule for the {out.dim()}-D tensor {name!r} (not a norm, not a bias)")
        gen = torch.Generator(device="cpu").manual_seed(_stable_seed(seed, name))
        # Draw in fp32 on the CPU whatever `out` is, so the values never depend on the destination.
        if out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous():
            return out.normal_(0.0, INIT_STD, generator=gen)
        return out.copy_(torch.empty(out.shape, dtype=torch.float32).normal_(0.0, INIT_STD, generator=gen))


def init_params(cfg: ModelConfig, seed: int) -> dict[str, Tensor]:
    """Every parameter of `cfg`, fp32, full Hugging Face names, in store order."""
    return {name: init_tensor_(name, torch.empty(shape, dtype=torch.float32), seed)
            for name, shape in cfg.parameter_shapes()}
