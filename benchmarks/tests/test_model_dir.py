"""The harness on a Hugging Face folder (--model-dir): make_hf_model's folders, SlideDP and the transformers peer
training the same folder, the rows of the peers that build named shapes only, Liger's patch per model_type, and
sessions/layer_paths.sh's commands."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # benchmarks/ is not an installed package

from benchmarks import make_hf_model  # noqa: E402
from benchmarks import run as bench  # noqa: E402
from benchmarks.peers import common, hf_liger, slidedp_run  # noqa: E402
from benchmarks.tests.test_benchmark_harness import run_session  # noqa: E402
from slidedp.model.hf import read_config  # noqa: E402


@pytest.fixture(scope="module")
def tiny_qwen3_5(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny-qwen3.5"
    make_hf_model.make("tiny-qwen3.5", out)
    return out


def test_make_hf_model_writes_a_folder_slidedp_reads(tmp_path, capsys):
    out = tmp_path / "tiny-gemma3"
    assert make_hf_model.main(["tiny-gemma3", str(out)]) == 0
    assert "tiny-gemma3: 181,440 parameters" in capsys.readouterr().out
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == "gemma3_text" and hf["dtype"] == "bfloat16" and hf["tie_word_embeddings"] is True
    assert hf["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    assert hf["rope_parameters"]["sliding_attention"]["rope_theta"] == 10_000.0
    assert (out / "model.safetensors").is_file()
    cfg = read_config(out)
    assert cfg.family == "gemma3_text" and cfg.vocab_size == 512 and cfg.num_layers == 4
    # the 4 B configs are the models named: gemma-3-4b-pt's text model, Qwen3.5-4B's
    gemma = make_hf_model.make_config("gemma3-4b")
    assert (gemma.hidden_size, gemma.num_hidden_layers, gemma.vocab_size, gemma.sliding_window) == (2560, 34, 262_208,
                                                                                                     1024)
    assert gemma.layer_types[4:6] == ["sliding_attention", "full_attention"]
    qwen = make_hf_model.make_config("qwen3.5-4b", vocab=1024)
    assert qwen.model_type == "qwen3_5_text" and qwen.vocab_size == 1024
    assert qwen.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]
    # the 80 GB card's MoE shape is the H200's with 12 layers instead of 16: 4.47 B parameters against 5.76 B
    big, small = make_hf_model.make_config("qwen3-moe-5.8b").to_dict(), make_hf_model.make_config("qwen3-moe-4.5b").to_dict()
    assert {k for k in big if big[k] != small.get(k)} == {"num_hidden_layers"}
    assert (big["num_hidden_layers"], small["num_hidden_layers"], small["num_local_experts"],
            small["num_experts_per_tok"]) == (16, 12, 64, 8)


@pytest.mark.slow  # 19 s; tests/data/test_family_equivalence.py holds SlideDP to transformers on folders by default
def test_slidedp_and_transformers_train_the_same_folder(tiny_qwen3_5, tmp_path):
    """python -m benchmarks.run --model-dir: SlideDP reads the folder (model.source = "hf"), hf loads it, both on
    tokens of its vocabulary; the rows are named by the folder. (About 35 s on two slow cores.)"""
    out = tmp_path / "q35.json"
    cmd = [sys.executable, "-m", "benchmarks.run", "--device", "cpu", "--model-dir", str(tiny_qwen3_5), "--batch", "2",
           "--seq", "32", "--steps", "2", "--warmup", "1", "--systems", "slidedp,hf,gpu_resident", "--out", str(out),
           "--quiet"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["system"], r["shape"]) for r in rows] == [("slidedp", "tiny-qwen3.5"), ("hf", "tiny-qwen3.5"),
                                                         ("gpu_resident", "tiny-qwen3.5")]
    for row in rows[:2]:
        assert row["status"] == "ok", row.get("error")
        assert row["tokens_per_step"] == 64 and row["tokens_per_s"] > 0
        assert row["tokens_per_s"] == pytest.approx(64 / row["step_s"])
    slide, hf, other = rows
    assert other["status"] == "skipped: gpu_resident is not supported with --model-dir (it builds named shapes only)"
    job = (Path(slide["job_file"])).read_text()
    assert f'source = "hf"\npath = "{tiny_qwen3_5}"' in job and "vocab_size" not in job
    assert hf["parameters"] == 200_360
    # the same weights and tokens: the first step's loss agrees (SlideDP in fp32 on the CPU, hf under bf16 autocast)
    assert slide["losses"][0] == pytest.approx(hf["losses"][0], rel=1e-3)


def test_the_token_data_and_job_of_a_folder(tiny_qwen3_5, tmp_path):
    p = common.parser("t")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--compute-dtype", default="")
    p.add_argument("--wait-timeout", type=float, default=60.0)
    p.add_argument("--plan-micro-batch", action="store_true")
    args = p.parse_args(["--device", "cpu", "--batch", "2", "--seq", "8", "--model-dir", str(tiny_qwen3_5)])
    common.check_args(args)
    assert common.shape_of(args).vocab_size == 512 and common.model_name(args) == "tiny-qwen3.5"
    assert common.base_row("x", "", args)["shape"] == "tiny-qwen3.5"
    job = slidedp_run.job_dict(args, tmp_path / "t.npy", tmp_path / "run", "n")
    assert job["model"] == {"source": "hf", "path": str(tiny_qwen3_5)}
    with pytest.raises(SystemExit, match="--vocab and --chat do not apply"):
        common.check_args(p.parse_args(["--vocab", "512", "--model-dir", str(tiny_qwen3_5)]))
    # the harness passes the folder to every peer (absolute) and names the rows by it unless labelled
    args = bench.parse_args(["--model-dir", str(tiny_qwen3_5), "--systems", "slidedp,hf_liger"])
    argv = bench.system_argv("hf_liger", bench.SYSTEMS["hf_liger"], args, tmp_path, tmp_path / "h.json")
    assert argv[argv.index("--model-dir") + 1] == str(tiny_qwen3_5.resolve())
    assert bench.workload(args)["shape"] == "tiny-qwen3.5"
    labelled = bench.parse_args(["--model-dir", str(tiny_qwen3_5), "--workload-label", "q", "--systems", "hf"])
    assert bench.workload(labelled)["shape"] == "q"
    with pytest.raises(SystemExit):
        bench.parse_args(["--model-dir", str(tmp_path / "nothing"), "--systems", "hf"])


def test_liger_is_asked_for_the_kernels_each_family_has(monkeypatch):
    def gemma3_text(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, geglu=True,
                    model=None):
        pass

    def qwen3_5(rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True,
                model=None):
        pass

    assert hf_liger.liger_kernels(gemma3_text, "gemma3_text") == {
        "rope": True, "rms_norm": True, "geglu": True, "cross_entropy": False, "fused_linear_cross_entropy": True}
    assert hf_liger.liger_kernels(qwen3_5, "qwen3_5_text") == {
        "rope": False, "rms_norm": True, "swiglu": True, "cross_entropy": False, "fused_linear_cross_entropy": True}
    # a liger-kernel without the family's patch: a row that says so, not a crash
    fake = type(sys)("liger_kernel")
    fake.__version__ = "0.0.1"
    fake.transformers = type(sys)("liger_kernel.transformers")
    fake.transformers.apply_liger_kernel_to_gemma3_text = gemma3_text
    monkeypatch.setitem(sys.modules, "liger_kernel", fake)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake.transformers)
    assert hf_liger.liger_patch("gemma3_text") == (gemma3_text, "0.0.1")
    with pytest.raises(common.Skip, match=r"^Liger has no kernels for qwen3_5_text \(liger-kernel 0.0.1 has no "):
        hf_liger.liger_patch("qwen3_5_text")


def _layer_paths(tmp_path: Path, *parts: str) -> list[str]:
    """Every command sessions/layer_paths.sh OUT PART... runs (run_session's fake python3); models in tmp_path/m."""
    done, text = run_session(tmp_path, "layer_paths.sh", *parts, MODELS=str(tmp_path / "m"))
    assert done.returncode == 0, done.stderr
    return text.splitlines()


def test_the_layer_paths_session_runs_each_system_in_its_own_command(tmp_path):
    lines = _layer_paths(tmp_path)
    runs = [line for line in lines if line.startswith("-m benchmarks.run --batch")]
    assert [(r.split("--systems ")[1].split()[0], r.split("--batch ")[1].split()[0]) for r in runs] == [
        ("slidedp", "8"), ("slidedp_transformers", "8"), ("slidedp", "32"), ("slidedp_transformers", "32"),
        ("slidedp", "8"), ("hf", "8"), ("hf_liger", "8"), ("slidedp", "8"), ("hf", "8"), ("hf_liger", "8")]
    for r in runs:
        assert "--seq 2048 --steps 6 --warmup 2" in r and "--timeout 300" in r
        assert ("--slidedp-set memory.device_budget_gib=24" in r) == r.split("--systems ")[1].startswith("slidedp")
    assert all(r.endswith("--shape qwen3-4b") for r in runs[:4])
    assert all(r.endswith(f"--model-dir {tmp_path / 'm' / 'gemma3-4b'}") for r in runs[4:7])
    assert [line for line in lines if "make_hf_model" in line] == [
        f"-m benchmarks.make_hf_model {name} {tmp_path / 'm' / name}" for name in ("gemma3-4b", "qwen3.5-4b")]
    merges = [line.split("--out ")[1] for line in lines if line.startswith("-m benchmarks.run --merge")]
    assert merges == [str(tmp_path / "out" / f"{p}.json") for p in ("qwen3-4b-b8", "qwen3-4b-b32", "gemma3-4b",
                                                                    "qwen3.5-4b")]


def test_the_80_gb_moe_parts_give_transformers_micro_batches_of_8_at_32_rows(tmp_path):
    """qwen3-moe-4.5b-b8 / -b32: the 12-layer folder made once; at 32 x 2,048 the peers take --micro-batch 8 (one
    forward of 32 rows does not fit an 80 GB card beside AdamW's state), SlideDP keeps the plan's micro-batch."""
    lines = _layer_paths(tmp_path, "qwen3-moe-4.5b-b8", "qwen3-moe-4.5b-b32")
    folder = tmp_path / "m" / "qwen3-moe-4.5b"
    # each part makes the folder where it lacks config.json (the fake python3 writes none)
    assert [line for line in lines if "make_hf_model" in line] == [f"-m benchmarks.make_hf_model qwen3-moe-4.5b {folder}"] * 2
    runs = [line for line in lines if line.startswith("-m benchmarks.run --batch")]
    assert [(r.split("--systems ")[1].split()[0], r.split("--batch ")[1].split()[0], r.endswith("--micro-batch 8"))
            for r in runs] == [("slidedp", "8", False), ("hf", "8", False), ("hf_liger", "8", False),
                               ("slidedp", "32", True), ("hf", "32", True), ("hf_liger", "32", True)]
    assert all(f"--model-dir {folder}" in r for r in runs)
    merges = [line.split("--out ")[1] for line in lines if line.startswith("-m benchmarks.run --merge")]
    assert merges == [str(tmp_path / "out" / f"qwen3-moe-4.5b-b{n}.json") for n in (8, 32)]
