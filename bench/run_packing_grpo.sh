#!/usr/bin/env bash
# GRPO with padded vs packed micro-batches (and packed with --compile): SmolLM2-135M-Instruct on addition, one GPU,
# the same seed, steps and samples (bench/results/packing_grpo_smollm2.json). The first step's rollouts are the same
# in every run. On the GPU machine:
#   source bench/gpu_env.sh && bash bench/run_packing_grpo.sh [STEPS] [OUTDIR] [RUNS: padded packed packed-compile]
STEPS=${1:-20}; OUTDIR=${2:-runs}; RUNS=${3:-padded packed}
COMMON=(--model "$SMOLLM2" --steps "$STEPS" --prompts-per-step 32 --group-size 16 --max-new-tokens 256 --lr 1e-5
        --micro-batch-size 128 --unformatted-credit 0.25 --eval-every 10 --eval-before-train --save-every 0
        --sglang-mem-fraction 0.6 --output-dir "$OUTDIR")
PACKED=(--max-tokens-per-micro-batch 32768 --attn-implementation flex_attention)
for run in $RUNS; do
  case $run in
    padded) python3 grpo.py "${COMMON[@]}" --run-name padded ;;
    packed) python3 grpo.py "${COMMON[@]}" "${PACKED[@]}" --run-name packed ;;
    packed-compile) python3 grpo.py "${COMMON[@]}" "${PACKED[@]}" --compile --run-name packed-compile ;;
    *) echo "unknown run $run (padded, packed, packed-compile)"; exit 2 ;;
  esac
done
