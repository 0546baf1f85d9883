#!/usr/bin/env bash
# SlideDP as a user runs it, on one H200: the job file's defaults (clipping 1.0, the plan's own
# micro-batch, delivery and held layers) at a 24 GiB budget, beside clipping off, a threshold no
# step reaches, and GPU-resident training with the same kernels and eagerly, in one command.
#   bash benchmarks/sessions/defaults.sh OUT PART     (BUDGET_S: seconds to keep to, default 520)
# PART:
#   4b    the updaters' AdamW rates on store-like memory (benchmarks/updater_rates.py, ~1 min; RATES=0
#         leaves them out), then Qwen3-4B at 8 x 2,048: SlideDP default, never-clips (max_grad_norm
#         1000), clipping off; resident_same_kernels and gpu_resident (~6 min)
#   4b32  the same at 32 x 2,048 without the rates, 10 steps a run; gpu_resident_chunked (the eager
#         peer's full logits of 32 sequences do not fit), ~9 min
#   8b    Qwen3-8B at 8 x 2,048: SlideDP default (with clipping it needs more host memory than this
#         host's 125 GiB: the launcher refuses it, and the row says why), SlideDP clipping off, then
#         resident_same_kernels and gpu_resident_chunked (~7 min)
#   8b-host  issue 26's rows: Qwen3-8B with clipping off at 8 and at 32 x 2,048 (one store), then
#         gpu_resident_chunked at both (micro-batches of 8 at 32), ~8 min
# OUT receives PART.json (merged), PART.md, PART.png, PART-logs.tgz and, for 4b, updater-rates.json.
# A fresh machine each call: every SlideDP run of the part shares one persistent store, and the first
# one creates it, calibrates, measures the plan's blocks and compiles (its first step is warm-up).
# The default run comes first on a fresh store: the random-init workload's norms (4-6) then exceed
# 1.0 on every step; trained on the same batch they fall below it within about 16 steps.
set -u
out=$1 part=$2 budget=${BUDGET_S:-520} steps=8 warm=2
work=/tmp/defaults/$part
mkdir -p "$out" "$work"
case $part in
  4b) shape=qwen3-4b batch=8 ;; 4b32) shape=qwen3-4b batch=32 steps=10 ;; 8b | 8b-host) shape=qwen3-8b batch=8 ;;
  *) echo "unknown PART $part (4b, 4b32, 8b, 8b-host)" >&2; exit 2 ;;
esac
store=defaults-$shape-b$batch
run() {  # NAME MAX_GRAD_NORM SYSTEMS LIMIT [harness args]; BATCH=N before it: another batch than the part's
  local name=$1 clip=$2 systems=$3 limit=$4 left
  shift 4
  left=$((budget - SECONDS - 20))
  if [ "$left" -lt 60 ]; then echo "defaults: $left s left, not starting $name" >&2; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  # --timeout is each system's: several in one command share what is left
  local n=$(($(tr -cd , <<< "$systems" | wc -c) + 1))
  [ $((limit * n)) -gt "$left" ] && limit=$((left / n))
  done=$(bash "$(dirname "$0")/committed_step.sh" "$store")  # 0 where a refused run made no store
  python3 -m benchmarks.run --shape "$shape" --batch "${BATCH:-$batch}" --seq 2048 --steps $steps --warmup $warm \
    --systems "$systems" --max-grad-norm "$clip" --slidedp-micro-batch plan --slidedp-set memory.device_budget_gib=24 \
    --slidedp-set store.persist=true --slidedp-set "store.name=\"$store\"" \
    --slidedp-set train.steps=$((done + steps)) --timeout "$limit" --out "$work/$name.json" --quiet "$@"
}
case $part in
  4b)
    [ "${RATES:-1}" = 0 ] || timeout 120 python3 -m benchmarks.updater_rates --threads 4,8,16 --no-huge --out "$out/updater-rates.json" > "$work/updater-rates.log" 2>&1 \
      || echo "updater_rates: rc $?" >&2
    [ -f "$work/updater-rates.log" ] && tail -25 "$work/updater-rates.log"
    run default 1.0 slidedp 200
    run never 1000 slidedp 110
    run off 0 slidedp 110
    run limit 1.0 resident_same_kernels,gpu_resident 80 ;;
  4b32)
    run default 1.0 slidedp 170
    run never 1000 slidedp 120
    run off 0 slidedp 120
    run limit 1.0 resident_same_kernels,gpu_resident_chunked 130 ;;
  8b)
    run default 1.0 slidedp 150
    run off 0 slidedp 240
    bash "$(dirname "$0")/drop_store.sh" "$store"  # the resident peers need the host's memory
    run limit 1.0 resident_same_kernels,gpu_resident_chunked 150 ;;
  8b-host)
    run off 0 slidedp 170
    BATCH=32 run off32 0 slidedp 150
    bash "$(dirname "$0")/drop_store.sh" "$store"
    run limit 0 gpu_resident_chunked 60
    BATCH=32 run limit32 0 gpu_resident_chunked 110 --micro-batch 8 ;;
esac
bash "$(dirname "$0")/drop_store.sh" "$store"
runs=("$work"/*.json)
[ -f "${runs[0]}" ] && python3 -m benchmarks.run --merge "${runs[@]}" --out "$out/$part.json"
tar czf "$out/$part-logs.tgz" -C "$work" --exclude='*.npy' --exclude='*.safetensors' --exclude='state' \
  --exclude='profile-*.json' . 2>/dev/null || true
ls -la "$out"
