"""Profiling tools of the benchmarks: a peer's step under torch.profiler (BENCH_PROFILE) and the
trace summary's arithmetic (busy time as the union of kernel intervals, kernel kinds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # benchmarks/ is not an installed package

from benchmarks import trace_summary  # noqa: E402


def kernel(name: str, ts: float, dur: float, stream: int = 7) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": stream}


def test_summary_counts_overlapping_kernels_once_and_sorts_them_by_kind():
    trace = {"traceEvents": [
        kernel("nvjet_sm90_tst_256x128_h_bz_TNT", 0, 1000),
        kernel("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", 500, 1000),  # overlaps
        kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 3000, 500),
        kernel("void at::native::reduce_kernel<512, 1, MeanOps<float>>", 4000, 250, stream=20),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 0, "dur": 2000, "tid": 21},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 99999, "tid": 1},  # not GPU work
    ]}
    s = trace_summary.summarize(trace)
    main = s["streams"]["7"]
    assert main["span_ms"] == 3.5 and main["busy_ms"] == 2.0 and main["idle_ms"] == 1.5 and main["events"] == 3
    assert s["streams"]["20"]["busy_ms"] == 0.25
    assert s["kinds_ms"] == {"memcpy/memset (copy engines)": 2.0, "gemm": 1.0, "elementwise": 1.0,
                             "attention": 0.5, "reduction": 0.25}
    assert s["top_kernels"][0]["name"].startswith("Memcpy") and s["top_kernels"][0]["ms"] == 2.0
    # compute (stream 7) sat idle 1.5 ms, from 1.5 ms to 3.0 ms, before the attention kernel
    gaps = s["compute_gaps"]
    assert gaps["stream"] == "7" and gaps["longest"] == [{"ms": 1.5, "next_kernel": "cudnn_generated_fort_native_sdpa_sm90_flash_fprop"}]
    assert gaps["buckets"] == {"0-0.05 ms": {"count": 0, "ms": 0.0}, "0.05-1 ms": {"count": 0, "ms": 0.0},
                               "1-inf ms": {"count": 1, "ms": 1.5}}


def test_the_compute_stream_is_the_busiest_with_kernels_other_than_nccls():
    """Copy engines and NCCL's stream can be busier than compute (NCCL kernels wait for the other rank
    inside the kernel): the idle stretches are the compute stream's."""
    trace = {"traceEvents": [
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 0, "dur": 9000, "tid": 21},
        kernel("ncclDevKernel_AllGather_RING_LL", 0, 8000, stream=22),
        kernel("nvjet_sm90_tst_256x128_h_bz_TNT", 0, 1000),
        kernel("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", 3000, 100),
        kernel("void at::native::reduce_kernel<512, 1, MeanOps<float>>", 0, 200, stream=20),
    ]}
    gaps = trace_summary.summarize(trace)["compute_gaps"]
    assert gaps["stream"] == "7"
    assert gaps["longest"] == [{"ms": 2.0, "next_kernel": "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0"}]
    assert trace_summary.summarize({"traceEvents": []})["compute_gaps"] == {}


def test_a_peer_writes_the_profiled_steps_trace(tmp_path):
    trace = tmp_path / "gr.json"
    env = {**os.environ, "BENCH_PROFILE": f"1:{trace}", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.peers.gpu_resident", "--shape", "tiny", "--batch", "2",
                           "--seq", "16", "--steps", "2", "--warmup", "1", "--device", "cpu",
                           "--json", str(tmp_path / "row.json")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert "Optimizer.step#AdamW.step" in names or any(str(n).startswith("aten::") for n in names)
    assert json.loads((tmp_path / "row.json").read_text())["status"] == "ok"
