#!/usr/bin/env bash
# Where the GPU time of the 16K step goes, and what the kernel choices buy (one H200):
# the per-layer / loss micro-benchmark (benchmarks.layer_bench), then SlideDP with eager and
# with compiled pointwise kernels, and GPU-resident training, each with step 5 profiled
# (traces summarized by benchmarks.trace_summary). One persistent store serves both SlideDP runs.
#   bash benchmarks/sessions/kernels_16k.sh OUT_DIR
set -u
out=$1
store=slidedp-kernels steps=8 warm=3
timeout 240 python3 -m benchmarks.layer_bench --shape qwen3-4b --micro 2 8 --compile --json "$out/layer-bench.json" \
  > "$out/layer-bench.txt" 2>&1
tail -30 "$out/layer-bench.txt"
parts=()
for mode in off auto; do
  committed=$(bash "$(dirname "$0")/committed_step.sh" "$store")
  part="$out/slidedp-compile-$mode.json"
  SLIDEDP_PROFILE_STEP=$((committed + 5)) python3 -m benchmarks.run --shape qwen3-4b --batch 8 --seq 2048 \
    --steps $steps --warmup $warm --systems slidedp --slidedp-set memory.device_budget_gib=24 \
    --slidedp-set plan.micro_batch=2 --slidedp-set "train.compile=\"$mode\"" --slidedp-set store.persist=true \
    --slidedp-set "store.name=\"$store\"" --slidedp-set train.steps=$((committed + steps)) --timeout 200 \
    --out "$part" --quiet
  [ -f "$part" ] && parts+=("$part")
  trace=$(find "$out/slidedp-compile-$mode.logs" -name "profile-rank0-step*.json" 2>/dev/null | head -1)
  [ -n "$trace" ] && python3 -m benchmarks.trace_summary "$trace" --json "$out/trace-slidedp-$mode.json" | head -40
done
BENCH_PROFILE=5:$out/gr-trace.json python3 -m benchmarks.run --shape qwen3-4b --batch 8 --seq 2048 --steps $steps \
  --warmup $warm --systems gpu_resident --timeout 120 --out "$out/gpu-resident.json" --quiet
[ -f "$out/gpu-resident.json" ] && parts+=("$out/gpu-resident.json")
[ -f "$out/gr-trace.json" ] && python3 -m benchmarks.trace_summary "$out/gr-trace.json" --json "$out/trace-gr.json" | head -40
python3 -m benchmarks.run --merge "${parts[@]}" --out "$out/qwen3-4b-16k-kernels.json"
