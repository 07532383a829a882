#!/usr/bin/env bash
# GRPO on multiplication (3 x 2 digits) with and without the calculator, SmolLM2-135M-Instruct, the two
# runs side by side on one GPU (bench/results/tools_*). Each run continues from its last checkpoint when
# started again, so a 100-step pair can span calls of the GPU machine.
# On the GPU machine: source bench/gpu_env.sh && bash bench/run_tools.sh [STEPS] [OUTDIR]
STEPS=${1:-100}; OUTDIR=${2:-runs}
common=(--model "$SMOLLM2" --dataset multiplication --steps "$STEPS" --prompts-per-step 32 --group-size 8
        --max-new-tokens 256 --lr 1e-5 --micro-batch-size 128 --eval-every 20 --eval-before-train --save-every 10
        --sglang-mem-fraction 0.3 --log-samples-every 10 --output-dir "$OUTDIR")
mkdir -p "$OUTDIR"
for run in tools_calculator tools_none; do
  resume=(); [ -d "$OUTDIR/$run/checkpoints" ] && resume=(--resume)
  extra=(); [ "$run" = tools_calculator ] && extra=(--tools calculator --max-turns 3)
  python3 grpo.py "${common[@]}" "${extra[@]}" "${resume[@]}" --run-name "$run" >> "$OUTDIR/$run.log" 2>&1 &
  [ "$run" = tools_calculator ] && sleep 60  # the second engine starts after the first has taken its memory
done
wait
tail -n 3 "$OUTDIR"/tools_*.log
