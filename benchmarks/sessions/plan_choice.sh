#!/usr/bin/env bash
# Issue 23's proof: the planner measures its GPU blocks and chooses the micro-batch. One H200, 2,048
# tokens per sequence, SlideDP at a 24 GiB budget: first plan.micro_batch = "auto" (the plan's choice,
# the first plan of this shape in the session's cache: it measures) next to GPU-resident training,
# then the micro-batch forced to 1, 2, 4 and 8 (same machine, the blocks now cached); a summary says
# the chosen micro-batch, each run's predicted and measured step, and how far the choice is from the
# best forced one. With clipping on, every run starts from a store of its own, made from the same
# seed: trained on one batch, a store's gradient norm falls below max_grad_norm within ~20 steps, and
# a run that inherited a trained store would time the unclipped step against the others' clipped one.
# With CLIP=0 no step's time depends on its norm, and the runs may share one persistent store (each
# trains on from its committed step): Qwen3-8B's store takes 18-27 s to make, once instead of per run.
# A call with PARTS=auto makes it anew, and a call removes it at its end unless KEEP_STORE=1 (the
# (SHAPE, BATCH)'s next call, PARTS=forced on the same machine, then trains on from it). FRESH_STORE=1
# (below) gives every run its own store all the same: the proof's Qwen3-8B calls use it.
# DEVICE=cpu runs the script on a CPU: SHAPE tiny, or unseen with UNSEEN_DIMS="64 2 4 2 128" SEQ=64.
#
#   bash benchmarks/sessions/plan_choice.sh OUT SHAPE BATCH     # SHAPE: qwen3-1.7b | qwen3-4b | qwen3-8b
#   bash benchmarks/sessions/plan_choice.sh OUT unseen BATCH    # a Llama-family HF folder (below)
#
# Device calls of at most ~9 minutes: one per (SHAPE, BATCH) for the small shapes, two for each
# Qwen3-8B one with CLIP=0 FRESH_STORE=1 (the same OUT and PLAN_CHOICE_WORK, back to back on a warm
# machine; the second with PARTS=forced). On one H200 (2026-12-03) the 8B runs took: at 8 x 2,048 the
# first 189 s, each forced ~70 s plus its store; at 32 x 2,048 the first 224 s, forced 8 and 4 125
# and 119 s with their stores. So FORCED="4 8" then "2 1" at 8, FORCED="8 4" then "2 1" at 32:
#   qwen3-1.7b 8 | qwen3-1.7b 32 | qwen3-4b 8 | qwen3-4b 32 | qwen3-8b 8 (auto, 4, 8; 2, 1) |
#   qwen3-8b 32 (auto, 8, 4; 2, 1) | unseen 8
# About 9 calls; each prints its summary, and the last call of a (SHAPE, BATCH) the comparison.
# FORCED may name a micro-batch again ("2 1 2 1"): each time is a run of its own (TAG-m2, TAG-m2-r2),
# and the summary (benchmarks.plan_choice_summary) also compares the micro-batches on all their runs'
# timed steps pooled. Qwen3-8B at 8 x 2,048 needs that: the host's AdamW bounds its step, and runs of
# one plan there differ by more than the candidates' predictions do (benchmarks/RESULTS.md, "The planner's
# first runs", which also has the runs' files: three forced 8B runs to a call).
# CHOSEN=MB names the plan's choice for a call of forced runs only (no TAG-auto run in its work folder).
# On one H200 (2026-12-01) Qwen3-1.7B at 8 x 2,048 took 438 s with STEPS=7 WARM=2, Qwen3-4B 570 s with
# STEPS=8 (its last forced run stopped by the budget): every run makes its store (Qwen3-4B ~10 s,
# Qwen3-8B 18-27 s), and a run's start and step 0 take ~45 s more; the first run also calibrates and
# measures the shape's blocks (47-56 s).
# "Fresh machine, no cache": the cache is $PLAN_CHOICE_WORK/cache (SLIDEDP_CACHE_DIR; default
# /tmp/plan_choice), empty on a fresh machine until the first run writes it (the calibration is then
# measured once, the blocks once per shape: the first run of each shape is a first plan). The script
# prints what the cache held first. OUT receives three files per (SHAPE, BATCH): TAG.json (the runs
# merged), TAG-summary.txt, TAG-logs.tgz (the device returns only a few files).
#
# The unseen shape: a Llama-family config written by transformers (untied embeddings, 24 query heads
# of 8 kv heads, 3,072 hidden, 26 layers; vocabulary of the Qwen3 token data the harness makes),
# random weights saved on the GPU; SlideDP alone (the GPU-resident peer takes named shapes only).
set -u
final=$1 shape=$2 batch=$3
parts=${PARTS:-auto,forced}
# the harness's files stay in a work folder of the machine (the device returns few files): $final gets
# the (SHAPE, BATCH)'s merged table, its summary and a tarball of the logs
out=${PLAN_CHOICE_WORK:-/tmp/plan_choice}
mkdir -p "$out" "$final"
export SLIDEDP_CACHE_DIR=${SLIDEDP_CACHE_DIR:-$out/cache}
mkdir -p "$SLIDEDP_CACHE_DIR"
# SEED_CACHE=benchmarks/results/plan-choice-TAG: the plans read that earlier first run's calibration
# and blocks (its -calibration.json and -measured.json, filed under the host and GPU they name) instead
# of measuring them; for forced runs compared with the first run of an earlier call, not for a first run
if [ -n "${SEED_CACHE:-}" ]; then
  python3 - "$SEED_CACHE" "$SLIDEDP_CACHE_DIR" <<'EOF' || exit 2
