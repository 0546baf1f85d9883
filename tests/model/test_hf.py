"""Hugging Face checkpoint folders: transformers round trips, sharding, atomic replace, and every error."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from slidedp.model import hf, layers  # noqa: E402
from slidedp.model.config import ModelConfig  # noqa: E402
from slidedp.model.hf import CheckpointError  # noqa: E402
from slidedp.model.init import init_params  # noqa: E402

LLAMA3 = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
          ("original_max_position_embeddings", 32), ("rope_type", "llama3"))


def tiny(family: str = "qwen3", tied: bool = False, **kw) -> ModelConfig:
    base = dict(family=family, vocab_size=96, hidden_size=64, intermediate_size=112, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                max_position_embeddings=128, attention_bias=family == "qwen2", qk_norm=family == "qwen3",
                bos_token_id=1, eos_token_id=2)
    return ModelConfig(**{**base, **kw})


def noisy_params(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """init_params plus noise everywhere, so norms and biases are not the trivial 1 and 0."""
    gen = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in init_params(cfg, seed).items()}


def rel_err(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def rewrite_header(path, edit) -> None:
    """Rewrite a safetensors file's header through `edit(header)`, keeping the data bytes."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])


# ---- transformers round trips --------------------------------------------------------
CASES = [("qwen3", True, {}), ("qwen2", False, {}), ("mistral", False, {}), ("llama", True, {"rope_scaling": LLAMA3})]


@pytest.mark.parametrize("family,tied,kw", CASES, ids=[c[0] + ("-tied" if c[1] else "") for c in CASES])
def test_write_folder_loads_in_transformers(tmp_path, family, tied, kw):
    cfg = tiny(family, tied, **kw)
    params = noisy_params(cfg)
    folder = tmp_path / "ckpt"
    hf.write_folder(folder, cfg, params, dtype=torch.float32)
    assert sorted(os.listdir(folder)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert os.listdir(tmp_path) == ["ckpt"]  # no temporary folder left behind
    conf = json.loads((folder / "config.json").read_text())
    assert conf["dtype"] == conf["torch_dtype"] == "float32"
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2
    assert hf.read_config(folder) == cfg
    hf.check_folder(folder, cfg)

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        ours = layers.forward_logits(cfg, params, ids)
    assert rel_err(ours, ref) < 1e-5
    if cfg.rope_scaling:  # transformers read our llama3 scaling (it changes the logits)
        assert rel_err(layers.forward_logits(tiny(family, tied), params, ids), ref) > 1e-3
    # transformers holds exactly our weights
    sd = model.state_dict()
    assert all(torch.equal(sd[n], t) for n, t in params.items())


def test_bf16_checkpoint_holds_rounded_weights(tmp_path):
    cfg = tiny("llama")
    params = noisy_params(cfg)
    hf.write_folder(tmp_path / "c", cfg, params)  # default dtype: bfloat16
    assert json.loads((tmp_path / "c" / "config.json").read_text())["dtype"] == "bfloat16"
    index = hf.tensor_index(tmp_path / "c")
    assert {i.dtype for i in index.values()} == {"BF16"}
    for name, t in params.items():
        got = hf.load_tensor(tmp_path / "c", name, index=index)
        assert got.dtype == torch.float32 and torch.equal(got, t.bfloat16().float())


# ---- shards -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_round_trip_is_byte_exact(tmp_path, dtype):
    cfg = tiny("qwen2")
    params = noisy_params(cfg)
    folder = tmp_path / "ckpt"
    hf.write_folder(folder, cfg, lambda name: params[name], dtype=dtype, max_shard_bytes=40_000)
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    n = len(files)
    assert n >= 4 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    size = torch.empty((), dtype=dtype).element_size()
    assert index["metadata"]["total_size"] == cfg.num_parameters() * size
    assert sorted(index["weight_map"]) == sorted(params)
    for f in files:  # the official reader agrees, shard by shard, and no shard outgrows the limit
        shard = load_file(folder / f)
        assert all(index["weight_map"][k] == f for k in shard)
        assert all(torch.equal(v, params[k].to(dtype)) for k, v in shard.items())
        assert sum(v.numel() * size for v in shard.values()) <= 40_000 or len(shard) == 1

    tensors = hf.tensor_index(folder)
    assert sorted(tensors) == sorted(params)
    for name, t in params.items():
        want = t.to(dtype).float()
        assert torch.equal(hf.load_tensor(folder, name, index=tensors), want)
        out = torch.empty(t.shape)  # straight into a caller's fp32 buffer
        assert hf.load_tensor(folder, name, out=out, index=tensors) is out and torch.equal(out, want)
    bf = torch.empty(params["model.norm.weight"].shape, dtype=torch.bfloat16)
    hf.load_tensor(folder, "model.norm.weight", out=bf)
    assert torch.equal(bf, params["model.norm.weight"].bfloat16())


def test_single_and_lazy_writes_are_identical(tmp_path):
    cfg = tiny("qwen3", tied=True)
    params = noisy_params(cfg)
    hf.write_folder(tmp_path / "a", cfg, params)
    hf.write_folder(tmp_path / "b", cfg, params.__getitem__)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert "lm_head.weight" not in hf.tensor_index(tmp_path / "a")  # tied: the head is the embedding


# ---- atomic replace ---------------------------------------------------------------------
def test_write_replaces_only_when_complete(tmp_path):
    cfg = tiny("llama")
    old, new = noisy_params(cfg, 0), noisy_params(cfg, 1)
    folder = tmp_path / "ckpt"
    hf.write_folder(folder, cfg, old, dtype=torch.float32)
    (folder / "stale.txt").write_text("from the old checkpoint")

    def failing(name):
        if name == "model.layers.1.mlp.up_proj.weight":
            raise RuntimeError("store went away")
        return new[name]

    with pytest.raises(RuntimeError, match="store went away"):
        hf.write_folder(folder, cfg, failing, dtype=torch.float32)
    assert os.listdir(tmp_path) == ["ckpt"]
    assert torch.equal(hf.load_tensor(folder, "model.norm.weight"), old["model.norm.weight"])

    hf.write_folder(folder, cfg, new, dtype=torch.float32)
    assert os.listdir(tmp_path) == ["ckpt"] and not (folder / "stale.txt").exists()
    assert torch.equal(hf.load_tensor(folder, "model.norm.weight"), new["model.norm.weight"])


def test_write_refuses_to_replace_a_non_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("precious")
    with pytest.raises(CheckpointError) as e:
        hf.write_folder(tmp_path, tiny(), noisy_params(tiny()))
    assert str(e.value) == f"{tmp_path} exists and is not a checkpoint folder; refusing to replace it"
    assert (tmp_path / "notes.txt").read_text() == "precious"


def test_write_rejects_a_wrong_shape(tmp_path):
    cfg = tiny()
    params = {**noisy_params(cfg), "model.norm.weight": torch.ones(63)}
    with pytest.raises(CheckpointError) as e:
        hf.write_folder(tmp_path / "c", cfg, params)
    assert str(e.value) == "write_folder: tensor 'model.norm.weight' has shape (63,); the config says (64,)"
    assert os.listdir(tmp_path) == []


# ---- config.json ------------------------------------------------------------------------
def test_reads_a_transformers_4_style_llama31_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072, "attention_bias": False,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    }))
    cfg = hf.read_config(tmp_path)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta, cfg.eos_token_id) == (128, 8, 500000.0, 128001)
    assert dict(cfg.rope_scaling) == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    assert cfg.num_parameters() == 8_030_261_248  # Llama-3.1-8B


