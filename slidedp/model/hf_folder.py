"""A Hugging Face checkpoint folder read without torch: config.json and the safetensors headers.

What the launcher, the dry run and the host-state daemon need before any tensor is read: the
model's shape, and where each tensor's bytes are, every lie a file can tell (truncation, a shape
that does not match its byte range, a missing shard) an error naming the file and the tensor.
Reading and writing tensors is hf.py's (it imports torch).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from slidedp.model.config import _ARCHITECTURES, FAMILIES, ModelConfig, ModelConfigError
from slidedp.model.expert_files import ExpertFormatError, expert_pieces, per_expert

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER = 100 * 2**20  # a header larger than this is corruption, not a model

# safetensors dtype tag -> bytes per element
ELEMENT_BYTES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1,
}
FLOAT_TAGS = ("F64", "F32", "F16", "BF16")


class CheckpointError(ValueError):
    pass


@dataclass(frozen=True)
class TensorInfo:
    file: str  # file name inside the checkpoint folder
    dtype: str  # safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _require_folder(folder: Path) -> None:
    if not folder.exists():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint path {folder} is not a folder")


def read_config(folder) -> ModelConfig:
    folder = Path(folder)
    _require_folder(folder)
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json (a Hugging Face checkpoint folder needs one)")
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(hf).__name__}")
    archs = hf.get("architectures") or []
    supported = tuple(_ARCHITECTURES.values())
    if hf.get("model_type") in FAMILIES and all(a in supported for a in archs):
        try:
            return ModelConfig.from_hf(hf)
        except ModelConfigError:  # a variant the native layers do not model: transformers' layers run it
            pass
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: {e}") from None
    return transformers_config(folder, hf)


def transformers_config(folder: Path, hf: dict) -> ModelConfig:
    """The model of a folder whose layers transformers runs (model/generic.py): its table from the
    safetensors headers, grouped into the embedding, the decoder layers, the final norm and the head."""
    path = folder / "config.json"
    archs = [str(a) for a in hf.get("architectures") or []]
    if "text_config" in hf or any("ForConditionalGeneration" in a for a in archs):
        raise CheckpointError(
            f"{path}: architecture {', '.join(archs) or '(none given)'} is not a text-only causal LM; SlideDP trains "
            "*ForCausalLM folders (a multimodal checkpoint's language model must be saved as one first)")
    drops = [k for k, v in sorted(hf.items()) if ("dropout" in k or "pdrop" in k) and isinstance(v, (int, float))
             and not isinstance(v, bool) and v]
    if drops:  # transformers drops in training; SlideDP's layers run as in eval
        raise CheckpointError(f"{path}: config.json {drops[0]}={hf[drops[0]]} is not supported (SlideDP trains "
                              "without dropout); set it to 0.0")
    try:
        layers, hidden, vocab = (int(hf[k]) for k in ("num_hidden_layers", "hidden_size", "vocab_size"))
    except KeyError as e:
        raise CheckpointError(f"{path} is missing the key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from None
    index = tensor_index(folder)
    # config.json may leave tying to the class's default, which only transformers knows: the files tell
    tied = bool(hf["tie_word_embeddings"]) if "tie_word_embeddings" in hf else "lm_head.weight" not in index
    shapes, other = {}, []
    for name, info in index.items():
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue
        if info.dtype not in FLOAT_TAGS or not info.shape:
            other.append(f"{name} ({info.dtype}, shape {list(info.shape)})")
        else:
            shapes[name] = info.shape
    pieces: list = []
    if per_expert(shapes):  # transformers fuses them into 3-D tensors on load: so does the store
        try:
            shapes, pieces = expert_pieces(str(hf.get("model_type")), shapes)
        except ExpertFormatError as e:
            raise CheckpointError(f"{folder}: its Mixture-of-Experts layers keep one tensor per expert: {e}") from None
    layer_tables: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(layers)]
    norm = []
    for name, shape in shapes.items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and len(parts) > 3 and parts[2].isdigit() and int(parts[2]) < layers:
            layer_tables[int(parts[2])].append((".".join(parts[3:]), shape))
        elif parts[:2] == ["model", "norm"]:
            norm.append((".".join(parts[2:]), shape))
        elif name not in ("model.embed_tokens.weight", "lm_head.weight"):
            other.append(name)
    if other:
        more = f" and {len(other) - 5} more" if len(other) > 5 else ""
        raise CheckpointError(
            f"{folder}: SlideDP trains the tensors model.embed_tokens, model.layers.N.*, model.norm.* and lm_head "
            f"of a causal LM (floating point, at least 1-D); this folder also has {', '.join(other[:5])}{more}")
    empty = [i for i, t in enumerate(layer_tables) if not t]
    if empty or not norm:
        raise CheckpointError(f"{folder}: config.json says {layers} layers, but the safetensors hold no tensors for "
                              + (f"layer(s) {empty[:5]}" if empty else "the final norm model.norm"))
    heads = int(hf.get("num_attention_heads") or 1)
    try:
        return ModelConfig(
            family=str(hf.get("model_type")), vocab_size=vocab, hidden_size=hidden,
            intermediate_size=int(hf.get("intermediate_size") or 4 * hidden), num_layers=layers, num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads), rms_norm_eps=float(hf.get("rms_norm_eps") or 1e-6),
            tie_word_embeddings=tied, max_position_embeddings=int(hf.get("max_position_embeddings") or 4096),
            bos_token_id=hf.get("bos_token_id") if isinstance(hf.get("bos_token_id"), int) else None,
            eos_token_id=hf["eos_token_id"][0] if isinstance(hf.get("eos_token_id"), list) else hf.get("eos_token_id"),
            source_config=json.dumps(hf, sort_keys=True), norm_table=tuple(norm),
            layer_tables=tuple(tuple(t) for t in layer_tables), disk_pieces=tuple(pieces),
        )
    except (ModelConfigError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from None


def _read_header(folder: Path, fname: str) -> dict[str, TensorInfo]:
    path = folder / fname
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if n < 0 or n > size - 8 or n > _MAX_HEADER:
            raise CheckpointError(f"{path} is truncated or not a safetensors file ({size} bytes, header length {n})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: the safetensors header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            tag, shape, (b, e) = entry["dtype"], tuple(int(s) for s in entry["shape"]), entry["data_offsets"]
            b, e = int(b), int(e)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}: {entry!r}") from None
        if tag not in ELEMENT_BYTES:
            raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {tag!r}")
        numel = 1
        for s in shape:
            numel *= s
        need = numel * ELEMENT_BYTES[tag]
        if min(shape, default=0) < 0 or b < 0 or e - b != need:
            raise CheckpointError(
                f"{path}: the header of tensor {name!r} is inconsistent: dtype {tag} x shape {list(shape)} = "
                f"{need} bytes, but data_offsets [{b}, {e}] span {e - b} bytes"
            )
        if base + e > size:
            raise CheckpointError(
                f"{path} is truncated: tensor {name!r} needs bytes up to {base + e} but the file has {size} bytes"
            )
        out[name] = TensorInfo(fname, tag, shape, base + b, base + e)
    return out


def tensor_index(folder) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint: name -> where its bytes are, from the safetensors headers."""
    folder = Path(folder)
    _require_folder(folder)
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index_path} is not valid JSON with a 'weight_map' object") from None
        out: dict[str, TensorInfo] = {}
        for fname in sorted(set(weight_map.values())):
            if not isinstance(fname, str) or Path(fname).name != fname:
                raise CheckpointError(f"{index_path} names the shard {fname!r}, which is not a file in the folder")
            for name, info in _read_header(folder, fname).items():
                if name in out:
                    raise CheckpointError(f"{folder}: tensor {name!r} is in both {out[name].file} and {fname}")
                out[name] = info
        for name, fname in weight_map.items():
            if name not in out or out[name].file != fname:
                raise CheckpointError(f"{index_path} maps {name!r} to {fname}, but {fname} has no such tensor")
        return out
    if (folder / SINGLE_FILE).is_file():
        return _read_header(folder, SINGLE_FILE)
    hint = " (PyTorch .bin weights are not supported: save as safetensors)" if any(folder.glob("*.bin")) else ""
    raise CheckpointError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")


