"""The benchmark harness on CPU: the smoke run, failure rows, SlideDP's job and metrics, and the model.

The harness itself runs on a GPU machine; here we check what must be right before it gets
there: one table and valid JSON, every failure a row, SlideDP's job file accepted by the
real job schema, and DecoderLM (what every peer trains) equal to slidedp.model.layers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # benchmarks/ is not an installed package

from benchmarks import report  # noqa: E402
from benchmarks import run as bench  # noqa: E402
from benchmarks.peers import common, slidedp_run  # noqa: E402
from slidedp.data.batches import Batches, rank_slice  # noqa: E402
from slidedp.data.stream import TokenStream, read_npy  # noqa: E402
from slidedp.model import layers  # noqa: E402
from slidedp.model.config import named_shape  # noqa: E402
from slidedp.model.init import init_params  # noqa: E402


def _header_cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_cpu_smoke_run_prints_one_table_and_writes_json_markdown_and_plot(tmp_path):
    out = tmp_path / "smoke.json"
    systems = "resident_same_kernels,gpu_resident,deepspeed,slideformer"
    cmd = [sys.executable, "-m", "benchmarks.run", "--device", "cpu", "--shape", "tiny", "--batch", "2", "--seq", "32",
           "--steps", "2", "--warmup", "1", "--systems", systems, "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]

    # stdout is the table and nothing else: header, separator, one line per system
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 6, done.stdout
    assert _header_cells(lines[0]) == list(bench.COLUMNS)
    limit, gpu, ds, slideformer = (_header_cells(line) for line in lines[2:])
    # the same-kernel limit is the baseline: 1.00x, and the eager resident peer is measured against it
    assert limit[0] == "resident_same_kernels" and limit[4] == "1.00x" and limit[-1] == "ok"
    assert gpu[0] == "gpu_resident" and gpu[4].endswith("x") and gpu[-1] == "ok"
    assert float(gpu[2].replace(",", "")) > 0
    assert ds[0] == "deepspeed" and ds[-1] == "skipped: deepspeed needs CUDA"
    assert slideformer[0] == "slideformer" and slideformer[-1] == "not run: its code is not available to this harness"
    assert "arXiv:2603.16428" not in slideformer[1] and "published: 1.40x-6.27x" in slideformer[1]

    doc = json.loads(out.read_text())
    assert doc["complete"] is True
    assert doc["columns"] == list(bench.COLUMNS)
    assert doc["torch"] == torch.__version__ and doc["host"] and doc["date"]
    assert "benchmarks.run" in doc["command"] and f"--systems {systems}" in doc["command"]
    assert [r["system"] for r in doc["rows"]] == systems.split(",")
    assert [t["system"] for t in doc["table"]] == systems.split(",")
    row = doc["rows"][0]
    assert row["status"] == "ok" and row["tokens_per_step"] == 64 and row["tokens_per_s"] > 0
    assert row["tokens_per_s"] == pytest.approx(64 / row["step_s"])
    assert row["step_s"] == row["step_times_s"][1]  # the median of the one step after warm-up
    assert row["vs_resident"] == 1.0 and row["baseline"] == "resident_same_kernels" and row["host_rss_gib"] > 0
    assert row["parameters"] == named_shape("tiny").num_parameters()
    assert row["compiled_kernels"] is False  # train.compile = "auto" compiles on CUDA only
    assert row["max_grad_norm"] == 1.0 and "clip 1" in row["config"]
    assert "--max-grad-norm 1" in row["command"]
    assert doc["rows"][1]["vs_resident"] == pytest.approx(doc["rows"][1]["tokens_per_s"] / row["tokens_per_s"])
    # both peers trained the same weights (the exact init on CPU) on the same batch with the same clipping. Their
    # bf16 matmuls are fused differently, and the first AdamW step moves each weight by about lr * sign(grad), so
    # rounding in near-zero gradients moves the second loss: 1.3e-6 and 1.1e-5 relative on a host with AMX. 5e-5
    # (3e-4 absolute) is an eighth of the one step's loss change (2.6e-3): another lr or no step would miss it.
    eager, limit = doc["rows"][1]["losses"], row["losses"]
    assert eager[0] == pytest.approx(limit[0], rel=1e-5)
    assert eager[1] == pytest.approx(limit[1], rel=5e-5) and limit[1] < limit[0] - 1e-3
    assert doc["rows"][2]["status"] == "skipped: deepspeed needs CUDA" and doc["rows"][2]["vs_resident"] is None
    assert doc["rows"][3]["source"].startswith("Yang and Wen") and doc["rows"][3]["shape"] == "tiny"
    assert (tmp_path / "smoke.logs" / "gpu_resident.log").is_file()

    # the per-run page and the plot beside the JSON
    md = (tmp_path / "smoke.md").read_text()
    assert md.startswith("# smoke\n") and "![tokens/s per system](smoke.png)" in md
    assert "## tiny, 2 x 32 tokens/step, 1 GPU" in md
    assert "SlideDP (`slidedp`, the default configuration) has no figure in this workload." in md
    assert bench.format_table(doc["rows"]).splitlines()[0] in md
    png = (tmp_path / "smoke.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # 29 s on 2 cores: the one-rank smoke runs by default
def test_cpu_smoke_with_two_ranks_runs_fsdp2_under_torchrun_and_slidedp_with_both_routes(tmp_path):
    out = tmp_path / "two.json"
    cmd = [sys.executable, "-m", "benchmarks.run", "--device", "cpu", "--gpus", "2", "--shape", "tiny", "--batch", "4",
           "--seq", "32", "--steps", "3", "--warmup", "1", "--systems",
           "fsdp2,slidedp,slidedp_replicated,fsdp2_offload,gpu_resident", "--out", str(out), "--timeout", "240"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["system"]: r for r in json.loads(out.read_text())["rows"]}
    for name in ("fsdp2", "slidedp", "slidedp_replicated", "fsdp2_offload"):
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["gpus"] == 2 and rows[name]["tokens_per_step"] == 128
        assert "on 2 ranks" in rows[name]["config"], rows[name]["config"]
    assert "torch.distributed.run --standalone --nproc-per-node 2" in rows["fsdp2"]["command"]
    assert rows["fsdp2"]["vs_resident"] == 1.0  # with several ranks the base is GPU-resident FSDP2
    assert rows["fsdp2"]["slidedp_ratio"] == pytest.approx(rows["slidedp"]["tokens_per_s"] / rows["fsdp2"]["tokens_per_s"])
    assert all("clip 1" in rows[n]["config"] for n in ("fsdp2", "slidedp", "fsdp2_offload"))
    assert "sharded over 2 rank(s)" in rows["fsdp2"]["config"]
    assert 'plan.grad_route="host"' in rows["slidedp_replicated"]["command"]
    assert rows["gpu_resident"]["status"].startswith("skipped: gpu_resident runs on one GPU only")
    # every system trains the same weights (on CPU the peers draw SlideDP's init) on the same global
    # batch at every step: their losses agree step by step, and fall
    losses = {n: rows[n]["losses"] for n in ("fsdp2", "fsdp2_offload", "slidedp", "slidedp_replicated")}
    for name, seen in losses.items():  # the peers compute in bf16 (FSDP2's MixedPrecisionPolicy), SlideDP on CPU in fp32
        assert seen == pytest.approx(losses["fsdp2"], rel=5e-5), (name, losses)
    assert losses["slidedp"][-1] < losses["slidedp"][0]


def _write_module(folder: Path, name: str, code: str) -> None:
    (folder / f"{name}.py").write_text(code)


def _fake_peers(tmp_path: Path, monkeypatch, **code: str) -> None:
    """Each keyword a system of the harness: a module of its own running that code (as `peer_NAME`)."""
    mods = tmp_path / "mods"
    mods.mkdir(exist_ok=True)
    for name, text in code.items():
        _write_module(mods, f"peer_{name}", text)
    monkeypatch.setenv("PYTHONPATH", str(mods))
    monkeypatch.setattr(bench, "SYSTEMS", {**bench.SYSTEMS, **{n: bench.System(f"peer_{n}") for n in code}})


# a fake peer's first line: where the harness wants its row (--json)
_JSON_PATH = "import json, sys, time\npath = sys.argv[sys.argv.index('--json') + 1]\n"


def test_failed_killed_and_hung_systems_become_rows(tmp_path, monkeypatch, capsys):
    _fake_peers(tmp_path, monkeypatch, raises="raise RuntimeError('CUDA error: an illegal memory access')\n",
                killed="import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
                hangs="import time\nprint('working', flush=True)\ntime.sleep(60)\n")
    out = tmp_path / "fail.json"
    rc = bench.main(["--device", "cpu", "--shape", "tiny", "--steps", "2", "--warmup", "1", "--quiet",
                     "--systems", "raises,killed,hangs", "--timeout", "2", "--out", str(out)])
    assert rc == 0
    rows = {r["system"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["raises"]["status"] == "failed: exit code 1, no result row"
    assert rows["raises"]["error"] == "RuntimeError: CUDA error: an illegal memory access"
    assert rows["killed"]["status"] == "failed: killed by SIGKILL (host out of memory?)"
    assert rows["hangs"]["status"] == "timeout after 2 s" and "working" in rows["hangs"]["output_tail"]
    table = capsys.readouterr().out.strip().splitlines()
    assert _header_cells(table[0]) == list(bench.COLUMNS) and len(table) == 5
    assert _header_cells(table[2])[-1] == (
        "failed: exit code 1, no result row -- RuntimeError: CUDA error: an illegal memory access")
    # the harness's own rows name the workload too: a merge keeps them beside their workload's rows
    assert all((r["shape"], r["batch"], r["seq"], r["gpus"]) == ("tiny", 8, 2048, 1) for r in rows.values())


def test_a_peer_stopped_after_it_wrote_its_row_keeps_its_figures(tmp_path, monkeypatch, capsys):
    """DeepSpeed at 32 x 2,048 wrote its finished row a second before its limit and was stopped in
    its NCCL teardown: its figures stand, and the table says the limit stopped it."""
    _fake_peers(tmp_path, monkeypatch, slow_exit=_JSON_PATH
                + "row = {'system': 'slow_exit', 'status': 'ok', 'tokens_per_s': 8734.7, 'step_s': 7.5029}\n"
                  "open(path, 'w').write(json.dumps(row))\n"
                  "print('RESULT ' + json.dumps(row), flush=True)\n"
                  "time.sleep(60)\n")
    out = tmp_path / "slow.json"
    assert bench.main(["--device", "cpu", "--shape", "tiny", "--steps", "2", "--warmup", "1", "--quiet",
                       "--systems", "slow_exit", "--timeout", "2", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["status"], row["tokens_per_s"], row["step_s"]) == ("ok", 8734.7, 7.5029)
    assert row["note"] == "its 2 s limit stopped it after it wrote this row"
    table = capsys.readouterr().out.strip().splitlines()
    assert _header_cells(table[2])[-1] == "ok -- its 2 s limit stopped it after it wrote this row"
    assert "8,735" in table[2]


def test_a_later_calls_row_replaces_an_earlier_failed_one_of_the_same_system_and_workload(tmp_path):
    """headline.sh's ONLY=...: a second call runs the rows the first could not finish; the merged
    table has one row per system and workload, the one that ran."""
    w32 = {"shape": "qwen3-4b", "batch": 32, "seq": 2048, "gpus": 1}
    first = [{**w32, "system": "fsdp2_offload", "status": "ok", "tokens_per_s": 6680.0},
             {**w32, "system": "deepspeed", "status": "timeout after 60 s"},
             {**w32, "system": "megatrain", "status": "ok", "tokens_per_s": 6473.0}]
    second = [{**w32, "system": "deepspeed", "status": "ok", "tokens_per_s": 8735.0},
              {**w32, "system": "megatrain", "status": "failed: killed by SIGKILL (host out of memory?)"},
              {**w32, "batch": 8, "system": "deepspeed", "status": "ok", "tokens_per_s": 4854.0},
              # SlideDP clipped and not: two rows of one system, and neither replaces the other
              {**w32, "system": "slidedp", "status": "ok", "tokens_per_s": 13795.0, "max_grad_norm": 1.0},
              {**w32, "system": "slidedp", "status": "ok", "tokens_per_s": 15085.0, "max_grad_norm": 0.0}]
    for name, rows in (("a", first), ("b", second)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"rows": rows}))
    assert bench.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                       "--out", str(tmp_path / "c.json")]) == 0
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert [(r["system"], r["batch"], r["status"], r.get("tokens_per_s")) for r in rows] == [
        ("fsdp2_offload", 32, "ok", 6680.0), ("deepspeed", 32, "ok", 8735.0), ("megatrain", 32, "ok", 6473.0),
        ("deepspeed", 8, "ok", 4854.0), ("slidedp", 32, "ok", 13795.0), ("slidedp", 32, "ok", 15085.0)]


def test_a_workload_label_names_the_rows_of_a_model_from_elsewhere(tmp_path, monkeypatch):
    """plan_choice.sh's unseen shape: an HF folder trained on qwen3-4b's token data. Its rows (a peer's, which
    names --shape itself, and the harness's own) carry the label, so no report files it under qwen3-4b."""
    _fake_peers(tmp_path, monkeypatch, named=_JSON_PATH
                + "open(path, 'w').write(json.dumps({'system': 'x', 'shape': 'tiny', 'status': 'ok', 'step_s': 1.0,"
                  " 'tokens_per_s': 1.0}))\n")
    out = tmp_path / "label.json"
    assert bench.main(["--device", "cpu", "--shape", "tiny", "--steps", "2", "--warmup", "1", "--quiet",
                       "--systems", "named,slideformer", "--workload-label", "llama-unseen", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["system"], r["shape"]) for r in rows] == [("named", "llama-unseen"), ("slideformer", "llama-unseen")]
    assert "## llama-unseen, 8 x 2,048 tokens/step, 1 GPU" in out.with_suffix(".md").read_text()


def test_merge_joins_runs_and_takes_ratios_within_each_workload(tmp_path, capsys):
    def doc(rows, **env):
        return json.dumps({"rows": rows, "host": "gpu-box", "gpu": "NVIDIA H200", "cpus": 16, **env})

    w8 = {"shape": "qwen3-4b", "batch": 8, "seq": 2048, "gpus": 1}
    w32 = {**w8, "batch": 32}
    ok = {"status": "ok", "config": "c", "step_s": 2.0, "gpu_peak_gib": 80.0, "host_rss_gib": 3.0, "shm_gib": 0.0}
    (tmp_path / "a.json").write_text(doc([
        {**ok, **w8, "system": "gpu_resident", "status": "out of memory", "error": "CUDA out of memory. Tried"},
        {**ok, **w8, "system": "gpu_resident_chunked", "tokens_per_s": 10000.0},
        {**ok, **w8, "system": "resident_same_kernels", "tokens_per_s": 12500.0},
    ]))
    (tmp_path / "b.json").write_text(doc([
        {**ok, **w8, "system": "slidedp", "tokens_per_s": 10000.0, "predicted_step_s": 1.9, "shm_gib": 48.25,
         "losses": [12.444, None, 11.206]},
        {**ok, **w8, "system": "fsdp2_offload", "tokens_per_s": 5000.0, "optimizer_s": 0.98},
        {**ok, **w32, "system": "gpu_resident_chunked", "tokens_per_s": 10000.0},
        {**ok, **w32, "system": "slidedp", "tokens_per_s": 13000.0},
        {**ok, **w32, "system": "zenflow", "tokens_per_s": 6500.0, "step_stat": "mean"},
    ], git_commit="b" * 40, date="2026-11-29T17:00:00+00:00"))
    assert bench.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                       "--out", str(tmp_path / "c.json")]) == 0
    merged = json.loads((tmp_path / "c.json").read_text())
    rows = merged["rows"]
    # 8 sequences: against the same-kernel limit; 32 sequences (no such row): against the chunked resident peer
    assert [r["vs_resident"] for r in rows] == [None, 0.8, 1.0, 0.8, 0.4, 1.0, 1.3, 0.65]
    assert [r["baseline"] for r in rows] == ["resident_same_kernels"] * 5 + ["gpu_resident_chunked"] * 3
    assert [r["slidedp_ratio"] for r in rows] == [None, 1.0, 0.8, 1.0, 2.0, 1.3, 1.0, 2.0]
    # where the runs ran (not where they were merged); where the sources differ, each one's value
    assert (merged["host"], merged["gpu"], merged["cpus"]) == ("gpu-box", "NVIDIA H200", 16)
    assert merged["git_commit"] == [None, "b" * 40]
    assert [(s["file"], s["git_commit"], s["date"]) for s in merged["settings"]["merged_from"]] == [
        (str(tmp_path / "a.json"), None, None), (str(tmp_path / "b.json"), "b" * 40, "2026-11-29T17:00:00+00:00")]
    table = capsys.readouterr().out.strip().splitlines()
    assert [_header_cells(line) for line in table[2:6]] == [
        ["gpu_resident", "c", "", "2.00", "", "", "80.0", "3.0 + 0.0", "", "out of memory -- CUDA out of memory. Tried"],
        ["gpu_resident_chunked", "c", "10,000", "2.00", "0.80x", "1.00x", "80.0", "3.0 + 0.0", "", "ok"],
        ["resident_same_kernels", "c", "12,500", "2.00", "1.00x", "0.80x", "80.0", "3.0 + 0.0", "", "ok"],
        ["slidedp", "c", "10,000", "2.00 (predicted 1.90)", "0.80x", "1.00x", "80.0", "3.0 + 48.2", "12.44 -> 11.21",
         "ok"],
    ]
    assert _header_cells(table[9])[3] == "2.00 (mean)"
    assert merged["table_markdown"] == "\n".join(table)
    md = (tmp_path / "c.md").read_text()
    assert "## qwen3-4b, 8 x 2,048 tokens/step, 1 GPU" in md and "## qwen3-4b, 32 x 2,048 tokens/step, 1 GPU" in md
    assert "SlideDP (`slidedp`): 10,000 tokens/s." in md
    assert "0.80x the throughput of `resident_same_kernels` (host-residence overhead +20%)." in md
    assert "1.30x the throughput of `gpu_resident_chunked` (no same-kernel resident row ran)." in md
    assert "SlideDP / each: `gpu_resident_chunked` 1.00x, `resident_same_kernels` 0.80x, `fsdp2_offload` 2.00x." in md
    assert f"Merged from: `{None}`" not in md and "Merged from: `" in md
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    # the index of a results folder lists each report with its workloads
    index = (tmp_path / "index.md")
    assert report.main(["--index", str(tmp_path)]) == 0
    text = index.read_text()
    assert "- [c](c.md) (2026-" in text and "qwen3-4b, 32 x 2,048 tokens/step, 1 GPU" in text
    assert "[a](a.md)" not in text  # a.json has no report (it was written by hand here)


