"""Seconds per python tool call in the jail, sandbox.py at several revisions side by side: each revision's
sandbox.py loaded as its own module in one process, one call of each in turn (each round starting at the next),
so that the machine's drift and the place in a round fall on all alike (CPU; no GPU needed):

    python bench/sandbox_ab.py --revs 7db5d00 HEAD WORKTREE --out bench/results/sandbox_ab.json

WORKTREE is the file as it is on disk. Reports each revision's median, p10 and p90 seconds of `--calls`
calls of `print(1)` (issue 52's measure), and its median over the first revision's.
"""

import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Args:
    revs: list[str] = field(default_factory=lambda: ["HEAD", "WORKTREE"])
    """git revisions of sandbox.py (WORKTREE: the file on disk); ratios are over the first"""
    calls: int = 300
    """calls of each revision, alternated"""
    program: str = "print(1)"
    out: str = ""
    """write the result here as JSON"""


def load(rev: str, folder: str):
    """sandbox.py at `rev` as a module of its own (its caches, its counters)."""
    path = os.path.join(folder, f"sandbox_{len(os.listdir(folder))}.py")
    if rev == "WORKTREE":
        source = open(os.path.join(ROOT, "sandbox.py")).read()
    else:
        source = subprocess.run(
            ["git", "-c", "safe.directory=*", "show", f"{rev}:sandbox.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(args: Args) -> None:
    with tempfile.TemporaryDirectory() as folder:
        modules = {rev: load(rev, folder) for rev in args.revs}
        seconds = {rev: [] for rev in args.revs}
        for module in modules.values():  # warm: the seccomp filter, the checks
            module.run_program(args.program)
        order = list(modules.items())
        for i in range(args.calls):
            for rev, module in order[i % len(order) :] + order[: i % len(order)]:  # each first in turn
                t0 = time.perf_counter()
                reply = module.run_program(args.program)
                seconds[rev].append(time.perf_counter() - t0)
                assert reply.strip() == "1" or args.program != "print(1)", (rev, reply)
    first = statistics.median(seconds[args.revs[0]])
    result = {
        "command": "python bench/sandbox_ab.py " + " ".join(sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, euid {os.geteuid()}",
        "revs": {},
    }
    for rev, s in seconds.items():
        s = sorted(s)
        result["revs"][rev] = {
            "median_s": round(statistics.median(s), 4),
            "p10_s": round(s[len(s) // 10], 4),
            "p90_s": round(s[len(s) * 9 // 10], 4),
            "median_over_first": round(statistics.median(s) / first, 3),
        }
        print(
            f"{rev:>10}: median {statistics.median(s) * 1000:.1f} ms ({statistics.median(s) / first:.2f}x), "
            f"p10 {s[len(s) // 10] * 1000:.1f}, p90 {s[len(s) * 9 // 10] * 1000:.1f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main(tyro.cli(Args))
