"""How the varlen backend calls torch's kernel on each torch signature, on CPU with a stand-in kernel.

torch 2.10's `varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None)` takes no scale
and no window; 2.11's takes keyword-only `scale` and `window_size` (its (-1, 0) is causal) and no is_causal.
The stand-in runs each document through SDPA and honours exactly the keywords its signature names, so the
varlen path's output must equal the dense-mask backend's: packed documents, GQA, and (on 2.11) a window.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slidedp.model import attention as attn


def _documents(q, k, v, cu, causal: bool, window: tuple[int, int], scale: float | None):
    out = torch.empty_like(q)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qd, kd, vd = (x[a:b].transpose(0, 1) for x in (q, k, v))  # [heads, n, d]
        kd, vd = (x.repeat_interleave(qd.shape[0] // x.shape[0], dim=0) for x in (kd, vd))
        n = b - a
        i = torch.arange(n)
        allowed = torch.ones(n, n, dtype=torch.bool)
        if causal or window[1] == 0:
            allowed &= i[:, None] >= i[None, :]
        if window[0] >= 0:
            allowed &= i[:, None] - i[None, :] <= window[0]
        out[a:b] = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=allowed, scale=scale).transpose(0, 1)
    return out


def kernel_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    return _documents(query, key, value, cu_seq_q, is_causal, (-1, -1), None)


def kernel_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1)):
    return _documents(query, key, value, cu_seq_q, False, window_size, scale)


def _rows(heads: int, kv_heads: int, d: int = 8):
    torch.manual_seed(0)
    documents = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0, 0, 0, 1, 1]])
    positions = torch.cat([torch.arange(n) for row in documents for n in torch.unique_consecutive(
        row, return_counts=True)[1].tolist()]).view(2, 10)
    tables = (torch.randn(16, d), torch.randn(16, d))
    q, k, v = torch.randn(2, 10, heads, d), torch.randn(2, 10, kv_heads, d), torch.randn(2, 10, kv_heads, d)
    return tables, positions, documents, q, k, v


@pytest.mark.parametrize("kernel", [kernel_2_10, kernel_2_11])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_packed_documents_through_the_kernel_equal_the_mask(monkeypatch, kernel, heads, kv_heads):
    import inspect
    monkeypatch.setattr(attn, "_varlen_kernel", lambda: (kernel, frozenset(inspect.signature(kernel).parameters)))
    tables, positions, documents, q, k, v = _rows(heads, kv_heads)
    varlen = attn.packed_rows(tables, positions, documents, "varlen")
    mask = attn.packed_rows(tables, positions, documents, "mask")
    assert varlen.cu_seqlens.tolist() == [0, 5, 8, 10, 18, 20] and varlen.max_seqlen == 8
    torch.testing.assert_close(varlen(q, k, v), mask(q, k, v), rtol=0, atol=1e-6)


def test_a_window_runs_on_2_11_and_is_refused_by_2_10(monkeypatch):
    import inspect
    tables, positions, documents, q, k, v = _rows(4, 2)
    monkeypatch.setattr(attn, "_varlen_kernel", lambda: (kernel_2_11, frozenset(inspect.signature(kernel_2_11).parameters)))
    windowed = attn.packed_rows(tables, positions, documents, "varlen").at_window(3)
    torch.testing.assert_close(windowed(q, k, v), attn.packed_rows(tables, positions, documents, "mask").at_window(3)(q, k, v),
                               rtol=0, atol=1e-6)
    monkeypatch.setattr(attn, "_varlen_kernel", lambda: (kernel_2_10, frozenset(inspect.signature(kernel_2_10).parameters)))
    with pytest.raises(ValueError, match="takes no window_size"):
        windowed(q, k, v)


def test_a_torch_without_window_size_leaves_windowed_models_to_the_mask(monkeypatch):
    import inspect
    monkeypatch.setattr(attn, "_varlen_kernel", lambda: (kernel_2_10, frozenset(inspect.signature(kernel_2_10).parameters)))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    assert attn.choose_backend(cuda, torch.bfloat16, 128, packed=True, windowed=False) == "varlen"
    assert attn.choose_backend(cuda, torch.bfloat16, 128, packed=True, windowed=True) == "mask"
    assert attn.choose_backend(cuda, torch.float32, 128, packed=True, windowed=False) == "mask"
    monkeypatch.setattr(attn, "_varlen_kernel", lambda: (kernel_2_11, frozenset(inspect.signature(kernel_2_11).parameters)))
    assert attn.choose_backend(cuda, torch.bfloat16, 128, packed=True, windowed=True) == "varlen"
    assert attn.choose_backend(cuda, torch.bfloat16, 128, packed=False, windowed=False) == "causal"
