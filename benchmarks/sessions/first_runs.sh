#!/usr/bin/env bash
# Issue 23's first-run criterion in one device call: for each SHAPE:BATCH:SECONDS, SlideDP with the
# plan's choice (plan.micro_batch = "auto") as the first plan of that shape on an empty cache of its own
# (it calibrates the host and measures the shape's blocks, as a fresh machine would), no clipping by
# default, GPU-resident left out (RESIDENT=gpu_resident_chunked etc. puts it back), within SECONDS.
# Each run is plan_choice.sh with PARTS=auto; OUT gets one tarball of every run's files and a summary
# line per run (the device returns few files).
#
#   bash benchmarks/sessions/first_runs.sh OUT qwen3-8b:32:330 qwen3-8b:8:230 [unseen:8:300 ...]
#
# On one H200 (2026-12-02) qwen3-1.7b:8 took ~150 s, qwen3-4b:8 ~170, qwen3-8b:8 ~230,
# unseen:8 ~200, qwen3-4b:32 ~280 with its GPU-resident peer and qwen3-8b:32 ~330 (its start and
# measuring the blocks of 8 B parameters take ~170 s of that). A run whose SECONDS run out before a
# timed step has no figure (its summary says so).
set -u
final=$1
shift
here=$(dirname "$0")
mkdir -p "$final/first-runs"
for spec in "$@"; do
  IFS=: read -r shape batch seconds <<<"$spec"
  work=/tmp/first-runs/$shape-b$batch-$$  # its own cache: a first plan
  PLAN_CHOICE_WORK=$work RESIDENT=${RESIDENT:-none} CLIP=${CLIP:-0} PARTS=auto STEPS=${STEPS:-6} WARM=${WARM:-2} \
    BUDGET_S=$seconds bash "$here/plan_choice.sh" "$final/first-runs/$shape-b$batch" "$shape" "$batch" \
    > "$final/first-runs/$shape-b$batch.out" 2>&1
  line=$(grep -h -- "-auto" "$final/first-runs/$shape-b$batch/"*-summary.txt 2>/dev/null | tail -1)
  echo "${line:-$shape-b$batch: no summary (see first-runs/$shape-b$batch.out)}" | tee -a "$final/first-runs.txt"
done
tar czf "$final/first-runs.tgz" -C "$final" first-runs && rm -rf "$final/first-runs"
