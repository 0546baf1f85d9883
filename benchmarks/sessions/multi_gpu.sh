#!/usr/bin/env bash
# Several GPUs of one host: Qwen3-4B shape, sequences of 2,048 tokens, SlideDP at a 24 GiB budget
# per GPU (micro-batches of 2) next to FSDP2 at the same global batch. One persistent store
# serves every SlideDP run (built by the first, attached by the next; train.steps counts on
# from the store's committed step), so each system runs in its own harness command and the
# rows are merged into one table at the end.
# (SHAPE, SEQ, STEPS and WARMUP change the model shape, tokens per sequence, steps and warm-up
# steps; BUDGET SlideDP's GPU budget in GiB per GPU; MICRO SlideDP's micro-batch; PROFILE=K runs
# step K of each SlideDP run (0 = its first step) under torch.profiler on every rank and writes
# each rank's benchmarks.trace_summary beside the row as TAG-SYSTEM-trace-rankR.txt; a profiled
# step past the warm-up stays in the row's median, slowed by the profiler.)
#   bash benchmarks/sessions/multi_gpu.sh OUT_DIR GPUS BATCH SYSTEMS [harness args ...]
# e.g. bash benchmarks/sessions/multi_gpu.sh /tmp/out 2 16 slidedp,slidedp_replicated,fsdp2
#      bash benchmarks/sessions/multi_gpu.sh /tmp/out 1 8 slidedp     (the single-GPU figure)
#      SHAPE=qwen3-14b BUDGET=80 STEPS=5 WARMUP=2 bash benchmarks/sessions/multi_gpu.sh /tmp/out 2 16 fsdp2,slidedp
#      SHAPE=qwen3-14b SEQ=65536 MICRO=1 BUDGET=80 STEPS=4 WARMUP=2 \
#        bash benchmarks/sessions/multi_gpu.sh /tmp/out 2 2 fsdp2,slidedp   (one sequence per GPU)
set -u
out=$1 gpus=$2 batch=$3 systems=$4
shift 4
shape=${SHAPE:-qwen3-4b} seq=${SEQ:-2048} steps=${STEPS:-8} warm=${WARMUP:-3} budget=${BUDGET:-24} micro=${MICRO:-2}
store=slidedp-multigpu-$shape
tag=$shape-${gpus}gpu-b$batch$([ "$seq" = 2048 ] || echo "-s$seq")$([ "$budget" = 24 ] || echo "-g$budget")
parts=()
for system in ${systems//,/ }; do
  committed=$(bash "$(dirname "$0")/committed_step.sh" "$store")
  part="$out/$tag-$system.json"
  [ -n "${PROFILE:-}" ] && export SLIDEDP_PROFILE_STEP=$((committed + PROFILE))
  python3 -m benchmarks.run --gpus "$gpus" --shape "$shape" --batch "$batch" --seq "$seq" --steps $steps --warmup $warm \
    --systems "$system" --slidedp-set memory.device_budget_gib=$budget --slidedp-set plan.micro_batch=$micro \
    --slidedp-set store.persist=true --slidedp-set "store.name=\"$store\"" --slidedp-set train.steps=$((committed + steps)) \
    --out "$part" --quiet "$@"
  [ -f "$part" ] && parts+=("$part")
  if [ -n "${PROFILE:-}" ]; then
    for trace in $(find "$out/$tag-$system.logs" -name "profile-rank*-step*.json" 2>/dev/null); do
      rank=$(basename "$trace" | sed 's/profile-rank\([0-9]*\)-.*/\1/')
      python3 -m benchmarks.trace_summary "$trace" > "$out/$tag-$system-trace-rank$rank.txt" 2>&1
      rm -f "$trace"  # hundreds of MB; the summary is what comes back
    done
  fi
done
[ ${#parts[@]} -gt 1 ] && python3 -m benchmarks.run --merge "${parts[@]}" --out "$out/$tag.json"
