#!/usr/bin/env bash
# The packed-chat table (issue 45): Qwen3-4B shape with a 512-token vocabulary, clipping 1.0; SlideDP at a
# 24 GiB budget with the plan's own micro-batch and every other choice, the peer uncapped (all on the GPU).
# For each layout of the same tokens per step:
#   slidedp           random tokens, one document per row (plain causal rows)
#   slidedp_packed    rows of packed multi-turn chat conversations (benchmarks.chat_data: median 885
#                     tokens, 10% under 300), each attending only to itself
#   hf_liger_packed   transformers + Liger with the same rows and their position ids (padding-free
#                     packing), flex_attention's block mask, everything on the GPU
# One persistent store serves every SlideDP run (built by the first, attached by the next; train.steps
# counts on from its committed step). Each layout B:T writes OUT/packed-BxT.json (+ .md, .png), merged from
# its systems' runs in OUT/parts/.
#   bash benchmarks/sessions/packed_chat.sh OUT B:T [B:T ...]     e.g. OUT 4:8192 2:16384
# SYSTEMS=... runs only those; STEPS (default 6, 2 of warm-up) and TIMEOUT (per system, default 280 s).
# The device command (carry [".whl"]; wheels from ../shared/device/prep liger-kernel==0.8.5):
#   <the prep script's install header>; SLIDEDP_CODE_COMMIT=SHA bash benchmarks/sessions/packed_chat.sh $OUT 4:8192
set -u
out=$1
shift
systems=${SYSTEMS:-slidedp,slidedp_packed,hf_liger_packed}
store=slidedp-packed
chat=${CHAT_DIR:-/tmp/packed-chat}
here=$(dirname "$0")
mkdir -p "$out/parts"
[ -f "$chat/chat.jsonl" ] || python3 -m benchmarks.chat_data "$chat" --conversations 2000 | tee "$out/chat-data.txt"
for layout in "$@"; do
  B=${layout%%:*} T=${layout##*:}
  steps=${STEPS:-6} warm=2
  for system in ${systems//,/ }; do  # one at a time: each SlideDP run trains on from the store's committed step
    total=$(( $(bash "$here/committed_step.sh" "$store") + steps ))
    python3 -m benchmarks.run --shape qwen3-4b --vocab 512 --workload-label "qwen3-4b, vocab 512" --batch "$B" \
      --seq "$T" --steps "$steps" --warmup $warm --systems "$system" --chat "$chat" \
      --slidedp-set memory.device_budget_gib=24 \
      --slidedp-set store.persist=true --slidedp-set "store.name=\"$store\"" --slidedp-set train.steps=$total \
      --timeout "${TIMEOUT:-280}" --out "$out/parts/packed-${B}x${T}-$system.json" --quiet
  done
  python3 -m benchmarks.run --merge "$out"/parts/packed-"${B}x${T}"-*.json --out "$out/packed-${B}x${T}.json"
done