# ---- errors, each message exact -----------------------------------------------------------
def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError) as e:
        hf.read_config(tmp_path / "nope")
    assert str(e.value) == f"checkpoint folder {tmp_path / 'nope'} does not exist"


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError) as e:
        hf.read_config(tmp_path)
    assert str(e.value) == f"{tmp_path} has no config.json (a Hugging Face checkpoint folder needs one)"


def test_bad_json(tmp_path):
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match=r"config.json is not valid JSON: Expecting property name"):
        hf.read_config(tmp_path)


def test_unsupported_architecture(tmp_path):
    """A causal LM whose tensors are not embed_tokens / layers.N / norm / lm_head (GPT-2's transformer.h.N)."""
    cfg = tiny("llama")
    hf.write_folder(tmp_path, cfg, noisy_params(cfg), dtype=torch.float32)
    conf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**conf, "architectures": ["GPT2LMHeadModel"],
                                                      "model_type": "gpt2"}))
    (tmp_path / "model.safetensors").rename(tmp_path / "x")
    renamed = {n.replace("model.layers.", "transformer.h."): t for n, t in noisy_params(cfg).items()}
    from safetensors.torch import save_file

    save_file(renamed, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        hf.read_config(tmp_path)
    assert str(e.value).startswith(
        f"{tmp_path}: SlideDP trains the tensors model.embed_tokens, model.layers.N.*, model.norm.* and lm_head of a "
        "causal LM (floating point, at least 1-D); this folder also has transformer.h.")


def test_multimodal_checkpoint_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"],
                                                      "model_type": "gemma3", "text_config": {}}))
    with pytest.raises(CheckpointError) as e:
        hf.read_config(tmp_path)
    assert str(e.value) == (f"{tmp_path / 'config.json'}: architecture Gemma3ForConditionalGeneration is not a "
                            "text-only causal LM; SlideDP trains *ForCausalLM folders (a multimodal checkpoint's "
                            "language model must be saved as one first)")


