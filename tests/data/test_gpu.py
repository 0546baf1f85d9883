"""On CUDA: packed rows through a layer, forward and backward, against each document run alone on the CPU
in fp32: the variable-length kernel (bf16) and the dense mask (fp32, bf16), grouped-query and multi-head
attention, with and without a sliding window, rows that end in padding, one document longer than the rest."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slidedp.model import layers
from slidedp.model.attention import choose_backend, packed_rows
from slidedp.model.config import named_shape
from slidedp.model.init import init_params

pytestmark = pytest.mark.gpu

T = 512
ROWS = [[90, 200, 30, 150, 41], [420, 60], [512]]  # rows 0 and 1 end in padding; 420 is the longest document
GQA = named_shape("tiny-llama", 512)  # 4 query heads over 2 key/value heads
MHA = dataclasses.replace(GQA, num_kv_heads=4)


def packed_batch(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """positions, documents [rows, T]: each document's positions from 0; padding continues the last one."""
    positions, documents = torch.zeros(len(rows), T, dtype=torch.long), torch.zeros(len(rows), T, dtype=torch.long)
    for r, lengths in enumerate(rows):
        at = 0
        for d, n in enumerate(lengths):
            positions[r, at:at + n], documents[r, at:at + n] = torch.arange(n), d
            at += n
        positions[r, at:] = torch.arange(lengths[-1], lengths[-1] + T - at)
        documents[r, at:] = len(lengths) - 1
    return positions, documents


def test_cuda_picks_the_variable_length_kernel_for_packed_bf16_rows():
    dev = torch.device("cuda")
    assert choose_backend(dev, torch.bfloat16, 128, packed=True, windowed=False) == "varlen"
    assert choose_backend(dev, torch.float32, 128, packed=True, windowed=False) == "mask"
    assert choose_backend(dev, torch.bfloat16, 128, packed=False, windowed=False) == "causal"
    assert choose_backend(dev, torch.bfloat16, 128, packed=False, windowed=True) == "varlen"


@pytest.mark.parametrize("cfg", [GQA, MHA], ids=["gqa", "mha"])
@pytest.mark.parametrize("backend,dtype,tol", [("varlen", torch.bfloat16, 3e-2), ("mask", torch.bfloat16, 3e-2),
                                               ("mask", torch.float32, 1e-4)])
@pytest.mark.parametrize("window", [None, 64])
def test_packed_rows_on_cuda_match_documents_alone(cfg, backend, dtype, tol, window):
    params = init_params(cfg, 3)
    gen = torch.Generator().manual_seed(0)
    positions, documents = packed_batch(ROWS)
    x = torch.randn(len(ROWS), T, cfg.hidden_size, generator=gen)
    g = torch.randn(x.shape, generator=gen)
    for r, lengths in enumerate(ROWS):
        g[r, sum(lengths):] = 0  # padding has no target: its gradient is 0 from the loss down
    dev = torch.device("cuda")
    p = {k: v.to(dev, dtype) for k, v in layers.layer_params(params, 0).items()}
    attn = packed_rows(layers.rope_tables(cfg, T, dev, dtype), positions, documents, backend).at_window(window)
    assert attn.backend == backend
    with torch.no_grad():
        y = layers.layer_forward(cfg, p, x.to(dev, dtype), attn, 0).float().cpu()
    acc = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in p.items()}
    gx = layers.layer_backward(cfg, p, x.to(dev, dtype), attn, g.to(dev, dtype), 0, acc).float().cpu()
    cpu = layers.layer_params(params, 0)
    cpu_leaves = {k: v.clone().requires_grad_(True) for k, v in cpu.items()}
    for r, lengths in enumerate(ROWS):
        at = 0
        for n in lengths:
            alone = x[r:r + 1, at:at + n].clone().requires_grad_(True)
            out = layers.decoder_layer(cfg, cpu_leaves, alone, layers.causal_attention(cfg, 1, n, "cpu").at_window(window))
            out.backward(g[r:r + 1, at:at + n])
            assert (y[r, at:at + n] - out[0].detach()).norm() <= tol * out.norm()
            assert (gx[r, at:at + n] - alone.grad[0]).norm() <= tol * alone.grad.norm()
            at += n
        assert not gx[r, at:].any()  # padding's gradient stays 0
    for name, leaf in cpu_leaves.items():  # the weights' gradients: the sum over every document
        assert (acc[name].cpu() - leaf.grad).norm() <= tol * leaf.grad.norm(), name
