"""The routers' auxiliary load-balancing loss (model/router_aux.py) against transformers' own.

One engine step (CPU, fp32, a fake link: one rank, whose statistics are the total) over packed rows with
padding, two micro-batches, against transformers running each document alone and taking its routers' logits
of all documents as one batch through the family's load_balancing_loss_func: the loss and every gradient.
The coefficient is raised to 1.0 so that a wrong auxiliary term would show far above float32 rounding.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from data.common import router_aux_loss  # noqa: E402
from families import AUX_FAMILIES, write_family_folder, with_router_aux  # noqa: E402
from model.test_generic import M, ROWS, T, engine_step, packed_batch  # noqa: E402
from pipeline.harness import rel_err  # noqa: E402
from slidedp.model import hf  # noqa: E402
from slidedp.model.generic import TransformersMath, UnsupportedModel  # noqa: E402
from slidedp.config import TrainSection  # noqa: E402
from slidedp.model.router_aux import aux_loss  # noqa: E402

COEF = 1.0
PAD = 7  # padding positions at the end of the last row of each micro-batch


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("aux")
    return {f: with_router_aux(write_family_folder(root / f, f, seed=5), COEF) for f in AUX_FAMILIES + ("glm4_moe",)}


def padded_batch(vocab: int, seed: int):
    """packed_batch with the last PAD positions of each micro-batch's last row turned into padding as the data
    makes it (input 0, no target, continuing the last document), and that document cut short to match."""
    ids, targets, positions, documents, docs = packed_batch(vocab, seed)
    real = torch.ones(M, ROWS, T, dtype=torch.bool)
    real[:, -1, T - PAD:] = False
    ids[:, -1, T - PAD:] = 0
    targets[:, -1, T - PAD - 1:] = -100  # the last real token's target was the first padding's id
    kept = []
    at = 0
    for i in range(M):
        for r in range(ROWS):
            row_at = 0
            while row_at < T:
                n = len(docs[at][0])
                if r == ROWS - 1 and row_at + n > T - PAD:  # the row's last document, cut at the padding
                    n_real = T - PAD - row_at
                    kept.append((ids[i, r, row_at:row_at + n_real], targets[i, r, row_at:row_at + n_real]))
                else:
                    kept.append((ids[i, r, row_at:row_at + n], targets[i, r, row_at:row_at + n]))
                row_at, at = row_at + n, at + 1
    return (ids, targets, positions, documents, kept), real


def reference(folder, docs, device: str = "cpu", dtype=torch.float32):
    """transformers, each document alone: (cross-entropy sum, aux, its routers' layers, gradients of CE sum +
    coef * aux, fp32 on the CPU)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    model.to(device)
    total, outs = torch.zeros((), device=device), []
    for ids, targets in docs:
        outs.append(model(input_ids=ids[None].to(device)))
        targets = targets.to(device)
        total = total + F.cross_entropy(outs[-1].logits[0].float(), targets, ignore_index=-100, reduction="sum")
    aux = router_aux_loss(model, outs)
    assert aux is not None and model.router_aux_loss_coef == COEF
    (total + COEF * aux).backward()
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return float(total.detach()), float(aux.detach()), len(outs[0].router_logits), grads


@pytest.mark.parametrize("family", AUX_FAMILIES)
def test_step_with_the_auxiliary_loss_equals_transformers(folders, family):
    batch, real = padded_batch(512, seed=11)
    routing: list = []
    loss, grads = engine_step(folders[family], batch, router_aux=True, real=real, routing=routing)
    want_loss, want_aux, moe_layers, want = reference(folders[family], batch[4])
    assert loss == pytest.approx(want_loss, rel=1e-5)  # the engine's own sum is the cross-entropy's
    share = routing[0]
    assert share.coef == COEF
    assert share.values[0] == moe_layers * int(real.sum())  # padding is not a row
    assert aux_loss(share.values) == pytest.approx(want_aux, rel=1e-5)
    worst = max((rel_err(grads[n], want[n]), n) for n in want)
    assert worst[0] < 1e-4, worst
    # the auxiliary term is in those gradients: without it the routers' are far off
    _, plain = engine_step(folders[family], batch, real=real)
    router = max(want, key=lambda n: rel_err(plain[n], want[n]))
    assert rel_err(plain[router], want[router]) > 1e-2, router


