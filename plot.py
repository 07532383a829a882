"""Curves without wandb: up to eight panels from run folders' metrics.jsonl (those it logs), several runs over each other.

    python plot.py runs/A                        # writes runs/A/curves.png
    python plot.py runs/A runs/B --out ab.png    # overlaid, one colour per run folder (default ./curves.png)
    write_curves(run_dir)                        # runlog.RunLog, rank 0: at each evaluation and at the end

Reward, held-out accuracy, response length, KL (to the reference, the old policy, the sampler) and entropy by step, a
reward model's score and tool use where the run has them; mean seconds and peak GPU memory of memory.py's phases
(train_rm.py's runs: loss, pairwise accuracy, margin).
bench/report.py draws with the same helpers (read_metrics, subplots, plot_metric).
PLUMBING: nothing here changes what is trained; matplotlib is imported only when a figure is drawn.
"""

import json
import os
import statistics
from dataclasses import dataclass

import tyro

from preflight import friendly_errors
from common import InputError


@dataclass
class Args:
    run_dirs: tyro.conf.Positional[list[str]]
    """run folders (each with the metrics.jsonl grpo.py / ppo.py / train_rm.py wrote); several are drawn over each other"""
    out: str | None = None
    """PNG to write; default: curves.png in the run folder, or ./curves.png for several runs"""


def parse_row(line: str) -> dict | None:
    """A metrics/samples row, or None for a line a kill cut short (here, not in runlog.py, which imports
    torch: seconds that plot.py and bench/report.py have no use for; runlog.RunLog uses it too)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def read_metrics(path: str) -> list[dict]:
    """A metrics.jsonl's rows, less a line a kill cut short."""
    with open(path) as f:
        return [row for line in f if (row := parse_row(line)) is not None]


def subplots(*grid: int, **figure_kw):
    """(figure, axes) on a bare matplotlib Figure: no pyplot state, no window; fig.savefig writes PNGs (Agg)."""
    try:
        from matplotlib.figure import Figure  # lazy: importing plot.py stays cheap for the training scripts
    except ImportError:
        raise SystemExit("drawing a PNG needs matplotlib: pip install matplotlib (requirements.txt lists it)") from None
    fig = Figure(**figure_kw)
    return fig, fig.subplots(*grid)


def plot_metric(ax, rows: list[dict], key: str, fmt: str = "-", **style) -> bool:
    """`key` against `step`, over the rows that log it; False where none does."""
    points = [(r["step"], r[key]) for r in rows if key in r]
    if points:
        ax.plot(*zip(*points), fmt, **style)
    return bool(points)


def per_phase(rows: list[dict], prefix: str, suffix: str, reduce) -> dict[str, float]:
    """{phase: reduce(values)} of the keys prefix + phase + suffix, phases in the order the run logged them."""
    values = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith(prefix) and k.endswith(suffix):
                values.setdefault(k[len(prefix) : len(k) - len(suffix)], []).append(v)
    return {p: reduce(v) for p, v in values.items()}


def first_logged(runs: dict, *choices: tuple[list, str]) -> tuple[list, str]:
    """The first (series, title) of `choices` that some run logs, else the first: a panel of train_rm.py's runs (no
    rollouts) shows its loss where grpo.py's shows the reward."""
    return next(
        (c for c in choices if any(k in r for rows in runs.values() for r in rows for k, _, _ in c[0])), choices[0]
    )


def nothing(ax, keys: str):
    ax.text(0.5, 0.5, f"no {keys}\nin metrics.jsonl (yet)", ha="center", transform=ax.transAxes, color="gray")
    ax.set(xticks=[], yticks=[], xlabel="")


def lines(ax, runs: dict, series: list[tuple[str, str, str]], title: str, log: bool = False):
    """One colour per run, one line style per (metric key, legend label, format) in `series`."""
    drawn = {}
    for colour, rows in enumerate(runs.values()):
        for key, label, fmt in series:
            if plot_metric(ax, rows, key, fmt, color=f"C{colour}", markersize=4):
                drawn[label] = fmt
    ax.set_title(title), ax.set_xlabel("step (updates done)"), ax.grid(alpha=0.3)
    if not drawn:
        return nothing(ax, ", ".join(key for key, _, _ in series[:2]))
    if log:  # KL and entropy span decades; symlog also shows KL's zeros (--beta 0, one epoch) and k1's negatives
        ax.set_yscale("symlog", linthresh=1e-4)
    if len(series) > 1:  # the line styles, in grey: the colours are the runs
        ax.legend(
            handles=[ax.plot([], [], fmt, color="gray", label=label)[0] for label, fmt in drawn.items()], fontsize=8
        )


