#!/usr/bin/env bash
# One H200, Qwen3-4B shape, 8 x 2,048 tokens/step, SlideDP at a 24 GiB budget, micro-batches of 2:
# the code before the restructure of issue 21 (a copy of an older commit, in BASE) next to this
# checkout, in one command, then this checkout's exact clipping in its three regimes (off; on with
# a threshold above the workload's norms, so that no step clips; 1.0, where every step of the
# random-init workload clips: its norms are about 4-5) beside GPU-resident training.
#   bash benchmarks/sessions/arch_and_clipping.sh OUT BASE [BATCH]
# BASE: an unpacked `git archive` of the older commit (its harness takes --slidedp-set only).
# Install this checkout into /tmp/site first (the device prep header); BASE is installed here.
set -u
out=$1 base=$2 batch=${3:-8} steps=${STEPS:-6} warm=${WARMUP:-2}
mkdir -p "$out" /tmp/arch-logs
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/base "$base" || exit
old() {  # NAME STEPS_SO_FAR MAX_GRAD_NORM TIMEOUT
  (cd "$base" && PYTHONPATH=/tmp/base:/tmp/site:$PWD PATH=/tmp/base/bin:$PATH python3 -m benchmarks.run \
    --shape qwen3-4b --batch "$batch" --seq 2048 --steps "$steps" --warmup "$warm" --systems slidedp \
    --slidedp-set memory.gpu_budget_gib=24 --slidedp-set train.micro_batch=2 --slidedp-set store.persist=true \
    --slidedp-set 'store.name="arch-base"' --slidedp-set train.steps=$(($2 + steps)) \
    --slidedp-set train.max_grad_norm="$3" --timeout "$4" --out "/tmp/arch-logs/$1.json" --quiet)
  cp "/tmp/arch-logs/$1.json" "$out/"
}
new() {  # NAME STEPS_SO_FAR MAX_GRAD_NORM TIMEOUT SYSTEMS
  python3 -m benchmarks.run --shape qwen3-4b --batch "$batch" --seq 2048 --steps "$steps" --warmup "$warm" \
    --systems "$5" --max-grad-norm "$3" --slidedp-micro-batch 2 --slidedp-set memory.device_budget_gib=24 \
    --slidedp-set store.persist=true --slidedp-set 'store.name="arch-new"' \
    --slidedp-set train.steps=$(($2 + steps)) --timeout "$4" --out "/tmp/arch-logs/$1.json" --quiet
  cp "/tmp/arch-logs/$1.json" "$out/"
}
old base-noclip 0 0 170
old base-clip "$steps" 1.0 120
(cd /tmp && PYTHONPATH=/tmp/base:/tmp/site python3 -m slidedp.launch.store_cli destroy --force arch-base) || true
new new-noclip 0 0 170 slidedp
new new-never "$steps" 1000 120 slidedp
new new-clip $((2 * steps)) 1.0 150 slidedp,gpu_resident
bash "$(dirname "$0")/drop_store.sh" arch-new
tar -czf "$out/arch-logs.tgz" -C /tmp arch-logs --exclude='*.npy' --exclude='*.safetensors' --exclude='state' 2>/dev/null
ls -la "$out"
