"""transformers' own layers on streamed tensors (model/generic.py) against transformers itself.

For each family of tests/families.py: a folder transformers wrote, read into a flat fp32 master as the
store would hold it, one engine step on rows of packed documents (CPU, fp32, a fake link for the daemons)
against the transformers model run on each document alone: the summed loss and every tensor's gradient.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from families import FAMILIES, write_family_folder  # noqa: E402
from slidedp.model import hf  # noqa: E402
from slidedp.model.family import math_for  # noqa: E402
from slidedp.model.generic import TransformersMath, UnsupportedModel  # noqa: E402
from slidedp.stepplan import StepPlan  # noqa: E402
from slidedp.store.layout import make_layout  # noqa: E402
from slidedp.worker.engine import Engine  # noqa: E402

from pipeline.harness import rel_err  # noqa: E402
from pipeline.test_engine_tiling import FakeLink  # noqa: E402

M, ROWS, T = 2, 2, 40  # micro-batches of ROWS rows of T positions


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: write_family_folder(root / f, f, seed=3) for f in FAMILIES}


def packed_batch(vocab: int, seed: int, packed: bool = True):
    """ids, targets, positions, documents [M, ROWS, T] and the documents as (ids, targets) pairs: rows of
    documents of 3 to 30 tokens (packed), or one document a row."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (M, ROWS, T), generator=gen)
    targets = torch.full((M, ROWS, T), -100)
    positions = torch.zeros(M, ROWS, T, dtype=torch.long)
    documents = torch.zeros(M, ROWS, T, dtype=torch.long)
    docs = []
    for i in range(M):
        for r in range(ROWS):
            at, d = 0, 0
            while at < T:
                n = min(T - at, int(torch.randint(3, 31, (), generator=gen))) if packed else T
                s = slice(at, at + n)
                positions[i, r, s], documents[i, r, s] = torch.arange(n), d
                targets[i, r, at:at + n - 1] = ids[i, r, at + 1:at + n]
                docs.append((ids[i, r, s], targets[i, r, s]))
                at, d = at + n, d + 1
    return ids, targets, positions, documents, docs


def engine_step(folder, batch, layers: str = "transformers", device: str = "cpu", dtype=torch.float32,
                router_aux: bool = False, real=None, routing: list | None = None):
    """(loss sum, name -> gradient of the summed loss) of one engine step over the folder's weights (real: the
    tokens that are not padding; routing: gets the step's router statistics where router_aux adds the loss)."""
    cfg = hf.read_config(folder)
    layout = make_layout(cfg)
    master = torch.zeros(layout.total_numel)
    index = hf.tensor_index(folder)
    for span in layout.tensors:
        hf.load_model_tensor(folder, cfg, span.name,
                             master[span.offset:span.offset + math.prod(span.shape)].view(span.shape), index)
    link = FakeLink(len(layout.chunks))
    slots = torch.zeros(len(layout.chunks), layout.max_chunk_numel, device=device)
    dev = torch.device(device)
    engine = Engine(cfg, layout, master, dev, dtype, link, lambda slot, numel: slots[slot, :numel], 1,
                    StepPlan(compute_dtype="bf16" if dtype == torch.bfloat16 else "fp32"),
                    math=math_for(cfg, layers, dev, dtype, router_aux=router_aux))
    ids, targets, positions, documents, _ = batch
    times = engine.run_step(0, ids, targets, positions, documents, scale=1.0, real=real)
    if routing is not None:
        routing.append(link.routing)
    flat = torch.zeros(layout.total_numel)
    for c in layout.chunks:
        slot, _ = link.landed[c.id]
        flat[c.offset:c.offset + c.numel] = slots[slot, :c.numel].cpu()
    grads = {s.name: flat[s.offset:s.offset + math.prod(s.shape)].view(s.shape) for s in layout.tensors}
    return times.loss_sum, grads


