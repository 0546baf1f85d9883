"""transformers' own decoder layers on streamed tensors: every causal LM whose layers form a list.

The binding. transformers builds the model once with its parameters on the meta device (no memory; the
rotary tables and other buffers are real). Its decoder layers are sorted into structures (the layer class,
its layer type, its tensors' shapes and its modules' settings: full and linear attention, sliding and global),
and one layer of each structure is kept as the template. A layer runs as
`torch.func.functional_call(template, tensors, ...)`, the tensors being views of the delivered chunk, so
autograd sees the streamed buffer itself and a layer's gradients land in views of one flat fp32 buffer,
as with the native layers. Views and not copies: a layer costs no copy on the device; one template per
structure and not per layer: an 80-layer model holds a handful of modules.

What a layer receives besides its input (rotary tables, position ids, whatever the family's forward hands
its layers) comes from the model's own forward: per micro-batch, the decoder runs once with its layers
replaced by recorders that keep each call's keywords and pass the hidden state through. So the rotary
module, the per-layer-type tables and any keyword a family adds are transformers' own, not a copy of them.
A probe at load checks the contract this relies on: the layers are called in order, each on the previous
one's output, the embedding reaches layer 0 scaled by at most a constant, and the final norm is all that
follows the last layer. A family that breaks it (per-layer inputs, shared KV caches) is refused by name.

Attention goes through `slidedp`, an attention function registered with transformers: it finds the
micro-batch's `Attention` (attention.py) set beside the layer's call and runs it at the module's sliding
window, scale, sinks and softcap: SDPA, the variable-length kernel for packed rows, or explicit scores.
With `compile`, each structure's layer runs through torch.compile around it (the attention stays eager).
No mask is made (transformers makes none for an attention function without a mask function).

Mixture-of-Experts routers add transformers' auxiliary load-balancing loss where the job asks
(router_aux.py): hooks on the templates' routers catch their logits in each layer's forward and recompute.

Packed rows through a layer that mixes tokens without attention (Gated DeltaNet, convolutions) would leak
across documents: a structure whose first forward called no attention is, on packed rows, run one document
at a time, each with the keywords the model's forward gives a sequence of that length. Exact, slower.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import Attention, document_bounds
from .config import ModelConfig
from .loss import chunked_cross_entropy_sum, norm_head_backward
from .router_aux import RouterAuxError, Routing

ATTENTION_NAME = "slidedp"
_calls = [0]  # attention calls so far: tells a structure that attends from one that does not
# The micro-batch's Attention while a layer runs: beside the call, not among its keywords, so a compiled
# layer neither guards on it nor recompiles for each micro-batch's documents.
_current: list[Attention | None] = [None]


@contextmanager
def _attending(attn: Attention | None) -> Iterator[None]:
    _current[0] = attn
    try:
        yield
    finally:
        _current[0] = None


class UnsupportedModel(ValueError):
    pass


def _attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, dropout: float = 0.0,
               scaling: float | None = None, sliding_window: int | None = None, softcap: float | None = None,
               s_aux: Tensor | None = None, **kwargs) -> tuple[Tensor, None]:
    """transformers' attention-function contract: q [b, heads, t, d], k, v [b, kv_heads, t, d] ->
    ([b, t, heads, d], no weights)."""
    attn = _current[0]
    if attn is None:
        raise RuntimeError(f"{type(module).__name__} called SlideDP's attention without the micro-batch's context")
    if not getattr(module, "is_causal", True):
        raise UnsupportedModel(f"{type(module).__name__} attends bidirectionally; SlideDP trains causal attention")
    if dropout:
        raise UnsupportedModel(f"{type(module).__name__} drops attention weights (dropout {dropout}); set the "
                               "config's attention dropout to 0")
    _calls[0] += 1
    b, _, t, d = query.shape
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    out = attn.at_window(sliding_window)(q, k, v, scale=scaling, sinks=s_aux, softcap=softcap)
    return out.view(b, t, -1, d), None


def register_attention() -> None:
    from transformers import AttentionInterface

    # never traced: a compiled layer runs in pieces around it (the kernels and the Attention stay eager)
    AttentionInterface.register(ATTENTION_NAME, torch.compiler.disable(_attention))


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the meta device and their buffers real (rotary tables)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


class _Recorder(nn.Module):
    """Stands in for decoder layer `index` during the model's forward: keeps the call's keywords."""

    def __init__(self, layer: nn.Module, index: int, calls: list) -> None:
        super().__init__()
        self.__dict__["_layer"], self.index, self.calls = layer, index, calls

    def __getattr__(self, name: str):  # the model's forward may read a layer's attributes (attention_type)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_layer"], name)

    def forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
        if any(a is not None for a in args):
            raise UnsupportedModel(f"decoder layer {self.index} takes positional inputs besides the hidden state "
                                   "(per-layer inputs): its layers cannot be streamed one at a time")
        self.calls.append((self.index, hidden_states, kwargs))
        return hidden_states


def _settings(layer: nn.Module) -> tuple:
    """What sets a layer's structure apart besides its tensors: the plain settings of its modules."""
    out = []
    for path, m in layer.named_modules():
        for k, v in sorted(vars(m).items()):
            if k != "layer_idx" and not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None))):
                out.append((path, k, v))
    return tuple(out)


