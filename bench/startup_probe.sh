#!/usr/bin/env bash
# Where a warm GRPO start-up goes before step 1, beyond what grpo.py logs (bench/results/README.md,
# "Start-up"): can Python cache bytecode here, how long the imports take in a fresh interpreter without
# and with a bytecode cache, what the spawned SGLang scheduler pays to re-run grpo.py's module level
# first, and grpo.py's set-up steps.
#
#   source bench/gpu_env.sh && bash bench/startup_probe.sh $OUT/probe.txt
#
# "Without a cache" is the GPU image as found (PYTHONDONTWRITEBYTECODE=1, no .pyc shipped), reproduced
# once .pyc files exist by pointing PYTHONPYCACHEPREFIX at an empty folder that is never written.
set -u
out=${1:?usage: startup_probe.sh OUT_FILE}
TIMEFORMAT="%R s"
t() { { time "$@" > /dev/null 2>&1; } 2>&1; }
{
echo "== bytecode: can Python write and find .pyc files next to each package?"
python3 - <<'PY'
import importlib, os, sys
print("sys.dont_write_bytecode", sys.dont_write_bytecode, "| PYTHONDONTWRITEBYTECODE", os.environ.get("PYTHONDONTWRITEBYTECODE"),
      "| pycache_prefix", sys.pycache_prefix, "| python", sys.executable, sys.version.split()[0])
for name in ("json", "torch", "torch._dynamo", "transformers", "sympy", "sglang", "tyro"):
    try:
        d = os.path.dirname(importlib.util.find_spec(name).origin)
    except Exception as e:
        print(name, "not found", e); continue
    c = os.path.join(d, "__pycache__")
    n_py = len([f for f in os.listdir(d) if f.endswith(".py")])
    n_pyc = len(os.listdir(c)) if os.path.isdir(c) else 0
    print(f"{name:14s} {d}  writable={os.access(d, os.W_OK)}  .py={n_py}  __pycache__ files={n_pyc}")
PY
echo; echo "== fresh interpreters without a bytecode cache, seconds"
export PYTHONDONTWRITEBYTECODE=1 PYTHONPYCACHEPREFIX=/tmp/empty-pycache
for i in 1 2; do echo "import torch, transformers: $(t python3 -c 'import torch, transformers')"; done
for i in 1 2; do echo "import grpo (its module level): $(t python3 -c 'import sys; sys.path.insert(0, "."); import grpo')"; done
for i in 1 2; do echo "import sglang.srt.entrypoints.engine: $(t python3 -c 'import sglang.srt.entrypoints.engine')"; done
for i in 1 2; do echo "import sglang.srt.managers.scheduler: $(t python3 -c 'import sglang.srt.managers.scheduler')"; done
echo "what a spawned scheduler does: run grpo.py as __mp_main__, then import the scheduler module:"
for i in 1 2; do echo "  $(t python3 -c 'import runpy; runpy.run_path("grpo.py", run_name="__mp_main__"); import sglang.srt.managers.scheduler')"; done
echo; echo "== grpo.py's set-up before the engine, in one process, still without a cache (seconds from launch)"
python3 - <<'PY'
import os, sys, time
sys.path.insert(0, ".")
from runlog import launch_time
t = launch_time()
def lap(what):
    global t
    print(f"  {what}: {time.time() - t:.2f} s"); t = time.time()
import grpo; lap("import grpo")
rank, world, device = grpo.init_distributed(30); lap("init_distributed (NCCL, world of one)")
tokenizer, context_len = grpo.check_model(os.environ["SMOLLM2"]); lap("check_model (config + tokenizer)")
a = grpo.Args(model=os.environ["SMOLLM2"])
grpo.task_prompts(tokenizer, list(a.dataset), a.eval_dataset, seed=0, num_eval=a.num_eval_prompts, max_prompt_len=a.max_prompt_len)
lap("task_prompts (default task)")
grpo.dist.destroy_process_group()
PY
echo; echo "== the same with bytecode cached (PYTHONDONTWRITEBYTECODE unset: the first run writes .pyc files)"
unset PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX
for i in 1 2 3; do echo "import sglang.srt.managers.scheduler: $(t python3 -c 'import sglang.srt.managers.scheduler')"; done
for i in 1 2; do echo "import grpo: $(t python3 -c 'import sys; sys.path.insert(0, "."); import grpo')"; done
echo; echo "== import profile of the scheduler module, top 25 cumulative (us)"
python3 -X importtime -c 'import sglang.srt.managers.scheduler' 2>&1 | sort -t'|' -k2 -n -r | head -25
} > "$out" 2>&1
cat "$out"