def test_a_systems_variants_in_one_workload_are_named_by_the_settings_they_differ_in():
    """plan_choice.sh's forced runs are SlideDP rows of one workload: the report names each by its own setting."""
    from benchmarks.table import row_labels

    base = "8x2048, 1 worker(s), clip 1, memory.device_budget_gib=24"
    group = [{"system": "slidedp", "config": f"{base}, train.micro_batch=0"},
             {"system": "slidedp", "config": "8x2048 (micro 1), 1 worker(s), clip 1, memory.device_budget_gib=24, "
                                             "train.micro_batch=1"},
             {"system": "gpu_resident", "config": "8x2048, fp32 on CUDA, clip 1"},
             {"system": "fsdp2_offload", "config": "8x2048, clip 1"}]
    assert row_labels(group) == ["slidedp (train.micro_batch=0)", "slidedp (train.micro_batch=1)", "gpu_resident",
                                 "fsdp2_offload"]
    # rows of one system that differ only in an effect, not a setting, are named by it
    assert row_labels([{"system": "x", "config": "a, fast"}, {"system": "x", "config": "a, slow"}]) == [
        "x (fast)", "x (slow)"]


def test_out_of_memory_inside_a_peer_is_a_row(tmp_path, capsys):
    args = common.parser("t").parse_args(["--device", "cpu", "--shape", "tiny", "--json", str(tmp_path / "r.json")])
    common.check_args(args)

    def body(row, host):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    assert common.run_peer("gpu_resident", "cfg", args, body, needs_cuda=False) == 1
    row = json.loads((tmp_path / "r.json").read_text())
    assert row["status"] == "out of memory"
    assert row["error"] == "CUDA out of memory. Tried to allocate 20.00 GiB"
    assert row["system"] == "gpu_resident" and row["tokens_per_step"] == 8 * 2048