@dataclass(frozen=True, eq=False)
class Batch:
    """One micro-batch's context: its Attention, each layer's keywords from the model's forward, (packed
    rows) its documents as (row, start, end) spans for layers that must see one document at a time, and
    which of its tokens are real (not padding: what the routers' auxiliary loss counts; None: all)."""

    attn: Attention
    layer_kwargs: tuple[dict, ...]
    spans: tuple[tuple[int, int, int], ...] | None
    real: Tensor | None = None

    @property
    def tokens(self) -> int:
        return self.attn.rows * self.attn.seq_len


def build(cfg: ModelConfig, dtype: torch.dtype) -> tuple:
    """(transformers' config, its causal LM with parameters on the meta device, the factor its forward puts
    on the logits) for the store's model, refused with UnsupportedModel where transformers does not know the
    family, its layers are tied together, its tensors are not the store's or its head does more than a
    factor and a softcap."""
    import transformers

    register_attention()
    source = dict(cfg.source() or cfg.to_hf())
    model_type = source.pop("model_type", cfg.family)
    try:
        config = transformers.AutoConfig.for_model(model_type, **source)
    except (ValueError, KeyError) as e:
        raise UnsupportedModel(f"transformers {transformers.__version__} does not know model_type "
                               f"{model_type!r}: {e}") from None
    for key, what in (("hidden_size_per_layer_input", "per-layer inputs"),
                      ("num_kv_shared_layers", "key/value caches shared across layers")):
        if getattr(config, key, 0):
            raise UnsupportedModel(f"{model_type}: {key} = {getattr(config, key)} ({what}) ties layers together; "
                                   "SlideDP streams layers that depend on nothing but the previous layer's output")
    config.use_cache = False
    with _parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTENTION_NAME)
    _check_table(cfg, model)
    return config, model, _head_scale(cfg, config, model)


