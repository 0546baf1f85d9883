"""The benchmark harness on CPU: the smoke run, failure rows, SlideDP's job and metrics, and the model.

The harness itself runs on a GPU machine; here we check what must be right before it gets
there: one table and valid JSON, every failure a row, SlideDP's job file accepted by the
real job schema, and DecoderLM (what every peer trains) equal to slidedp.model.layers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # benchmarks/ is not an installed package

from benchmarks import run as bench  # noqa: E402
from benchmarks.peers import common, slidedp_run  # noqa: E402
from slidedp.data import Batches, TokenStream, rank_slice, read_npy  # noqa: E402
from slidedp.model import layers  # noqa: E402
from slidedp.model.config import named_shape  # noqa: E402
from slidedp.model.init import init_params  # noqa: E402


def _header_cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_cpu_smoke_run_prints_one_table_and_writes_json(tmp_path):
    out = tmp_path / "smoke.json"
    cmd = [sys.executable, "-m", "benchmarks.run", "--device", "cpu", "--shape", "tiny", "--batch", "2", "--seq", "32",
           "--steps", "2", "--warmup", "1", "--systems", "gpu_resident,deepspeed", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]

    # stdout is the table and nothing else: header, separator, one line per system
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 4, done.stdout
    assert _header_cells(lines[0]) == list(bench.COLUMNS)
    gpu_line, ds_line = _header_cells(lines[2]), _header_cells(lines[3])
    assert gpu_line[0] == "gpu_resident" and gpu_line[4] == "1.00x" and gpu_line[-1] == "ok"
    assert float(gpu_line[2].replace(",", "")) > 0
    assert ds_line[0] == "deepspeed" and ds_line[-1] == "skipped: deepspeed needs CUDA"

    doc = json.loads(out.read_text())
    assert doc["complete"] is True
    assert doc["columns"] == list(bench.COLUMNS)
    assert doc["torch"] == torch.__version__ and doc["host"] and doc["date"]
    assert "benchmarks.run" in doc["command"] and "--systems gpu_resident,deepspeed" in doc["command"]
    assert [r["system"] for r in doc["rows"]] == ["gpu_resident", "deepspeed"]
    assert [t["system"] for t in doc["table"]] == ["gpu_resident", "deepspeed"]
    gpu = doc["rows"][0]
    assert gpu["status"] == "ok" and gpu["tokens_per_step"] == 64 and gpu["tokens_per_s"] > 0
    assert gpu["tokens_per_s"] == pytest.approx(64 / gpu["step_s"])
    assert gpu["step_s"] == gpu["step_times_s"][1]  # the median of the one step after warm-up
    assert gpu["vs_gpu_resident"] == 1.0 and gpu["host_rss_gib"] > 0
    assert gpu["parameters"] == named_shape("tiny").num_parameters()
    assert all(l > 0 for l in gpu["losses"])
    assert doc["rows"][1]["status"] == "skipped: deepspeed needs CUDA" and doc["rows"][1]["vs_gpu_resident"] is None
    assert (tmp_path / "smoke.logs" / "gpu_resident.log").is_file()


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
    assert rows["fsdp2"]["vs_gpu_resident"] == 1.0  # with several ranks the base is GPU-resident FSDP2
    assert "sharded over 2 rank(s)" in rows["fsdp2"]["config"]
    assert 'runtime.grad_route="host"' in rows["slidedp_replicated"]["command"]
    assert rows["gpu_resident"]["status"].startswith("skipped: gpu_resident runs on one GPU only")
    # every system trains the same weights (on CPU the peers draw SlideDP's init) on the same global
    # batch at every step: their losses agree step by step, and fall
    losses = {n: rows[n]["losses"] for n in ("fsdp2", "fsdp2_offload", "slidedp", "slidedp_replicated")}
    for name, seen in losses.items():  # the peers compute in bf16 (FSDP2's MixedPrecisionPolicy), SlideDP on CPU in fp32
        assert seen == pytest.approx(losses["fsdp2"], rel=5e-5), (name, losses)
    assert losses["slidedp"][-1] < losses["slidedp"][0]


def _write_module(folder: Path, name: str, code: str) -> None:
    (folder / f"{name}.py").write_text(code)


def test_failed_killed_and_hung_systems_become_rows(tmp_path, monkeypatch, capsys):
    mods = tmp_path / "mods"
    mods.mkdir()
    _write_module(mods, "peer_raises", "raise RuntimeError('CUDA error: an illegal memory access')\n")
    _write_module(mods, "peer_killed", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    _write_module(mods, "peer_hangs", "import time\nprint('working', flush=True)\ntime.sleep(60)\n")
    monkeypatch.setenv("PYTHONPATH", str(mods))
    systems = {"raises": bench.System("peer_raises"), "killed": bench.System("peer_killed"),
               "hangs": bench.System("peer_hangs")}
    monkeypatch.setattr(bench, "SYSTEMS", {**bench.SYSTEMS, **systems})
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


def test_merge_joins_runs_and_takes_ratios_against_the_first_gpu_resident_row(tmp_path, capsys):
    def doc(rows, **env):
        return json.dumps({"rows": rows, "host": "gpu-box", "gpu": "NVIDIA H200", "cpus": 16, **env})

    ok = {"status": "ok", "config": "c", "step_s": 2.0, "gpu_peak_gib": 80.0, "host_rss_gib": 3.0, "shm_gib": 0.0}
    (tmp_path / "a.json").write_text(doc([
        {**ok, "system": "gpu_resident", "status": "out of memory", "error": "CUDA out of memory. Tried"},
        {**ok, "system": "gpu_resident_chunked", "tokens_per_s": 10000.0},
    ]))
    (tmp_path / "b.json").write_text(doc([
        {**ok, "system": "slidedp", "tokens_per_s": 9500.0, "predicted_step_s": 1.9, "shm_gib": 48.25,
         "losses": [12.444, None, 11.206]},
        {**ok, "system": "fsdp2_offload", "tokens_per_s": 5000.0, "optimizer_s": 0.98},
    ], git_commit="b" * 40, date="2026-11-29T17:00:00+00:00"))
    assert bench.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                       "--out", str(tmp_path / "c.json")]) == 0
    merged = json.loads((tmp_path / "c.json").read_text())
    assert [r["vs_gpu_resident"] for r in merged["rows"]] == [None, 1.0, 0.95, 0.5]
    # where the runs ran (not where they were merged); where the sources differ, each one's value
    assert (merged["host"], merged["gpu"], merged["cpus"]) == ("gpu-box", "NVIDIA H200", 16)
    assert merged["git_commit"] == [None, "b" * 40]
    assert [(s["file"], s["git_commit"], s["date"]) for s in merged["settings"]["merged_from"]] == [
        (str(tmp_path / "a.json"), None, None), (str(tmp_path / "b.json"), "b" * 40, "2026-11-29T17:00:00+00:00")]
    table = capsys.readouterr().out.strip().splitlines()
    assert [_header_cells(line) for line in table[2:]] == [
        ["gpu_resident", "c", "", "2.00", "", "80.0", "3.0 + 0.0", "", "out of memory -- CUDA out of memory. Tried"],
        ["gpu_resident_chunked", "c", "10,000", "2.00", "1.00x", "80.0", "3.0 + 0.0", "", "ok"],
        ["slidedp", "c", "9,500", "2.00 (predicted 1.90)", "0.95x", "80.0", "3.0 + 48.2", "12.44 -> 11.21", "ok"],
        ["fsdp2_offload", "c", "5,000", "2.00 (optimizer 0.98)", "0.50x", "80.0", "3.0 + 0.0", "", "ok"],
    ]
    assert merged["table_markdown"] == "\n".join(table)


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
job.run_dir.mkdir(parents=True, exist_ok=True)
with open(f"/dev/shm/slidedp.{job.store_name}.grads", "wb") as f:  # a segment the "launcher" forgets
    f.write(bytes(4096))
step_s = [5.0, 2.0, 1.0, 3.0]
with open(job.run_dir / "metrics.jsonl", "w") as f:
    f.write(json.dumps({"event": "start", "store": job.store_name}) + "\\n")
    for step in reversed(range(job.train.steps)):  # order must not matter
        tokens = job.train.global_batch * job.train.seq_len
        f.write(json.dumps({"step": step, "step_s": step_s[step], "tokens": tokens,
                            "tokens_per_s": tokens / step_s[step], "gpu_peak_bytes": (step + 1) << 30,
                            "host_rss_bytes": 2 << 30, "shm_bytes": 3 << 30, "predicted_step_s": 1.5,
                            "loss": 6.0}) + "\\n")
print("trained", job.store_name, job.train.compute_dtype, job.runtime.device, job.memory.gpu_budget_gib,
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


def test_slidedp_launcher_out_of_memory_is_a_row(tmp_path, monkeypatch):
    mods = tmp_path / "mods"
    mods.mkdir()
    _write_module(mods, "fake_launcher", FAKE_LAUNCHER)
    monkeypatch.setenv("PYTHONPATH", str(mods))
    monkeypatch.setenv("FAKE_LAUNCHER_OOM", "1")
    assert slidedp_run.run(_slidedp_argv(tmp_path)) == 1
    row = json.loads((tmp_path / "row.json").read_text())
    assert row["status"] == "out of memory" and row["launcher_exit_code"] == 3
    assert row["error"] == ("out of memory: the launcher exited with code 3: "
                            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB")


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
    assert row["vs_gpu_resident"] is None  # not an ok row: no ratio is taken from it


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