FAKE_LAUNCHER = '''
import json, os, sys
from slidedp.config import load_job  # the real schema: the harness's job file must pass it

job = load_job(sys.argv[-1])
if os.environ.get("FAKE_LAUNCHER_OOM"):
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB")
    sys.exit(3)
if os.environ.get("FAKE_LAUNCHER_REFUSES"):  # the launcher's refusal, then the daemons' goodbyes
    print("14:41:34 ERROR [launcher] job failed: the job needs 130.4 GiB of host memory but the host has 123.5 GiB")
    print("14:41:34 INFO [hoststate] stopped")
    sys.exit(1)
job.run_dir.mkdir(parents=True, exist_ok=True)
with open(f"/dev/shm/slidedp.{job.store_name}.grads", "wb") as f:  # a segment the "launcher" forgets
    f.write(bytes(4096))
step_s = [5.0, 2.0, 1.0, 3.0]
with open(job.run_dir / "metrics.jsonl", "w") as f:
    f.write(json.dumps({"event": "start", "store": job.store_name}) + "\\n")
    for step in reversed(range(job.train.steps)):  # order must not matter
        tokens = job.train.global_batch * job.train.seq_len
        f.write(json.dumps({"step": step, "step_s": step_s[step], "tokens": tokens,
                            "tokens_per_s": tokens / step_s[step], "device_peak_bytes": (step + 1) << 30,
                            "host_rss_bytes": 2 << 30, "shm_bytes": 3 << 30, "predicted_step_s": 1.5,
                            "loss": 6.0}) + "\\n")
print("trained", job.store_name, job.plan.compute_dtype, job.runtime.device, job.memory.device_budget_gib,
      job.train.max_grad_norm, job.checkpoint.final, job.store.persist, job.store.shadow_bf16, flush=True)
if os.environ.get("FAKE_LAUNCHER_LINGER"):  # every step committed, then a slow shutdown
    import time
    time.sleep(120)
'''


