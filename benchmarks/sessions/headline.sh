#!/usr/bin/env bash
# The default-configuration headline (issue 27) on one H200: Qwen3-4B at 8 x 2,048 and 32 x 2,048
# tokens/step, Qwen3-8B at 8 x 2,048, every system clipping the global gradient norm to 1.0
# (SlideDP's default), SlideDP at a 24 GiB budget with every other choice left to its plan, the
# other systems uncapped. One PART per device command (each under ~9 minutes; a fresh machine each
# time: every PART installs, creates SlideDP's store, calibrates and compiles again), 6 steps each
# (2 of warm-up: 4 timed, so ZenFlow's mean spans one update interval of 4). Each PART writes
# $OUT/PART.json (its systems merged), PART.md, PART.png and PART-logs.tgz (the logs, no big
# files): the device returns at most 8 files. On the development machine afterwards:
#   python3 -m benchmarks.run --merge r/limit.json r/resident.json r/offload-b8.json \
#       r/offload-b32.json r/8b.json --out benchmarks/results/headline-<date>.json
# (writes the .md and .png beside it), then `python3 -m benchmarks.report --index benchmarks/results`.
#
#   bash benchmarks/sessions/headline.sh OUT PART
# PART (in the order to run them; estimated device time, the start of the machine not counted):
#   limit        4B, 8 and 32 seqs: slidedp, slidedp_noclip, resident_same_kernels (about 8 min)
#   resident     4B, 8 and 32 seqs: gpu_resident (chunked at 32), hf_liger, torchao_offload (about 8 min)
#   offload-b8   4B, 8 seqs: fsdp2_offload, deepspeed, zenflow, megatrain, slideformer (about 7 min)
#   offload-b32  4B, 32 seqs: fsdp2_offload, deepspeed, zenflow, megatrain (about 9 min)
#   8b           8B, 8 seqs: slidedp (refused with clipping: 130 GiB of host memory), slidedp_noclip,
#                resident_same_kernels, gpu_resident_chunked, hf_liger (about 9 min; the offloading peers
#                need 16-27 B/param of host memory, more than the host's 125 GiB)
#
# Before the first command, on the development machine, from the checkout's root: the workplace's
# device prep script with --deepspeed and liger-kernel==0.8.5 torchao==0.18.0 (pyzmq, posix_ipc,
# DeepSpeed 0.19.8 and the wheels they lack, into the ignored .whl), and a MegaTrain clone copied
# without its .git into the ignored .peers/MegaTrain with its commit in .peers/MegaTrain/COMMIT:
#   echo /.peers/ >> .git/info/exclude; mkdir -p .peers
#   rsync -a --exclude .git CLONE .peers/ && git -C CLONE rev-parse HEAD > .peers/MegaTrain/COMMIT
# Each device command (carry [".whl", ".peers"], timeout_s 600; SHA = the commit being measured):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH || exit; python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . || exit; DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/deepspeed-*.tar.gz || exit; SLIDEDP_CODE_COMMIT=SHA bash benchmarks/sessions/headline.sh $OUT limit
# (the same with resident, offload-b8, offload-b32, 8b; `limit` and `resident` need no DeepSpeed: their
# command may drop the third install line.) The script keeps to BUDGET_S seconds (default 480, so the
# installs and the merge fit in the command's 600): each system's --timeout is its share of what is
# left after a minute is kept for each system still to come (at most its LIMIT below), and a system
# that would get under a minute (DeepSpeed and ZenFlow: two, for compiling DeepSpeedCPUAdam) is not started (the
# merged table lacks its row; stderr says so).
# SlideDP's micro-batch: the plan's where this SlideDP lets the plan choose it (plan.micro_batch = "auto"),
# else the peers' (the whole batch); MICRO=N names it instead (say so beside the figure: it is forced).
# ONLY=SYSTEM,... runs just those systems of the PART (the rows an earlier call of it could not finish);
# merge its table with that call's. Every PART starts by removing the headline stores a PART before it
# left on the same machine (a kept Qwen3-8B store got the next PART's peers killed for host memory).
set -u
out=$1 part=$2 budget=${BUDGET_S:-480}
work=/tmp/headline/$part   # the harness's logs stay here; only the merged files go to $OUT
mkdir -p "$out" "$work"
steps=6 warm=2
parts=()

