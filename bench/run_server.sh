#!/usr/bin/env bash
# GRPO on addition with SmolLM2-135M-Instruct on one machine with 2 GPUs, the same work in each run, one run after the
# other (bench/results/server_*):
#   colocate      1 GPU, the engine in-process
#   colocate_x2   torchrun x2, an engine on each GPU (the baseline for the 2-GPU placements)
#   server_sync   trainer on GPU 0, an SGLang server on GPU 1 (sglang.launch_server, as a user starts it), weights over NCCL
#   server_async  the same, --async-rollout (one step off-policy)
#   injob_async   torchrun x1 on GPU 0 with --rollout-gpus 1 --async-rollout: the job starts its own server on GPU 1
# The two server runs share one server (it outlives a trainer). A run continues from its checkpoint when
# started again; with DEADLINE (a Unix time) a run gets SIGTERM in time to save and exit.
# On the GPU machine: source bench/gpu_env.sh && DEADLINE=$(( $(date +%s) + 560 )) bash bench/run_server.sh STEPS OUTDIR [RUNS]
STEPS=${1:-40}; OUTDIR=${2:-runs}; RUNS=${3:-"colocate_x2 server_sync server_async injob_async colocate"}
MODEL=${MODEL:-$SMOLLM2}; PORT=${PORT:-30000}; URL=http://127.0.0.1:$PORT
# SERVER_GPU=0: the server on the trainer's GPU (a one-GPU machine), its share of memory SERVER_MEM, weights over
# gloo (NCCL refuses two members of one group on one GPU): tests the server path, not its speed.
SERVER_GPU=${SERVER_GPU:-1}; SERVER_MEM=${SERVER_MEM:-0.6}; SYNC=(); [ "$SERVER_GPU" = 0 ] && SYNC=(--rollout-sync-backend gloo)
common=(--model "$MODEL" --prompts-per-step 32 --group-size 16 --max-new-tokens 256 --lr 1e-5
        --micro-batch-size 128 --eval-every 10 --eval-before-train --save-every 10 --log-samples-every 10
        --output-dir "$OUTDIR" $EXTRA)
mkdir -p "$OUTDIR"

stop_server() { pkill -f "sglang[.]launch_server --model-path .* --port $PORT " ; sleep 5; }  # GPU 1 for the next run

start_server() {  # SGLang's own launcher, the engine settings colocate uses
  curl -sf "$URL/health" > /dev/null && return 0
  echo "=== $(date -u +%FT%TZ) server" >> "$OUTDIR/server.log"
  CUDA_VISIBLE_DEVICES=$SERVER_GPU python3 -m sglang.launch_server --model-path "$MODEL" --port "$PORT" --skip-tokenizer-init \
    --mem-fraction-static "$SERVER_MEM" --attention-backend triton --sampling-backend pytorch --cuda-graph-backend-prefill disabled \
    --log-level warning >> "$OUTDIR/server.log" 2>&1 &
}

for run in $RUNS; do
  steps=$STEPS
  [ -d "$OUTDIR/$run/checkpoints/step_$(printf %06d "$steps")" ] && continue  # done
  resume=(); [ -d "$OUTDIR/$run/checkpoints" ] && resume=(--resume)
  launch=(env CUDA_VISIBLE_DEVICES=${TRAIN_GPU:-0} python3); extra=()
  case $run in
    colocate_x2) stop_server; launch=(torchrun --standalone --nproc_per_node 2) ;;
    server_sync) start_server; extra=(--rollout-mode server --rollout-url "$URL" "${SYNC[@]}") ;;
    server_async) start_server; extra=(--rollout-mode server --rollout-url "$URL" "${SYNC[@]}" --async-rollout) ;;
    injob_async) stop_server; launch=(torchrun --standalone --nproc_per_node 1); extra=(--rollout-mode server --rollout-gpus 1 --async-rollout) ;;
  esac
  limit=()
  if [ -n "$DEADLINE" ]; then
    left=$(( DEADLINE - $(date +%s) )); [ "$left" -lt 120 ] && break  # too little time to start and do a step
    limit=(timeout -s TERM -k 60 "$left")
  fi
  echo "=== $(date -u +%FT%TZ) $run ${resume[*]}" >> "$OUTDIR/$run.log"
  "${limit[@]}" "${launch[@]}" grpo.py --steps "$steps" "${common[@]}" "${extra[@]}" "${resume[@]}" --run-name "$run" >> "$OUTDIR/$run.log" 2>&1
  echo "=== exit $?" >> "$OUTDIR/$run.log"
done
stop_server  # only this script's server: a machine may run other servers (a `pkill` of all of them ended another bench's)
tail -n 3 "$OUTDIR"/*.log
