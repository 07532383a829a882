#!/usr/bin/env bash
# Issue 43: --deterministic-rollout on ONE GPU, SmolLM2-135M-Instruct on addition, the same seed, data and settings in
# every run, STEPS steps each, three runs side by side (bench/results/deterministic_*):
#   normal   SGLang as every other run here
#   det_a    --deterministic-rollout
#   det_b    --deterministic-rollout again: its samples and metrics must be det_a's, step for step
# Each run has its own SGLang engine at --sglang-mem-fraction MEM (0.1: SGLang sizes its KV cache from the memory free
# when it starts), launched GAP s apart (it reads the free memory twice while it starts), torch's CPU threads
# cores / 4. The three share the GPU and the CPU, each beside the other two, so their ratios compare; their seconds
# are not those of a run alone. No evaluation, no checkpoint: steps only.
# First (~15 s): preflight.DETERMINISTIC_ATTENTION (the copy CPU machines check) against the installed SGLang's list.
# With DEADLINE (a Unix time) each run gets SIGTERM in time to exit; the report compares the steps that every run
# finished. Then bench/report.py deterministic writes RESULTS/deterministic_smollm2_<gpu>.json and the
# summary keys deterministic_rollout_cost and deterministic_mismatch_kl into RESULTS/summary.json (a copy of
# bench/results/summary.json where RESULTS is another folder), and the runs' metrics, samples and logs go to
# RESULTS/deterministic_runs_<gpu>.tgz.
# On the GPU machine, in one call:
#   source bench/gpu_env.sh && DEADLINE=$(( $(date +%s) + 420 )) RESULTS=$OUT bash bench/run_deterministic.sh 20 /tmp/runs/det
# Knobs (environment): MEM (0.1), GAP (20), PROMPTS (32), GROUP (8), MB (16), LR (1e-5), SEED (0), RUNS.
STEPS=${1:-20}; OUTDIR=${2:-runs/deterministic}; RESULTS=${RESULTS:-bench/results}
RUNS=${RUNS:-"normal det_a det_b"}; MEM=${MEM:-0.1}; GAP=${GAP:-20}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / 4 > 0 ? $(nproc) / 4 : 1 ))}
common=(--model "$SMOLLM2" --steps "$STEPS" --seed "${SEED:-0}" --prompts-per-step "${PROMPTS:-32}"
        --group-size "${GROUP:-8}" --max-new-tokens 256 --lr "${LR:-1e-5}" --micro-batch-size "${MB:-16}"
        --sglang-mem-fraction "$MEM" --eval-every 0 --save-every -1 --log-samples-every 1 --output-dir "$OUTDIR")
mkdir -p "$OUTDIR" "$RESULTS"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | grep -oiE 'h[0-9]{3}|a100' | tr 'A-Z' 'a-z')
gpu=${gpu:-gpu}

# before any engine starts (an import that touches the GPU between an engine's two memory readings can stop it)
timeout 120 python3 -c "
from preflight import DETERMINISTIC_ATTENTION as ours
from sglang.srt.server_args import DETERMINISTIC_ATTENTION_BACKEND_CHOICES as theirs
import sglang
same = sorted(ours) == sorted(theirs)
print(('attention list matches' if same else 'attention list DIFFERS from'), 'SGLang', sglang.__version__, sorted(theirs))
" 2>&1 | tail -n 1 > "$OUTDIR/attention_check.txt"
cat "$OUTDIR/attention_check.txt"

for run in $RUNS; do
  flags=(); [ "$run" != normal ] && flags=(--deterministic-rollout)
  rm -rf "${OUTDIR:?}/$run"  # a fresh run each time: the comparison needs both from step 1
  limit=()
  if [ -n "$DEADLINE" ]; then
    left=$(( DEADLINE - $(date +%s) )); [ "$left" -lt 150 ] && { echo "no time left to start $run"; break; }
    limit=(timeout -s TERM -k 30 "$left")
  fi
  echo "=== $(date -u +%FT%TZ) $run ${flags[*]}" > "$OUTDIR/$run.log"
  ( "${limit[@]}" python3 grpo.py "${common[@]}" "${flags[@]}" --run-name "$run" >> "$OUTDIR/$run.log" 2>&1
    echo "=== exit $?" >> "$OUTDIR/$run.log" ) &
  sleep "$GAP"
done
wait
for run in $RUNS; do
  printf '%-8s %s\n' "$run" "$(grep -h "^step " "$OUTDIR/$run.log" 2>/dev/null | tail -n 1 | cut -c1-150)"
done

[ "$RESULTS" != bench/results ] && [ ! -e "$RESULTS/summary.json" ] && cp bench/results/summary.json "$RESULTS/"
python3 bench/report.py deterministic "$OUTDIR" --out "$RESULTS/deterministic_smollm2_$gpu.json" \
  --summary "$RESULTS/summary.json" --command "DEADLINE=... bash bench/run_deterministic.sh $STEPS $OUTDIR (RUNS=$RUNS MEM=$MEM GAP=$GAP)"
tar czf "$RESULTS/deterministic_runs_$gpu.tgz" -C "$OUTDIR" --exclude checkpoints .
