"""plan.layers: whose layers run the model, as the plan resolves it, says it and measures it."""

from __future__ import annotations

import pytest

from families import write_family_folder
from pipeline.harness import TINY
from slidedp.config import ConfigError, load_job, model_config
from slidedp.launch.planning import plan_job
from slidedp.model.config import named_shape
from slidedp.planner import REFERENCE_CALIBRATION, Workload, measure
from slidedp.planner.plan import device_work_sizes

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("layers")
    return {f: write_family_folder(root / f, f) for f in ("llama", "qwen3_5")}


def job(folder, *sets: str):
    return load_job(TINY, ['model.source="hf"', f'model.path="{folder}"', "model.vocab_size=0", *sets])


def test_auto_is_native_where_the_native_layers_model_it(folders):
    llama = plan_job(job(folders["llama"]))
    assert llama.step.layers == "native" and "layers: native (SlideDP's own)" in llama.describe()
    hybrid = plan_job(job(folders["qwen3_5"]))
    assert hybrid.step.layers == "transformers"
    assert "layers: transformers (transformers' qwen3_5_text layer modules, untiled)" in hybrid.describe()
    assert plan_job(job(folders["llama"], 'plan.layers="transformers"')).step.layers == "transformers"


def test_refusals_name_what_to_change(folders):
    with pytest.raises(ConfigError, match='plan.layers = "native": SlideDP\'s own layers do not model this '
                                          'qwen3_5_text configuration; use "auto" or "transformers"'):
        plan_job(job(folders["qwen3_5"], 'plan.layers="native"'))
    with pytest.raises(ConfigError, match=r"plan.seq_tile_tokens = 512: transformers' layers \(which run this "
                                          r"qwen3_5_text model\) are not tiled"):
        plan_job(job(folders["qwen3_5"], "plan.seq_tile_tokens=512"))


def test_the_cuda_plan_never_tiles_transformers_layers(folders):
    cuda = ['runtime.device="cuda"', "train.global_batch=8", "train.seq_len=4096"]
    plan = plan_job(job(folders["qwen3_5"], *cuda), REFERENCE_CALIBRATION)
    assert plan.step.layers == "transformers" and plan.step.seq_tile_tokens == 0
    assert "layers                transformers (the family's own layer modules, untiled)" in plan.describe()
    # 65,536 tokens of the Qwen3-4B shape: at 24 GiB the native layers fit by tiling the sequence, and
    # transformers' do not fit at all (they cannot tile); at 40 GiB they fit untiled
    cfg = named_shape("qwen3-4b")

    def sizes(layers: str, gib: int) -> list:
        work = Workload(model=cfg, global_batch=1, seq_len=65536, world=1, micro_batch=0, layers=layers)
        return device_work_sizes(work, gib * 2**30)

    assert sizes("native", 24) == [(1, 8192, 1024)]
    assert sizes("transformers", 24) == [] and sizes("transformers", 40) == [(1, 0, 1024)]


def test_the_planner_times_one_layer_of_each_structure(folders):
    """Qwen3.5's tiny model alternates linear and full attention: two structures, two layers each; the
    layer blocks are their mean, under a shape key of their own."""
    cfg = model_config(job(folders["qwen3_5"]))
    from slidedp.model.generic import TransformersMath
    import torch

    assert TransformersMath(cfg, torch.device("cpu"), torch.float32).structures() == {0: 2, 1: 2}
    blocks = measure.measure_blocks(cfg, 16, "fp32", False, [(2, 0, 16)], 2, device="cpu", repeat=1,
                                    device_name="cpu", layers="transformers")
    assert blocks.shape == measure.shape_key(cfg, 16, "fp32", False, None, "transformers")
    assert blocks.shape != measure.shape_key(cfg, 16, "fp32", False)
    assert "transformers layers" in blocks.shape
    (layer,) = blocks.layers
    assert layer.forward_s > 0 and layer.backward_s > 0
