"""Model shape: one frozen dataclass for the whole decoder family, and its parameter table.

Parameter names follow Hugging Face (`model.layers.3.mlp.up_proj.weight`), so a checkpoint
folder maps onto the store without renaming. The four native families compute their table from
the shape; any other family (run by transformers' own layers, model/generic.py) carries the table
read from its folder (`layer_tables`, `norm_table`) and its config.json (`source_config`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
LAYER_TYPES = ("full_attention", "sliding_attention")
Table = tuple[tuple[str, tuple[int, ...]], ...]  # (name, shape) pairs in store order
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class ModelConfigError(ValueError):
    pass


def layers_for(cfg: "ModelConfig", choice: str | None) -> str:
    """Whose layers run the model (plan.layers): the job's choice, or (None: "auto") SlideDP's own where
    they model it, else transformers'."""
    if choice is None:
        return "native" if cfg.native else "transformers"
    if choice == "native" and not cfg.native:
        raise ModelConfigError(f"plan.layers = \"native\": SlideDP's own layers do not model this {cfg.family} "
                               "configuration; use \"auto\" or \"transformers\"")
    return choice


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    attention_bias: bool = False  # Qwen2: bias on q, k and v
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k
    # llama3-style rope scaling as sorted (key, value) pairs, or () for none
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Sliding-window attention: a "sliding_attention" layer's token sees itself and the sliding_window - 1
    # tokens before it; layer_types names each layer's kind, () for every layer full (transformers' keys)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # The transformers path (families without native layers): config.json as read (JSON text), each
    # layer's tensors (local names) and the final norm's (names under model.norm.) as on disk.
    source_config: str = ""
    layer_tables: tuple[Table, ...] = ()
    norm_table: Table = ()
    # Tensors the folder keeps in another form than the store (expert_files.py: one tensor per expert of a
    # fused expert tensor; a renamed router): (name on disk, store name, element offset, shape on disk).
    disk_pieces: tuple[tuple[str, str, int, tuple[int, ...]], ...] = ()

    def __post_init__(self) -> None:
        if self.family not in FAMILIES and not self.layer_tables:
            raise ModelConfigError(f"model family {self.family!r} is not supported; supported: {', '.join(FAMILIES)}")
        if self.layer_tables and (len(self.layer_tables) != self.num_layers or not self.source_config):
            raise ModelConfigError(f"a transformers-path model needs a table for each of its {self.num_layers} "
                                   f"layers and its config.json; got {len(self.layer_tables)} tables")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ModelConfigError(f"model.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.sliding_window is not None and int(self.sliding_window) <= 0:
            raise ModelConfigError(f"sliding_window must be a positive integer, got {self.sliding_window!r}")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ModelConfigError(f"layer_types names {len(self.layer_types)} layers; the model has "
                                       f"{self.num_layers}")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ModelConfigError(f"layer_types {unknown} are not supported; supported: {', '.join(LAYER_TYPES)}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ModelConfigError("layer_types has sliding_attention layers and sliding_window is not set")

    def window_of(self, layer: int) -> int | None:
        """The layer's sliding window in tokens, None for full causal attention."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def windowed(self) -> bool:
        """Whether some layer attends through a sliding window."""
        return "sliding_attention" in self.layer_types

    @property
    def native(self) -> bool:
        """Whether SlideDP's own layers (layers.py) can run this model; else only transformers' can."""
        return not self.layer_tables

    # ---- parameter table -------------------------------------------------------------
    def layer_parameter_shapes(self, layer: int = 0) -> list[tuple[str, tuple[int, ...]]]:
        """Parameters of decoder layer `layer`, local names, in store order."""
        if self.layer_tables:
            return list(self.layer_tables[layer])
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        shapes: list[tuple[str, tuple[int, ...]]] = [("input_layernorm.weight", (h,))]
        shapes += [("self_attn.q_proj.weight", (q, h))]
        if self.attention_bias:
            shapes += [("self_attn.q_proj.bias", (q,))]
        shapes += [("self_attn.k_proj.weight", (kv, h))]
        if self.attention_bias:
            shapes += [("self_attn.k_proj.bias", (kv,))]
        shapes += [("self_attn.v_proj.weight", (kv, h))]
        if self.attention_bias:
            shapes += [("self_attn.v_proj.bias", (kv,))]
        shapes += [("self_attn.o_proj.weight", (h, q))]
        if self.qk_norm:
            shapes += [("self_attn.q_norm.weight", (d,)), ("self_attn.k_norm.weight", (d,))]
        shapes += [
            ("post_attention_layernorm.weight", (h,)),
            ("mlp.gate_proj.weight", (i, h)),
            ("mlp.up_proj.weight", (i, h)),
            ("mlp.down_proj.weight", (h, i)),
        ]
        return shapes

    def parameter_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every trainable tensor of the model, full Hugging Face names, in store order."""
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab_size, self.hidden_size))]
        for layer in range(self.num_layers):
            out += [(f"model.layers.{layer}.{n}", s) for n, s in self.layer_parameter_shapes(layer)]
        out += [(f"model.norm.{n}", s) for n, s in self.norm_parameter_shapes()]
        if not self.tie_word_embeddings:
            out.append(("lm_head.weight", (self.vocab_size, self.hidden_size)))
        return out

    def disk_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor as the model's folder holds it: parameter_shapes() with each tensor kept in pieces on
        disk replaced by its pieces (in element order)."""
        pieces: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
        for disk, stored, _, shape in self.disk_pieces:
            pieces.setdefault(stored, []).append((disk, shape))
        return [entry for name, shape in self.parameter_shapes() for entry in pieces.get(name, [(name, shape)])]

    def pieces_of(self, name: str) -> list[tuple[str, int, tuple[int, ...]]]:
        """The pieces (name on disk, element offset, shape) tensor `name` is kept in on disk; [] when whole."""
        return [(disk, offset, shape) for disk, stored, offset, shape in self.disk_pieces if stored == name]

    def norm_parameter_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """The final norm's tensors, names under `model.norm.`."""
        return list(self.norm_table) if self.layer_tables else [("weight", (self.hidden_size,))]

    def layer_numel(self, layer: int = 0) -> int:
        return sum(math.prod(shape) for _, shape in self.layer_parameter_shapes(layer))

    def num_parameters(self) -> int:
        """The sum over parameter_shapes(), counted from the layers' tables (the planner asks it often)."""
        layers = (sum(map(self.layer_numel, range(self.num_layers))) if self.layer_tables
                  else self.num_layers * self.layer_numel())
        embed = self.vocab_size * self.hidden_size
        norm = sum(math.prod(s) for _, s in self.norm_parameter_shapes())
        return embed + layers + norm + (0 if self.tie_word_embeddings else embed)

    def source(self) -> dict[str, Any]:
        """The transformers path's config.json as read ({} for a native model)."""
        return json.loads(self.source_config) if self.source_config else {}

    @property
    def head_name(self) -> str:
        return "model.embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight"

    # ---- Hugging Face config.json ----------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            archs = hf.get("architectures")
            raise ModelConfigError(
                f"config.json model_type {model_type!r} (architectures {archs}) is not supported; "
                f"supported model types: {', '.join(FAMILIES)}"
            )
        try:
            heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            head_dim = hf.get("head_dim") or hidden // heads
            # transformers >= 5 writes rope_parameters (theta included); older files rope_scaling + rope_theta
            params = hf.get("rope_parameters") or {}
            scaling = dict(hf.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"})
            rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
            if float(scaling.pop("partial_rotary_factor", 1.0)) != 1.0:
                raise ModelConfigError("config.json partial_rotary_factor != 1 is not supported")
            if rope_type == "default":
                scaling = {}
            elif rope_type == "llama3":
                scaling = {
                    "rope_type": "llama3",
                    "factor": float(scaling["factor"]),
                    "low_freq_factor": float(scaling["low_freq_factor"]),
                    "high_freq_factor": float(scaling["high_freq_factor"]),
                    "original_max_position_embeddings": int(
                        scaling.get("original_max_position_embeddings", hf.get("max_position_embeddings", 4096))
                    ),
                }
            else:
                raise ModelConfigError(
                    f"config.json rope scaling type {rope_type!r} is not supported; supported: none, llama3"
                )
            # Only Qwen2's q/k/v bias is modelled; elsewhere attention_bias also adds an o_proj bias.
            if model_type != "qwen2" and hf.get("attention_bias"):
                raise ModelConfigError(f"config.json attention_bias=true is not supported for {model_type}")
            if hf.get("mlp_bias"):
                raise ModelConfigError("config.json mlp_bias=true is not supported")
            window, layer_types = _windows(model_type, hf, int(hf["num_hidden_layers"]))
            if float(hf.get("attention_dropout") or 0.0) != 0.0:  # transformers would drop attention weights in training
                raise ModelConfigError(f"config.json attention_dropout={hf['attention_dropout']} is not supported "
                                       "(SlideDP trains without dropout); set it to 0.0")
            if hf.get("hidden_act", "silu") != "silu":
                raise ModelConfigError(f"config.json hidden_act {hf['hidden_act']!r} is not supported; supported: silu")
            return cls(
                family=model_type,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                attention_bias=(model_type == "qwen2"),
                qk_norm=(model_type == "qwen3"),
                rope_scaling=tuple(sorted(scaling.items())),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_id=hf.get("eos_token_id") if not isinstance(hf.get("eos_token_id"), list) else hf["eos_token_id"][0],
                sliding_window=window,
                layer_types=layer_types,
            )
        except KeyError as e:
            raise ModelConfigError(f"config.json is missing the key {e.args[0]!r}") from None

    def to_hf(self) -> dict[str, Any]:
        if self.layer_tables:  # transformers' config as read: nothing of it is SlideDP's to rewrite
            return self.source()
        hf: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "use_cache": True,
            "rope_scaling": dict(self.rope_scaling) or None,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.family in ("llama", "mistral"):
            hf["attention_bias"] = self.attention_bias
            hf["mlp_bias"] = False
        if self.family == "qwen3":
            hf["attention_bias"] = False
        if self.family == "mistral":  # every layer slides, or none
            hf["sliding_window"] = self.sliding_window if self.windowed else None
        if self.family in ("qwen2", "qwen3"):
            hf["use_sliding_window"] = self.windowed
            hf["sliding_window"] = self.sliding_window if self.windowed else None
            if self.windowed:
                hf["layer_types"] = list(self.layer_types)
                hf["max_window_layers"] = self.layer_types.index("sliding_attention")
        return hf

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rope_scaling"] = [list(kv) for kv in self.rope_scaling]
        d["layer_types"] = list(self.layer_types)
        if not self.layer_tables:  # native layouts keep the keys (and the hash) they always had
            for key in ("source_config", "layer_tables", "norm_table", "disk_pieces"):
                del d[key]
        else:
            d["layer_tables"] = [_table_to_json(t) for t in self.layer_tables]
            d["norm_table"] = _table_to_json(self.norm_table)
            if self.disk_pieces:
                d["disk_pieces"] = [[disk, stored, offset, list(shape)] for disk, stored, offset, shape in self.disk_pieces]
            else:  # layouts of folders without pieces keep the hash they had
                del d["disk_pieces"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        d["rope_scaling"] = tuple(tuple(kv) for kv in d.get("rope_scaling", ()))
        d["layer_types"] = tuple(d.get("layer_types", ()))
        d["layer_tables"] = tuple(_table_from_json(t) for t in d.get("layer_tables", ()))
        d["norm_table"] = _table_from_json(d.get("norm_table", ()))
        d["disk_pieces"] = tuple((str(a), str(b), int(o), tuple(int(x) for x in shape))
                                 for a, b, o, shape in d.get("disk_pieces", ()))
        return cls(**d)


def _table_to_json(table: Table) -> list:
    return [[name, list(shape)] for name, shape in table]


def _table_from_json(table) -> Table:
    return tuple((str(name), tuple(int(s) for s in shape)) for name, shape in table)


def _windows(model_type: str, hf: dict[str, Any], num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) as transformers reads them: Mistral slides every layer when
    sliding_window is set; Qwen2/Qwen3 only with use_sliding_window, the layers that layer_types names
    (else those from max_window_layers on); Llama has no windows."""
    if model_type == "llama":
        return None, ()
    window = hf.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window"):
        window = None
    if window is None:
        return None, ()
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ModelConfigError(f"config.json sliding_window must be a positive integer or null, got {window!r}")
    if model_type == "mistral":
        return window, ("sliding_attention",) * num_layers
    types = hf.get("layer_types")
    if types is None:
        first = int(hf.get("max_window_layers", num_layers))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    types = tuple(types)
    return (window, types) if "sliding_attention" in types else (None, ())


def _qwen3(hidden: int, layers: int, inter: int, heads: int, tied: bool) -> ModelConfig:
    return ModelConfig(
        family="qwen3", vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
        num_heads=heads, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        tie_word_embeddings=tied, max_position_embeddings=262144, qk_norm=True,
        bos_token_id=151643, eos_token_id=151645,
    )


# Named shapes for the `random` model source (demos and benchmarks).
NAMED_SHAPES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        family="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, tie_word_embeddings=True, max_position_embeddings=2048, qk_norm=True,
    ),
    "tiny-llama": ModelConfig(
        family="llama", vocab_size=512, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, tie_word_embeddings=False, max_position_embeddings=2048,
    ),
    "small": ModelConfig(
        family="llama", vocab_size=2048, hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8,
        num_kv_heads=4, head_dim=32, tie_word_embeddings=False, max_position_embeddings=4096,
    ),
    "qwen3-0.6b": _qwen3(1024, 28, 3072, 16, tied=True),
    "qwen3-1.7b": _qwen3(2048, 28, 6144, 16, tied=True),
    "qwen3-4b": _qwen3(2560, 36, 9728, 32, tied=True),
    "qwen3-8b": _qwen3(4096, 36, 12288, 32, tied=False),
    "qwen3-14b": _qwen3(5120, 40, 17408, 40, tied=False),
}


def named_shape(name: str, vocab_size: int | None = None) -> ModelConfig:
    if name not in NAMED_SHAPES:
        raise ModelConfigError(f"unknown model shape {name!r}; known: {', '.join(NAMED_SHAPES)}")
    cfg = NAMED_SHAPES[name]
    return dataclasses.replace(cfg, vocab_size=vocab_size) if vocab_size else cfg