def _slidedp_argv(tmp_path: Path, *extra: str) -> list[str]:
    return ["--device", "cpu", "--shape", "tiny", "--batch", "2", "--seq", "16", "--steps", "4", "--warmup", "1",
            "--budget-gib", "12", "--launcher", "fake_launcher", "--workdir", str(tmp_path / "work"),
            "--json", str(tmp_path / "row.json"), *extra]


def test_slidedp_job_file_and_metrics_reduction(tmp_path, monkeypatch):
    mods = tmp_path / "mods"
    mods.mkdir()
    _write_module(mods, "fake_launcher", FAKE_LAUNCHER)
    monkeypatch.setenv("PYTHONPATH", str(mods))
    assert slidedp_run.run(_slidedp_argv(tmp_path, "--set", "store.shadow_bf16=true")) == 0
    row = json.loads((tmp_path / "row.json").read_text())
    assert row["status"] == "ok", row.get("error")
    assert row["step_s"] == 2.0  # median of steps 1..3 (3 s, 1 s, 2 s) after one warm-up step
    assert row["tokens_per_step"] == 32 and row["tokens_per_s"] == 16.0
    assert row["step_times_s"] == [5.0, 2.0, 1.0, 3.0]
    assert row["gpu_peak_gib"] == 4.0 and row["metrics_host_rss_gib"] == 2.0 and row["metrics_shm_gib"] == 3.0
    assert row["host_rss_gib"] > 0  # sampled by the harness over the launcher's process tree
    assert row["shm_gib"] == 3.0  # the store's own count: more than the harness saw appear in /dev/shm
    assert row["predicted_step_s"] == 1.5
    store = Path(row["job_file"]).stem
    assert row["leftover_segments_removed"] == [f"slidedp.{store}.grads"]
    assert not Path(f"/dev/shm/slidedp.{store}.grads").exists()
    assert "metrics_missing_keys" not in row
    assert f"trained {Path(row['job_file']).stem} fp32 cpu 12.0 1.0 False False True" in row["output_tail"]
    tokens = __import__("numpy").load(tmp_path / "work" / "tokens.npy")
    assert tokens.tolist() == common.batch_stream(named_shape("tiny"), 2, 16, 0).tolist()  # one batch, --seed 0


def test_a_relative_workdir_is_found_by_the_launcher_running_inside_it(tmp_path, monkeypatch):
    """The launcher runs with the work dir as its cwd: a relative --workdir (as a session script's
    `OUT` of `r`) must not hand it a job-file path that only resolves from the harness's cwd."""
    mods = tmp_path / "mods"
    mods.mkdir()
    _write_module(mods, "fake_launcher", FAKE_LAUNCHER)
    monkeypatch.setenv("PYTHONPATH", str(mods))
    monkeypatch.chdir(tmp_path)
    argv = _slidedp_argv(tmp_path)
    argv[argv.index("--workdir") + 1] = "out/work"
    assert slidedp_run.run(argv) == 0
    row = json.loads((tmp_path / "row.json").read_text())
    assert row["status"] == "ok", row.get("error")
    assert Path(row["job_file"]).parent == tmp_path / "out" / "work"
    assert row["step_s"] == 2.0