import json, shutil, sys
from pathlib import Path
from slidedp.planner.cache import slug
prefix, cache = sys.argv[1], Path(sys.argv[2])
missing = [f"{prefix}-{kind}.json" for kind in ("calibration", "measured") if not Path(f"{prefix}-{kind}.json").is_file()]
if missing:
    sys.exit(f"plan_choice: SEED_CACHE={prefix}: no {' or '.join(missing)} (name a first run's files without the suffix)")
cal = json.loads(Path(f"{prefix}-calibration.json").read_text())["calibration"]
name = f"{slug(cal['host'])}-{slug(cal['device_name'])}.json"
for kind in ("calibration", "measured"):
    shutil.copyfile(f"{prefix}-{kind}.json", cache / f"{kind}-{name}")
print(f"plan_choice: the cache now holds {prefix}'s calibration and blocks for host {cal['host']}, {cal['device_name']}")
EOF
fi
echo "cache $SLIDEDP_CACHE_DIR holds: $(ls "$SLIDEDP_CACHE_DIR" | tr '\n' ' ')"
steps=${STEPS:-8} warm=${WARM:-3} budget=${BUDGET_S:-560}  # BUDGET_S: seconds this call keeps to
clip=${CLIP:-1.0}  # max_grad_norm; CLIP=0 for Qwen3-8B on a 125 GiB host (clipped, its job needs ~130 GiB)
peer_micro=${PEER_MICRO:-8}  # the GPU-resident peer's micro-batch
[ "$shape" = qwen3-8b ] && peer_micro=${PEER_MICRO:-2}
resident=${RESIDENT:-gpu_resident}  # 32 sequences' full logits, or Qwen3-8B's, do not fit: the chunked loss
{ [ "$batch" -ge 32 ] || [ "$shape" = qwen3-8b ]; } && resident=${RESIDENT:-gpu_resident_chunked}
extra=()
hshape=$shape
if [ "$shape" = unseen ]; then
  hshape=qwen3-4b  # the harness's token data (vocabulary 151,936); the rows say llama-unseen
  folder="$out/llama-unseen"
  if [ ! -f "$folder/config.json" ]; then
    # UNSEEN_DIMS="hidden layers heads kv_heads intermediate": a smaller one for the CPU run of this script
    python3 - "$folder" ${UNSEEN_DIMS:-3072 26 24 8 8192} <<'EOF'
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
hidden, layers, heads, kv, inter = map(int, sys.argv[2:7])
cfg = LlamaConfig(vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
                  tie_word_embeddings=False, max_position_embeddings=8192, rope_theta=500000.0)
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained(sys.argv[1], safe_serialization=True)
print(f"wrote {sys.argv[1]}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters")
EOF
  fi
  extra=(--slidedp-set 'model.source="hf"' --slidedp-set "model.path=\"$folder\"" --workload-label llama-unseen)
