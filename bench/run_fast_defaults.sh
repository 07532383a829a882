#!/usr/bin/env bash
# Issue 55 on ONE GPU: the step a user gets from the command as typed (no micro-batch, attention or --compile flag:
# start.micro_batching's token budget) against the best flags found, at four shapes, one run after the other, each run
# with the GPU to itself (the default sizes itself from the whole GPU's memory: two side by side would each count it):
#   add    SmolLM2-135M-Instruct on addition, the README's quickstart (512 samples x 256 tokens)
#   calc   SmolLM2 on multiplication with the calculator over up to 3 turns, 64 prompts x 8 (512 samples)
#   q1p5   Qwen2.5-1.5B shapes (random weights: every sample runs to the cap), 16 x 16 samples x 1024 tokens
#   q7     Qwen2.5-7B shapes, LoRA rank 8, 16 x 16 x 1024
# Each shape's runs: `default` (nothing added), then each of its variants' flag sets, in order; STEPS steps each (q7:
# at most 4, ~51 s a step on an H200), no evaluation, no checkpoint. Then `bench/report.py defaults OUTDIR` writes each shape's default over its fastest run
# (median step after the first), the update MFU and peak memory of each, and the summary keys default_vs_best and
# default_update_mfu_1p5b.
# On the GPU machine (the random models are made once, in /tmp/models):
#   source bench/gpu_env.sh && setsid nohup bash bench/run_fast_defaults.sh 6 /tmp/runs/fd > /tmp/fd.log 2>&1 &
# SHAPES picks shapes (default "add calc q1p5 q7"); DRY=1 prints the commands instead.
STEPS=${1:-6}; OUTDIR=${2:-/tmp/runs/fd}; SHAPES=${SHAPES:-"add calc q1p5 q7"}
quiet=(--eval-every 0 --save-every -1 --log-samples-every 0 --output-dir "$OUTDIR")
run() {  # NAME FLAGS...
  local name=$1; shift
  [ -f "$OUTDIR/$name/metrics.jsonl" ] && [ "$(grep -c train/loss "$OUTDIR/$name/metrics.jsonl")" -ge "$n" ] && return
  rm -rf "${OUTDIR:?}/$name"
  echo "=== $(date -u +%FT%TZ) $name: grpo.py $*" | tee "$OUTDIR/$name.log"
  [ -n "$DRY" ] && return
  python3 grpo.py "$@" "${quiet[@]}" --steps "$n" --run-name "$name" >> "$OUTDIR/$name.log" 2>&1
  echo "=== exit $?" >> "$OUTDIR/$name.log"
}
mkdir -p "$OUTDIR" /tmp/models
for shape in $SHAPES; do
  n=$STEPS
  case $shape in
    add) base=(--model "$SMOLLM2" --lr 1e-5)
         variants=("nocompile|--no-compile" "mbs128|--micro-batch-size 128") ;;
    calc) base=(--model "$SMOLLM2" --dataset multiplication --tools calculator --max-turns 3 --max-prompt-len 1024
                --prompts-per-step 64 --group-size 8 --lr 1e-5)
          variants=("nocompile|--no-compile" "mbs64|--micro-batch-size 64") ;;
    q1p5) [ -d /tmp/models/q1p5 ] || [ -n "$DRY" ] || python3 bench/make_random_model.py --shape 1.5b --tokenizer "$SMOLLM2" --out /tmp/models/q1p5
          base=(--model /tmp/models/q1p5 --prompts-per-step 16 --group-size 16 --max-new-tokens 1024 --lr 1e-6)
          variants=("nocompile|--no-compile"
                    "t16k_compile|--max-tokens-per-micro-batch 16384 --attn-implementation varlen --compile") ;;
    q7) [ -d /tmp/models/q7 ] || [ -n "$DRY" ] || python3 bench/make_random_model.py --shape 7b --tokenizer "$SMOLLM2" --out /tmp/models/q7
        base=(--model /tmp/models/q7 --lora-rank 8 --prompts-per-step 16 --group-size 16 --max-new-tokens 1024)
        n=$((STEPS < 4 ? STEPS : 4))
        variants=("nocompile|--no-compile" "t8k|--max-tokens-per-micro-batch 8192 --attn-implementation varlen") ;;
    *) echo "unknown shape $shape"; continue ;;
  esac
  run "${shape}__default" "${base[@]}"
  for v in "${variants[@]}"; do
    IFS=' ' read -r -a flags <<< "${v#*|}"
    run "${shape}__${v%%|*}" "${base[@]}" "${flags[@]}"
  done
done
[ -n "$DRY" ] && exit 0
for f in "$OUTDIR"/*.log; do printf '%-24s %s\n' "$(basename "$f" .log)" "$(grep -hE "^micro-batches|^done:|Error" "$f" | tail -n 2 | tr '\n' ' ' | cut -c1-220)"; done