run() {  # TAG SHAPE BATCH SYSTEMS LIMIT [harness args]: each system in its own harness command
  local tag=$1 shape=$2 batch=$3 systems=$4 limit=$5 system committed left timeout need
  shift 5
  for system in ${systems//,/ }; do
    [ -z "${ONLY:-}" ] || [[ ",$ONLY," == *",$system,"* ]] || continue
    # at most LIMIT s, and never so much that the systems still to come get under a minute each
    [ "$system" = slideformer ] || pending=$((pending - 1))
    left=$((budget - SECONDS)) timeout=$((budget - SECONDS - 60 * pending))
    [ "$timeout" -gt "$limit" ] && timeout=$limit
    # DeepSpeed's first use compiles DeepSpeedCPUAdam: at 60 s it timed out compiling (one H200, 2026-12-02)
    need=60
    [ "$system" = deepspeed ] || [ "$system" = zenflow ] && need=120
    if [ "$timeout" -lt "$need" ]; then
      echo "headline: $left s left, not starting $tag $system (it needs $need s)" >&2
      continue
    fi
    committed=$(bash "$(dirname "$0")/committed_step.sh" "headline-$shape")
    python3 -m benchmarks.run --shape "$shape" --batch "$batch" --seq 2048 --steps $steps --warmup $warm \
      --systems "$system" --max-grad-norm 1.0 --slidedp-micro-batch "${MICRO:-plan}" \
      --slidedp-set memory.device_budget_gib=24 --slidedp-set store.persist=true \
      --slidedp-set "store.name=\"headline-$shape\"" --slidedp-set train.steps=$((committed + steps)) \
      --timeout "$timeout" --out "$work/$tag-$system.json" --quiet "$@"
    [ -f "$work/$tag-$system.json" ] && parts+=("$work/$tag-$system.json")
  done
}

drop_store() {  # the persistent store holds 50-130 GiB of host memory that the next systems need
  bash "$(dirname "$0")/drop_store.sh" "headline-$1"
}

case $part in  # pending: the systems the PART runs (slideformer is a row, not a run)
  limit | resident) pending=6 per=2 ;; offload-b8 | offload-b32) pending=4 per=1 ;; 8b) pending=5 per=1 ;;
esac
if [ -n "${ONLY:-}" ]; then  # each system of a PART runs once per workload (twice in limit and resident)
  only=${ONLY//,/ } only=(${only//slideformer/})
  pending=$((${#only[@]} * ${per:-1}))
fi
bash "$(dirname "$0")/drop_store.sh" headline-qwen3-4b headline-qwen3-8b
case $part in
  limit)
    run 4b-b8 qwen3-4b 8 slidedp,slidedp_noclip,resident_same_kernels 170
    run 4b-b32 qwen3-4b 32 slidedp,slidedp_noclip,resident_same_kernels 140
    drop_store qwen3-4b ;;
  resident)
    run 4b-b8 qwen3-4b 8 gpu_resident,hf_liger,torchao_offload 110
    run 4b-b32 qwen3-4b 32 gpu_resident_chunked,hf_liger,torchao_offload 130 ;;
  offload-b8)
    run 4b-b8 qwen3-4b 8 fsdp2_offload,deepspeed,zenflow,megatrain,slideformer 130 ;;
  offload-b32)
    run 4b-b32 qwen3-4b 32 fsdp2_offload,deepspeed,zenflow,megatrain 160 ;;
  8b)
    # with clipping the job needs more host memory than the 125 GiB host: its row is the launcher's refusal
    # (a minute: the blocks it measures first stay cached for the run without clipping)
    run 8b-b8 qwen3-8b 8 slidedp,slidedp_noclip 200
    drop_store qwen3-8b
    run 8b-b8 qwen3-8b 8 resident_same_kernels,gpu_resident_chunked,hf_liger 110 ;;
  *)
    echo "unknown PART $part (limit, resident, offload-b8, offload-b32, 8b)" >&2
    exit 2 ;;
esac

if [ ${#parts[@]} -gt 0 ]; then
  python3 -m benchmarks.run --merge "${parts[@]}" --out "$out/$part.json"
fi
# the logs without the big files (tokens, traces, run dirs' checkpoints): they explain a failed row
tar czf "$out/$part-logs.tgz" -C "$work" --exclude='*.npy' --exclude='profile-*.json' --exclude='*.safetensors' . \
  2>/dev/null || true
ls -la "$out"