def test_the_write_back_of_device_held_units_is_left_out_of_the_median():
    """The last step of a job with device-held layers also writes them back to the store (as the peers
    time no saving of their state): the median is of the other steps, and the write-back is kept."""
    recs = [{"step": i, "step_s": s, "tokens": 100, "write_back_s": w}
            for i, (s, w) in enumerate([(9.0, 0.0), (1.0, 0.0), (1.2, 0.0), (1.1, 0.0), (2.0, 0.7)])]
    row: dict = {"tokens_per_step": 100}
    slidedp_run.reduce_metrics(recs, 1, row)
    assert row["step_s"] == 1.1 and row["write_back_s"] == [0.7]  # not 1.15 (median of 1.0, 1.2, 1.1, 2.0)
    assert row["step_times_s"] == [9.0, 1.0, 1.2, 1.1, 2.0]
    only = {"tokens_per_step": 100}
    slidedp_run.reduce_metrics(recs[:1] + recs[4:], 1, only)  # nothing else after warm-up: kept
    assert only["step_s"] == 2.0


def test_every_system_trains_on_the_same_batch_at_every_step(tmp_path):
    """SlideDP's data file, cut by slidedp.data, gives every step the rows the peers train on, and each
    rank of N the rows the FSDP2 peer's rank takes."""
    cfg, batch, seq = named_shape("tiny"), 4, 16
    slidedp_run.write_tokens(tmp_path / "t.npy", cfg, batch, seq, seed=5)
    stream = TokenStream(read_npy(tmp_path / "t.npy"), cfg.vocab_size)
    batches = Batches(stream, seq, batch)
    ids, targets = common.random_batch(cfg, batch, seq, "cpu", seed=5)
    assert ids.shape == (batch, seq) and torch.equal(ids[:, 1:], targets[:, :-1])
    for step in (0, 1, 7):
        rows = torch.from_numpy(batches.batch(step))
        assert torch.equal(rows[:, :-1], ids) and torch.equal(rows[:, 1:], targets)
        for rank in range(2):
            mine = torch.from_numpy(rank_slice(batches.batch(step), rank, 2))
            r_ids, r_targets = common.random_batch(cfg, batch, seq, "cpu", seed=5, rank=rank, world=2)
            assert torch.equal(mine[:, :-1], r_ids) and torch.equal(mine[:, 1:], r_targets)
    assert not torch.equal(common.random_batch(cfg, batch, seq, "cpu", seed=6)[0], ids)


def _failed_launcher_row(tmp_path: Path, monkeypatch, how: str) -> dict:
    """The row of a SlideDP run whose (fake) launcher fails as FAKE_LAUNCHER_<how> says."""
    mods = tmp_path / "mods"
    mods.mkdir()
    _write_module(mods, "fake_launcher", FAKE_LAUNCHER)
    monkeypatch.setenv("PYTHONPATH", str(mods))
    monkeypatch.setenv(f"FAKE_LAUNCHER_{how}", "1")
    assert slidedp_run.run(_slidedp_argv(tmp_path)) == 1
    return json.loads((tmp_path / "row.json").read_text())


