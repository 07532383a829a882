#!/usr/bin/env bash
# PPO on the built-in addition task with SmolLM2-135M-Instruct, one GPU, on GRPO's budget
# (512 samples a step: bench/run_grpo_arith.sh). On the GPU machine:
#   source bench/gpu_env.sh && bash bench/run_ppo_arith.sh [STEPS] [OUTDIR]
STEPS=${1:-100}; OUTDIR=${2:-runs}
python3 ppo.py --model "$SMOLLM2" --steps "$STEPS" --prompts-per-step 128 --group-size 4 --max-new-tokens 256 \
  --lr 1e-5 --critic-lr 1e-5 --kl-coef 0.001 --gamma 1.0 --lam 0.95 --micro-batch-size 128 --unformatted-credit 0.25 \
  --eval-every 20 --eval-before-train --save-every -1 --sglang-mem-fraction 0.6 --log-samples-every 20 \
  --output-dir "$OUTDIR" --run-name ppo_arith_smollm2