fi
store=slidedp-plan-$shape
tag=$shape-b$batch
drop_store() { bash "$(dirname "$0")/drop_store.sh" "$store"; }
# a store that another shape's call kept (KEEP_STORE=1) holds host memory this shape's runs need: a kept
# Qwen3-8B store (98 of 128 GB of /dev/shm) made every run of the next shape fail at once. It is kept for
# its own shape's next call, so it is not removed here: the call stops and says how.
for manifest in /dev/shm/slidedp.slidedp-plan-*.manifest; do
  [ -e "$manifest" ] || continue
  other=${manifest#/dev/shm/slidedp.}; other=${other%.manifest}
  [ "$other" = "$store" ] && continue
  echo "plan_choice: store $other, kept by an earlier call (KEEP_STORE=1), holds host memory these runs need;" \
       "finish its shape's runs (PARTS=forced, without KEEP_STORE) or remove it: slidedp-store destroy --force $other" >&2
  exit 2
done
shared=0  # 1: the runs share one persistent store (no clipping: the norm does not set a step's time)
python3 -c "import sys; sys.exit(float(sys.argv[1]) != 0)" "$clip" && shared=1
# FRESH_STORE=1: every run makes its own store without clipping too. Trained on one batch, a shared
# store's loss falls below 0.01 within two runs, its gradients vanish, and their squares and then the
# moments fall to subnormal floats, on which the CPU's AdamW runs several times slower: a later run
# may time that, not its micro-batch, and every run of a fresh store starts where the others did.
[ "${FRESH_STORE:-0}" = 1 ] && shared=0
[ $shared = 1 ] && [[ $parts == *auto* ]] && drop_store
run() {  # NAME SYSTEMS MICRO TIMEOUT: SlideDP at plan.micro_batch = MICRO (auto: the plan's choice)
  local limit=$4 left=$((budget - SECONDS - 25)) done=0 keep=()
  if [ "$left" -lt 60 ]; then echo "plan_choice: $left s left, not starting $1" >&2; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  if [ $shared = 1 ]; then  # train on from the shared store's committed step (0 while it does not exist)
    done=$(bash "$(dirname "$0")/committed_step.sh" "$store") keep=(--slidedp-set store.persist=true)
  else
    drop_store  # the run before's, or one a stopped run left
  fi
  python3 -m benchmarks.run --shape "$hshape" --batch "$batch" --seq "${SEQ:-2048}" --steps $steps --warmup $warm \
    ${DEVICE:+--device "$DEVICE"} --systems "$2" --micro-batch "$peer_micro" --max-grad-norm "$clip" --slidedp-set memory.device_budget_gib=24 \
    --slidedp-set plan.micro_batch="$3" --slidedp-set "store.name=\"$store\"" "${keep[@]}" \
    --slidedp-set train.steps=$((done + steps)) --slidedp-set "run.trace_steps=\"${TRACE:-}\"" "${extra[@]}" \
    --timeout "$limit" --out "$out/$1.json" --quiet
}
if [[ $parts == *auto* ]]; then
  run "$tag-auto" slidedp auto 300
  # its own harness command: --timeout is per system, and the call's budget must hold
  # RESIDENT=none leaves the peer out (Qwen3-8B's runs out of GPU memory on one H200: 138 GiB)
  [ "$shape" = unseen ] || [ "$resident" = none ] || run "$tag-resident" "$resident" auto 150
fi
if [[ $parts == *forced* ]]; then
  for m in ${FORCED:-1 2 4 8}; do  # a micro-batch named again runs again: TAG-mM-r2, -r3 (in this work folder)
    [ $((batch % m)) -eq 0 ] || continue
    name=$tag-m$m n=1
    while [ -e "$out/$name.json" ]; do n=$((n + 1)) name=$tag-m$m-r$n; done
    run "$name" slidedp "$m" 240
  done
fi
# a shared store stays for the (SHAPE, BATCH)'s next call (KEEP_STORE=1), else it goes with this one
[ $shared = 1 ] && [ "${KEEP_STORE:-0}" != 1 ] && drop_store
python3 -m benchmarks.plan_choice_summary ${CHOSEN:+--chosen "$CHOSEN"} "$out/$tag"-*.json | tee "$final/$tag-summary.txt"
# the calibration and the measured blocks, so that a plan can be replayed off the machine
for f in "$SLIDEDP_CACHE_DIR"/*.json; do [ -f "$f" ] && cp "$f" "$final/cache-$(basename "$f")"; done
runs=("$out/$tag"-*.json)
[ -f "${runs[0]}" ] && python3 -m benchmarks.run --merge "${runs[@]}" --out "$final/$tag.json" >/dev/null
tar czf "$final/$tag-logs.tgz" -C "$out" --exclude='*.npy' --exclude='profile-*.json' --exclude='*.safetensors' \
  --exclude='llama-unseen' . 2>/dev/null || true