def bars(
    ax, values: dict, title: str, xlabel: str, fmt: str, marks: dict | None = None, keys: str = "", least: float = 0.0
):
    """Horizontal bars, one row per phase, one colour per run: {run: {phase: value}}; `marks` alike, as ticks. Phases
    under `least` x the largest value in every run are left out, and counted in the title (a CPU run's memory phases
    take no time: seven empty rows)."""
    phases = list(dict.fromkeys(p for v in values.values() for p in v if not p.startswith("startup_")))  # once
    top = max((v[p] for v in values.values() for p in phases if p in v), default=0.0)
    small = [p for p in phases if all(v.get(p, 0) < least * top for v in values.values())]
    phases = [p for p in phases if p not in small]
    title += f"\n{len(small)} phases under {least:.0%} of the largest bar not drawn" * bool(small)
    ax.set_title(title), ax.set_xlabel(xlabel), ax.grid(axis="x", alpha=0.3), ax.margins(x=0.12)  # room for labels
    if not phases:
        return nothing(ax, keys)
    height = 0.8 / len(values)
    for i, (name, v) in enumerate(values.items()):
        y = [j - 0.4 + height * (i + 0.5) for j in range(len(phases))]
        ax.bar_label(
            ax.barh(y, [v.get(p, 0) for p in phases], height, color=f"C{i}"),
            fontsize=7,
            padding=2,
            labels=[fmt % v[p] if v.get(p, 0) > top / 50 else "" for p in phases],
        )  # no crowd of "0.00"s
        if marks:
            ax.plot([marks[name].get(p, float("nan")) for p in phases], y, "k|", markersize=9)
    ax.set_yticks(range(len(phases)), phases, fontsize=8), ax.invert_yaxis()


