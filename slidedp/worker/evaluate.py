"""The eval loss of a rank's share of held-out rows, forward only, on the weights of a committed step.

It runs between two training steps, after step s - 1 (so on version s, the weights step s trains
from): every layer is fetched at version s (the fetch waits until the updaters have applied step
s - 1 to it, so what it reads is current), run under no_grad, and nothing leaves the device but two
numbers (the summed token loss and the count of trained targets), which the launcher adds up over the
ranks. No gradient slot is taken and no gradient or loss message goes to the aggregator, so the
updaters and the aggregator never see an eval; every rank fetches the same layers in the same order,
so the sharded route's all-gathers pair up. Held units are read from their device copies, current
after the step's own update on the device.
"""

from __future__ import annotations

import torch

from ..data.targets import IGNORE_INDEX
from ..store.layout import unit_tensors


@torch.no_grad()
def eval_loss(engine, version: int, ids: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor,
              segments: torch.Tensor) -> tuple[float, int]:
    """(sum of token losses, trained targets) of rows [M, m, T] (on the CPU) at weights version `version`."""
    cfg, math = engine.cfg, engine.math
    M, m, T = ids.shape
    attns = engine.micro_attention(M, m, T, positions, segments)
    ids_dev = ids.to(engine.device)
    tied, held = cfg.tie_word_embeddings, engine.held
    if tied or "embed" in held or not engine.rows_from_host:
        embed_w = engine._weight("embed", version)
        xs = [math.embed(embed_w, ids_dev[i]) for i in range(M)]
    else:
        xs = [math.scale_embedding(x) for x in engine.host_embedding(ids, version)]

    for layer in range(cfg.num_layers):
        unit, strip = engine.units[f"layer.{layer}"], f"model.layers.{layer}."
        if unit.name in held:
            p = held[unit.name].tensors(strip)
        else:
            p = unit_tensors(engine.delivery.fetch(unit, version), unit, strip=strip)
            nxt = f"layer.{layer + 1}"
            if layer + 1 < cfg.num_layers and nxt not in held:
                engine.delivery.prefetch(engine.units[nxt], version)
        p = math.prepare(layer, p)
        xs = [math.layer_forward(layer, p, x, a, engine.plan.seq_tile_tokens) for x, a in zip(xs, attns)]
        del p
    norm_unit = engine.units["norm"]
    norm_p = unit_tensors(engine.delivery.fetch(norm_unit, version), norm_unit, strip="model.norm.")
    head_w = embed_w if tied else engine._weight("head", version)
    total = torch.zeros((), dtype=torch.float32, device=engine.device)
    targets_dev = targets.to(engine.device)
    for x, tgt in zip(xs, targets_dev):
        total += math.loss(x, tgt, norm_p, head_w, engine.plan.loss_chunk_tokens)
    return float(total), int((targets != IGNORE_INDEX).sum())
