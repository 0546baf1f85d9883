#!/usr/bin/env bash
# One H200, Qwen3-4B shape, SlideDP at a 24 GiB budget (micro-batches of 2 x 2,048 tokens), one
# persistent store for every SlideDP run: 16K tokens/step first (the host's first plan: bare
# calibrated rates), then 64K next to GPU-resident training with the chunked loss, then 16K again
# next to GPU-resident training (the plan now charges what the earlier runs measured).
#   bash benchmarks/sessions/single_gpu.sh OUT_DIR
set -u
out=$1 store=slidedp-1gpu
run() {  # NAME BATCH STEPS WARMUP SYSTEMS TIMEOUT
  local committed
  committed=$(bash "$(dirname "$0")/committed_step.sh" "$store")
  python3 -m benchmarks.run --shape qwen3-4b --batch "$2" --seq 2048 --steps "$3" --warmup "$4" --systems "$5" \
    --slidedp-set memory.device_budget_gib=24 --slidedp-set plan.micro_batch=2 --slidedp-set store.persist=true \
    --slidedp-set "store.name=\"$store\"" --slidedp-set train.steps=$((committed + $3)) --timeout "$6" \
    --out "$out/$1.json" --quiet
}
run qwen3-4b-16k-first-plan 8 8 3 slidedp 200
run qwen3-4b-64k 32 4 2 slidedp,gpu_resident_chunked 260
run qwen3-4b-16k-learned 8 8 3 slidedp,gpu_resident 150
