"""Attention backends: how one micro-batch's rows reach the attention kernel, chosen explicitly.

The engine builds one `Attention` per micro-batch (`plain_rows` or `packed_rows`) and hands it to every
layer's forward, recompute and backward; `Attention.at_window` gives the view of one layer (its sliding
window). The backend is chosen once, by the caller (`choose_backend`), never guessed from the tensors:

causal  every row is one sequence (one document, perhaps followed by its padding) and the layer has no
        window shorter than the row: SDPA's is_causal kernel (flash on CUDA) over the plain rope tables.
varlen  CUDA with a bf16/fp16 flash kernel: the micro-batch's rows flatten into one list of documents
        (cumulative lengths `cu_seqlens`, the longest `max_seqlen`) for torch's variable-length flash
        kernel (`torch.nn.attention.varlen.varlen_attn`); a window of W tokens is the kernel's (W - 1, 0).
        Each document costs the square of its length, not the row's; no mask exists, so padding costs
        nothing. Grouped-query K/V go in with their own head count (the kernel shares them).
mask    CPU, fp32 on CUDA, or where no kernel covers the shape: a boolean [rows, 1, T, T] mask for SDPA,
        block-diagonal over documents and banded by the window. Exact, and T^2 bytes per row.

Every backend computes the same softmax over the same keys as each document run alone (to float rounding):
a token sees the tokens of its own document at most `window - 1` positions back, itself included.
A sliding window counts as in transformers (`kv_idx > q_idx - sliding_window`).

Rope: plain rows use the tables at positions 0..T-1; packed rows gather each token's table at its position
in its own document (so a document's tokens see the same rotations as the document alone).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor

BACKENDS = ("causal", "varlen", "mask")
_VARLEN_HEAD_DIM_MAX = 256  # FlashAttention-2's largest head dimension


@lru_cache(maxsize=1)
def _varlen_kernel():
    """torch's variable-length flash attention and the keywords this torch takes, or None where it has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_available(device: torch.device, dtype: torch.dtype, head_dim: int, windowed: bool = False) -> bool:
    """Whether the varlen backend runs here: CUDA (compute capability 8.0 or newer), half precision, a head
    dimension the flash kernel takes, and a torch that ships the kernel (one that takes window_size where
    a layer has a sliding window: torch 2.11 on; 2.10's takes only is_causal)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or head_dim > _VARLEN_HEAD_DIM_MAX:
        return False
    kernel = _varlen_kernel()
    if kernel is None or (windowed and "window_size" not in kernel[1]):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


def choose_backend(device: torch.device, dtype: torch.dtype, head_dim: int, packed: bool, windowed: bool) -> str:
    """The backend for a micro-batch: plain causal where it suffices, else the variable-length kernel where
    it runs, else the dense mask. packed: some row holds several documents; windowed: some layer's sliding
    window is shorter than the rows."""
    if not packed and not windowed:
        return "causal"
    return "varlen" if varlen_available(device, dtype, head_dim, windowed) else "mask"


@dataclass(frozen=True, eq=False)
class Attention:
    """One micro-batch's attention: the backend and its per-token data, built once, shared by every layer.

    cos, sin: [T, 1, head_dim] (plain rows) or [rows, T, 1, head_dim] (each token's table in its document),
    laid out for q and k as [rows, T, heads, head_dim]. documents: [rows, T] the document number of each
    token (None: each row is one; kept by varlen too, for the layers whose scores run explicitly). cu_seqlens: int32 [documents + 1], the documents' bounds over the rows
    flattened (varlen). window: this layer's sliding window in tokens (None: full causal attention).
    """

    backend: str
    cos: Tensor
    sin: Tensor
    rows: int
    seq_len: int
    documents: Tensor | None = None
    cu_seqlens: Tensor | None = None
    max_seqlen: int = 0
    window: int | None = None
    _masks: dict = field(default_factory=dict, repr=False)  # window -> dense mask, shared by at_window views

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"attention backend {self.backend!r}; known: {', '.join(BACKENDS)}")

    def at_window(self, window: int | None) -> "Attention":
        """This micro-batch's attention for a layer with this sliding window (None: full). A window that
        spans the whole row is no window; a window on plain rows leaves the causal kernel for the
        variable-length one (each row a document) or the mask."""
        if window is not None and window >= self.seq_len:
            window = None
        if window == self.window:
            return self
        if window is not None and self.backend == "causal":
            varlen = varlen_available(self.cos.device, self.cos.dtype, self.cos.shape[-1], windowed=True)
            backend = "varlen" if varlen else "mask"
            return replace(self, backend=backend, window=window, cu_seqlens=_row_bounds(self.rows, self.seq_len,
                                                                                           self.cos.device),
                           max_seqlen=self.seq_len)
        return replace(self, window=window)

    def mask(self) -> Tensor:
        """The dense [rows, 1, T, T] boolean mask of this layer (made once per window per micro-batch)."""
        if self.window not in self._masks:
            t, dev = self.seq_len, self.cos.device
            i = torch.arange(t, device=dev)
            allowed = i[:, None] >= i[None, :]
            if self.window is not None:
                allowed = allowed & (i[:, None] - i[None, :] < self.window)
            if self.documents is None:
                mask = allowed.expand(self.rows, t, t)
            else:
                mask = (self.documents[:, :, None] == self.documents[:, None, :]) & allowed
            self._masks[self.window] = mask.unsqueeze(1)
        return self._masks[self.window]

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, scale: float | None = None, sinks: Tensor | None = None,
                 softcap: float | None = None) -> Tensor:
        """Attention of q [rows, T, heads, d] over k, v [rows, T, kv_heads, d] (rope applied): [rows, T, heads * d].

        scale: of the scores (None: d ** -0.5). sinks [heads]: gpt-oss's attention sinks (a logit per head that
        joins each softmax and is dropped after it); softcap: Gemma 2's cap * tanh(scores / cap). Both run the
        scores explicitly (over the dense mask); so does a head dimension the flash kernel does not take."""
        b, t, nh, d = q.shape
        scale = d**-0.5 if scale is None else scale
        explicit = sinks is not None or softcap is not None
        if self.backend == "varlen" and not explicit and d <= _VARLEN_HEAD_DIM_MAX and _kernel_scales(scale, d):
            return _varlen(q, k, v, self, scale).view(b, t, nh * d)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        nkv = k.shape[1]
        if explicit:
            return _explicit(q, k, v, self.mask(), scale, sinks, softcap).transpose(1, 2).reshape(b, t, nh * d)
        kw = dict(is_causal=True) if self.backend == "causal" else dict(attn_mask=self.mask())
        if nkv != nh and (_SDPA_GQA and not (self.backend != "causal" and q.is_cuda)):
            o = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True, **kw)
        else:  # CUDA's kernel for a mask takes whole heads
            if nkv != nh:
                k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, scale=scale, **kw)
        return o.transpose(1, 2).reshape(b, t, nh * d)


def _explicit(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, sinks: Tensor | None,
              softcap: float | None) -> Tensor:
    """Softmax attention with its scores in the open, as transformers' eager attention: q [rows, heads, T, d],
    k, v [rows, kv_heads, T, d], mask [rows, 1, T, T] -> [rows, heads, T, d]."""
    nh, nkv = q.shape[1], k.shape[1]
    if nkv != nh:
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:  # as gpt-oss: the sink joins the softmax (after subtracting the row max) and is dropped
        sink = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1).to(scores.dtype)
        both = torch.cat([scores, sink], dim=-1)
        both = both - both.max(dim=-1, keepdim=True).values
        probs = torch.softmax(both, dim=-1, dtype=both.dtype)[..., :-1].to(q.dtype)
    return torch.matmul(probs, v)


# enable_gqa (torch >= 2.5) lets SDPA read the shared k/v heads without materializing copies.
_SDPA_GQA = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)


def _kernel_scales(scale: float, head_dim: int) -> bool:
    """Whether the varlen kernel applies this scale (torch 2.10's takes none: it scales by head_dim ** -0.5)."""
    return "scale" in _varlen_kernel()[1] or scale == head_dim**-0.5


def _varlen(q: Tensor, k: Tensor, v: Tensor, a: Attention, scale: float) -> Tensor:
    b, t, nh, d = q.shape
    kernel, takes = _varlen_kernel()
    kw: dict = {"scale": scale} if "scale" in takes else {}  # torch 2.10's kernel scales by d**-0.5 itself
    # causal: torch 2.10 takes is_causal and no window; 2.11 reads window_size (-1, 0) as causal
    if "window_size" in takes:
        kw["window_size"] = (-1 if a.window is None else a.window - 1, 0)
    elif a.window is not None:
        raise ValueError("this torch's varlen_attn takes no window_size: windowed layers need the mask backend")
    if "is_causal" in takes:
        kw["is_causal"] = True
    if k.shape[2] != nh and "enable_gqa" in takes:
        kw["enable_gqa"] = True
    flat = (x.reshape(b * t, x.shape[2], d) for x in (q, k, v))
    return kernel(*flat, a.cu_seqlens, a.cu_seqlens, a.max_seqlen, a.max_seqlen, **kw)


def _row_bounds(rows: int, seq_len: int, device) -> Tensor:
    return torch.arange(0, (rows + 1) * seq_len, seq_len, dtype=torch.int32, device=device)


def plain_rows(tables: tuple[Tensor, Tensor], rows: int, seq_len: int, backend: str = "causal") -> Attention:
    """Rows of one sequence each, from the rope tables [>= seq_len, d] (on the compute device)."""
    cos, sin = (x[:seq_len].unsqueeze(1) for x in tables)
    if backend == "causal":
        return Attention("causal", cos, sin, rows, seq_len)
    return Attention(backend, cos, sin, rows, seq_len, cu_seqlens=_row_bounds(rows, seq_len, cos.device),
                     max_seqlen=seq_len)


def document_bounds(documents: Tensor) -> tuple[Tensor, int]:
    """(cu_seqlens int64 [n + 1], longest) of the documents of [rows, T] (CPU): a document ends where the
    number changes or the row ends."""
    rows, t = documents.shape
    starts = torch.ones(rows, t, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    at = torch.nonzero(starts.reshape(-1)).squeeze(1)
    cu = torch.cat([at, torch.tensor([rows * t])])
    return cu, int((cu[1:] - cu[:-1]).max())


def single_document(documents: Tensor) -> bool:
    """Every row of [rows, T] holds one document (perhaps followed by its padding)."""
    return bool((documents == documents[:, :1]).all())


def packed_rows(tables: tuple[Tensor, Tensor], positions: Tensor, documents: Tensor, backend: str) -> Attention:
    """Rows of packed documents: positions, documents [rows, T] on the CPU (each token's position in its
    document and the document's number in the row); the tables on the compute device."""
    rows, t = documents.shape
    dev = tables[0].device
    pos = positions.to(dev, non_blocking=True)
    cos, sin = (x[pos].unsqueeze(2) for x in tables)
    if backend == "varlen":
        cu, longest = document_bounds(documents)
        return Attention("varlen", cos, sin, rows, t, documents=documents.to(dev), cu_seqlens=cu.to(dev, torch.int32),
                         max_seqlen=longest)
    if backend != "mask":
        raise ValueError(f"packed rows need the varlen or mask backend, not {backend!r}")
    return Attention("mask", cos, sin, rows, t, documents=documents.to(dev))
