#!/usr/bin/env bash
# The long-sequence table: Qwen3-4B shape, ONE sequence of T tokens per step, SlideDP under an
# 80 GiB GPU budget (the planner tiles and offloads as it needs) next to GPU-resident training
# (chunked loss) at the lengths it fits. One persistent store serves every length: built by the
# first run, attached by the next (train.steps counts on from the store's committed step).
#   bash benchmarks/sessions/long_sequences.sh OUT_DIR SYSTEMS T [T ...]
# e.g. bash benchmarks/sessions/long_sequences.sh /tmp/out slidedp,gpu_resident_chunked 32768 65536
# A length of 262144 or more runs one step and reports it (a step there takes minutes).
set -u
out=$1 systems=$2
shift 2
store=slidedp-longseq
for T in "$@"; do
  steps=2 warm=1
  [ "$T" -ge 262144 ] && { steps=1; warm=0; }
  total=$(( $(bash "$(dirname "$0")/committed_step.sh" "$store") + steps ))
  python3 -m benchmarks.run --shape qwen3-4b --batch 1 --seq "$T" --steps $steps --warmup $warm \
    --systems "$systems" --slidedp-set memory.device_budget_gib=80 --slidedp-set store.persist=true \
    --slidedp-set "store.name=\"$store\"" --slidedp-set train.steps=$total --timeout 560 \
    --out "$out/longseq-$T-${systems//,/+}.json" --quiet
done
