#!/usr/bin/env bash
# Issue 42: LoRA on ONE GPU (bench/results/lora_*). Three parts, each sized for one call of the GPU machine (~9 min):
#   acc   SmolLM2-135M-Instruct on addition, STEPS (60) steps, four runs side by side: full fine-tuning at LR (1e-5,
#         today's runs') and LoRA rank 1, 8, 32 at LORA_LR (1e-4: ~10x, as "LoRA Without Regret"), alpha 32, every
#         linear layer, SGLang serving the adapter (--lora-sync adapter, the default; a name ending in m, e.g. r8m: the
#         adapter merged into SGLang's weights, --lora-sync merge; in a: adapter, named);
#         --eval-every 20 on 256 held-out prompts; SGLang at MEM (0.1) each, launched 20 s apart;
#         PROMPTS x GROUP (16 x 8) samples of at most MAX_NEW (128) tokens a step (run_variants.sh: 32 x 8 x 256, 7-13 s
#         a step three at once: 60 steps would not fit a call); with DEADLINE each run saves and stops in time, and the
#         same command continues them (--resume) while OUTDIR is there
#   7b    a Qwen2.5-7B-shaped model (random weights): LoRA rank 8 with --lora-sync adapter (SGLang serves the adapter,
#         the base synced once), 5 steps (memory and seconds by phase), then full
#         fine-tuning of it, 2 steps, and where that does not fit, with --offload in the time DEADLINE leaves; each under
#         `timeout` (an out-of-memory end is a result: its log says so, and `run` prints oom)
#   sync  bench/lora_sync_bench.py at 1.5B and 7B shapes: sync seconds, merge vs adapter (SGLang with LoRA on)
#   all   the three in order (a part already done is skipped)
# Each part ends by packing what the report needs (metrics, run info, logs: no checkpoints) into $OUT/lora_PART.tgz.
# On the GPU machine (OUTDIR: keep it between calls, not $OUT):
#   source bench/gpu_env.sh && DEADLINE=$(( $(date +%s) + 530 )) bash bench/run_lora.sh acc [OUTDIR]
#   source bench/gpu_env.sh && bash bench/run_lora.sh 7b [OUTDIR]      # then: ... sync [OUTDIR]
# then, with the tgz files unpacked into OUTDIR (tar xzf lora_acc.tgz -C OUTDIR; ...):
#   python3 bench/report.py lora OUTDIR --out bench/results/lora_h100.json --png bench/results/lora_addition_h100.png \
#     --summary bench/results/summary.json
# Knobs (environment): STEPS, LR, LORA_LR, MEM, MEM_7B (0.5), PROMPTS, GROUP, MAX_NEW, RUNS ("full r1 r8 r32"),
# PARALLEL (4), OMP_NUM_THREADS (cores / (PARALLEL + 1)), MODELS (/tmp/models: the random-weight models).
PART=${1:?"which part: acc, 7b, sync or all"}; OUTDIR=${2:-runs/lora}
STEPS=${STEPS:-60}; MODELS=${MODELS:-/tmp/models}; PARALLEL=${PARALLEL:-4}; RUNS=${RUNS:-"full r1 r8 r32"}
mkdir -p "$OUTDIR"

model() {  # a random-weight model of Qwen2.5's shape $1, made once
  local dir=$MODELS/qwen2.5-$1-random
  [ -e "$dir/config.json" ] || python3 bench/make_random_model.py --shape "$1" --tokenizer "$SMOLLM2" --out "$dir" >&2 || return 1
  echo "$dir"
}

left() { if [ -z "$DEADLINE" ]; then echo 100000; else echo $(( DEADLINE - $(date +%s) )); fi; }

run() {  # PART NAME LIMIT_S ARGS...: grpo.py under timeout, its console in OUTDIR/PART/NAME.log, its end in one line
  local part=$1 name=$2 limit=$3 t0 rc status=ok; shift 3
  local log=$OUTDIR/$part/$name.log; t0=$(date +%s)
  rm -rf "${OUTDIR:?}/$part/$name"  # a run cut short before: again from the start (no checkpoints here)
  echo "=== $(date -u +%FT%TZ) $name" >> "$log"
  timeout -s TERM -k 30 "$limit" python3 grpo.py "$@" --output-dir "$OUTDIR/$part" --run-name "$name" >> "$log" 2>&1
  rc=$?
  if grep -qi "out of memory\|OutOfMemory" "$log"; then status=oom; elif [ $rc -ne 0 ]; then status="fail($rc)"; fi
  echo "=== exit $rc $status $(( $(date +%s) - t0 ))s" >> "$log"
  echo "$name $status $(( $(date +%s) - t0 ))s"
}

pack() {  # what the report reads, into $OUT (only 8 files come back from a call)
  [ -n "$OUT" ] || return 0
  (cd "$OUTDIR" && find "$1" -maxdepth 2 \( -name '*.log' -o -name 'metrics.jsonl' -o -name 'run_info.json' \
     -o -name 'args.json' -o -name '*.json' \) -not -path '*/checkpoints/*' -print0 | tar czf "$OUT/lora_$1.tgz" --null -T -)
}