def test_slidedp_launcher_out_of_memory_is_a_row(tmp_path, monkeypatch):
    row = _failed_launcher_row(tmp_path, monkeypatch, "OOM")
    assert row["status"] == "out of memory" and row["launcher_exit_code"] == 3
    assert row["error"] == ("out of memory: the launcher exited with code 3: "
                            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB")


def test_a_refused_slidedp_run_is_a_row_that_says_why(tmp_path, monkeypatch):
    # the launcher's ERROR line, not the daemons' goodbyes printed after it
    row = _failed_launcher_row(tmp_path, monkeypatch, "REFUSES")
    assert row["error"] == ("the launcher exited with code 1: 14:41:34 ERROR [launcher] job failed: the job needs "
                            "130.4 GiB of host memory but the host has 123.5 GiB")


@pytest.mark.slow  # 21 s of a real run stopped by its timeout
def test_a_slidedp_run_stopped_by_the_timeout_keeps_the_steps_it_committed(tmp_path, monkeypatch, capsys):
    """The harness stops a launcher that outlives --timeout; the steps already committed (past the
    warm-up) still give the row its figures, and the status says both."""
    mods = tmp_path / "mods"
    mods.mkdir()
    _write_module(mods, "fake_launcher", FAKE_LAUNCHER)
    monkeypatch.setenv("PYTHONPATH", str(mods))
    monkeypatch.setenv("FAKE_LAUNCHER_LINGER", "1")
    monkeypatch.setattr(bench, "SYSTEMS", {"slidedp": bench.System(
        "benchmarks.peers.slidedp_run", ("--launcher", "fake_launcher"))})
    out = tmp_path / "stopped.json"
    assert bench.main(["--device", "cpu", "--shape", "tiny", "--batch", "2", "--seq", "16", "--steps", "4",
                       "--warmup", "1", "--quiet", "--systems", "slidedp", "--timeout", "20", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["status"] == "timeout after 20 s (its figures: the 4 steps it committed)"
    assert row["steps_before_stop"] == 4 and row["step_s"] == 2.0 and row["tokens_per_s"] == 16.0
    assert row["error"].startswith("stopped by SIGTERM; the launcher's last output: trained ")
    assert row["vs_resident"] is None and row["slidedp_ratio"] is None  # not an ok row: no ratio is taken from it


def test_a_rank_killed_under_torchrun_is_named():
    """torchrun exits 1 when a rank dies; its failure report says which signal ended which rank."""
    tail = ("Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n"
            "  exitcode  : -9 (pid: 2591)\n  traceback : Signal 9 (SIGKILL) received by PID 2591\n"
            "[1]:\n  exitcode  : -15 (pid: 2590)\n")
    assert bench._failure_status(1, False, 200, tail) == "failed: a rank was killed by SIGKILL (host out of memory?)"
    assert bench._failure_status(1, False, 200, "  exitcode  : -11 (pid: 7)") == "failed: a rank was killed by SIGSEGV"
    assert bench._failure_status(1, False, 200, "Traceback ...") == "failed: exit code 1, no result row"
    assert bench._failure_status(-9, False, 200) == "failed: killed by SIGKILL (host out of memory?)"


@pytest.mark.parametrize("shape", ["tiny", "small"])  # tied (Qwen3) and untied (Llama) heads
@pytest.mark.parametrize("loss", ["full", "chunked"])
def test_decoder_lm_is_slidedp_model(shape, loss):
    """DecoderLM's fp32 loss and gradients equal plain F.cross_entropy over layers.forward_logits."""
    cfg = named_shape(shape)
    model = common.DecoderLM(cfg, loss=loss, chunk_tokens=24)  # 60 tokens: three chunks
    model.init_weights(seed=3)
    params = dict(model.hf_named_parameters())
    ref = init_params(cfg, 3)
    assert list(params) == list(ref)  # same names, same order as the store
    for name, t in ref.items():
        assert torch.equal(params[name], t), name  # same init, bit for bit

    ids, targets = common.random_batch(cfg, 3, 20, "cpu", seed=1)
    assert torch.equal(ids[:, 1:], targets[:, :-1])
    loss_sum = model(ids, targets)
    loss_sum.backward()

    leaves = {k: v.clone().requires_grad_() for k, v in ref.items()}
    logits = layers.forward_logits(cfg, leaves, ids)
    expected = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1), reduction="sum")
    expected.backward()
    assert loss_sum.dtype == torch.float32
    torch.testing.assert_close(loss_sum, expected, rtol=1e-6, atol=0)
    for name, leaf in leaves.items():  # float32 rounding, relative to the tensor's largest gradient
        err = (params[name].grad - leaf.grad).abs().max().item()
        assert err <= 1e-5 * leaf.grad.abs().max().item(), (name, err)


# ---- the peers added for the default-configuration headline ----------------------------------


def _reference_steps(cfg, ids, targets, micro, steps, max_norm, loss="chunked", chunk_tokens=24, seed=3):
    """DecoderLM + torch AdamW + clip_grad_norm_: the plain PyTorch trainer every peer must equal."""
    ref = common.DecoderLM(cfg, loss=loss, chunk_tokens=chunk_tokens)
    ref.init_weights(seed)
    opt = torch.optim.AdamW(ref.parameters(), lr=common.LR, betas=common.BETAS, eps=common.EPS, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        loss_value = sum(ref(a, b) for a, b in common.micro_batches(ids, targets, micro)) / targets.numel()
        loss_value.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss_value.item())
    return ref, losses


@pytest.mark.parametrize("shape", ["tiny", "small"])  # tied (Qwen3, qk-norm) and untied (Llama) heads
def test_the_same_kernel_limit_trains_slidedps_math(shape):
    """resident_same_kernels (SlideDP's fused layers, chunked loss without recompute, layer-major
    micro-batches) on CPU in fp32: the reference's gradients to rounding, then the same two clipped
    AdamW steps."""
    from benchmarks.peers.resident_same_kernels import ResidentSameKernels

    cfg = named_shape(shape)
    ids, targets = common.random_batch(cfg, 4, 16, "cpu", seed=1)
    model = ResidentSameKernels(cfg, "cpu", torch.float32, max_grad_norm=1.0, chunk_tokens=24)
    model.init_weights(3, on="")
    ref = common.DecoderLM(cfg, loss="chunked", chunk_tokens=24)
    ref.init_weights(3)
    assert [n for n, _ in model.named_tensors()] == [n for n, _ in ref.hf_named_parameters()]
    loss = model.backward(ids, targets, micro_batch=2)
    expected = sum(ref(a, b) for a, b in common.micro_batches(ids, targets, 2)) / targets.numel()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=0)
    grads, params = dict(model.named_tensors("grad")), dict(ref.hf_named_parameters())
    for name, p in params.items():
        err = (grads[name] - p.grad).abs().max().item()
        assert err <= 1e-5 * p.grad.abs().max().item(), (name, err)
    torch._foreach_zero_([g for g in grads.values()])

    model2 = ResidentSameKernels(cfg, "cpu", torch.float32, max_grad_norm=1.0, chunk_tokens=24)
    model2.init_weights(3, on="")
    mine = [model2.step(ids, targets, micro_batch=2).item() for _ in range(2)]
    ref2, theirs = _reference_steps(cfg, ids, targets, 2, 2, 1.0)
    assert mine == pytest.approx(theirs, rel=1e-6)
    weights = dict(model2.named_tensors())
    for name, p in ref2.hf_named_parameters():
        # fp32 rounding in the gradients moves Adam's update of near-zero gradients: a tenth of lr at most
        assert (weights[name] - p).abs().max().item() <= 0.1 * common.LR, name


def test_the_transformers_peer_trains_the_harness_model(tmp_path):
    """hf (the Liger peer without Liger) builds AutoModelForCausalLM from the workload's config, with the
    harness's weights, targets and clipped fused AdamW: its losses are the plain trainer's."""
    from benchmarks.peers import hf_liger

    out = tmp_path / "hf.json"
    argv = ["--no-liger", "--device", "cpu", "--dtype", "fp32", "--shape", "tiny", "--batch", "4", "--seq", "16",
            "--micro-batch", "2", "--steps", "3", "--warmup", "1", "--json", str(out)]
    assert hf_liger.main(argv) == 0
    row = json.loads(out.read_text())
    assert row["status"] == "ok", row.get("error")
    assert row["system"] == "hf" and row["parameters"] == named_shape("tiny").num_parameters()
    assert "gradient checkpointing, fused AdamW, clip 1" in row["config"]
    cfg = named_shape("tiny")
    ids, targets = common.random_batch(cfg, 4, 16, "cpu", seed=0)
    _, theirs = _reference_steps(cfg, ids, targets, 2, 3, 1.0, loss="full", seed=0)
    assert row["losses"] == pytest.approx(theirs, rel=1e-5)
    # with Liger (Triton kernels) it needs CUDA: on this machine a row says so
    assert hf_liger.main(["--device", "cpu", "--shape", "tiny", "--json", str(tmp_path / "liger.json")]) == 0
    assert json.loads((tmp_path / "liger.json").read_text())["status"] == "skipped: hf_liger needs CUDA"


