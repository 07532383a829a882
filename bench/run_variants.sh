#!/usr/bin/env bash
# Issue 30: the policy losses, advantages and rollout corrections side by side on ONE GPU, SmolLM2-135M-Instruct, the
# same seed, settings and data in every run, STEPS steps each (bench/results/variants_*):
#   addition (9 runs)        add_grpo (today's default), add_gspo, add_cispo, add_rloo, add_reinforcepp,
#                            add_tis, add_mis, add_icepop, add_seqmask (GRPO with each --rollout-correction)
#   multiplication + --tools calculator (3 runs)   mul_ppoclip, mul_gspo, mul_cispo (the multi-turn masks under each loss)
#   addition, 4 updates a batch (4 runs)   add_ppoclip_mb4, add_gspo_mb4, add_cispo_mb4, add_sapo_mb4 (--num-minibatches 4: with one
#                            update a batch every ratio is 1 when the loss is computed, nothing clips and the
#                            losses take the same step; here the ratios move and each loss's clip range acts)
# PARALLEL runs at once (default 3: six at once ran out of the H100's 80 GB, results/README.md), each with its own SGLang engine at --sglang-mem-fraction MEM (default 0.1: SGLang
# sizes its KV cache from the memory free when it starts, so a small share fits beside the others; at 0.07 an engine refused
# to start when another process allocated between its two memory readings), launched 30 s apart.
# A run continues from its checkpoint when started again; with DEADLINE (a Unix time) each run gets SIGTERM in time to
# save a checkpoint (--save-on-signal) and exit, and no run starts with less than 150 s left: a call of the GPU machine
# picks up where the last one stopped. Logs and run folders under OUTDIR (keep it between calls: not $OUT).
# On the GPU machine:
#   source bench/gpu_env.sh && DEADLINE=$(( $(date +%s) + 560 )) bash bench/run_variants.sh [STEPS] [OUTDIR] [RUNS]
# then, once every run has its last checkpoint (the report draws with plot.py, one figure per task):
#   python3 bench/report.py variants OUTDIR --task addition --out bench/results/variants_addition.json \
#     --png bench/results/variants_addition.png --summary bench/results/summary.json      # and --task tools
# Knobs (environment): PARALLEL, OMP_NUM_THREADS (cores / (PARALLEL + 1)), MEM, PROMPTS (32), GROUP (8), MB (micro-batch size, 16: the same update at any size), LR (1e-5), SEED (0).
STEPS=${1:-60}; OUTDIR=${2:-runs/variants}
RUNS=${3:-"add_grpo add_gspo add_cispo add_rloo add_reinforcepp add_tis add_mis add_icepop add_seqmask mul_ppoclip mul_gspo mul_cispo
            add_ppoclip_mb4 add_gspo_mb4 add_cispo_mb4 add_sapo_mb4"}
PARALLEL=${PARALLEL:-3}; MEM=${MEM:-0.1}
# torch's CPU threads: by default each process takes every core, and PARALLEL trainers beside their SGLang schedulers
# oversubscribe the CPU (four runs on 16 cores: 28-31 s a step; capped at 3 threads each: 7-13 s, results/README.md)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / (PARALLEL + 1) > 0 ? $(nproc) / (PARALLEL + 1) : 1 ))}
common=(--model "$SMOLLM2" --steps "$STEPS" --seed "${SEED:-0}" --prompts-per-step "${PROMPTS:-32}" --group-size "${GROUP:-8}"
        --max-new-tokens 256 --lr "${LR:-1e-5}" --micro-batch-size "${MB:-16}" --sglang-mem-fraction "$MEM" --eval-every 10
        --eval-before-train --save-every 20 --keep-checkpoints 1 --log-samples-every 20 --output-dir "$OUTDIR")
mkdir -p "$OUTDIR"

flags() {  # the run's own flags: one axis changed from the default, or the task with tools
  case $1 in
    add_grpo) ;;
    add_gspo) echo --policy-loss gspo ;;
    add_cispo) echo --policy-loss cispo ;;
    add_rloo) echo --advantage rloo ;;
    add_reinforcepp) echo --advantage reinforce++ ;;
    add_tis) echo --rollout-correction tis ;;
    add_mis) echo --rollout-correction mis ;;
    add_icepop) echo --rollout-correction icepop ;;
    add_seqmask) echo --rollout-correction seq-mask ;;
    add_*_mb4) loss=${1#add_}; loss=${loss%_mb4}; [ "$loss" = ppoclip ] && loss=ppo-clip
               echo --num-minibatches 4 --policy-loss "$loss" ;;
    mul_*) loss=${1#mul_}; [ "$loss" = ppoclip ] && loss=ppo-clip
           echo --dataset multiplication --tools calculator --max-turns 3 --max-prompt-len 1024 --policy-loss "$loss" ;;
    *) echo "unknown run $1" >&2; return 1 ;;
  esac
}

launch() {  # one run in the background, its console appended to OUTDIR/<run>.log
  local run=$1 resume=() limit=() extra
  extra=$(flags "$run") || return 1
  [ -d "$OUTDIR/$run" ] && resume=(--resume)  # stopped before its first checkpoint: from step 0
  if [ -n "$DEADLINE" ]; then
    limit=(timeout -s TERM -k 60 $(( DEADLINE - $(date +%s) )))
  fi
  echo "=== $(date -u +%FT%TZ) $run ${resume[*]}" >> "$OUTDIR/$run.log"
  # shellcheck disable=SC2086  # $extra: the run's flags, split on purpose
  ( "${limit[@]}" python3 grpo.py "${common[@]}" $extra "${resume[@]}" --run-name "$run" >> "$OUTDIR/$run.log" 2>&1
    echo "=== exit $?" >> "$OUTDIR/$run.log" ) &
}

for run in $RUNS; do
  [ -d "$OUTDIR/$run/checkpoints/step_$(printf %06d "$STEPS")" ] && continue  # done
  if [ -n "$DEADLINE" ] && [ $(( DEADLINE - $(date +%s) )) -lt 150 ]; then break; fi  # too little time to start and train
  while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do wait -n; done
  launch "$run"
  sleep 30  # SGLang reads the free memory before and after loading its weights: not while another engine starts
done
wait
for run in $RUNS; do
  printf '%-16s %s\n' "$run" "$(grep -h "^step \|^eval after" "$OUTDIR/$run.log" 2>/dev/null | tail -n 1 | cut -c1-150)"
done
