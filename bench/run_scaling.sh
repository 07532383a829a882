#!/usr/bin/env bash
# The same GRPO step on 1, 2, 4, 8 GPUs (weak scaling: 16 prompts x 8 samples per GPU), random
# weights with Qwen2.5 shapes: rollout tokens/s and step time per GPU count. On the GPU machine:
#   source bench/gpu_env.sh && bash bench/run_scaling.sh OUTDIR "1 2 4 8" [1.5b]
#   python bench/report.py scaling OUTDIR --out bench/results/scaling_1p5b.json
# EXTRA="..." adds grpo.py flags (the CPU check uses EXTRA="--rollout-engine hf ..." and a tiny model
# via MODEL=...). Prints one line per run: <name> ok|fail <seconds>.
OUTDIR=${1:-runs}; COUNTS=${2:-"1 2 4 8"}; SHAPE=${3:-1.5b}
MODEL=${MODEL:-/tmp/models/qwen2.5-$SHAPE-random}
mkdir -p "$OUTDIR"
[ -e "$MODEL/config.json" ] || python3 bench/make_random_model.py --shape "$SHAPE" --tokenizer "$SMOLLM2" --out "$MODEL" || exit 1
for n in $COUNTS; do
  name=scale_${SHAPE}_${n}gpu; t0=$(date +%s)
  # shellcheck disable=SC2086
  timeout "${RUN_TIMEOUT:-300}" torchrun --standalone --nproc_per_node="$n" grpo.py --model "$MODEL" --steps "${STEPS:-5}" \
    --prompts-per-step $((16 * n)) --group-size 8 --max-new-tokens "${MAX_NEW_TOKENS:-512}" --micro-batch-size 8 \
    --gradient-checkpointing --sglang-mem-fraction 0.6 --eval-every 0 --save-every -1 --lr 1e-6 \
    --output-dir "$OUTDIR" --run-name "$name" $EXTRA > "$OUTDIR/$name.log" 2>&1
  rc=$?; status=ok; [ $rc -ne 0 ] && status="fail($rc)"
  echo "$name $status $(( $(date +%s) - t0 ))s"
done
