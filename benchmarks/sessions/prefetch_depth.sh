#!/usr/bin/env bash
# How far ahead the layer copies (and, on the sharded route, the all-gathers) should run: SlideDP on
# GPUS GPUs at the plan's depth (on a fresh host its first plan, which teaches the cache the
# host's rates), then at each of DEPTHS (plan.prefetch_depth) with the learned rates, then
# GPU-resident FSDP2 at the same global batch. multi_gpu.sh runs each (one persistent store), and
# each lands in OUT/depth-D (OUT/depth-plan, OUT/fsdp2); the same variables apply (SHAPE, BUDGET...).
#   bash benchmarks/sessions/prefetch_depth.sh OUT GPUS BATCH "DEPTHS" [harness args ...]
# e.g. bash benchmarks/sessions/prefetch_depth.sh /tmp/out 2 16 "1 2 3" --timeout 150
set -u
out=$1 gpus=$2 batch=$3 depths=$4
shift 4
here=$(dirname "$0")
mkdir -p "$out/depth-plan" "$out/fsdp2"
bash "$here/multi_gpu.sh" "$out/depth-plan" "$gpus" "$batch" slidedp "$@"
for d in $depths; do
  mkdir -p "$out/depth-$d"
  bash "$here/multi_gpu.sh" "$out/depth-$d" "$gpus" "$batch" slidedp --slidedp-set plan.prefetch_depth=$d "$@"
done
bash "$here/multi_gpu.sh" "$out/fsdp2" "$gpus" "$batch" fsdp2 "$@"
