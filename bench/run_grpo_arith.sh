#!/usr/bin/env bash
# GRPO on the built-in addition task with SmolLM2-135M-Instruct, one GPU (bench/results/grpo_arith_smollm2.*).
# On the GPU machine: source bench/gpu_env.sh && bash bench/run_grpo_arith.sh [STEPS] [OUTDIR]
STEPS=${1:-100}; OUTDIR=${2:-runs}
python3 grpo.py --model "$SMOLLM2" --steps "$STEPS" --prompts-per-step 32 --group-size 16 --max-new-tokens 256 \
  --lr 1e-5 --micro-batch-size 128 --unformatted-credit 0.25 --eval-every 20 --eval-before-train --save-every 0 \
  --sglang-mem-fraction 0.6 --log-samples-every 20 --output-dir "$OUTDIR" --run-name grpo_arith_smollm2
