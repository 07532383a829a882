"""(CPU) Which micro-batches train fastest on a CPU: the README's CPU command with each setting, alternated, the
trainer's phases (the old log-probs and the update) read from metrics.jsonl, steps 2 on (step 1 warms up).

    python bench/cpu_micro_batches.py --model /tmp/smol-random --out bench/results/cpu_micro_batches.json

--model: e.g. random weights of SmolLM2-135M's shapes (bench/make_random_model.py --shape smollm2). Each setting runs
--rounds times, in turn (A B C A B C ...), so that the machine's drift falls on all alike.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = {  # name: the flags (the CPU default first: --micro-batch-size 16, padded rows)
    "padded 16 rows (default)": [],
    "padded 4 rows": ["--micro-batch-size", "4"],
    "packed 1024 tokens": ["--max-tokens-per-micro-batch", "1024"],
    "packed 4096 tokens": ["--max-tokens-per-micro-batch", "4096"],
}


@dataclass
class Args:
    model: str
    """model folder"""
    steps: int = 4
    """steps a run (the first not counted)"""
    rounds: int = 2
    """runs of each setting"""
    out: str = ""
    """JSON to write"""
    settings: list[str] = field(default_factory=lambda: list(SETTINGS))
    """which of SETTINGS"""


def one_run(model: str, steps: int, flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as runs:
        cmd = [sys.executable, "grpo.py", "--model", model, "--rollout-engine", "hf", "--steps", str(steps)]
        cmd += ["--eval-every", "0", "--save-every", "-1", "--output-dir", runs, "--run-name", "r", *flags]
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
        rows = [json.loads(line) for line in open(os.path.join(runs, "r", "metrics.jsonl"))]
        rows = [r for r in rows if "time/update" in r][1:]
        return {
            "wall_s": time.time() - t0,
            "update_s": statistics.mean(r["time/update"] for r in rows),
            "logprob_s": statistics.mean(r["time/logprob"] for r in rows),
            "step_s": statistics.mean(r["perf/step_s"] for r in rows),
        }


def main(a: Args):
    runs = {name: [] for name in a.settings}
    for round_ in range(a.rounds):
        for name in a.settings:
            runs[name].append(one_run(a.model, a.steps, SETTINGS[name]))
            r = runs[name][-1]
            print(f"round {round_ + 1} {name}: update {r['update_s']:.2f} s, old log-probs {r['logprob_s']:.2f} s")
    summary = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("update_s", "logprob_s", "step_s")}
        | {"flags": " ".join(SETTINGS[name])}
        for name, rs in runs.items()
    }
    base = summary[a.settings[0]]
    for name, s in summary.items():
        s["trainer_s_vs_first"] = (s["update_s"] + s["logprob_s"]) / (base["update_s"] + base["logprob_s"])
        print(
            f"{name}: update {s['update_s']:.2f} s + old log-probs {s['logprob_s']:.2f} s, {s['trainer_s_vs_first']:.2f}x"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "runs": runs, "median": summary},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main(tyro.cli(Args))