def test_llama_variant_the_native_layers_do_not_model_goes_to_transformers(tmp_path):
    """attention_bias = true: not in the native layers, so the folder's own table is read (transformers' layers)."""
    cfg = tiny("llama")
    params = noisy_params(cfg)
    for layer in range(cfg.num_layers):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            rows = params[f"model.layers.{layer}.self_attn.{proj}.weight"].shape[0]
            params[f"model.layers.{layer}.self_attn.{proj}.bias"] = torch.randn(rows)
    from safetensors.torch import save_file

    tmp_path.mkdir(exist_ok=True)
    save_file(params, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_hf(), "attention_bias": True}))
    got = hf.read_config(tmp_path)
    assert not got.native and got.family == "llama"
    assert ("self_attn.o_proj.bias", (cfg.hidden_size,)) in got.layer_parameter_shapes(1)
    assert got.num_parameters() == sum(t.numel() for t in params.values())
    hf.check_folder(tmp_path, got)


def test_truncated_safetensors(tmp_path):
    cfg = tiny()
    hf.write_folder(tmp_path, cfg, noisy_params(cfg), dtype=torch.float32)
    path = tmp_path / "model.safetensors"
    size = path.stat().st_size
    os.truncate(path, size - 10)
    with pytest.raises(CheckpointError) as e:
        hf.check_folder(tmp_path, cfg)
    assert str(e.value) == (f"{path} is truncated: tensor 'lm_head.weight' needs bytes up to {size} "
                            f"but the file has {size - 10} bytes")
    os.truncate(path, 5)
    with pytest.raises(CheckpointError) as e:
        hf.tensor_index(tmp_path)
    assert str(e.value) == f"{path} is truncated or not a safetensors file (5 bytes, header length -1)"


def test_header_shape_lies(tmp_path):
    cfg = tiny()
    hf.write_folder(tmp_path, cfg, noisy_params(cfg), dtype=torch.float32)
    path = tmp_path / "model.safetensors"
    name = "model.layers.0.mlp.up_proj.weight"

    def grow(h):  # a shape that does not fit its byte range
        h[name]["shape"] = [112, 65]
    rewrite_header(path, grow)
    with pytest.raises(CheckpointError) as e:
        hf.check_folder(tmp_path, cfg)
    raw = path.read_bytes()
    b, end = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])[name]["data_offsets"]
    assert str(e.value) == (f"{path}: the header of tensor {name!r} is inconsistent: dtype F32 x shape [112, 65] = "
                            f"29120 bytes, but data_offsets [{b}, {end}] span 28672 bytes")

    def transpose(h):  # the right size, the wrong shape
        h[name]["shape"] = [64, 112]
    rewrite_header(path, transpose)
    with pytest.raises(CheckpointError) as e:
        hf.check_folder(tmp_path, cfg)
    assert str(e.value) == f"{path}: tensor {name!r} has shape (64, 112); the config expects (112, 64)"


def test_missing_and_extra_tensors(tmp_path):
    cfg = tiny("llama", tied=True)
    params = noisy_params(cfg)
    path = tmp_path / "model.safetensors"
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    missing = {k: v for k, v in params.items() if k != "model.layers.1.mlp.down_proj.weight"}
    save_file(missing, path)
    with pytest.raises(CheckpointError) as e:
        hf.check_folder(tmp_path, cfg)
    assert str(e.value) == (f"{tmp_path} is missing 1 tensor(s) the config needs: "
                            "model.layers.1.mlp.down_proj.weight")

    # known non-parameters and a redundant tied head are fine
    ok = {**params, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
          "lm_head.weight": params["model.embed_tokens.weight"].clone()}
    save_file(ok, path)
    hf.check_folder(tmp_path, cfg)

    save_file({**params, "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}, path)
    with pytest.raises(CheckpointError) as e:
        hf.check_folder(tmp_path, cfg)
    assert str(e.value) == (f"{tmp_path} has 1 tensor(s) a llama model of this config does not have: "
                            "model.layers.0.self_attn.o_proj.bias")

    with pytest.raises(CheckpointError) as e:
        hf.load_tensor(tmp_path, "model.layers.9.mlp.up_proj.weight")
    assert str(e.value) == f"{tmp_path} has no tensor 'model.layers.9.mlp.up_proj.weight'"


def test_missing_weights_and_missing_shard(tmp_path):
    with pytest.raises(CheckpointError) as e:
        hf.tensor_index(tmp_path)
    assert str(e.value) == f"{tmp_path} has neither model.safetensors nor model.safetensors.index.json"

    cfg = tiny()
    hf.write_folder(tmp_path / "c", cfg, noisy_params(cfg), max_shard_bytes=40_000)
    shard = sorted((tmp_path / "c").glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError) as e:
        hf.check_folder(tmp_path / "c", cfg)
    assert str(e.value) == f"{shard} is missing"