def _head_scale(cfg: ModelConfig, config, model: nn.Module) -> float:
    """The constant the causal LM's forward multiplies the head's logits by (Cohere's logit_scale, Granite's
    1 / logits_scaling; 1.0 for most), found by running its forward on a stand-in decoder and head. Refused
    where the forward does more to the logits than that and the config's final_logit_softcapping."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    gen = torch.Generator().manual_seed(0)
    h = torch.randn(1, 3, cfg.hidden_size, generator=gen)
    w = torch.randn(5, cfg.hidden_size, generator=gen) * cfg.hidden_size**-0.5

    class Output(BaseModelOutputWithPast):
        def __getattr__(self, name: str):  # what else a family's forward reads (router_logits...): nothing
            if name.startswith("__"):
                raise AttributeError(name)
            return None

    class Decoder(nn.Module):
        def forward(self, *args, **kwargs):
            return Output(last_hidden_state=h)

    decoder = model.get_decoder()
    name = next(n for n, m in model.named_children() if m is decoder)
    head = nn.Linear(cfg.hidden_size, 5, bias=False)
    head.weight = nn.Parameter(w)
    setattr(model, name, Decoder())
    model.set_output_embeddings(head)
    try:
        with torch.no_grad():
            got = model(input_ids=torch.zeros(1, 3, dtype=torch.long), use_cache=False).logits.float()
    finally:
        setattr(model, name, decoder)
    raw = h @ w.T
    cap = getattr(config, "final_logit_softcapping", None)
    before_cap = got if cap is None else cap * torch.atanh(got / cap)
    ratio = (before_cap / raw).flatten()
    scale = float(ratio.median())
    want = raw * scale
    if cap is not None:
        want = torch.tanh(want / cap) * cap
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise UnsupportedModel(f"{type(model).__name__}'s forward transforms the head's logits beyond a constant "
                               "scale and the config's final_logit_softcapping; SlideDP's loss cannot reproduce it")
    return 1.0 if abs(scale - 1.0) < 1e-6 else scale


def _check_table(cfg: ModelConfig, model: nn.Module) -> None:
    # parameters and persistent buffers (Gemma 4's layer_scalar): both stream, a buffer unchanged by AdamW
    # (it gets no gradient, so its moments stay 0 and its update is 0)
    built = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        built.pop("lm_head.weight", None)
    stored = dict(cfg.parameter_shapes())
    if built != stored:
        missing = sorted(set(built) - set(stored))
        extra = sorted(set(stored) - set(built))
        shapes = sorted(n for n in set(built) & set(stored) if built[n] != stored[n])
        raise UnsupportedModel(
            f"the {cfg.family} model transformers builds from this config.json ({type(model).__name__}) does not "
            "have the folder's tensors: "
            + "; ".join(f"{what} {names[:4]}" for what, names in (("it has, the folder lacks", missing),
                        ("the folder has, it lacks", extra), ("other shapes", shapes)) if names))


class TransformersMath:
    """transformers' layers for any causal LM of the store's layout (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, compile: bool = False,
                 router_aux: bool = False) -> None:
        """compile: run each structure's layer through torch.compile (attention stays eager, outside the
        graph; packed rows of layers that run one document at a time stay eager too). router_aux: add the
        routers' auxiliary loss (refused, UnsupportedModel, for a model whose transformers class adds none)."""
        self.cfg, self.device, self.dtype = cfg, device, dtype
        config, model, self.logit_scale = build(cfg, dtype)
        for module in model.modules():  # buffers (rotary tables) to the device; parameters stay on meta
            for k, b in module._buffers.items():
                if b is not None:
                    module._buffers[k] = b.to(device)
        model.eval()  # no dropout anywhere
        self.config = config
        self.decoder = model.get_decoder()
        layers = list(self.decoder.layers)
        types = getattr(config, "layer_types", None) or [None] * len(layers)
        keys = [(type(m).__name__, types[i], tuple((n, tuple(p.shape)) for n, p in m.named_parameters()), _settings(m))
                for i, m in enumerate(layers)]
        self._structure = [keys.index(k) for k in keys]  # each layer's structure: its first layer's index
        self.templates = {s: layers[s] for s in set(self._structure)}
        self._buffers = {s: {n for n, _ in m.named_buffers()} for s, m in self.templates.items()}
        self._attends: dict[int, bool] = {}
        self.norm = self.decoder.norm
        embed = self.decoder.embed_tokens
        self.padding_idx = getattr(embed, "padding_idx", None)
        scale = getattr(embed, "embed_scale", None)
        self._embed_scale = None if scale is None else torch.as_tensor(scale, dtype=torch.float32)
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self._calls: list = []
        self.decoder.layers = nn.ModuleList([_Recorder(m, i, self._calls) for i, m in enumerate(layers)])
        self.decoder.norm = _Recorder(self.norm, -1, self._calls)
        self._doc_kwargs: dict[int, dict] = {}
        self._compiled = {s: _compiled_layer(m) for s, m in self.templates.items()} if compile else {}
        self._input_scale = self._probe()
        self.routing: Routing | None = None
        if router_aux:
            try:
                self.routing = Routing(model, self.templates, device)
            except RouterAuxError as e:
                raise UnsupportedModel(str(e)) from None

    # ---- load ------------------------------------------------------------------------------
    def _record(self, rows: int, seq_len: int, position_ids: Tensor, embeds: Tensor | None = None
                ) -> tuple[list, Tensor]:
        """Run the model's forward with the layers recording: each layer's (input, keywords), and its output."""
        self._calls.clear()
        x = embeds if embeds is not None else torch.zeros((), device=self.device, dtype=self.dtype).expand(
            rows, seq_len, self.cfg.hidden_size)
        with torch.no_grad():
            out = self.decoder(inputs_embeds=x, position_ids=position_ids, use_cache=False).last_hidden_state
        calls = list(self._calls)
        self._calls.clear()
        order = [i for i, _, _ in calls]
        if order != list(range(self.cfg.num_layers)) + [-1]:
            raise UnsupportedModel(f"{type(self.decoder).__name__}'s forward calls its layers and norm in the order "
                                   f"{order[:8]}...; SlideDP streams them once each, in order")
        return calls, out

    def _probe(self) -> Tensor | None:
        """Check the streaming contract on a short random input; returns the constant the forward scales the
        embedding by before layer 0 (Gemma 1/2), None if it passes it as is."""
        t = 4
        x = torch.randn(1, t, self.cfg.hidden_size, device=self.device).to(self.dtype)
        calls, out = self._record(1, t, torch.arange(t, device=self.device)[None], x)
        for (i, h, _), (_, prev, _) in zip(calls[1:], calls):
            if h is not prev:
                raise UnsupportedModel(f"{type(self.decoder).__name__}'s forward changes the hidden state between "
                                       f"layers (before layer {i}); SlideDP cannot stream its layers")
        if out is not calls[-1][1]:
            raise UnsupportedModel(f"{type(self.decoder).__name__}'s forward does more than the final norm after "
                                   "the last layer")
        first = calls[0][1]
        if first is x:
            return None
        ratio = (first.float() / x.float()).flatten()
        if not torch.allclose(ratio, ratio[0].expand_as(ratio), rtol=1e-2):
            raise UnsupportedModel(f"{type(self.decoder).__name__}'s forward transforms the embeddings before the "
                                   "first layer; SlideDP cannot stream its layers")
        return ratio[0].to(self.dtype)

    # ---- the interface (family.ModelMath) ----------------------------------------------------
    def structures(self) -> dict[int, int]:
        return {s: self._structure.count(s) for s in sorted(set(self._structure))}

    def rope(self, seq_len: int) -> tuple[Tensor, Tensor]:
        """Placeholder tables: transformers' layers rotate with the model's own rotary module."""
        z = torch.zeros(seq_len, 1, device=self.device, dtype=self.dtype)
        return z, z

    def batch_context(self, attn: Attention, positions: Tensor | None, documents: Tensor | None,
                      real: Tensor | None = None) -> Batch:
        """real [rows, T] bool (None: every token): the tokens that are not padding."""
        rows, t = attn.rows, attn.seq_len
        if positions is None:
            pos = torch.arange(t, device=self.device)[None].expand(rows, t)
            spans = None
        else:
            pos = positions.to(self.device)
            spans = tuple(_spans(documents)) if documents is not None else None
        calls, _ = self._record(rows, t, pos)
        if real is not None:
            real = None if bool(real.all()) else real.reshape(-1).to(self.device, torch.float32)
        return Batch(attn, tuple(kw for _, _, kw in calls[:-1]), spans, real)

    def prepare(self, layer: int, p: dict[str, Tensor]) -> dict[str, Tensor]:
        return p

    def _call(self, layer: int, p: Mapping[str, Tensor], x: Tensor, kwargs: dict, attn: Attention | None,
              compiled: bool = True) -> Tensor:
        s = self._structure[layer]
        with _attending(attn):
            if compiled and s in self._compiled:
                out = self._compiled[s](dict(p), x, kwargs)
            else:
                out = torch.func.functional_call(self.templates[s], dict(p), (x,), kwargs)
        return out[0] if isinstance(out, tuple) else out

    def _run(self, layer: int, p: Mapping[str, Tensor], x: Tensor, ctx: Batch) -> Tensor:
        s = self._structure[layer]
        if s not in self._attends:  # the structure's first call (eager): does it attend through us?
            before = _calls[0]
            y = self._call(layer, p, x, ctx.layer_kwargs[layer], ctx.attn, compiled=False)
            self._attends[s] = _calls[0] > before
            if self._attends[s] or ctx.spans is None:
                return y
            if self.routing is not None:  # its routers' logits come again, document by document
                self.routing.forget()
        elif self._attends[s] or ctx.spans is None:
            return self._call(layer, p, x, ctx.layer_kwargs[layer], ctx.attn)
        rows = [[] for _ in range(x.shape[0])]
        for r, a, b in ctx.spans:  # one document at a time, as the model's forward would see it alone (eager:
            # a compiled layer would compile again for every document length)
            rows[r].append(self._call(layer, p, x[r:r + 1, a:b], self._alone(b - a), None, compiled=False))
        return torch.cat([torch.cat(pieces, dim=1) for pieces in rows])

    def _alone(self, length: int) -> dict:
        """The keywords the model's forward gives each layer of a sequence of `length` tokens alone."""
        if length not in self._doc_kwargs:
            if len(self._doc_kwargs) > 4096:
                self._doc_kwargs.clear()
            calls, _ = self._record(1, length, torch.arange(length, device=self.device)[None])
            self._doc_kwargs[length] = calls[0][2]
        return self._doc_kwargs[length]

    def layer_forward(self, layer: int, p: Mapping[str, Tensor], x: Tensor, ctx: Batch, tile: int) -> Tensor:
        routing = self.routing
        if routing is None or not routing.collecting:
            return self._run(layer, p, x, ctx)
        with routing.caught() as logits:
            y = self._run(layer, p, x, ctx)
        routing.add(logits, ctx.real, ctx.tokens)
        return y

    def layer_backward(self, layer: int, p: Mapping[str, Tensor], x: Tensor, ctx: Batch, grad_y: Tensor,
                       tile: int, acc: Mapping[str, Tensor]) -> Tensor:
        x = x.detach().requires_grad_(True)
        buffers = self._buffers[self._structure[layer]]  # stream with the layer, never trained
        leaves = {k: v.detach().requires_grad_(k not in buffers) for k, v in p.items()}
        routing = self.routing if self.routing is not None and self.routing.active else None
        with torch.enable_grad():
            if routing is None:
                outputs, grads = [self._run(layer, leaves, x, ctx)], [grad_y]
            else:  # the auxiliary loss's term of this layer's routers joins the backward
                with routing.caught() as logits:
                    outputs, grads = [self._run(layer, leaves, x, ctx)], [grad_y]
                term = routing.backward_term(logits, ctx.real, ctx.tokens)
                if term is not None:
                    outputs.append(term)
                    grads.append(torch.ones_like(term))
        names = [n for n in leaves if n not in buffers]
        got = torch.autograd.grad(outputs, [x] + [leaves[n] for n in names], grads, allow_unused=True)
        for n, g in zip(names, got[1:]):
            if g is not None:
                acc[n].add_(g)
        return got[0]

    def embed(self, weight: Tensor, ids: Tensor) -> Tensor:
        return self.scale_embedding(F.embedding(ids, weight, self.padding_idx))

    def scale_embedding(self, rows: Tensor) -> Tensor:
        """As the model: the embedding module's scale (Gemma 3/4), then the forward's (Gemma 1/2), each in the
        compute dtype."""
        if self._embed_scale is not None:
            rows = rows * self._embed_scale.to(rows.device, rows.dtype)
        if self._input_scale is not None:
            rows = rows * self._input_scale.to(rows.device, rows.dtype)
        return rows

    def embedding_grad(self, grad_x: Tensor, ids: Tensor) -> Tensor:
        g = self.scale_embedding(grad_x).reshape(-1, grad_x.shape[-1]).to(torch.float32)
        if self.padding_idx is not None:  # nn.Embedding gives the padding row no gradient
            g = g.masked_fill((ids.reshape(-1) == self.padding_idx)[:, None], 0.0)
        return g

    def _norm(self, x: Tensor, p: Mapping[str, Tensor]) -> Tensor:
        return torch.func.functional_call(self.norm, dict(p), (x,))

    def loss_and_backward(self, x, targets, norm_p, head_w, scale, tile, chunk, norm_acc, head_acc) -> Tensor:
        return norm_head_backward(x, targets, self._norm, norm_p, head_w, scale, 0, chunk, norm_acc, head_acc,
                                  self.softcap, self.logit_scale)

    def loss(self, x, targets, norm_p, head_w, chunk) -> Tensor:
        h = self._norm(x, norm_p).reshape(-1, x.shape[-1])
        return chunked_cross_entropy_sum(h, head_w, targets.reshape(-1), chunk, self.softcap, self.logit_scale)


def _compiled_layer(template: nn.Module):
    def run(p: dict[str, Tensor], x: Tensor, kwargs: dict):
        return torch.func.functional_call(template, p, (x,), kwargs)

    return torch.compile(run, dynamic=False)


def _spans(documents: Tensor) -> Iterator[tuple[int, int, int]]:
    """(row, start, end) of each document of documents [rows, T] (CPU), from the bounds the varlen kernel
    takes (a document never crosses a row's end)."""
    t = documents.shape[1]
    cu = document_bounds(documents)[0].tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        yield a // t, a % t, b - a // t * t
