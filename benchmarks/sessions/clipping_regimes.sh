#!/usr/bin/env bash
# One H200, Qwen3-4B shape, SlideDP at a 24 GiB budget, micro-batches of 2 (forced, as in the runs
# before the planner chose it), one persistent store: exact clipping in its three regimes (off; a
# threshold no step reaches; 1.0, where every step of the random-init workload clips) at 8 x 2,048
# and 32 x 2,048 tokens/step, beside the same-kernel GPU-resident limit; then, with the time left,
# SlideDP's default configuration (clipping 1.0, the plan's own micro-batch) at 8 x 2,048.
#   bash benchmarks/sessions/clipping_regimes.sh OUT     (BUDGET_S: seconds to keep to, default 500)
set -u
out=$1 budget=${BUDGET_S:-500} steps=6 warm=2 store=clip-regimes done=0
mkdir -p "$out" /tmp/regimes
run() {  # NAME BATCH MAX_GRAD_NORM SYSTEMS LIMIT [harness args]
  local name=$1 batch=$2 clip=$3 systems=$4 limit=$5 left
  shift 5
  left=$((budget - SECONDS))
  if [ "$left" -lt 60 ]; then echo "regimes: $left s left, not starting $name" >&2; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  python3 -m benchmarks.run --shape qwen3-4b --batch "$batch" --seq 2048 --steps $steps --warmup $warm \
    --systems "$systems" --max-grad-norm "$clip" --slidedp-set memory.device_budget_gib=24 \
    --slidedp-set store.persist=true --slidedp-set "store.name=\"$store\"" \
    --slidedp-set train.steps=$((done + steps)) --timeout "$limit" --out "/tmp/regimes/$name.json" --quiet "$@"
  case $systems in slidedp*) done=$((done + steps)) ;; esac
}
run b8-clip 8 1.0 slidedp 170 --slidedp-micro-batch 2
run b32-off 32 0 slidedp 130 --slidedp-micro-batch 2
run b32-never 32 1000 slidedp 110 --slidedp-micro-batch 2
run b32-clip 32 1.0 slidedp 110 --slidedp-micro-batch 2
run limit 8 1.0 resident_same_kernels 80
run limit32 32 1.0 resident_same_kernels 90
run b8-default 8 1.0 slidedp 200 --slidedp-micro-batch plan
bash "$(dirname "$0")/drop_store.sh" "$store"
python3 -m benchmarks.run --merge /tmp/regimes/*.json --out "$out/clipping-regimes.json"
tar czf "$out/regimes-logs.tgz" -C /tmp regimes --exclude='*.npy' --exclude='*.safetensors' --exclude='state' \
  --exclude='profile-*.json' 2>/dev/null || true
ls -la "$out"
