"""Where a script's main() spends its wall time, line by line, from a py-spy recording (raw: folded stacks).

    py-spy record --idle --rate 100 --format raw -o spy.txt -- python grpo.py ...
    python bench/spy_report.py spy.txt --script grpo.py --top 25

Each sample of the main thread falls on the line main() was running (the frame `main (grpo.py:LINE)`); --idle keeps
the samples where the thread waited (a GPU sync, a sleep, a lock), so the seconds add up to main's wall time. For each
line: seconds, share of main's samples, the source line, and the innermost functions its samples were in.
"""

import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass

import tyro


@dataclass
class Args:
    spy: tyro.conf.Positional[str]
    """py-spy's raw output: one 'frame;frame;...;frame COUNT' line per distinct stack"""
    script: str = "grpo.py"
    """the script whose main() is read; its source lines are printed beside the counts (found beside this folder)"""
    rate: float = 100.0
    """py-spy's --rate (samples a second): counts become seconds"""
    top: int = 25
    """lines to print"""
    leaves: int = 3
    """innermost functions to print for each line"""


def main_lines(lines: list[str], script: str) -> tuple[Counter, dict[int, Counter]]:
    """(samples on each line of `script`'s main(), each line's innermost frames counted) from folded stacks."""
    by_line, leaves = Counter(), defaultdict(Counter)
    where = re.compile(rf"^main \((?:.*/)?{re.escape(script)}:(\d+)\)$")
    for text in lines:
        stack, _, count = text.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        for i, frame in enumerate(frames):
            if m := where.match(frame):
                line = int(m.group(1))
                by_line[line] += int(count)
                leaves[line][frames[-1] if i + 1 < len(frames) else "(main itself)"] += int(count)
                break
    return by_line, leaves


def main(a: Args):
    with open(a.spy) as f:
        by_line, leaves = main_lines(f.readlines(), os.path.basename(a.script))
    path = a.script if os.path.exists(a.script) else os.path.join(os.path.dirname(__file__), "..", a.script)
    source = open(path).read().splitlines() if os.path.exists(path) else []
    total = sum(by_line.values())
    print(f"main() of {a.script}: {total / a.rate:.1f} s in {total} samples at {a.rate:g}/s")
    for line, n in by_line.most_common(a.top):
        text = source[line - 1].strip() if 0 < line <= len(source) else ""
        print(f"{n / a.rate:8.2f} s {n / total:6.1%}  {a.script}:{line}  {text[:90]}")
        for leaf, k in leaves[line].most_common(a.leaves):
            print(f"{'':28}{k / a.rate:7.2f} s  in {leaf[:110]}")


if __name__ == "__main__":
    main(tyro.cli(Args))
