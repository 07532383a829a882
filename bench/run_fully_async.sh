#!/usr/bin/env bash
# Issue 51 on a 4-GPU machine: fully async (--max-staleness 2 / 4) against one step off (--async-rollout) and
# colocated x2, two runs side by side in each round (run_server.sh's runs; GPUs 0,1 and 2,3), three shapes:
#   long   a long thin tail where one step off waits for its server: Qwen2.5-1.5B shapes, random weights, 190 more
#          stop ids (geometric lengths, mean ~800 tokens, the longest of a step ~3000-5000, cap 8192), 4 prompts x 16 a
#          step (64 samples: the update is short, the step's longest sample is not)
#   tail   the shape of docs/async.md's 1 + 1 balance (380 more stop ids: mean ~400, cap 4096), 8 prompts x 16: the
#          update on one GPU about as long as the server's generation, so one step off hardly waits
#   gsm8k  SmolLM2-135M-Instruct's natural lengths on GSM8K, 1024 tokens, 32 x 16 a step
#   add    SmolLM2 on addition, 40 steps with held-out accuracy every 10: learning, fully async against colocated
# Rounds, in order (each pair starts 30 s apart, the first on GPUs 0,1):
#   long, tail, gsm8k: injob_async | injob_full_k2, then colocate_x2 | injob_full_k4;  add: colocate_x2 | injob_full_k2
# On the GPU machine (4 GPUs):
#   source bench/gpu_env.sh && setsid nohup bash bench/run_fully_async.sh /tmp/runs/fa .data/gsm8k > /tmp/fa.log 2>&1 &
# then `bench/report.py server` on each shape's folder (OUTDIR/tail, OUTDIR/gsm8k, OUTDIR/add).
OUTDIR=${1:-/tmp/runs/fa}; GSM8K=${2:-.data/gsm8k}; ROUNDS=${ROUNDS:-"long1 long2 gsm1 add gsm2 tail1 tail2"}
TAIL_STEPS=${TAIL_STEPS:-15}; LONG_STEPS=${LONG_STEPS:-10}; GSM_STEPS=${GSM_STEPS:-12}
TAIL=/tmp/models/tail LONG=/tmp/models/long
[ -d "$TAIL" ] || python3 bench/make_random_model.py --shape 1.5b --tokenizer "$SMOLLM2" --stop-tokens 380 --out "$TAIL"
[ -d "$LONG" ] || python3 bench/make_random_model.py --shape 1.5b --tokenizer "$SMOLLM2" --stop-tokens 190 --out "$LONG"
quiet="--eval-every 0 --save-every -1 --log-samples-every 0"
T="--max-new-tokens 4096 --micro-batch-size 64 --max-tokens-per-micro-batch 8192 --attn-implementation varlen \
--sglang-cuda-graph-max-bs 512 --prompts-per-step 8 $quiet"
L="--max-new-tokens 8192 --micro-batch-size 64 --max-tokens-per-micro-batch 8192 --attn-implementation varlen \
--sglang-cuda-graph-max-bs 512 --prompts-per-step 4 $quiet"
G="--dataset $GSM8K --max-new-tokens 1024 --micro-batch-size 32 $quiet"

pair() {  # STEPS DIR MODEL EXTRA RUN_ON_0,1 RUN_ON_2,3
  echo "=== $(date -u +%FT%TZ) $2: $5 | $6"
  CUDA_VISIBLE_DEVICES=0,1 PORT=30000 MODEL=$3 EXTRA="$4" bash bench/run_server.sh "$1" "$2" "$5" &
  sleep 30
  CUDA_VISIBLE_DEVICES=2,3 PORT=30100 MODEL=$3 EXTRA="$4" bash bench/run_server.sh "$1" "$2" "$6" &
  wait
}

for round in $ROUNDS; do
  case $round in
    long1) pair "$LONG_STEPS" "$OUTDIR/long" "$LONG" "$L" injob_async injob_full_k2 ;;
    long2) pair "$LONG_STEPS" "$OUTDIR/long" "$LONG" "$L" colocate_x2 injob_full_k4 ;;
    tail1) pair "$TAIL_STEPS" "$OUTDIR/tail" "$TAIL" "$T" injob_async injob_full_k2 ;;
    tail2) pair "$TAIL_STEPS" "$OUTDIR/tail" "$TAIL" "$T" colocate_x2 injob_full_k4 ;;
    gsm1) pair "$GSM_STEPS" "$OUTDIR/gsm8k" "$SMOLLM2" "$G" injob_async injob_full_k2 ;;
    gsm2) pair "$GSM_STEPS" "$OUTDIR/gsm8k" "$SMOLLM2" "$G" colocate_x2 injob_full_k4 ;;
    add) pair 40 "$OUTDIR/add" "$SMOLLM2" "" colocate_x2 injob_full_k2 ;;
  esac
done
echo "=== $(date -u +%FT%TZ) done"