def test_statistics_do_not_depend_on_the_micro_batches(folders):
    """Two micro-batches of one row each give the step one micro-batch of both rows gives."""
    batch, real = padded_batch(512, seed=12)
    one: list = []
    _, grads = engine_step(folders["qwen3_moe"], batch, router_aux=True, real=real, routing=one)
    merged = tuple(x.reshape(1, M * ROWS, T) for x in batch[:4]) + (batch[4],)
    both: list = []
    _, grads_one = engine_step(folders["qwen3_moe"], merged, router_aux=True, real=real.reshape(1, M * ROWS, T),
                               routing=both)
    assert both[0].values == pytest.approx(one[0].values, rel=1e-6)
    assert max(rel_err(grads_one[n], grads[n]) for n in grads if grads[n].abs().max() > 0) < 1e-5


def test_the_aggregate_is_transformers_formula():
    """aux from [R, c, S] is E * sum((c / R) * (S / R)), 0 without rows."""
    values = (4.0, 3.0, 5.0, 1.5, 2.5)  # 4 rows, 2 experts
    assert aux_loss(values) == pytest.approx(2 * (3 * 1.5 + 5 * 2.5) / 16)
    assert aux_loss((0.0, 0.0, 0.0, 0.0, 0.0)) == 0.0


def test_the_job_setting_and_the_config():
    def train(setting: str) -> TrainSection:
        return TrainSection(steps=1, global_batch=1, seq_len=8, lr=1e-3, router_aux_loss=setting)

    assert train("auto").adds_router_aux({"output_router_logits": True}) and not train("auto").adds_router_aux({})
    assert train("on").adds_router_aux({}) and not train("off").adds_router_aux({"output_router_logits": True})


def test_a_model_without_the_loss_is_refused_when_asked(folders):
    cfg = hf.read_config(folders["glm4_moe"])
    with pytest.raises(UnsupportedModel, match=r"Glm4MoeForCausalLM adds no router auxiliary loss in transformers.*"
                                               r"set train.router_aux_loss = \"off\""):
        TransformersMath(cfg, torch.device("cpu"), torch.float32, router_aux=True)


def test_output_router_logits_folders_load(folders, tmp_path):
    """config.json output_router_logits=true is read as is (it used to be refused)."""
    shutil.copytree(folders["mixtral"], tmp_path / "m")
    conf = json.loads((tmp_path / "m" / "config.json").read_text())
    assert conf["output_router_logits"] is True
    cfg = hf.read_config(tmp_path / "m")
    assert cfg.source()["output_router_logits"] is True


def test_the_launcher_refuses_the_loss_for_a_model_without_routers(tmp_path):
    """train.router_aux_loss = "on" for a dense model SlideDP's own layers run: refused before any store."""
    from launch.planning import check_layers
    from pipeline.harness import TINY
    from slidedp.config import load_job, model_config
    from slidedp.section import ConfigError

    job = load_job(TINY, ["train.router_aux_loss=on"])
    with pytest.raises(ConfigError, match=r"train.router_aux_loss = \"on\": this qwen3 model has no routers"):
        check_layers(job, model_config(job))
    job = load_job(TINY, ["train.router_aux_loss=auto"])
    assert check_layers(job, model_config(job)) == "native"


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_step_with_the_auxiliary_loss_on_cuda_compiled_in_bf16(folders, family, monkeypatch):
    """What a GPU job runs (CUDA, bf16, each layer structure through torch.compile with the routers' hooks
    inside): within twice the distance of transformers' own bf16 run from the fp32 reference, or 10% of a
    gradient where that is closer."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import model.test_generic as g

    monkeypatch.setattr(g, "math_for", lambda cfg, layers, dev, dtype, router_aux=False: TransformersMath(
        cfg, dev, dtype, compile=True, router_aux=router_aux))
    batch, real = padded_batch(512, seed=11)
    routing: list = []
    _, grads = engine_step(folders[family], batch, device="cuda", dtype=torch.bfloat16, router_aux=True, real=real,
                           routing=routing)
    _, want_aux, _, want = reference(folders[family], batch[4])
    _, bf16_aux, _, bf16 = reference(folders[family], batch[4], "cuda", torch.bfloat16)
    assert abs(aux_loss(routing[0].values) - want_aux) <= max(0.02 * want_aux, 2 * abs(bf16_aux - want_aux))
    for n in want:
        err, theirs = rel_err(grads[n], want[n]), rel_err(bf16[n], want[n])
        assert err <= max(0.1, 2 * theirs), (n, err, theirs)
