"""Seconds per python tool call, the old sandbox (a plain subprocess: --python-sandbox process) beside
the bubblewrap jail (bwrap), alternated in one process on one machine (CPU; no GPU needed):

    python bench/sandbox_bench.py --out bench/results/sandbox_cpu.json

One at a time: median and p99 seconds of `--calls` calls of a typical model program. Then
`--workers` threads at once (grpo.py's --tool-workers): calls per second over `--burst` calls. The
trainer's side is included (start, the cgroup, reading the output, the kill and clean-up).

CPU (`--cpu-rounds`): a trainer's own busy thread (a Python loop) alone, then beside `--workers` calls
of a program that never stops (each stopped at 2 s, then another): the loop's rate alone over beside,
per round (the trainer's slowdown). And the other side: one call of a fixed CPU-bound program alone, then
beside one busy process per core (its slowdown: a call given too little weight would be starved).
"""

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sandbox import cgroup_parents, run_program, sandbox_problem  # noqa: E402

PROGRAM = "x = 123 * 45\nprint(x)\nprint(sum(i * i for i in range(1000)))\n"  # what the worked example teaches
BUSY = "while True: pass"  # a runaway loop, stopped at its deadline
WORK = "s = 0\nfor i in range(10**7):\n    s += i\nprint(s > 0)"  # ~0.5 s of CPU
CALL_LIMIT_S = 60.0


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
    cpu_rounds: int = 3
    """rounds of the trainer's loop alone and beside `workers` busy calls (0: skip the CPU part)"""
    cpu_s: float = 3.0
    """seconds the trainer's loop is timed, each time"""
    machine: str = ""
    """how the results name this machine (default: its CPU count)"""
    out: str = ""
    """write the results here (JSON)"""


def timed(program: str, sandbox: str, printed: str, limits: dict | None = None) -> float:
    t0 = time.perf_counter()
    reply = run_program(program, sandbox=sandbox, limits=limits)
    assert reply.startswith(printed), reply
    return time.perf_counter() - t0


def loop_rate(seconds: float) -> float:
    """A trainer's own CPU-bound thread: iterations of a small Python loop per second."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(1000))
        n += 1
    return n / seconds


def busy_calls(stop: threading.Event):
    while not stop.is_set():
        try:
            run_program(BUSY, limits={"seconds": 2.0})
        except TimeoutError:
            pass


def trainer_slowdown(args: Args) -> list[float]:
    """Per round: the loop's rate alone over its rate beside `workers` busy calls."""
    slowdowns = []
    for _ in range(args.cpu_rounds):
        alone, stop = loop_rate(args.cpu_s), threading.Event()
        threads = [threading.Thread(target=busy_calls, args=(stop,)) for _ in range(args.workers)]
        for t in threads:
            t.start()
        time.sleep(0.5)  # the jails started
        slowdowns.append(alone / loop_rate(args.cpu_s))
        stop.set()
        for t in threads:
            t.join()
    return slowdowns


def call_slowdown() -> tuple[float, float]:
    """Seconds of one call of WORK alone, then beside one busy process per core (the best of two each; a call
    starved past CALL_LIMIT_S counts as CALL_LIMIT_S)."""

    def best() -> float:
        try:
            return min(timed(WORK, "bwrap", "True", limits={"seconds": CALL_LIMIT_S}) for _ in range(2))
        except TimeoutError:
            return CALL_LIMIT_S

    alone = best()
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(os.cpu_count())]
    try:
        time.sleep(0.3)
        return alone, best()
    finally:
        for p in busy:
            p.kill()
            p.wait()


def main(args: Args):
    for sandbox in ("process", "bwrap"):
        problem = sandbox_problem(sandbox)
        assert problem is None, problem
        timed(PROGRAM, sandbox, "5535\n")  # warm: the filter built, the interpreter's files in the page cache
    single = {"process": [], "bwrap": []}
    for _ in range(args.calls):
        for sandbox in single:
            single[sandbox].append(timed(PROGRAM, sandbox, "5535\n"))
    rate = {"process": [], "bwrap": []}
    with ThreadPoolExecutor(args.workers) as pool:
        for _ in range(args.rounds):
            for sandbox in rate:
                t0 = time.perf_counter()
                list(pool.map(lambda s: timed(PROGRAM, s, "5535\n"), [sandbox] * args.burst))
                rate[sandbox].append(args.burst / (time.perf_counter() - t0))
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": args.machine or f"{os.cpu_count()} CPU cores, no GPU",
        "uid": os.getuid(),
        "command": "python bench/sandbox_bench.py " + " ".join(sys.argv[1:]),
        "program": PROGRAM,
        "cgroups": [p for p, _ in cgroup_parents()],
        "workers": args.workers,
    }
    for sandbox in single:
        s = sorted(single[sandbox])
        result[sandbox] = {
            "call_s_median": statistics.median(s),
            "call_s_p99": s[int(0.99 * (len(s) - 1))],
            "calls": len(s),
            "calls_per_s": max(rate[sandbox]),
            "calls_per_s_each_round": rate[sandbox],
        }
    result["bwrap_over_process_median"] = result["bwrap"]["call_s_median"] / result["process"]["call_s_median"]
    if args.cpu_rounds:
        slowdowns, (alone, beside) = trainer_slowdown(args), call_slowdown()
        result["cpu"] = {
            "trainer_slowdown": statistics.median(slowdowns),
            "trainer_slowdown_each_round": slowdowns,
            "busy_calls": args.workers,
            "call_s_alone": alone,
            "call_s_beside_busy_processes": beside,
            "call_slowdown": beside / alone,
        }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main(tyro.cli(Args))
