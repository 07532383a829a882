"""Seconds per GRPO step on a CPU, by phase: this tree against an earlier commit, with the CPU as it is and as
CPUs without bf16 instructions would be, the runs alternated (other jobs on the machine drift).

    python bench/make_random_model.py --shape smollm2 --tokenizer ./tiny-model --out /tmp/smollm2-random
    python bench/cpu_step_bench.py --model /tmp/smollm2-random --before-rev 2da0215 --out bench/results/cpu_step_smollm2_shape.json

Each run is the README's CPU command (`python grpo.py --model M --lr 1e-5 --micro-batch-size 128`, the CPU-sized
defaults) for `--steps` steps, no evaluation, no checkpoint, of one tree ('before' or 'after') as one CPU (`--runs`:
tree/isa, run in that order, `--reps` times over). What a CPU "without bf16" is here:
  native       the machine as it is
  avx512_core  ONEDNN_MAX_CPU_ISA=AVX512_CORE: oneDNN without its bf16 instructions (an AVX-512 CPU such as
               Cascade Lake); fp32 kernels unchanged, and fsdp.compute_dtype then picks fp32
  avx2         also ATEN_CPU_CAPABILITY=avx2 and MKL_ENABLE_INSTRUCTIONS=AVX2: an AVX2 machine, as near as one
               can get on this one (bf16 matmuls emulated even slower than a real AVX2 CPU's: 15x fp32, not 6.6x)
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ISAS = {
    "native": {},
    "avx512_core": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
PHASES = ("perf/step_s", "time/generate", "time/sync_weights", "time/logprob", "time/update")


@dataclass
class Args:
    model: str
    """model folder (bench/make_random_model.py --shape smollm2)"""
    before_rev: str
    """the commit to compare with (its tree, from `git archive`)"""
    out: str
    """JSON to write (rewritten after every run)"""
    after_rev: str = "HEAD"
    """the commit to measure (also from `git archive`: edits made while it runs don't count)"""
    runs: tuple[str, ...] = ("before/native", "after/native", "before/avx2", "after/avx2")
    """tree/isa pairs, in order: tree before or after, isa native, avx512_core or avx2 (see the module docstring)"""
    steps: int = 2
    """GRPO steps per run (all of them count: the first step was no slower than the others)"""
    reps: int = 2
    """times over the list of runs"""


def run_once(tree: str, args: Args, isa: str, run_dir: str) -> dict:
    cmd = [
        sys.executable,
        "grpo.py",
        "--model",
        args.model,
        "--lr",
        "1e-5",
        "--micro-batch-size",
        "128",
        "--steps",
        str(args.steps),
        "--eval-every",
        "0",
        "--save-every",
        "-1",
        "--output-dir",
        run_dir,
        "--run-name",
        "r",
    ]
    load = os.getloadavg()[0]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=tree, env={**os.environ, **ISAS[isa]}, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(
            f"{' '.join(cmd)} in {tree} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "r", "metrics.jsonl"))]
    first = next((x for x in proc.stdout.splitlines() if "no GPU found" in x), "")
    return {
        "isa": isa,
        "env": ISAS[isa],
        "load_1min_before": load,
        "load_1min_after": os.getloadavg()[0],
        "wall_s": round(time.time() - t0, 1),
        "first_line": first,
        "command": " ".join(cmd[1:]),
        "steps": [{k: round(r[k], 3) for k in (*PHASES, "rollout/logprob_abs_diff")} for r in rows],
    }


def summarize(runs: list[dict]) -> dict:
    """Per (tree, isa): medians and ranges of each phase over all steps of all reps."""
    out = {}
    for key in sorted({(r["tree"], r["isa"]) for r in runs}):
        steps = [s for r in runs if (r["tree"], r["isa"]) == key for s in r["steps"]]
        out[f"{key[0]}/{key[1]}"] = {
            k.split("/")[1]: {
                "median": round(statistics.median(s[k] for s in steps), 1),
                "min": round(min(s[k] for s in steps), 1),
                "max": round(max(s[k] for s in steps), 1),
            }
            for k in PHASES
        }
        out[f"{key[0]}/{key[1]}"]["logprob_abs_diff_max"] = max(s["rollout/logprob_abs_diff"] for s in steps)
        out[f"{key[0]}/{key[1]}"]["n_steps"] = len(steps)
    return out


def machine() -> dict:
    import torch

    sys.path.insert(0, ROOT)
    from fsdp import BF16_CPU_FLAGS, compute_dtype, cpu_flags

    model = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "bf16_flags": sorted(cpu_flags() & BF16_CPU_FLAGS),
        "avx512f": "avx512f" in cpu_flags(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "compute_dtype_native": str(compute_dtype(torch.device("cpu"))),
        "threads": torch.get_num_threads(),
    }


def main(args: Args):
    work = tempfile.mkdtemp(prefix="cpu-step-")
    trees = {"before": args.before_rev, "after": args.after_rev}
    for name, rev in trees.items():
        os.makedirs(os.path.join(work, name))
        subprocess.run(f"git archive {rev} | tar -x -C {os.path.join(work, name)}", shell=True, cwd=ROOT, check=True)
    revs = {
        name: subprocess.run(
            ["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        for name, rev in trees.items()
    }
    result = {
        "what": "seconds per GRPO step on this CPU, by phase (the README's CPU command), before/after",
        "command": "python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine(),
        **revs,
        "runs": [],
    }
    for rep in range(args.reps):
        for tree, isa in (r.split("/") for r in args.runs):
            run = run_once(os.path.join(work, tree), args, isa, os.path.join(work, f"{tree}-{isa}-{rep}"))
            result["runs"].append({"tree": tree, "rep": rep, **run})
            result["summary"] = summarize(result["runs"])
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            print(
                f"{tree} {isa} rep {rep}: step s {[s['perf/step_s'] for s in run['steps']]}, "
                f"load {run['load_1min_before']:.1f}",
                flush=True,
            )
    shutil.rmtree(work)


if __name__ == "__main__":
    main(tyro.cli(Args))