def reference_step(folder, docs, device: str = "cpu", dtype=torch.float32):
    """transformers, each document alone: the summed loss and the gradients (fp32, on the CPU)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    model.to(device)
    total = torch.zeros((), device=device)
    for ids, targets in docs:
        logits = model(input_ids=ids[None].to(device)).logits[0].float()
        total = total + F.cross_entropy(logits, targets.to(device), ignore_index=-100, reduction="sum")
    total.backward()
    return float(total.detach()), {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_step_equals_each_document_alone(folders, family):
    batch = packed_batch(512, seed=7)
    loss, grads = engine_step(folders[family], batch)
    want_loss, want = reference_step(folders[family], batch[4])
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert set(want) <= set(grads)
    worst = max((rel_err(grads[n], want[n]), n) for n in want)
    assert worst[0] < 1e-4, worst
    for n in set(grads) - set(want):  # buffers that stream with the layer (Gemma 4's layer_scalar): no gradient
        assert float(grads[n].abs().max()) == 0.0, n


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma3"])
def test_plain_rows(folders, family):
    batch = packed_batch(512, seed=8, packed=False)
    loss, grads = engine_step(folders[family], batch)
    want_loss, want = reference_step(folders[family], batch[4])
    assert loss == pytest.approx(want_loss, rel=1e-5)
    worst = max((rel_err(grads[n], want[n]), n) for n in want)
    assert worst[0] < 1e-4, worst


def test_native_and_transformers_layers_agree(folders):
    """The same Llama store through both implementations."""
    batch = packed_batch(512, seed=9)
    loss_n, grads_n = engine_step(folders["llama"], batch, layers="native")
    loss_t, grads_t = engine_step(folders["llama"], batch, layers="transformers")
    assert loss_n == pytest.approx(loss_t, rel=1e-6)
    assert max(rel_err(grads_n[n], grads_t[n]) for n in grads_n) < 1e-5


def test_layers_that_would_leak_run_one_document_at_a_time(folders):
    """Qwen3.5's Gated DeltaNet layers carry state along the row: run on the packed row as is, document 2
    would see document 1. The engine's result equals each document alone (above); here: the row as is
    differs from it, so the test above could fail."""
    cfg = hf.read_config(folders["qwen3_5"])
    m = TransformersMath(cfg, torch.device("cpu"), torch.float32)
    linear = next(i for i, t in enumerate(m.config.layer_types) if t == "linear_attention")
    layout = make_layout(cfg)
    index = hf.tensor_index(folders["qwen3_5"])
    prefix = f"model.layers.{linear}."
    p = {s.name[len(prefix):]: hf.load_tensor(folders["qwen3_5"], s.name, index=index)
         for s in layout.tensors if s.name.startswith(prefix)}
    x = torch.randn(1, 20, cfg.hidden_size)
    whole = m._call(linear, p, x, m._alone(20), None)
    second_alone = m._call(linear, p, x[:, 8:], m._alone(12), None)
    assert torch.allclose(whole[:, :8], m._call(linear, p, x[:, :8], m._alone(8), None), atol=1e-6)
    assert (whole[:, 8:] - second_alone).abs().max() > 1e-3


def test_refuses_layers_tied_together(tmp_path):
    """Gemma 4's per-layer inputs have tensors outside the layers; its shared KV caches tie layers together."""
    from families import tiny_config

    config = tiny_config("gemma4")
    config.hidden_size_per_layer_input = 8
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "ple")
    with pytest.raises(hf.CheckpointError, match=r"this folder also has model.embed_tokens_per_layer.weight"):
        hf.read_config(tmp_path / "ple")
    config = tiny_config("gemma4")
    config.num_kv_shared_layers = 2
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "shared")
    cfg = hf.read_config(tmp_path / "shared")
    with pytest.raises(UnsupportedModel, match=r"num_kv_shared_layers = 2 \(key/value caches shared across layers\)"):
        TransformersMath(cfg, torch.device("cpu"), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_step_on_cuda_in_bf16(folders, family):
    """CUDA, bf16: packed rows through the variable-length kernel (explicit scores for gpt-oss's sinks)
    against the fp32 reference on each document alone, as close as transformers' own bf16 run of each
    document is (twice its distance, or 5% of the loss and 10% of a gradient where that is closer): a
    document leaking into the next one, a wrong window or a dropped scale is off by far more."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    batch = packed_batch(512, seed=7)
    loss, grads = engine_step(folders[family], batch, device="cuda", dtype=torch.bfloat16)
    want_loss, want = reference_step(folders[family], batch[4])
    bf16_loss, bf16 = reference_step(folders[family], batch[4], "cuda", torch.bfloat16)
    assert abs(loss - want_loss) <= max(0.05 * want_loss, 2 * abs(bf16_loss - want_loss))
    for n in want:
        err, theirs = rel_err(grads[n], want[n]), rel_err(bf16[n], want[n])
        assert err <= max(0.1, 2 * theirs), (n, err, theirs)


@pytest.mark.parametrize("backend", [
    "aot_eager",
    # inductor's C++ code for the CPU: 21-37 s of compiling on CI's 2 cores (-m slow); on a GPU it emits Triton
    pytest.param("inductor", marks=pytest.mark.slow),
])
def test_compiled_layers_give_the_same_step(folders, monkeypatch, backend):
    """train.compile: each structure's layer through torch.compile (attention eager, outside the graph)
    gives the eager step's numbers, and a second micro-batch of other documents reuses the compiled code.
    By default through dynamo and AOT autograd (`aot_eager`: the graphs, their breaks around the attention,
    the guards) without inductor's code generation; with it under -m slow."""
    import functools

    import torch._dynamo

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    with torch._dynamo.config.patch(cache_size_limit=64):
        _compiled_step_is_the_eager_one(folders, monkeypatch)


def _compiled_step_is_the_eager_one(folders, monkeypatch) -> None:
    batch = packed_batch(512, seed=7)
    want_loss, want = engine_step(folders["gemma3"], batch)
    monkeypatch.setitem(globals(), "math_for",
                        lambda cfg, layers, dev, dtype, router_aux=False: TransformersMath(cfg, dev, dtype, compile=True,
                                                                                          router_aux=router_aux))
    with _count_compiles() as first:
        loss, grads = engine_step(folders["gemma3"], batch)
    assert first() > 0  # it did compile
    assert loss == pytest.approx(want_loss, rel=1e-6)
    assert max(rel_err(grads[n], want[n]) for n in want) < 1e-5
    with _count_compiles() as count:
        engine_step(folders["gemma3"], packed_batch(512, seed=8))
    assert count() == 0


class _count_compiles:
    """The number of graphs dynamo compiles inside the block."""

    def __enter__(self):
        from torch._dynamo.utils import counters

        self._counters, self._before = counters, counters["stats"]["unique_graphs"]
        return lambda: self._counters["stats"]["unique_graphs"] - self._before

    def __exit__(self, *exc) -> None:
        return None


def test_per_expert_folders_fill_the_fused_store_and_are_written_back(folders, tmp_path):
    """Mixtral's folder keeps each expert's w1/w2/w3 and names its MoE block `block_sparse_moe`; the store holds
    transformers' fused, renamed tensors, equal to what from_pretrained builds, and writing the store back gives
    the folder's own tensors, byte for byte in fp32."""
    folder = folders["mixtral"]
    on_disk = hf.tensor_index(folder)
    assert "model.layers.1.block_sparse_moe.experts.3.w1.weight" in on_disk
    cfg = hf.read_config(folder)
    table = dict(cfg.layer_parameter_shapes(1))
    assert table["mlp.experts.gate_up_proj"] == (4, 96, 64) and table["mlp.experts.down_proj"] == (4, 64, 48)
    assert "mlp.gate.weight" in table and not any(".experts.0." in n or "block_sparse" in n for n in table)
    assert sorted(n for n, _ in cfg.disk_shapes()) == sorted(n for n in on_disk if n != "lm_head.weight"
                                                              or not cfg.tie_word_embeddings)
    index = hf.tensor_index(folder)
    store = {n: hf.load_model_tensor(folder, cfg, n, torch.empty(s), index=index) for n, s in cfg.parameter_shapes()}
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    want = model.state_dict()
    for n, t in store.items():
        assert torch.equal(t, want[n]), n
    hf.write_folder(tmp_path / "out", cfg, store, dtype=torch.float32)
    written = hf.tensor_index(tmp_path / "out")
    assert set(written) == set(n for n, _ in cfg.disk_shapes())
    for n in written:
        assert torch.equal(hf.load_tensor(tmp_path / "out", n), hf.load_tensor(folder, n)), n


# Families whose forward does something between the layers and the loss: Gemma 2 scales the embeddings in
# the model's forward (not the embedding module) and softcaps both the scores and the logits; Cohere 2
# multiplies the logits by logit_scale; Granite multiplies embeddings and residuals and divides the logits.
HEAD_AND_INPUT = {
    "gemma2": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=12,
                   query_pre_attn_scalar=16, head_dim=16),
    "cohere2": dict(head_dim=16, sliding_window=12, logit_scale=0.5),
    "granite": dict(logits_scaling=4.0, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2),
}


@pytest.mark.parametrize("model_type", sorted(HEAD_AND_INPUT))
def test_what_the_forward_does_around_the_layers(tmp_path, model_type):
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=512, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2, pad_token_id=0, bos_token_id=None,
        attention_dropout=0.0, **HEAD_AND_INPUT[model_type])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((0.02 if p.ndim >= 2 else 0.1) * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    batch = packed_batch(512, seed=7)
    loss, grads = engine_step(tmp_path, batch)
    want_loss, want = reference_step(tmp_path, batch[4])
    assert loss == pytest.approx(want_loss, rel=1e-5)
    worst = max((rel_err(grads[n], want[n]), n) for n in want)
    assert worst[0] < 1e-4, worst
