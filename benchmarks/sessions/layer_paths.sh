#!/usr/bin/env bash
# The layer paths on one H200 (plan.layers): SlideDP's own layers against transformers' layer modules on the
# same streamed weights, and SlideDP on model families only transformers' layers run, against transformers
# (+ Liger where it has the family's kernels). Clipping 1.0 everywhere; SlideDP at a 24 GiB budget with the
# plan's micro-batch and every other choice, the transformers peers uncapped (everything on the GPU).
# PARTs (default: all four, in this order):
#   qwen3-4b-b8    --shape qwen3-4b, 8 x 2,048: slidedp (native layers), slidedp_transformers
#   qwen3-4b-b32   the same at 32 x 2,048
#   gemma3-4b      google/gemma-3-4b-pt's text model (gemma3_text, 3.88 B) as a random folder made once in
#                  /tmp (python -m benchmarks.make_hf_model), 8 x 2,048: slidedp (plan.layers "auto": transformers'
#                  layers), hf, hf_liger (apply_liger_kernel_to_gemma3_text)
#   qwen3.5-4b     Qwen/Qwen3.5-4B's text model (qwen3_5_text: Gated DeltaNet in 3 layers of 4, 4.21 B) the same
#                  way; hf_liger is a "Liger has no kernels" row where the installed liger-kernel lacks
#                  apply_liger_kernel_to_qwen3_5. Without flash-linear-attention / causal-conv1d on the machine
#                  SlideDP and hf both run transformers' torch fallback of the linear attention.
#   qwen3-moe-b8   a Qwen3-MoE shape of 5.8 B parameters (64 experts, top-8, 16 layers of Qwen3-30B-A3B's size;
#                  benchmarks/make_hf_model.py), 8 x 2,048: slidedp, hf, hf_liger (apply_liger_kernel_to_qwen3_moe)
#   qwen3-moe-b32  the same at 32 x 2,048
#   qwen3-moe-4.5b-b8, qwen3-moe-4.5b-b32   the same layers, 12 of them (4.5 B), for an 80 GB card (H100), where
#                  transformers with everything on the GPU does not fit the 5.8 B shape; at 32 x 2,048 the
#                  transformers peers take 4 micro-batches of 8 (--micro-batch 8: one of 32 would not fit)
#                  hf_liger: liger-kernel 0.8.5's fused MoE kernels autotune 32-40 Triton configurations each on
#                  the first step (likely why it made no step in 220 s on 2026-12-04); LIGER_FUSED_MOE_AUTOTUNE=0 pins one,
#                  and then it runs on an H200 (89 GiB at 8 x 2,048, 101 at 32 x 2,048). All on the GPU this model needs
#                  more than an 80 GB card (out of memory at AdamW's state on an H100).
# Each PART writes OUT/PART.json (+ .md, .png), merged from its systems' runs in OUT/parts/ (one harness
# command per system: a fresh process each, under TIMEOUT).
#   bash benchmarks/sessions/layer_paths.sh OUT [PART ...]
# SYSTEMS=... runs only those of each PART; STEPS (default 6, 2 of warm-up) and TIMEOUT (per system, default
# 300 s); MODELS (default /tmp/layer-paths-models) holds the folders; SLIDEDP_SETS="SECTION.KEY=VALUE ..." adds
# job-file values to the slidedp systems (e.g. SLIDEDP_SETS=run.trace_steps=3,4: the timeline of two timed steps,
# <run dir>/trace.json).
# The device command (carry [".whl"], timeout_s 600; wheels from ../shared/device/prep liger-kernel==0.8.5; one
# or two PARTs per command: a HF PART is three systems, so give it TIMEOUT=170 or split it with
# SYSTEMS=slidedp and SYSTEMS=hf,hf_liger and merge the returned parts here with
# `python3 -m benchmarks.run --merge A.json B.json --out C.json`):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH || exit; python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . || exit; SLIDEDP_CODE_COMMIT=SHA bash benchmarks/sessions/layer_paths.sh $OUT qwen3-4b-b8 qwen3-4b-b32
#   (then ... TIMEOUT=170 bash benchmarks/sessions/layer_paths.sh $OUT gemma3-4b; the same with qwen3.5-4b)
set -u
out=$1
shift
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(qwen3-4b-b8 qwen3-4b-b32 gemma3-4b qwen3.5-4b)
steps=${STEPS:-6} warm=2 timeout=${TIMEOUT:-300}
models=${MODELS:-/tmp/layer-paths-models}
mkdir -p "$out/parts"

table() {  # PART BATCH DEFAULT_SYSTEMS [harness args]: each system in its own harness command, then the merge
  local part=$1 batch=$2 systems=${SYSTEMS:-$3} system budget
  shift 3
  for system in ${systems//,/ }; do
    budget=()
    if [[ $system == slidedp* ]]; then
      budget=(--slidedp-set memory.device_budget_gib=24)
      for kv in ${SLIDEDP_SETS:-}; do budget+=(--slidedp-set "$kv"); done
    fi
    python3 -m benchmarks.run --batch "$batch" --seq 2048 --steps "$steps" --warmup $warm --systems "$system" \
      --max-grad-norm 1.0 "${budget[@]}" --timeout "$timeout" --out "$out/parts/$part-$system.json" --quiet "$@"
  done
  python3 -m benchmarks.run --merge "$out"/parts/"$part"-*.json --out "$out/$part.json"
}

folder() {  # NAME: the model folder, made once
  [ -f "$models/$1/config.json" ] || python3 -m benchmarks.make_hf_model "$1" "$models/$1" | tee "$out/make-$1.txt"
}

for part in "${parts[@]}"; do
  case $part in
    qwen3-4b-b8) table "$part" 8 slidedp,slidedp_transformers --shape qwen3-4b ;;
    qwen3-4b-b32) table "$part" 32 slidedp,slidedp_transformers --shape qwen3-4b ;;
    gemma3-4b | qwen3.5-4b)
      folder "$part" && table "$part" 8 slidedp,hf,hf_liger --model-dir "$models/$part" ;;
    qwen3-moe-b8 | qwen3-moe-b32)
      folder qwen3-moe-5.8b && table "$part" "${part#qwen3-moe-b}" slidedp,hf,hf_liger --model-dir "$models/qwen3-moe-5.8b" ;;
    qwen3-moe-4.5b-b8)
      folder qwen3-moe-4.5b && table "$part" 8 slidedp,hf,hf_liger --model-dir "$models/qwen3-moe-4.5b" ;;
    qwen3-moe-4.5b-b32)
      folder qwen3-moe-4.5b && table "$part" 32 slidedp,hf,hf_liger --model-dir "$models/qwen3-moe-4.5b" --micro-batch 8 ;;
    *)
      echo "unknown PART $part (qwen3-4b-b8, qwen3-4b-b32, gemma3-4b, qwen3.5-4b, qwen3-moe-b8, qwen3-moe-b32," \
        "qwen3-moe-4.5b-b8, qwen3-moe-4.5b-b32)" >&2
      exit 2 ;;
  esac
done
ls -la "$out"