def check_folder(folder, cfg: ModelConfig) -> None:
    """Every tensor `cfg` needs is present with its shape in a float dtype, and nothing unexpected is."""
    folder = Path(folder)
    index = tensor_index(folder)
    expected = dict(cfg.disk_shapes())
    missing = [n for n in expected if n not in index]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{folder} is missing {len(missing)} tensor(s) the config needs: "
                              f"{', '.join(missing[:5])}{more}")
    if cfg.tie_word_embeddings and "lm_head.weight" in index:  # a redundant copy of the tied head
        expected = {**expected, "lm_head.weight": expected["model.embed_tokens.weight"]}
    for name, shape in expected.items():
        info = index[name]
        if info.shape != shape:
            raise CheckpointError(f"{folder / info.file}: tensor {name!r} has shape {info.shape}; "
                                  f"the config expects {shape}")
        if info.dtype not in FLOAT_TAGS:
            raise CheckpointError(f"{folder / info.file}: tensor {name!r} has dtype {info.dtype}; "
                                  f"expected one of {', '.join(FLOAT_TAGS)}")
    extra = [n for n in index if n not in expected and not n.endswith("rotary_emb.inv_freq")]
    if not cfg.native:
        extra = [n for n in extra if n != "lm_head.weight"]
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise CheckpointError(f"{folder} has {len(extra)} tensor(s) a {cfg.family} model of this config does "
                              f"not have: {', '.join(extra[:5])}{more}")
