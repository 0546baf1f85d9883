"""On CUDA: a packed row's attention (block-diagonal mask, per-token rope) through a layer, forward and
backward, against each document run alone on the CPU in fp32."""

from __future__ import annotations

import pytest
import torch

from slidedp.model import layers
from slidedp.model.attention import document_rope
from slidedp.model.config import named_shape
from slidedp.model.init import init_params
from slidedp.sft.packing import PackedRows

from sft.test_packing import documents

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_packed_row_on_cuda_matches_documents_alone(dtype, tol):
    cfg = named_shape("tiny-llama", 512)  # grouped-query attention: the mask path takes whole heads on CUDA
    params = init_params(cfg, 3)
    docs = documents([90, 200, 30, 150, 41])
    rows = PackedRows.build(docs, 512, packed=True)
    ids, _, positions, segments = (torch.from_numpy(a)[None] for a in rows.row(0))
    dev = torch.device("cuda")
    p = {k: v.to(dev, dtype) for k, v in layers.layer_params(params, 0).items()}
    x = layers.embed(params["model.embed_tokens.weight"], ids)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    g[:, rows.positions_used:] = 0
    rope = document_rope(layers.rope_tables(cfg, 512, dev, dtype), positions.to(dev), segments.to(dev))
    with torch.no_grad():
        y = layers.layer_forward(cfg, p, x.to(dev, dtype), rope, 0).float().cpu()
    acc = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in p.items()}
    gx = layers.layer_backward(cfg, p, x.to(dev, dtype), rope, g.to(dev, dtype), 0, acc).float().cpu()
    cpu = layers.layer_params(params, 0)
    at = 0
    for d in range(len(docs)):
        n = len(docs.document(d)[0]) - 1
        alone = x[:, at:at + n].clone().requires_grad_(True)
        out = layers.decoder_layer(cfg, cpu, alone, layers.rope_tables(cfg, n, "cpu"))
        out.backward(g[:, at:at + n])
        assert (y[:, at:at + n] - out.detach()).norm() <= tol * out.norm()
        assert (gx[:, at:at + n] - alone.grad).norm() <= tol * alone.grad.norm()
        at += n
