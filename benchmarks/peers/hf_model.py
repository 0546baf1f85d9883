"""The benchmark's model as a `transformers` model: the same config, the same random weights' rules.

For the peers that train what users load (`AutoModelForCausalLM`): Liger, MegaTrain. The
config is slidedp's own `ModelConfig.to_hf()` (what SlideDP writes into a model folder); the
parameters carry the same names as SlideDP's store, so `common.init_named_` fills them by the
same rules (and, with the exact CPU generator, the same values).
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.peers import common
from slidedp.model.config import ModelConfig


def hf_config(cfg: ModelConfig, attn_implementation: str = "sdpa") -> Any:
    from transformers import AutoConfig

    d = cfg.to_hf()
    d.pop("architectures", None)
    model_type = d.pop("model_type")
    d["use_cache"] = False  # training: no KV cache
    conf = AutoConfig.for_model(model_type, **d)
    conf._attn_implementation = attn_implementation
    return conf


def build(cfg: ModelConfig, device: str, dtype: torch.dtype, seed: int, on: str,
          attn_implementation: str = "sdpa") -> torch.nn.Module:
    """AutoModelForCausalLM for cfg on `device` in `dtype`, weights drawn by common.init_named_.

    Built with `dtype` as torch's default, as `from_pretrained(torch_dtype=...)` builds it: the
    parameters in `dtype`, buffers that transformers makes in fp32 on purpose (the rope
    frequencies) left in fp32 (a `model.to(dtype)` would round them too)."""
    from transformers import AutoModelForCausalLM

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config(cfg, attn_implementation),
                                                     attn_implementation=attn_implementation)
    finally:
        torch.set_default_dtype(default)
    wrong = {str(p.dtype) for p in model.parameters() if p.dtype != dtype}
    if wrong:
        raise RuntimeError(f"the transformers model has parameters in {sorted(wrong)}, not {dtype}")
    named = dict(model.named_parameters())  # tied: lm_head.weight is the embedding, listed once
    missing = [n for n, _ in cfg.parameter_shapes() if n not in named]
    if missing:
        raise RuntimeError(f"the transformers model lacks {missing[:3]} (its names differ from SlideDP's)")
    common.init_named_(((n, named[n]) for n, _ in cfg.parameter_shapes()), seed, on)
    return model