def test_peers_that_cannot_run_here_are_rows_that_say_why(tmp_path, monkeypatch):
    from benchmarks.peers import megatrain_run, torchao_offload

    assert torchao_offload.main(["--device", "cpu", "--shape", "tiny", "--json", str(tmp_path / "ao.json")]) == 0
    ao = json.loads((tmp_path / "ao.json").read_text())
    assert ao["status"] == "skipped: torchao_offload needs CUDA"
    assert "no clipping (CPUOffloadOptimizer cannot clip)" in ao["config"] and ao["max_grad_norm"] == 0.0

    # MegaTrain: no clone where it looks, a clone that does not import, the commit of a carried copy
    with pytest.raises(common.Skip, match=r"MegaTrain not found at .*nowhere \(clone github.com/DLYuanGod/MegaTrain"):
        megatrain_run.import_megatrain(tmp_path / "nowhere")
    clone = tmp_path / "MegaTrain"
    (clone / "infinity").mkdir(parents=True)
    (clone / "infinity" / "__init__.py").write_text("import flash_attn_that_is_missing\n")
    (clone / "COMMIT").write_text("919520f\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(common.Skip, match=r"import infinity \(MegaTrain at .*\) failed: ModuleNotFoundError"):
        megatrain_run.import_megatrain(clone)
    assert megatrain_run.clone_commit(clone) == "919520f"
    monkeypatch.setenv(megatrain_run.ENV, str(clone))
    assert megatrain_run.megatrain_path("") == clone and megatrain_run.megatrain_path("/x") == Path("/x")
    assert megatrain_run.NoPaddingMask().to("cuda:0") is None  # its layers then run causal SDPA
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # main sets it: undone after the test
    assert megatrain_run.main(["--device", "cpu", "--shape", "tiny", "--json", str(tmp_path / "mt.json")]) == 0
    mt = json.loads((tmp_path / "mt.json").read_text())
    assert mt["status"] == "skipped: megatrain needs CUDA"
    assert "bf16 weights and gradients on the host (not fp32 master)" in mt["config"]


def test_deepspeed_and_zenflow_configs_clip_and_zenflow_runs_one_micro_batch_per_step():
    from benchmarks.peers import deepspeed_offload as ds

    args = common.parser("t").parse_args(["--batch", "8", "--micro-batch", "2", "--max-grad-norm", "0.5"])
    common.check_args(args)
    args.zenflow = False
    plain = ds.ds_config(args)
    assert plain["gradient_clipping"] == 0.5 and plain["gradient_accumulation_steps"] == 4
    assert "zenflow" not in plain["zero_optimization"] and "optimizer" not in plain
    args.zenflow, args.micro_batch = True, 8
    zen = ds.ds_config(args)
    assert zen["zero_optimization"]["zenflow"] == {"topk_ratio": 0.05, "select_strategy": "auto",
                                                   "select_interval": "auto", "update_interval": 4,
                                                   "full_warm_up_rounds": 0, "overlap_step": True}
    assert zen["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert zen["optimizer"] == {"type": "AdamW", "params": {"lr": common.LR, "betas": list(common.BETAS),
                                                           "eps": common.EPS, "weight_decay": 0.0}}
    assert zen["gradient_clipping"] == 0.5


