"""Seconds per python tool call, the old sandbox (a plain subprocess: --python-sandbox process) beside
the bubblewrap jail (bwrap), alternated in one process on one machine (CPU; no GPU needed):

    python bench/sandbox_bench.py --out bench/results/sandbox_cpu.json

One at a time: median and p99 seconds of `--calls` calls of a typical model program. Then
`--workers` threads at once (grpo.py's --tool-workers): calls per second over `--burst` calls. The
trainer's side is included (start, the cgroup, reading the output, the kill and clean-up).
"""

import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sandbox import cgroup_parents, run_program, sandbox_problem  # noqa: E402

PROGRAM = "x = 123 * 45\nprint(x)\nprint(sum(i * i for i in range(1000)))\n"  # what the worked example teaches


@dataclass
class Args:
    calls: int = 200
    """calls one at a time per sandbox (alternated: one of each in turn)"""
    burst: int = 320
    """calls per sandbox with `workers` threads at once"""
    workers: int = 16
    """threads calling at once, as grpo.py's --tool-workers"""
    rounds: int = 2
    """bursts per sandbox, alternated"""
    out: str = ""
    """write the results here (JSON)"""


def timed(sandbox: str) -> float:
    t0 = time.perf_counter()
    reply = run_program(PROGRAM, sandbox=sandbox)
    assert reply.startswith("5535\n"), reply
    return time.perf_counter() - t0


def main(args: Args):
    for sandbox in ("process", "bwrap"):
        problem = sandbox_problem(sandbox)
        assert problem is None, problem
        timed(sandbox)  # warm: the filter built, the interpreter's files in the page cache
    single = {"process": [], "bwrap": []}
    for _ in range(args.calls):
        for sandbox in single:
            single[sandbox].append(timed(sandbox))
    rate = {"process": [], "bwrap": []}
    with ThreadPoolExecutor(args.workers) as pool:
        for _ in range(args.rounds):
            for sandbox in rate:
                t0 = time.perf_counter()
                list(pool.map(timed, [sandbox] * args.burst))
                rate[sandbox].append(args.burst / (time.perf_counter() - t0))
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPU cores, no GPU", "uid": os.getuid(),
              "command": "python bench/sandbox_bench.py " + " ".join(sys.argv[1:]), "program": PROGRAM,
              "cgroups": [p for p, _ in cgroup_parents()], "workers": args.workers}
    for sandbox in single:
        s = sorted(single[sandbox])
        result[sandbox] = {"call_s_median": statistics.median(s), "call_s_p99": s[int(0.99 * (len(s) - 1))],
                           "calls": len(s), "calls_per_s": max(rate[sandbox]), "calls_per_s_each_round": rate[sandbox]}
    result["bwrap_over_process_median"] = result["bwrap"]["call_s_median"] / result["process"]["call_s_median"]
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main(tyro.cli(Args))
