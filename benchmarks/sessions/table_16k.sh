#!/usr/bin/env bash
# One H200, Qwen3-4B shape, 16,384 tokens/step (8 x 2,048, micro-batches of 2), SlideDP at a 24 GiB
# budget: the four systems in one harness command (SlideDP's first plan on this host), then SlideDP
# again next to GPU-resident training (its plan now charges the AdamW rate and GPU time the first run
# measured). One persistent store serves both SlideDP runs.
#   bash benchmarks/sessions/table_16k.sh OUT_DIR [harness args ...]
set -u
out=$1 store=slidedp-table16k
shift
run() {  # NAME STEPS SYSTEMS TIMEOUT [harness args]
  local name=$1 steps=$2 systems=$3 limit=$4 committed
  shift 4
  committed=$(bash "$(dirname "$0")/committed_step.sh" "$store")
  python3 -m benchmarks.run --shape qwen3-4b --batch 8 --seq 2048 --steps "$steps" --warmup 3 --systems "$systems" \
    --slidedp-set memory.device_budget_gib=24 --slidedp-set plan.micro_batch=2 --slidedp-set store.persist=true \
    --slidedp-set "store.name=\"$store\"" --slidedp-set train.steps=$((committed + steps)) --timeout "$limit" \
    --out "$out/$name.json" --quiet "$@"
}
run qwen3-4b-16k-table 8 slidedp,gpu_resident,fsdp2_offload,deepspeed 200 "$@"
run qwen3-4b-16k-table-learned 8 slidedp,gpu_resident 150 "$@"
