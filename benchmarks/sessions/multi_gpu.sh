#!/usr/bin/env bash
# Several GPUs of one host: Qwen3-4B shape, sequences of 2,048 tokens, SlideDP at a 24 GiB budget
# per GPU (micro-batches of 2) next to FSDP2 at the same global batch. One persistent store
# serves every SlideDP run (built by the first, attached by the next; train.steps counts on
# from the store's committed step), so each system runs in its own harness command and the
# rows are merged into one table at the end.
# (SHAPE, STEPS and WARMUP change the model shape, steps and warm-up steps.)
#   bash benchmarks/sessions/multi_gpu.sh OUT_DIR GPUS BATCH SYSTEMS [harness args ...]
# e.g. bash benchmarks/sessions/multi_gpu.sh /tmp/out 2 16 slidedp,slidedp_replicated,fsdp2
#      bash benchmarks/sessions/multi_gpu.sh /tmp/out 1 8 slidedp     (the single-GPU figure)
set -u
out=$1 gpus=$2 batch=$3 systems=$4
shift 4
store=slidedp-multigpu-${SHAPE:-qwen3-4b} steps=${STEPS:-8} warm=${WARMUP:-3} shape=${SHAPE:-qwen3-4b}
parts=()
for system in ${systems//,/ }; do
  committed=$(bash "$(dirname "$0")/committed_step.sh" "$store")
  part="$out/$shape-${gpus}gpu-b$batch-$system.json"
  python3 -m benchmarks.run --gpus "$gpus" --shape "$shape" --batch "$batch" --seq 2048 --steps $steps --warmup $warm \
    --systems "$system" --slidedp-set memory.gpu_budget_gib=24 --slidedp-set train.micro_batch=2 \
    --slidedp-set store.persist=true --slidedp-set "store.name=\"$store\"" --slidedp-set train.steps=$((committed + steps)) \
    --out "$part" --quiet "$@"
  [ -f "$part" ] && parts+=("$part")
done
[ ${#parts[@]} -gt 1 ] && python3 -m benchmarks.run --merge "${parts[@]}" --out "$out/$shape-${gpus}gpu-b$batch.json"
