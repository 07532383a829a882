#!/usr/bin/env bash
# Largest SGLang memory fraction that runs 5 full GRPO steps, random weights with Qwen2.5 shapes,
# one GPU, full fine-tuning with gradient checkpointing, CUDA graphs on (grpo.py's defaults).
# On the GPU machine:
#   source bench/gpu_env.sh && bash bench/run_memory_sweep.sh OUTDIR "offload:0.9 resident:0.7" [1.5b|7b]
# Each config is MODE:FRACTION, MODE = offload (--offload) or resident. Prints one line per run:
#   <name> ok|oom|fail <seconds>; each run's folder holds metrics.jsonl (bench/report.py memory).
OUTDIR=${1:-runs}; CONFIGS=${2:-"offload:0.9 resident:0.7"}; SHAPE=${3:-1.5b}
MODEL=/tmp/models/qwen2.5-$SHAPE-random
mkdir -p "$OUTDIR"
[ -e "$MODEL/config.json" ] || python3 bench/make_random_model.py --shape "$SHAPE" --tokenizer "$SMOLLM2" --out "$MODEL" || exit 1
for c in $CONFIGS; do
  mode=${c%%:*}; frac=${c##*:}; name=mem_${SHAPE}_${mode}_${frac}
  extra=(); [ "$mode" = offload ] && extra=(--offload)
  t0=$(date +%s)
  timeout "${RUN_TIMEOUT:-300}" python3 grpo.py --model "$MODEL" --steps 5 --prompts-per-step 16 --group-size 8 \
    --max-new-tokens 256 --micro-batch-size 8 --gradient-checkpointing "${extra[@]}" --sglang-mem-fraction "$frac" \
    --eval-every 0 --save-every -1 --lr 1e-6 --output-dir "$OUTDIR" --run-name "$name" > "$OUTDIR/$name.log" 2>&1
  rc=$?; status=ok
  if grep -qi "out of memory\|OutOfMemory" "$OUTDIR/$name.log"; then status=oom; elif [ $rc -ne 0 ]; then status="fail($rc)"; fi
  echo "$name $status $(( $(date +%s) - t0 ))s"
done
