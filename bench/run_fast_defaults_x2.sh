#!/usr/bin/env bash
# Issue 55 on TWO GPUs of one host: run_fast_defaults.sh's shapes split over the GPUs, each shape's runs one after
# another on one GPU (each comparison within one GPU, each run with its GPU to itself: the default sizes itself from
# the whole GPU): GPU 0 q1p5, add, calc, then a cProfile of the addition default (where time/other goes; not compiled:
# dynamo's tracing under cProfile would swamp it); GPU 1 q7, then the GPU tests of the defaults.
#   source bench/gpu_env.sh && setsid nohup bash bench/run_fast_defaults_x2.sh /tmp/runs/fd2 > /tmp/runs/fd2.log 2>&1 &
# Then: python3 bench/report.py defaults /tmp/runs/fd2 --out bench/results/fast_defaults_h200x2.json --summary ...
OUT=${1:-/tmp/runs/fd2}; STEPS=${STEPS:-6}
mkdir -p "$OUT"
(
  CUDA_VISIBLE_DEVICES=0 SHAPES="q1p5 add calc" bash bench/run_fast_defaults.sh "$STEPS" "$OUT" > "$OUT/gpu0.log" 2>&1
  CUDA_VISIBLE_DEVICES=0 python3 -m cProfile -o "$OUT/add_profile.out" grpo.py --model "$SMOLLM2" --lr 1e-5 --no-compile \
    --steps 4 --eval-every 0 --save-every -1 --log-samples-every 0 --output-dir "$OUT/profile" --run-name add \
    > "$OUT/profile.log" 2>&1
  python3 -c "import pstats, sys; s = pstats.Stats(sys.argv[1]).sort_stats('cumulative')
s.print_callees(r'grpo.py:\d+\(main\)'); s.print_callees(r'memory.py:\d+\(phase\)'); s.print_stats(80)" \
    "$OUT/add_profile.out" > "$OUT/add_profile.txt" 2>&1
) &
(
  CUDA_VISIBLE_DEVICES=1 SHAPES="q7" bash bench/run_fast_defaults.sh "$STEPS" "$OUT" > "$OUT/gpu1.log" 2>&1
  CUDA_VISIBLE_DEVICES=1 GRPO_TEST_MODEL="$SMOLLM2" python3 -m pytest tests/test_gpu.py -q -x -p no:cacheprovider \
    -k "never_waits or ppo_three or three_full_steps" > "$OUT/gpu_tests.log" 2>&1
) &
wait
echo "=== done $(date -u +%FT%TZ)"
