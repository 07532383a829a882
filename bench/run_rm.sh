#!/usr/bin/env bash
# The whole reward-model loop on one GPU with nothing from outside (bench/results/rm_*): SmolLM2-135M-Instruct's
# own addition completions -> pairs labelled by the rule (bench/rm_pairs.py) -> a reward model trained from
# SmolLM2 (train_rm.py) -> GRPO with that reward model alone (--reward-weights 0 1; accuracy judged by the rule).
# Each stage is skipped when its output exists and the runs continue from their checkpoints, so it can span
# calls of the GPU machine: with DEADLINE (a Unix time) a run gets SIGTERM in time to save and exit.
# On the GPU machine: source bench/gpu_env.sh && DEADLINE=$(( $(date +%s) + 540 )) bash bench/run_rm.sh [OUTDIR] [GRPO_STEPS]
# Knobs (environment): RM_INIT, the model the reward model starts from (default $SMOLLM2; a policy checkpoint's model/
# folder that another run is still writing is waited for, at most RM_WAIT s, the pairs made meanwhile), RM_NAME (its run name, default rm),
# RM_STEPS (600), RM_LR (5e-5: at 1e-5 the 'number' pairs stayed at chance for 400 steps, results/README.md), NUMBER_PAIRS
# (4 per prompt), MEM (SGLang's share, 0.3), GROUP (GRPO's group size, 8), MB (GRPO's micro-batch, 16). GRPO_STEPS 0:
# no GRPO stage (pairs and a reward model only).
OUTDIR=${1:-runs}; STEPS=${2:-60}; RM_STEPS=${RM_STEPS:-600}; MEM=${MEM:-0.3}; RM_INIT=${RM_INIT:-$SMOLLM2}; RM_NAME=${RM_NAME:-rm}
mkdir -p "$OUTDIR"
limit() {  # the command, killed with SIGTERM before DEADLINE
  if [ -n "$DEADLINE" ]; then
    local left=$(( DEADLINE - $(date +%s) )); [ "$left" -lt 90 ] && return 124
    timeout -s TERM -k 60 "$left" "$@"
  else "$@"; fi
}
if [ ! -s "$OUTDIR/pairs.eval.jsonl" ]; then
  limit python3 bench/rm_pairs.py --model "$SMOLLM2" --dataset addition --out "$OUTDIR/pairs.jsonl" --train-prompts 3000 --number-pairs "${NUMBER_PAIRS:-4}" \
    --eval-prompts 500 --group-size 8 --max-new-tokens 256 --sglang-mem-fraction "$MEM" > "$OUTDIR/pairs.log" 2>&1 || exit 1
fi
rm_final="$OUTDIR/$RM_NAME/checkpoints/step_$(printf %06d "$RM_STEPS")/model"
if [ ! -d "$rm_final" ]; then
  # a checkpoint's model/ folder that another run is still writing: wait for it (it appears whole, an atomic rename),
  # at most RM_WAIT seconds (3600); anything else (a hub id, a folder) goes to train_rm.py as it is
  while [[ "$RM_INIT" == */checkpoints/step_*/model ]] && [ ! -e "$RM_INIT/config.json" ]; do
    if [ "$SECONDS" -gt "${RM_WAIT:-3600}" ] || { [ -n "$DEADLINE" ] && [ $(( DEADLINE - $(date +%s) )) -lt 90 ]; }; then
      echo "run_rm.sh: RM_INIT=$RM_INIT is not there after $SECONDS s (a typo, or the run writing it failed?)" >&2; exit 1
    fi
    sleep 10
  done
  resume=(); [ -d "$OUTDIR/$RM_NAME" ] && resume=(--resume)
  echo "=== $(date -u +%FT%TZ) $RM_NAME from $RM_INIT ${resume[*]}" >> "$OUTDIR/$RM_NAME.log"
  limit python3 train_rm.py --model "$RM_INIT" --dataset "$OUTDIR/pairs.jsonl" --eval-dataset "$OUTDIR/pairs.eval.jsonl" \
    --steps "$RM_STEPS" --pairs-per-step 64 --micro-batch-size 64 --lr "${RM_LR:-5e-5}" --eval-every 50 --eval-before-train --save-every 100 \
    --output-dir "$OUTDIR" --run-name "$RM_NAME" "${resume[@]}" >> "$OUTDIR/$RM_NAME.log" 2>&1
  echo "=== exit $?" >> "$OUTDIR/$RM_NAME.log"
  [ -d "$rm_final" ] || exit 1
fi
if [ "$STEPS" -gt 0 ] && [ ! -d "$OUTDIR/grpo_rm/checkpoints/step_$(printf %06d "$STEPS")" ]; then
  resume=(); [ -d "$OUTDIR/grpo_rm" ] && resume=(--resume)
  echo "=== $(date -u +%FT%TZ) grpo_rm ${resume[*]}" >> "$OUTDIR/grpo_rm.log"
  limit python3 grpo.py --model "$SMOLLM2" --reward-model "$rm_final" --reward-weights 0 1 --steps "$STEPS" \
    --prompts-per-step 32 --group-size "${GROUP:-8}" --max-new-tokens 256 --lr 1e-5 --micro-batch-size "${MB:-16}" --eval-every 10 \
    --eval-before-train --save-every 10 --keep-checkpoints 1 --sglang-mem-fraction "$MEM" --log-samples-every 10 \
    --output-dir "$OUTDIR" --run-name grpo_rm "${resume[@]}" >> "$OUTDIR/grpo_rm.log" 2>&1
  echo "=== exit $?" >> "$OUTDIR/grpo_rm.log"
fi
tail -n 3 "$OUTDIR"/*.log