def test_each_systems_command_line(tmp_path):
    """What each system's child process is started with: the common flags first, the system's own
    after them (so slidedp_noclip's --max-grad-norm 0 wins), SlideDP's plan-chosen micro-batch."""
    args = bench.parse_args(["--shape", "qwen3-4b", "--batch", "8", "--steps", "6", "--warmup", "2",
                             "--budget-gib", "24", "--slidedp-set", "memory.prefetch_depth=2"])
    argv = {name: bench.system_argv(name, system, args, tmp_path, tmp_path / f"{name}.json")
            for name, system in bench.SYSTEMS.items() if system.published is None}
    common_flags = ["--shape", "qwen3-4b", "--batch", "8", "--seq", "2048", "--steps", "6", "--warmup", "2",
                    "--device", "cuda", "--seed", "0"]
    for name, cmd in argv.items():
        assert cmd[:2] == [sys.executable, "-m"] and cmd[3:3 + len(common_flags)] == common_flags, name
        assert cmd[cmd.index("--max-grad-norm") + 1] == "1" and cmd[cmd.index("--budget-gib") + 1] == "24.0", name
    assert argv["slidedp"][2:3] == ["benchmarks.peers.slidedp_run"]
    assert argv["slidedp"][-5:] == ["--workdir", str(tmp_path / "slidedp-work"), "--plan-micro-batch",
                                    "--set", "memory.prefetch_depth=2"]
    noclip = argv["slidedp_noclip"]
    assert noclip[len(noclip) - 1 - noclip[::-1].index("--max-grad-norm") + 1] == "0"  # the last one wins
    assert "--zenflow" in argv["zenflow"] and argv["zenflow"][2] == "benchmarks.peers.deepspeed_offload"
    assert argv["hf_liger"][2] == "benchmarks.peers.hf_liger" and "--liger" in argv["hf_liger"]
    assert argv["megatrain"][2] == "benchmarks.peers.megatrain_run"
    assert argv["resident_same_kernels"][2] == "benchmarks.peers.resident_same_kernels"
    assert argv["torchao_offload"][2] == "benchmarks.peers.torchao_offload"
    peers = bench.parse_args(["--slidedp-micro-batch", "4", "--systems", "slidedp"])
    assert bench.system_argv("slidedp", bench.SYSTEMS["slidedp"], peers, tmp_path, tmp_path / "s.json")[-2:] == [
        "--set", "plan.micro_batch=4"]
    two = bench.parse_args(["--gpus", "2", "--systems", "fsdp2"])
    assert bench.system_argv("hf_liger", bench.SYSTEMS["hf_liger"], two, tmp_path, tmp_path / "h.json") is None
    assert bench.system_argv("fsdp2", bench.SYSTEMS["fsdp2"], two, tmp_path, tmp_path / "f.json")[2:4] == [
        "torch.distributed.run", "--standalone"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--slidedp-micro-batch", "some"])
    with pytest.raises(SystemExit):  # a packed system needs the chat data
        bench.parse_args(["--systems", "slidedp,slidedp_packed"])
    chat = bench.parse_args(["--systems", "slidedp_packed,hf_liger_packed", "--chat", str(tmp_path / "chat")])
    for name in ("slidedp_packed", "hf_liger_packed"):
        cmd = bench.system_argv(name, bench.SYSTEMS[name], chat, tmp_path, tmp_path / "p.json")
        assert cmd[cmd.index("--chat") + 1] == str(tmp_path / "chat"), name


def test_slidedp_job_lets_the_plan_choose_the_micro_batch_only_where_slidedp_accepts_it(tmp_path, monkeypatch):
    p = common.parser("t")
    p.add_argument("--compute-dtype", default="")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--wait-timeout", type=float, default=600.0)
    p.add_argument("--plan-micro-batch", action="store_true")
    args = p.parse_args(["--device", "cpu", "--shape", "tiny", "--batch", "4", "--plan-micro-batch"])
    common.check_args(args)
    job = slidedp_run.job_dict(args, tmp_path / "t.npy", tmp_path / "run", "n")
    assert slidedp_run.plan_picks_micro_batch() is True  # plan.micro_batch = "auto": the plan's choice
    assert job["plan"]["micro_batch"] == "auto" and job["train"]["max_grad_norm"] == 1.0
    monkeypatch.setattr(slidedp_run, "plan_picks_micro_batch", lambda: False)  # an older SlideDP: the peers' batch
    assert slidedp_run.job_dict(args, tmp_path / "t.npy", tmp_path / "run", "n")["plan"]["micro_batch"] == 4


FAKE_PYTHON = '''#!/usr/bin/env bash
echo "$*" >> "$FAKE_CALLS"
out="" prev=""
for a in "$@"; do [ "$prev" = "--out" ] && out=$a; prev=$a; done
[ -n "$out" ] && echo '{"rows": []}' > "$out"
[ "$1" = "-c" ] && echo 0
exit 0
'''


def run_session(tmp_path: Path, script: str, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, str]:
    """benchmarks/sessions/SCRIPT OUT ARGS... with a fake python3 that records each command (and writes an
    empty table): its result and every command it ran, one a line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    calls = tmp_path / "calls"
    full = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_CALLS": str(calls), **env}
    done = subprocess.run(["bash", str(ROOT / "benchmarks/sessions" / script), str(tmp_path / "out"), *args],
                          cwd=ROOT, env=full, capture_output=True, text=True, timeout=60)
    return done, calls.read_text() if calls.exists() else ""


def _headline(tmp_path: Path, part: str, **env: str) -> tuple[subprocess.CompletedProcess, str, list[str]]:
    """sessions/headline.sh PART (run_session): its result, every command, and the harness runs among them."""
    done, text = run_session(tmp_path, "headline.sh", part, **env)
    return done, text, [line for line in text.splitlines() if line.startswith("-m benchmarks.run --shape")]


@pytest.mark.parametrize("budget", ["10000", "0"])
def test_the_headline_session_runs_each_system_in_its_own_command_within_its_budget(tmp_path, budget):
    """sessions/headline.sh PART: one harness command per system with the headline's settings, merged
    into OUT/PART.json; with no time left it starts nothing (and says so) rather than overrun the call."""
    done, text, runs = _headline(tmp_path, "offload-b8", BUDGET_S=budget)
    assert done.returncode == 0, done.stderr
    if budget == "0":
        assert runs == [] and "not starting 4b-b8 fsdp2_offload (it needs 60 s)" in done.stderr
        assert "--merge" not in text
        return
    systems = [r.split("--systems ")[1].split()[0] for r in runs]
    assert systems == ["fsdp2_offload", "deepspeed", "zenflow", "megatrain", "slideformer"]
    for r in runs:
        assert "--shape qwen3-4b --batch 8 --seq 2048 --steps 6 --warmup 2" in r
        assert "--max-grad-norm 1.0 --slidedp-micro-batch plan --slidedp-set memory.device_budget_gib=24" in r
        assert "--timeout 130" in r
    merge = [line for line in text.splitlines() if line.startswith("-m benchmarks.run --merge")]
    assert len(merge) == 1 and merge[0].endswith(f"--out {tmp_path / 'out' / 'offload-b8.json'}")
    assert (tmp_path / "out" / "offload-b8-logs.tgz").is_file()


def test_the_headline_session_runs_only_the_systems_named(tmp_path):
    """ONLY=SYSTEM,...: the rows an earlier call of a PART could not finish, with the time that PART gives
    the systems still to come reckoned for those alone (DeepSpeed timed out at 60 s beside three others)."""
    done, _, runs = _headline(tmp_path, "offload-b32", BUDGET_S="300", ONLY="deepspeed,zenflow")
    assert done.returncode == 0, done.stderr
    assert [r.split("--systems ")[1].split()[0] for r in runs] == ["deepspeed", "zenflow"]
    # the first gets its PART's limit (160 s), not 300 - 3 x 60 as it would beside the two it does not run
    assert "--timeout 160" in runs[0] and "--shape qwen3-4b --batch 32" in runs[0]


def test_drop_store_removes_a_store_and_says_when_one_stays(tmp_path):
    """sessions/drop_store.sh: through the installed package (the device's install could lack the
    console script, and its failed destroy went unseen); a store still there afterwards is said, rc 1."""
    from slidedp.store.client import call
    from slidedp.store.shm import SHM_DIR, unlink_store

    name = f"drop-{uuid.uuid4().hex[:8]}"
    manifest = Path(SHM_DIR) / f"slidedp.{name}.manifest"
    script = str(ROOT / "benchmarks/sessions/drop_store.sh")
    real, broken = tmp_path / "real", tmp_path / "broken"
    real.mkdir(), broken.mkdir()
    (real / "python3").write_text(f'#!/usr/bin/env bash\nexec {sys.executable} "$@"\n')  # this venv's python
    (real / "python3").chmod(0o755)
    (broken / "python3").write_text("#!/usr/bin/env bash\necho 'No module named slidedp' >&2\nexit 1\n")
    (broken / "python3").chmod(0o755)
    path = lambda d: {**os.environ, "PATH": f"{d}:/usr/bin:/bin"}  # noqa: E731
    try:
        call(name, "create", source="random", shape="tiny", vocab_size=512, init_seed=0)
        assert manifest.exists()
        failed = subprocess.run(["bash", script, name], env=path(broken), capture_output=True, text=True, timeout=60)
        assert failed.returncode == 1 and manifest.exists()
        assert failed.stderr == f"drop_store: store {name} is still there: No module named slidedp\n"
        done = subprocess.run(["bash", script, name, "no-such-store"], env=path(real), cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stderr == "", done.stderr
        assert not manifest.exists() and not list(Path(SHM_DIR).glob(f"slidedp.{name}.*"))
    finally:
        unlink_store(name)


def test_the_headline_session_starts_deepspeed_only_with_time_to_compile_its_adam(tmp_path):
    """DeepSpeed's first use compiles DeepSpeedCPUAdam: given 60 s it timed out compiling. A PART gives it
    and ZenFlow 120 s or starts neither, and the systems after them still run."""
    # 170 s for three systems, a minute kept for each one still to come: DeepSpeed would get 50 s, ZenFlow 110
    done, _, runs = _headline(tmp_path, "offload-b32", BUDGET_S="170", ONLY="deepspeed,zenflow,megatrain")
    assert done.returncode == 0, done.stderr
    assert [r.split("--systems ")[1].split()[0] for r in runs] == ["megatrain"] and "--timeout 160" in runs[0]
    assert "not starting 4b-b32 deepspeed (it needs 120 s)" in done.stderr
    assert "not starting 4b-b32 zenflow (it needs 120 s)" in done.stderr