acc() {
  mkdir -p "$OUTDIR/acc"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / (PARALLEL + 1) > 0 ? $(nproc) / (PARALLEL + 1) : 1 ))}
  local common=(--model "$SMOLLM2" --steps "$STEPS" --prompts-per-step "${PROMPTS:-16}" --group-size "${GROUP:-8}"
                --max-new-tokens "${MAX_NEW:-128}" --micro-batch-size 16 --sglang-mem-fraction "${MEM:-0.1}"
                --eval-every 20 --eval-before-train --save-every 20 --keep-checkpoints 1 --log-samples-every 20)
  for name in $RUNS; do
    [ -d "$OUTDIR/acc/$name/checkpoints/step_$(printf %06d "$STEPS")" ] && continue  # done
    [ "$(left)" -lt 150 ] && break  # too little time to start and train
    while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do wait -n; done
    local flags=(--lr "${LR:-1e-5}") resume=() limit=()
    [ "$name" != full ] && flags=(--lr "${LORA_LR:-1e-4}" --lora-rank "$(echo "${name#r}" | tr -d am)")
    [ "${name%a}" != "$name" ] && flags+=(--lora-sync adapter)  # r8a: rank 8, SGLang serving the adapter
    [ "${name%m}" != "$name" ] && flags+=(--lora-sync merge)    # r8m: rank 8, merged into the engine's weights
    [ -d "$OUTDIR/acc/$name" ] && resume=(--resume)  # stopped before its first checkpoint: from step 0
    [ -n "$DEADLINE" ] && limit=(timeout -s TERM -k 60 "$(left)")  # SIGTERM: it saves the finished steps, exits
    echo "=== $(date -u +%FT%TZ) $name ${resume[*]}" >> "$OUTDIR/acc/$name.log"
    ( "${limit[@]}" python3 grpo.py "${common[@]}" "${flags[@]}" "${resume[@]}" --output-dir "$OUTDIR/acc" \
        --run-name "$name" >> "$OUTDIR/acc/$name.log" 2>&1; echo "=== exit $?" >> "$OUTDIR/acc/$name.log" ) &
    sleep 20  # SGLang reads the free memory before and after loading its weights: not while another engine starts
  done
  wait
  for name in $RUNS; do
    printf '%-5s %s\n' "$name" "$(grep -h "^step \|^eval after" "$OUTDIR/acc/$name.log" 2>/dev/null | tail -n 1 | cut -c1-150)"
  done
  pack acc
}

b7() {
  mkdir -p "$OUTDIR/7b"
  local m common
  m=$(model 7b) || return 1
  common=(--model "$m" --prompts-per-step 16 --group-size 8 --max-new-tokens 128 --micro-batch-size 8
          --gradient-checkpointing --sglang-mem-fraction "${MEM_7B:-0.5}" --eval-every 0 --save-every -1)
  grep -q "=== exit 0 ok" "$OUTDIR/7b/lora.log" 2>/dev/null || run 7b lora 420 "${common[@]}" --steps 5 --lr 1e-5 --lora-rank 8 --lora-sync adapter
  grep -q "=== exit" "$OUTDIR/7b/full.log" 2>/dev/null || run 7b full 300 "${common[@]}" --steps 2 --lr 1e-6
  # full fine-tuning that did not fit: what --offload costs, in the time left (DEADLINE)
  if ! grep -q "=== exit 0 ok" "$OUTDIR/7b/full.log" && ! grep -q "=== exit" "$OUTDIR/7b/full_offload.log" 2>/dev/null \
    && [ "$(left)" -gt 240 ]; then
    run 7b full_offload $(( $(left) > 390 ? 360 : $(left) - 30 )) "${common[@]}" --steps 2 --lr 1e-6 --offload
  fi
  grep -h "^=== exit\|^step " "$OUTDIR"/7b/*.log | cut -c1-150
  pack 7b
}

syncs() {
  mkdir -p "$OUTDIR/sync"
  local shape m out
  for shape in 1.5b 7b; do
    out=$OUTDIR/sync/lora_sync_${shape/./p}.json
    [ -s "$out" ] && continue
    m=$(model "$shape") || return 1
    timeout -k 30 360 python3 bench/lora_sync_bench.py --model "$m" --rank 8 --out "$out" > "${out%.json}.log" 2>&1
    echo "sync $shape: exit $? $(grep -h '"merge_over_adapter"' "$out" 2>/dev/null)"
  done
  pack sync
}

case $PART in
  acc) acc ;;
  7b) b7 ;;
  sync) syncs ;;
  all) acc && b7 && syncs ;;
  *) echo "unknown part $PART: acc, 7b, sync or all" >&2; exit 2 ;;
esac
