"""Sliding-window attention against transformers: Mistral (every layer), Qwen2 (layers from max_window_layers
on) and Qwen3 (layer_types), forward and backward, written back so transformers reads the same model; and
packed documents under a window, each as if alone."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from slidedp.model import hf, layers  # noqa: E402
from slidedp.model.attention import packed_rows  # noqa: E402
from slidedp.model.config import ModelConfig  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=128,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
WINDOWED = {
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=11),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=7,
                                              max_window_layers=1),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, use_sliding_window=True, sliding_window=5,
                                              layer_types=["sliding_attention", "full_attention",
                                                           "sliding_attention"]),
}
EXPECTED_WINDOWS = {"mistral": [11, 11, 11], "qwen2": [None, 7, 7], "qwen3": [5, None, 5]}


def hf_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(WINDOWED[family](), dtype=torch.float32,
                                                         attn_implementation="eager")
    with torch.no_grad():  # norms off their trivial 1, biases off 0
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape))
    return model.eval()


def rel_err(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_windowed_model_matches_transformers_forward_and_backward(family):
    model = hf_model(family)
    cfg = ModelConfig.from_hf(model.config.to_dict())
    assert [cfg.window_of(i) for i in range(cfg.num_layers)] == EXPECTED_WINDOWS[family]
    params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(1))
    ref = model(ids).logits
    ours = layers.forward_logits(cfg, params, ids)
    assert rel_err(ours, ref) < 1e-5
    full = layers.forward_logits(ModelConfig.from_dict({**cfg.to_dict(), "sliding_window": None, "layer_types": []}),
                                 params, ids)
    assert rel_err(full, ref) > 1e-3  # the window changes the model at 32 tokens
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    (ref * weights).sum().backward()
    (ours * weights).sum().backward()
    hf_params = dict(model.named_parameters())
    for name, p in params.items():
        assert rel_err(p.grad, hf_params[name].grad) < 1e-5, name


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_windows_are_written_back_as_transformers_reads_them(tmp_path, family):
    model = hf_model(family)
    cfg = ModelConfig.from_hf(model.config.to_dict())
    params = {n: p.detach() for n, p in model.named_parameters()}
    hf.write_folder(tmp_path / "ckpt", cfg, params, dtype=torch.float32)
    assert hf.read_config(tmp_path / "ckpt") == cfg
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert rel_err(again(ids).logits, model(ids).logits) < 1e-6
    written = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert written["sliding_window"] == model.config.sliding_window


def test_a_window_as_long_as_the_rows_is_full_attention():
    """Mistral's default window (4096) over shorter rows changes nothing: the plain causal kernel runs."""
    cfg = ModelConfig.from_hf(transformers.MistralConfig(**COMMON).to_dict())
    assert cfg.window_of(0) == 4096
    attn = layers.causal_attention(cfg, 1, 64, "cpu")
    assert attn.at_window(4096) is attn and attn.backend == "causal"
    windowed = attn.at_window(11)
    assert (windowed.backend, windowed.window) == ("mask", 11)


def test_packed_documents_under_a_window_are_each_computed_alone():
    model = hf_model("mistral")
    cfg = ModelConfig.from_hf(model.config.to_dict())
    p = {n[len("model.layers.0."):]: t.detach() for n, t in model.named_parameters()
         if n.startswith("model.layers.0.")}
    lengths = [20, 5, 14]  # one shorter than the window, two longer
    t = sum(lengths) + 3  # and padding, in the last document's segment
    documents = torch.tensor(sum([[d] * n for d, n in enumerate(lengths)], []) + [len(lengths) - 1] * 3)[None]
    positions = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(lengths[-1], lengths[-1] + 3)])[None]
    x = torch.randn(1, t, cfg.hidden_size, generator=torch.Generator().manual_seed(4), requires_grad=True)
    attn = packed_rows(layers.rope_tables(cfg, t, "cpu"), positions, documents, "mask").at_window(cfg.window_of(0))
    y = layers.decoder_layer(cfg, p, x, attn)
    at = 0
    for n in lengths:
        alone = layers.decoder_layer(cfg, p, x[:, at:at + n], layers.causal_attention(cfg, 1, n, "cpu").at_window(11))
        assert rel_err(y[:, at:at + n], alone) < 1e-6
        at += n


def test_attention_dropout_is_refused(tmp_path):
    conf = {**transformers.MistralConfig(**COMMON, attention_dropout=0.1).to_dict(), "architectures":
            ["MistralForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(hf.CheckpointError) as e:
        hf.read_config(tmp_path)
    assert str(e.value) == (f"{tmp_path / 'config.json'}: config.json attention_dropout=0.1 is not supported "
                            "(SlideDP trains without dropout); set it to 0.0")
