"""benchmarks/paper_plan.py: the launcher's plan for a config.json on a host the tests do not have."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import paper_plan
from slidedp.model.hf_folder import read_config
from slidedp.planner import REFERENCE_CALIBRATION, cache

pytest.importorskip("transformers")

SMALL_MOE = {  # a Qwen3-MoE config.json of a few million parameters: 2 layers of 8 experts, 2 a token
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128,
    "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "vocab_size": 1024, "tie_word_embeddings": False, "output_router_logits": False,
    "attention_dropout": 0.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
}


def test_the_folder_holds_every_tensor_header_and_no_weights(tmp_path):
    count = paper_plan.write_folder({**SMALL_MOE, "quantization_config": {"quant_method": "mxfp4"}}, tmp_path)
    cfg = read_config(tmp_path)  # the launcher's own reading of a folder
    assert cfg.num_parameters() == count
    assert cfg.layer_tables and dict(cfg.layer_tables[0])["mlp.experts.gate_up_proj"] == (8, 64, 64)
    weights = tmp_path / "model.safetensors"
    assert weights.stat().st_size > 2 * count  # the bf16 weights' length ...
    assert os.stat(weights).st_blocks * 512 < weights.stat().st_size  # ... never written: a hole
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())


def test_it_prints_the_launchers_plan_and_the_host_memory_it_takes(tmp_path, capsys):
    config, cal = tmp_path / "config.json", tmp_path / "calibration.json"
    config.write_text(json.dumps(SMALL_MOE))
    cache.save(REFERENCE_CALIBRATION, cal)
    args = [str(config), str(cal), "--gpus", "4", "--host-gib", "64", "--batch", "8", "--seq", "256",
            "--bus-gbps", "240", "--h2d-total-gbps", "220"]
    assert paper_plan.main(args) == 0
    out = capsys.readouterr().out
    assert "SlideDP plan: qwen3_moe" in out and "on 4 rank(s)" in out
    assert "GPU links 240 GB/s among 4, H2D of all 220 GB/s" in out  # the links a 4-GPU calibration would hold
    assert "Mixture-of-Experts: 8 experts, 2 a token" in out
    assert "host memory of the planned job:" in out and "of 64.0 GiB" in out
    # too little host memory: the launcher's refusal, in its words
    assert paper_plan.main([*args[:5], "0.01", *args[6:]]) == 1
    assert "refused (store): the job needs" in capsys.readouterr().out


def test_blocks_of_the_same_layers_written_by_another_transformers_are_taken_with_a_note():
    from slidedp.planner.measure import MeasuredBlocks

    key = "qwen3_moe transformers layers 0123456789ab h2048 16 layers vocab 151936; seq 2048; bf16; compiled"
    other = key.replace("0123456789ab", "fedcba987654")
    blocks = MeasuredBlocks(other, "NVIDIA H200")
    found, note = paper_plan.blocks_for({other: blocks}, key)
    assert found is not None and found.shape == key and "the same layers" in note
    assert paper_plan.blocks_for({}, key) == (None, "no GPU blocks of this shape in the blocks file: the GPU time is "
                                                    "the FLOPs'")


def test_several_hosts_plan_host_0_with_the_network_and_the_part(tmp_path, capsys):
    config, cal = tmp_path / "config.json", tmp_path / "calibration.json"
    config.write_text(json.dumps(SMALL_MOE))
    cache.save(REFERENCE_CALIBRATION, cal)
    args = [str(config), str(cal), "--gpus", "2", "--host-gib", "64", "--batch", "8", "--seq", "256",
            "--bus-gbps", "240", "--h2d-total-gbps", "110"]
    assert paper_plan.main(args) == 0
    one = capsys.readouterr().out
    assert paper_plan.main([*args, "--nnodes", "2", "--network-gbps", "200"]) == 0
    out = capsys.readouterr().out
    assert "on host 0 of 2, each 2 x NVIDIA H200" in out
    assert "4 x 256 = 1,024 tokens/step on 2 rank(s) of this host, one of 2 hosts" in out
    assert "25.0 GB/s (200 Gb/s) each way per host, set by the job; latency 20 us per ring step, assumed" in out
    assert "routes                params sharded, grads reduce_scatter" in out and "\n  network " in out
    assert "host memory of the planned job on each of the 2 hosts (its part: 1/2 of the state)" in out

    def state(text: str) -> float:  # the store's state the job creates per B/param (12, or 14 with the shadow)
        per, part = text.split("the store's state (")[1].split(" B/param) ")
        part = part.split(",")[0]
        return float(part.split()[0]) * (1024 if part.endswith("GiB") else 1) / int(per)

    assert state(out) == pytest.approx(state(one) / 2, rel=0.05)  # its part: half, to the pages of small chunks


def test_another_gpu_is_the_calibrated_one_scaled_as_the_command_says(tmp_path):
    cal = tmp_path / "calibration.json"
    cache.save(REFERENCE_CALIBRATION, cal)
    a = paper_plan.argparse.Namespace(calibration=cal, learned=False, gpus=4, bus_gbps=15.0,
                                      h2d_total_gbps=110.0, device_name="RTX 4090", tflops_scale=0.167,
                                      pcie_scale=0.5, gpu_mem_gib=23.6)
    c = paper_plan.calibration(a, 1)
    r = REFERENCE_CALIBRATION
    assert c.device_name == "RTX 4090" and c.device_tflops == pytest.approx(r.device_tflops * 0.167)
    assert (c.h2d_gbps, c.d2h_gbps, c.bidir_gbps) == pytest.approx((r.h2d_gbps / 2, r.d2h_gbps / 2, r.bidir_gbps / 2))
    assert c.device_mem_bytes == int(23.6 * 2**30) and c.adamw_params_per_s == r.adamw_params_per_s  # the host's stay
    assert (c.bus_gpus, c.allreduce_gbps, c.h2d_total_gbps) == (4, 15.0, 110.0)