def draw(run_dirs: list[str], out: str) -> list[str]:
    """Draw the runs' panels into `out`, those with something to draw; their titles."""
    runs = {os.path.basename(os.path.normpath(d)): read_metrics(os.path.join(d, "metrics.jsonl")) for d in run_dirs}
    fig, ax = subplots(2, 4, figsize=(21, 8.5), layout="constrained")
    lines(
        ax[0, 0],
        runs,
        *first_logged(
            runs,
            ([("rollout/reward_mean", "", "-")], "reward (sampled, mean)"),
            ([("train/loss", "train", "-"), ("eval/loss", "held out", "o-")], "Bradley-Terry loss"),
        ),
    )
    keys = {k for rows in runs.values() for r in rows for k in r if k.startswith("eval/") and k.count("/") == 2}
    sources = sorted(k.split("/")[1] for k in keys if k.endswith("/strict_acc"))
    groups = sorted(k.split("/")[2] for k in keys if k.startswith("eval/pair_acc/"))  # train_rm.py's rows' "group"
    lines(
        ax[0, 1],
        runs,
        [("eval/strict_acc", "strict", "o-"), ("eval/flexible_acc", "flexible", "^--")]
        + [(f"eval/{s}/strict_acc", f"{s} strict", "sDvPX"[i % 5] + ":") for i, s in enumerate(sources)]
        + [("eval/pair_acc", "pairwise", "o-")]
        + [(f"eval/pair_acc/{g}", g, "sDvPX"[i % 5] + ":") for i, g in enumerate(groups)],
        "held-out accuracy (greedy; a reward model's: pairwise)",
    )
    ax[0, 1].set_ylim(-0.02, 1.02)
    lines(
        ax[0, 2],
        runs,
        *first_logged(
            runs,
            ([("rollout/response_len_mean", "", "-")], "response length (tokens, sampled, mean)"),
            (
                [("train/margin", "train", "-"), ("eval/margin", "held out", "o-")],
                "margin r(chosen) - r(rejected), mean",
            ),
        ),
    )
    lines(  # --reward-model: what it scores beside the rule (reward_model.rm_stats)
        ax[0, 3],
        runs,
        [
            ("rollout/rm_score", "reward model's score", "-"),
            ("rollout/rule_reward", "rule reward", "--"),
            ("rollout/rm_rule_corr", "their correlation", ":"),
        ],
        "reward model (sampled, mean)",
    )
    lines(  # --tools: how samples use them (tools.tool_stats), and the greedy evaluation's share
        ax[1, 3],
        runs,
        [
            ("tools/calls_per_sample", "calls a sample", "-"),
            ("tools/turns_mean", "turns a sample", "--"),
            ("tools/used_frac", "share that called one", ":"),
            ("eval/tool_used_frac", "share that called one (held out)", "o-"),
        ],
        "tool use (sampled, mean)",
    )
    lines(
        ax[1, 0],
        runs,
        [
            ("train/kl", "kl (in the loss)", "-"),
            ("train/entropy", "entropy", ":"),
            ("train/kl_per_response", "kl per response", "-."),
            ("train/approx_kl", "approx kl", "--"),
            ("rollout/mismatch_kl", "mismatch kl (sampler || trainer)", "+-"),
        ],
        "KL and entropy (log scale above 1e-4)",
        log=True,
    )
    steps = {name: [r for r in rows if "perf/step_s" in r] for name, rows in runs.items()}
    timed = {name: rows[1:] or rows for name, rows in steps.items()}  # step 1 left out where there are more: warm-up
    phases = {name: per_phase(rows, "time/", "", statistics.mean) for name, rows in timed.items()}  # none: train_rm.py
    bars(
        ax[1, 1],
        {
            name: {"whole step": statistics.mean(r["perf/step_s"] for r in timed[name]), **v} if v else {}
            for name, v in phases.items()
        },
        "seconds per phase (mean, step 1 left out)",
        "seconds",
        "%.2f",
        least=0.01,
    )
    bars(
        ax[1, 2],
        {name: per_phase(rows, "memory/", "_device_peak_gib", max) for name, rows in steps.items()},
        "GPU memory per phase (peak)",
        "GiB (bars: the whole device, |: the trainer's own)",
        "%.1f",
        {name: per_phase(rows, "memory/", "_peak_gib", max) for name, rows in steps.items()},
        "memory/* (a CPU run?)",
    )
    # only the panels with something to draw (a CPU run has no GPU memory; train_rm.py's runs no KL, no phases), 3 a row
    shown = [a for a in ax.flat if a.has_data()] or [ax[0, 1]]
    cols = {1: 1, 2: 2, 4: 2, 7: 4, 8: 4}.get(len(shown), 3)
    grid = fig.add_gridspec(-(-len(shown) // cols), cols)
    for a in ax.flat:
        a.set_subplotspec(grid[shown.index(a)]) if a in shown else a.remove()
    fig.set_size_inches(16 / 3 * cols, 8.5 / 2 * grid.nrows)
    if len(runs) > 1:
        fig.legend(
            handles=[shown[0].plot([], [], color=f"C{i}", label=n)[0] for i, n in enumerate(runs)],
            loc="outside upper center",
            ncol=min(len(runs), 6),
        )
    else:
        fig.suptitle(next(iter(runs)))
    fig.savefig(out + ".tmp", format="png", dpi=100)
    os.replace(out + ".tmp", out)  # whole or not at all: a viewer never reads a half-written PNG
    return [a.get_title() for a in shown]


_said = set()  # write_curves' console lines, each printed once per process


def write_curves(run_dir: str):
    """Redraw `run_dir`/curves.png from its metrics.jsonl. For the training scripts: never raises, since a
    figure is not worth a run; a failure is one printed line (the same failure is not printed again)."""
    out = os.path.join(run_dir, "curves.png")
    try:
        draw([run_dir], out)
        line = f"curves: {out} (redrawn at each evaluation and at the end)"
    except (Exception, SystemExit) as e:  # SystemExit: subplots() found no matplotlib
        why = e if isinstance(e, SystemExit) else f"{type(e).__name__}: {e}"
        line = f"plot.py: {out} not written ({why}); training goes on"
    if line not in _said:
        _said.add(line)
        print(line, flush=True)


def main(a: Args):
    if not a.run_dirs:
        raise InputError("which runs? give one or more run folders: python plot.py runs/A [runs/B ...] [--out ab.png]")
    for d in a.run_dirs:
        if not os.path.isfile(os.path.join(d, "metrics.jsonl")):
            raise InputError(
                f"{d}: no metrics.jsonl there (expected the run folder grpo.py, ppo.py or train_rm.py wrote)"
            )
    out = a.out or (os.path.join(a.run_dirs[0], "curves.png") if len(a.run_dirs) == 1 else "curves.png")
    draw(a.run_dirs, out)
    print(f"plot.py: wrote {out} ({len(a.run_dirs)} run{'s' * (len(a.run_dirs) > 1)})")


if __name__ == "__main__":
    with friendly_errors("plot.py"):
        main(tyro.cli(Args))
