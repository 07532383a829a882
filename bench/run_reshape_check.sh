#!/usr/bin/env bash
# Issue 50's check on real GPUs, after the reshape: every script's default path for two steps (and an evaluation after
# each), SmolLM2-135M-Instruct + SGLang, on a 2-GPU machine with the GPU kit's bundle installed.
#   PART=1: grpo.py on GPU 0 beside ppo.py on GPU 1 (colocated engines); then grpo_minimal.py on GPU 0; then grpo.py
#           under torchrun on both GPUs (FSDP2 over NCCL, an engine a rank)
#   PART=2: grpo.py, then ppo.py --async-rollout, in server mode: torchrun on GPU 0, an SGLang server this job starts on
#           GPU 1 (--rollout-gpus 1), the weights over NCCL
# usage: PART=1 bash bench/run_reshape_check.sh OUT_DIR      (then PART=2; each part under 10 minutes)
# Each run's console goes to OUT_DIR/<run>.log and its run folder to OUT_DIR/<run>/; OUT_DIR/summary.txt holds each
# run's exit code and its step and eval lines.
set -uo pipefail
OUT=${1:?an output folder}
mkdir -p "$OUT"
M=${MODEL:-$SMOLLM2}
SIZES="--steps 2 --eval-every 1 --num-eval-prompts 64 --prompts-per-step 32 --group-size 8 --max-new-tokens 128"
FLAGS="--model $M $SIZES --lr 1e-5 --micro-batch-size 64 --log-samples-every 1 --save-every -1 --output-dir $OUT"
export PYTHONUNBUFFERED=1

run() {  # run NAME GPUS COMMAND...: the command with CUDA_VISIBLE_DEVICES=GPUS, its console in OUT/NAME.log
  local name=$1 gpus=$2
  shift 2
  (CUDA_VISIBLE_DEVICES=$gpus timeout 540 "$@" > "$OUT/$name.log" 2>&1; echo "$name exit $?" >> "$OUT/exits.txt")
}

if [ "${PART:-1}" = 1 ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpus.txt"
  lscpu | head -20 > "$OUT/cpu.txt"
  run grpo 0 python grpo.py $FLAGS --run-name grpo &
  run ppo 1 python ppo.py $FLAGS --run-name ppo --critic-lr 1e-5 &
  wait
  run grpo_minimal 0 python grpo_minimal.py --model "$M" $SIZES --lr 1e-5 --micro-batch-size 64 \
    --output-dir "$OUT" --run-name grpo_minimal
  run grpo_torchrun2 0,1 torchrun --standalone --nproc_per_node 2 grpo.py $FLAGS --run-name grpo_torchrun2
else
  run grpo_server 0,1 torchrun --standalone --nproc_per_node 1 grpo.py $FLAGS --run-name grpo_server \
    --rollout-mode server --rollout-gpus 1
  run ppo_server_async 0,1 torchrun --standalone --nproc_per_node 1 ppo.py $FLAGS --run-name ppo_server_async \
    --critic-lr 1e-5 --rollout-mode server --rollout-gpus 1 --async-rollout
fi
for log in "$OUT"/*.log; do
  echo "== $(basename "$log")"
  grep -E "^(step [0-9]|eval after|done|stopped|.*: )" "$log" | grep -v "^  " | tail -12
done >> "$OUT/summary.txt"
cat "$OUT/exits.txt"
