#!/usr/bin/env bash
# GRPO on multiplication (3 x 2 digits) with and without the calculator, SmolLM2-135M-Instruct, one run
# after the other on the same GPU and engine settings (bench/results/tools_*). RUNS picks the runs (default
# "tools_calculator tools_none"; tools_python: the python tool, its programs in the bubblewrap jail). A run continues from its last
# checkpoint when started again, so a 100-step pair can span calls of the GPU machine: with DEADLINE (a
# Unix time) a run gets SIGTERM in time to save a checkpoint (grpo.py's --save-on-signal) and exit.
# On the GPU machine: source bench/gpu_env.sh && DEADLINE=$(( $(date +%s) + 560 )) bash bench/run_tools.sh [STEPS] [OUTDIR]
STEPS=${1:-100}; OUTDIR=${2:-runs}
common=(--model "$SMOLLM2" --dataset multiplication --steps "$STEPS" --prompts-per-step 32 --group-size 8
        --max-new-tokens 256 --lr 1e-5 --micro-batch-size 128 --eval-every 10 --eval-before-train --save-every 10
        --log-samples-every 10 --output-dir "$OUTDIR")
mkdir -p "$OUTDIR"
for run in ${RUNS:-tools_calculator tools_none}; do
  [ -d "$OUTDIR/$run/checkpoints/step_$(printf %06d "$STEPS")" ] && continue  # done
  resume=(); [ -d "$OUTDIR/$run" ] && resume=(--resume)  # stopped before its first checkpoint: from step 0
  extra=(); [ "$run" != tools_none ] && extra=(--tools "${run#tools_}" --max-turns 3 --max-prompt-len 1024 --micro-batch-size 32)
  limit=()
  if [ -n "$DEADLINE" ]; then
    left=$(( DEADLINE - $(date +%s) )); [ "$left" -lt 120 ] && break  # too little time to start and do a step
    limit=(timeout -s TERM -k 60 "$left")
  fi
  echo "=== $(date -u +%FT%TZ) $run ${resume[*]}" >> "$OUTDIR/$run.log"
  "${limit[@]}" python3 grpo.py "${common[@]}" "${extra[@]}" "${resume[@]}" --run-name "$run" >> "$OUTDIR/$run.log" 2>&1
  echo "=== exit $?" >> "$OUTDIR/$run.log"
done
tail -n 3 "$OUTDIR"/tools_*.log
