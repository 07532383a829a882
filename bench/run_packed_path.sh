#!/usr/bin/env bash
# Issue 55's open question: do the micro-batch loops' queued copies (common.to_device: pinned buffers, no wait for the
# GPU) cost time at small shapes? bench/packing_bench.py, one process a shape, the same batch in every run, each way of
# copying in turn: `packed/varlen` (grpo.py's way now), `/waits` (the copies as before issue 55: blocking, the mask on
# the GPU), `/direct` (non-blocking from ordinary memory). SHAPES: "smollm2 q1p5" (the default) or either.
#   source bench/gpu_env.sh && bash bench/run_packed_path.sh /tmp/runs/pp
OUT=${1:-/tmp/runs/pp}; SHAPES=${SHAPES:-"smollm2 q1p5"}; mkdir -p "$OUT"
ways() {  # ways SUFFIX ROUNDS: each way of copying, ROUNDS times in turn
  for _ in $(seq "$2"); do for w in "" /waits /direct; do printf '%s ' "packed/varlen$1$w"; done; done
}
for shape in $SHAPES; do
  case $shape in
    # SmolLM2-135M at the README quickstart's size: 512 samples, ~60 prompt + 20-200 response tokens, 65536 tokens
    # shellcheck disable=SC2046
    smollm2) python3 bench/packing_bench.py --model "$SMOLLM2" --samples 512 --prompt-len 60 --min-len 20 \
               --max-len 200 --max-tokens 65536 --steps 5 --warmup 2 --runs $(ways "" 2) $(ways /compile 1) \
               --out "$OUT/smollm2.json" > "$OUT/smollm2.log" 2>&1 ;;
    # Qwen2.5-1.5B shapes at 1024 tokens: 256 samples, the default's 33792-token budget, compiled as by default
    # shellcheck disable=SC2046
    q1p5) python3 bench/packing_bench.py --model 1.5b --samples 256 --prompt-len 100 --min-len 50 --max-len 1024 \
            --max-tokens 33792 --steps 2 --warmup 1 --runs $(ways /compile 1) \
            --out "$OUT/q1p5.json" > "$OUT/q1p5.log" 2>&1 ;;
    *) echo "unknown shape $shape" ;;
  esac
done
grep -h "^run " "$OUT"/*.log
