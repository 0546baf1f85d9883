"""The tiny family models of tests/families.py are what the generic layer path's tests take them for: a folder
that reloads to the same logits, parameters named embed / layers.<i> / norm / lm_head, decoder layers run once
each in order on the previous layer's output, and the layer kinds each family was meant to mix."""

from __future__ import annotations

import re

import pytest
import torch

from families import FAMILIES, LAYER_KINDS, SLIDING_WINDOW, VOCAB, tiny_model, write_family_folder

SEQ = 40  # past the sliding window (12), so sliding layers see a different mask from full ones


def _input(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (2, SEQ), generator=g)


@pytest.mark.parametrize("family", FAMILIES)
def test_folder_reloads_to_the_same_logits(tmp_path, family):
    import transformers

    model = tiny_model(family, seed=0)
    folder = write_family_folder(tmp_path / family, family, seed=0)
    assert (folder / "model.safetensors").exists() and (folder / "tokenizer.json").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(loaded) is type(model)
    assert loaded.config.eos_token_id == 2 and loaded.config.pad_token_id == 0
    assert loaded.generation_config.eos_token_id == 2 and loaded.generation_config.pad_token_id == 0
    assert len(transformers.AutoTokenizer.from_pretrained(folder)) <= VOCAB
    ids = _input()
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    assert want.shape == (2, SEQ, VOCAB) and torch.isfinite(want).all()
    assert (got - want).abs().max().item() <= 1e-6
    # Every weight is off its trivial init: none of norms at one, biases and sinks at zero survives.
    for name, p in loaded.named_parameters():
        assert not torch.all(p == p.flatten()[0]), name
    # Another seed is another model.
    other = tiny_model(family, seed=1)
    with torch.no_grad():
        assert (other(input_ids=ids).logits - want).abs().max().item() > 1e-3


_NAME = re.compile(r"model\.embed_tokens\.weight|model\.layers\.\d+\..+|model\.norm\..+|lm_head\.weight")


@pytest.mark.parametrize("family", FAMILIES)
def test_parameter_names_are_embed_layers_norm_head(family):
    model = tiny_model(family)
    names = [n for n, _ in model.named_parameters()]
    assert [n for n in names if not _NAME.fullmatch(n)] == []
    assert "model.embed_tokens.weight" in names
    n_layers = model.config.num_hidden_layers
    assert {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")} == set(range(n_layers))
    tied = model.config.tie_word_embeddings
    assert ("lm_head.weight" in names) == (not tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    for tie in (True, False):
        assert tiny_model(family, tied=tie).config.tie_word_embeddings is tie


@pytest.mark.parametrize("family", FAMILIES)
def test_layers_run_once_each_in_order_on_the_previous_output(family):
    model = tiny_model(family)
    layers = model.model.layers
    calls, outputs, handles = [], {}, []
    for i, layer in enumerate(layers):
        def pre(module, args, kwargs, i=i):
            calls.append((i, args, dict(kwargs)))

        def post(module, args, kwargs, output, i=i):
            outputs[i] = output[0] if isinstance(output, tuple) else output

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post, with_kwargs=True))
    embedded, normed = [], []
    handles.append(model.model.embed_tokens.register_forward_hook(lambda m, a, out: embedded.append(out)))
    handles.append(model.model.norm.register_forward_pre_hook(lambda m, a: normed.append(a[0])))
    try:
        with torch.no_grad():
            model(input_ids=_input())
    finally:
        for h in handles:
            h.remove()
    assert [i for i, _, _ in calls] == list(range(len(layers)))
    assert len(embedded) == 1 and len(normed) == 1
    for i, args, kwargs in calls:
        assert isinstance(args[0], torch.Tensor) and args[0].shape == (2, SEQ, model.config.hidden_size)
        assert args[0] is (embedded[0] if i == 0 else outputs[i - 1]), i
        assert not any(isinstance(a, torch.Tensor) for a in args[1:]), (i, [type(a) for a in args[1:]])
        assert not any(isinstance(v, torch.Tensor) and v.shape == args[0].shape for v in kwargs.values()), i
    assert normed[0] is outputs[len(layers) - 1]
    # Seen with transformers 5.25 (pytest -s): attention_mask, cache, position_embeddings, position_ids, plus
    # use_cache (all but gemma3/gemma4), output_router_logits (gpt_oss), shared_kv_states (gemma4, whose
    # layers also get per_layer_input positionally, None here).
    print(f"\n{family}: positional {[len(a) for _, a, _ in calls]}, kwargs {[sorted(k) for _, _, k in calls]}")


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_kinds(family):
    config = tiny_model(family).config
    kinds = LAYER_KINDS.get(family)
    if kinds is not None:
        assert len(config.layer_types) == config.num_hidden_layers
        assert set(config.layer_types) == kinds
    if family in ("gemma3", "gemma4", "gpt_oss", "mistral"):
        assert config.sliding_window == SLIDING_WINDOW
    if family == "mistral":
        # MistralConfig has no layer_types: every layer slides (a mix would be Ministral).
        assert getattr(config, "layer_types", None) is None
    if family == "qwen3_5":
        assert config.layer_types == ["linear_attention", "full_attention"] * 2
    if family == "gemma4":
        model = tiny_model(family)
        full = [i for i, t in enumerate(config.layer_types) if t == "full_attention"]
        for i, layer in enumerate(model.model.layers):
            head_dim = 32 if i in full else 16
            assert layer.self_attn.q_proj.out_features == 4 * head_dim, i
        assert config.hidden_size_per_layer_input == 0 and config.num_kv_shared_layers == 0
