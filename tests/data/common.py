"""Shared pieces of the SFT tests: the demo's chat data and tokenizer, a tiny model folder that
transformers wrote, and a plain transformers + AdamW reference that runs each document on its own."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
CHAT = ROOT / "examples" / "data" / "chat"
CHAT_TOKENIZER = CHAT / "tokenizer.json"
VOCAB = 512


def conversations(n: int | None = None) -> list[list[dict]]:
    lines = (CHAT / "train.jsonl").read_text().splitlines()
    return [json.loads(line)["messages"] for line in lines[:n]]


def write_model_folder(folder: Path, family: str = "qwen3", tied: bool = True, seed: int = 0) -> Path:
    """A tiny model with noisy weights, saved by transformers itself (config.json with pad_token_id and the
    like, generation_config.json), plus the chat tokenizer's files: a folder as the hub would ship it."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                  max_position_embeddings=256, tie_word_embeddings=tied, bos_token_id=None, eos_token_id=2,
                  pad_token_id=0)
    if family == "qwen3":
        config = transformers.Qwen3Config(**common)
    else:
        config = transformers.LlamaConfig(**common)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(CHAT)
    tok.save_pretrained(folder)
    return folder


def router_aux_loss(model, outs) -> torch.Tensor | None:
    """transformers' routers' auxiliary loss over the outputs of several forwards (documents run alone) taken
    as one batch, by the family's own load_balancing_loss_func; None where the model adds none."""
    import sys

    if not getattr(model.config, "output_router_logits", False) or not hasattr(model, "router_aux_loss_coef"):
        return None
    balance = sys.modules[type(model).__module__].load_balancing_loss_func
    layers = len(outs[0].router_logits)
    gates = tuple(torch.cat([o.router_logits[i] for o in outs]) for i in range(layers))
    return balance(gates, model.num_experts, model.num_experts_per_tok, None)


def hf_reference(folder: Path, steps_docs: list[list[tuple[torch.Tensor, torch.Tensor]]], train, lr_of,
                 attn: str = "eager", dtype: torch.dtype = torch.float32):
    """transformers model + torch AdamW: each document alone, loss = sum of its trained targets' losses
    over the step / the step's trained targets (+ the routers' auxiliary loss over the step's documents
    taken as one batch, where config.json asks for it); weight decay on matrices only, optional clipping.
    dtype: the reference's precision (float64: the truth an fp32 run is measured against, where fp32's
    own rounding is large, as in gradients that are sums of cancelling terms; experts then run transformers'
    eager loop, grouped_mm having no float64). Returns (losses, grad norms, state dict)."""
    import transformers

    experts = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn, **experts)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for p in params.values() if p.ndim >= 2], "weight_decay": train.weight_decay},
         {"params": [p for p in params.values() if p.ndim < 2], "weight_decay": 0.0}],
        lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps, foreach=False)
    losses, norms = [], []
    for step, docs in enumerate(steps_docs):
        count = sum(int((t != -100).sum()) for _, t in docs)
        opt.zero_grad(set_to_none=True)
        total, outs = torch.zeros(()), []
        for ids, targets in docs:
            outs.append(model(input_ids=ids[None]))
            total = total + F.cross_entropy(outs[-1].logits[0].float(), targets, ignore_index=-100, reduction="sum")
        loss = total / count
        aux = router_aux_loss(model, outs)
        if aux is not None:
            loss = loss + model.router_aux_loss_coef * aux
        loss.backward()
        if train.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(list(params.values()), train.max_grad_norm)
        else:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params.values()]))
        for g in opt.param_groups:
            g["lr"] = lr_of(step)
        opt.step()
        losses.append(float(loss.detach()))
        norms.append(float(norm))
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}
