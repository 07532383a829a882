#!/usr/bin/env bash
# GRPO on addition with SmolLM2-135M-Instruct on one machine with 2 GPUs, the same work in each run, one run after the
# other (bench/results/server_*):
#   colocate      1 GPU, the engine in-process
#   colocate_x2   torchrun x2, an engine on each GPU (the baseline for the 2-GPU placements)
#   server_sync   trainer on GPU 0, an SGLang server on GPU 1 (sglang.launch_server, as a user starts it), weights over NCCL
#   server_async  the same, --async-rollout (one step off-policy)
#   injob_async   torchrun x1 on GPU 0 with --rollout-gpus 1 --async-rollout: the job starts its own server on GPU 1
#   injob_full_k2, injob_full_k4   the same with --max-staleness 2 / 4 instead: fully async (producer.py)
# and on more GPUs (CUDA_VISIBLE_DEVICES names them; the job's servers take the last ones):
#   colocate_x4        torchrun x4, an engine on each GPU (the baseline for the 4-GPU placements)
#   injob_async_2p2    torchrun x2 + --rollout-gpus 2 --async-rollout: 2 training GPUs, 2 servers
#   injob_async_tp2    torchrun x1 + --rollout-gpus 2 --rollout-tp 2 --async-rollout: one server over 2 GPUs (3 GPUs)
#   server2_sync       the trainer on TRAIN_GPU, a user's server on each of SERVER_GPUS (default "1 2"), both URLs
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

stop_server() {  # only this script's servers (ports PORT, PORT+1): their GPUs for the next run
  pkill -f "sglang[.]launch_server --model-path .* --port ($PORT|$((PORT + 1))) " ; sleep 5
}

start_server() {  # SGLang's own launcher, the engine settings colocate uses; GPU $1 (default SERVER_GPU), port $2
  local gpu=${1:-$SERVER_GPU} port=${2:-$PORT}
  curl -sf "http://127.0.0.1:$port/health" > /dev/null && return 0
  echo "=== $(date -u +%FT%TZ) server on GPU $gpu, port $port" >> "$OUTDIR/server.log"
  CUDA_VISIBLE_DEVICES=$gpu python3 -m sglang.launch_server --model-path "$MODEL" --port "$port" --skip-tokenizer-init \
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
    injob_full_k*) stop_server; launch=(torchrun --standalone --nproc_per_node 1)
                   extra=(--rollout-mode server --rollout-gpus 1 --max-staleness "${run#injob_full_k}") ;;
    colocate_x4) stop_server; launch=(torchrun --standalone --nproc_per_node 4) ;;
    injob_async_2p2) stop_server; launch=(torchrun --standalone --nproc_per_node 2); extra=(--rollout-mode server --rollout-gpus 2 --async-rollout) ;;
    injob_async_tp2) stop_server; launch=(torchrun --standalone --nproc_per_node 1)
                     extra=(--rollout-mode server --rollout-gpus 2 --rollout-tp 2 --async-rollout) ;;
    server2_sync) stop_server; gpus=(${SERVER_GPUS:-1 2})
                  start_server "${gpus[0]}" "$PORT"; start_server "${gpus[1]}" $((PORT + 1))
                  extra=(--rollout-mode server --rollout-url "$URL" "http://127.0.0.1:$((PORT + 1))" "${SYNC[@]}") ;;
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
