#!/usr/bin/env bash
# Issue 15 on one machine with 2 GPUs: `torchrun --nnodes 2`, two nodes of one GPU each (CUDA_VISIBLE_DEVICES=0
# and =1), meeting on localhost: GRPO on addition with SmolLM2-135M-Instruct, an SGLang engine per node, STEPS
# steps with a checkpoint, then the same two launches with --resume for 2 more. Each node's console goes to
# OUTDIR/node<R>.log, the run to OUTDIR/multinode/. tests/patched_run.py engine_owner only prints which rank,
# node and GPU start each engine. NCCL's P2P and shared-memory transports are off, so the ranks talk over its
# network transport as two machines would (the NCCL_DEBUG lines name it: "via NET/Socket" or "NET/IB").
# A second run of the script skips the first part if its checkpoint is there.
# On the GPU machine (nvidia-h200-x2): source bench/gpu_env.sh && bash bench/run_multinode.sh OUTDIR [STEPS]
# GPUS="2 3": the two nodes' GPUs on a bigger machine (default "0 1").
OUTDIR=${1:?usage: bash bench/run_multinode.sh OUTDIR [STEPS]}; STEPS=${2:-10}
MODEL=${MODEL:-$SMOLLM2}
export NCCL_P2P_DISABLE=${NCCL_P2P_DISABLE:-1} NCCL_SHM_DISABLE=${NCCL_SHM_DISABLE:-1}
export NCCL_DEBUG=${NCCL_DEBUG:-INFO} NCCL_DEBUG_SUBSYS=${NCCL_DEBUG_SUBSYS:-INIT,NET}
# --dist-timeout-minutes 5: a node that fails leaves the other at a collective for 5 minutes, not 30
common=(--model "$MODEL" --prompts-per-step 32 --group-size 16 --max-new-tokens 256 --lr 1e-5
        --micro-batch-size 128 --eval-every 5 --eval-before-train --save-every 5 --log-samples-every 5
        --dist-timeout-minutes 5 --output-dir "$OUTDIR" --run-name multinode $EXTRA)
mkdir -p "$OUTDIR"

two_nodes() {  # one run: both launches at once, node 0 on GPU 0 and node 1 on GPU 1; their exit codes at the end
  local port pids=()
  port=$(python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  local gpus=(${GPUS:-0 1})
  for node in 0 1; do
    echo "=== $(date -u +%FT%TZ) node $node: $*" >> "$OUTDIR/node$node.log"
    CUDA_VISIBLE_DEVICES=${gpus[$node]} torchrun --nnodes 2 --node-rank "$node" --nproc-per-node 1 \
      --master-addr 127.0.0.1 --master-port "$port" tests/patched_run.py engine_owner grpo.py \
      "${common[@]}" "$@" >> "$OUTDIR/node$node.log" 2>&1 &
    pids+=($!)
  done
  for node in 0 1; do
    wait "${pids[$node]}"
    echo "=== exit $?" >> "$OUTDIR/node$node.log"
  done
}

[ -d "$OUTDIR/multinode/checkpoints/step_$(printf %06d "$STEPS")" ] || two_nodes --steps "$STEPS"
two_nodes --steps $(( STEPS + 2 )) --resume
grep -h "engine .* started by\|resumed from\|saved \|=== exit" "$OUTDIR"/node0.log "$OUTDIR"/node1.log
grep -h "via NET\|NET/" "$OUTDIR"/node0.log | head -n 3
tail -n 4 "$OUTDIR/node0.log"
