#!/usr/bin/env bash
# Issue 55's small-shape question on ONE GPU, in one call: where do the CPU-bound SmolLM2 steps lose time?
#   1. addition as typed at this code (SGLang's scheduler waits on its sockets when idle: sleep_on_idle) against OLD,
#      this code without sleep_on_idle (its scheduler polls in a loop), and this code with 4 torch CPU
#      threads (OMP_NUM_THREADS=4, not one a core), in turn twice (new old t4 new old t4), 6 steps; the CPU share of
#      the run's processes read from top every 15 s while it lives (<name>_cpu.txt);
#   2. one more run of this code under py-spy (.whl/ carries it): main()'s wall time line by line (spy_add_report.txt);
#   3. bench/run_packed_path.sh at SmolLM2: the micro-batch copies (pinned, blocking as before issue 55, direct), no
#      engine; 4. the GPU tests of the waits in the micro-batch loops; 5. run_packed_path.sh at 1.5B shapes.
#   ~22 min on one H200, in this order of importance.
#   source bench/gpu_env.sh && setsid nohup bash bench/run_cpu_side_ab.sh /tmp/runs/ab > /tmp/runs/ab.log 2>&1 &
OUT=${1:-/tmp/runs/ab}; HERE=$PWD; OLD=${OLD:-/tmp/no_idle_sleep}
mkdir -p "$OUT"
if [ ! -e "$OLD/grpo.py" ]; then  # this tree's code, SGLang's scheduler left to poll (rollout.start_sglang)
  mkdir -p "$OLD" && cp ./*.py "$OLD"/ && sed -i '/sleep_on_idle=True,/d' "$OLD/rollout.py"
  grep -q sleep_on_idle "$OLD/rollout.py" && grep -c "sleep_on_idle=True" "$OLD/rollout.py"
fi
quiet=(--model "$SMOLLM2" --lr 1e-5 --steps 6 --eval-every 0 --save-every -1 --log-samples-every 0 --output-dir "$OUT")
for round in 1 2; do
  for side in new old t4; do
    name=add__${side}_$round; dir=$HERE; [ "$side" = old ] && dir=$OLD  # <shape>__<variant>: report.py reads them
    threads=${OMP_NUM_THREADS:-}; [ "$side" = t4 ] && threads=4
    echo "=== $(date -u +%FT%TZ) $name ($dir, OMP_NUM_THREADS=${threads:-unset})"
    (cd "$dir" && if [ -n "$threads" ]; then export OMP_NUM_THREADS=$threads; fi \
      && exec python3 grpo.py "${quiet[@]}" --run-name "$name" > "$OUT/$name.log" 2>&1) &
    pid=$!
    while kill -0 "$pid" 2>/dev/null; do  # top's second frame: the CPU share over the last second
      top -b -n 2 -d 1 -w 250 | awk '/^top -/{f++} f==2' | grep -E "sglang|python" | head -6 >> "$OUT/${name}_cpu.txt"
      echo "--- $(date -u +%T)" >> "$OUT/${name}_cpu.txt"; sleep 14
    done
  done
done
# where main()'s wall time goes, line by line (the untimed time/other included): py-spy samples the trainer 100 times a
# second from outside, waits included (--idle); bench/spy_report.py puts each sample on the line main() was running
if command -v py-spy > /dev/null; then
  py-spy record --idle --rate 100 --format raw -o "$OUT/spy_add.txt" -- \
    python3 grpo.py "${quiet[@]}" --run-name spy > "$OUT/spy.log" 2>&1
  python3 bench/spy_report.py "$OUT/spy_add.txt" --script grpo.py --top 30 > "$OUT/spy_add_report.txt" 2>&1
fi
SHAPES=smollm2 bash bench/run_packed_path.sh "$OUT/packed_path"
GRPO_TEST_MODEL="$SMOLLM2" timeout 600 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider \
  -k "never_waits or waits_for_the_gpu_only" > "$OUT/gpu_tests.log" 2>&1
SHAPES=q1p5 bash bench/run_packed_path.sh "$OUT/packed_path"
# each run's median step and phases (steps 2-6), in one JSON beside the runs
python3 bench/report.py defaults "$OUT" --out "$OUT/cpu_side_ab.json"
echo "=== done $(date -u +%FT%TZ)"
