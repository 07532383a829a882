"""Turn a run folder (metrics.jsonl, run_info.json) into a committed result: JSON summary + curve PNG.

    python bench/report.py arith  runs/<run> --out bench/results/grpo_arith_smollm2.json --png bench/results/grpo_arith_smollm2.png
    python bench/report.py memory runs/<run> --out bench/results/grpo_memory_1p5b.json
    python bench/report.py scaling runs/ --out bench/results/scaling_1p5b.json     # bench/run_scaling.sh's runs
    python bench/report.py tools runs/ --out bench/results/tools_multiplication_smollm2.json --png ...  # run_tools.sh's
    python bench/report.py server runs/ --out bench/results/server_smollm2_....json --png ...           # run_server.sh's
    python bench/report.py rm runs/ --out bench/results/rm_addition_smollm2.json --png ...             # run_rm.sh's
    python bench/report.py arith runs/<ppo run> --out ... --compare bench/results/raw/grpo_arith_smollm2.metrics.jsonl \
        --compare-png bench/results/ppo_vs_grpo_arith_smollm2.png
    python bench/report.py variants runs/variants --task addition --out bench/results/variants_addition.json \
        --png bench/results/variants_addition.png --summary bench/results/summary.json    # run_variants.sh's; --task tools
    python bench/report.py deterministic runs/det --out bench/results/deterministic_smollm2_h100.json \
        --summary bench/results/summary.json                                             # run_deterministic.sh's
    python bench/report.py lora runs/lora --out bench/results/lora_h100.json --png bench/results/lora_addition_h100.png \
        --summary bench/results/summary.json                                              # run_lora.sh's three parts
"""

import json
import math
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Literal

import tyro

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from plot import draw, plot_metric, read_metrics, subplots  # noqa: E402  (the repo root's plot.py: one copy of the drawing)


@dataclass
class Args:
    kind: tyro.conf.Positional[
        Literal["arith", "memory", "scaling", "tools", "server", "rm", "variants", "deterministic", "lora", "defaults"]
    ]
    """arith: accuracy summary + curve; memory: per-phase memory and time; scaling: tokens/s by GPU count;
    tools: accuracy and tool use with and without tools; server: colocate vs server vs async (run_server.sh);
    rm: run_rm.sh's pairs, reward model and GRPO against it;
    variants: the policy losses, advantages and corrections of one task side by side (run_variants.sh);
    deterministic: --deterministic-rollout twice and a normal run, same seed (run_deterministic.sh);
    lora: full fine-tuning vs LoRA ranks on addition, a 7B shape on one GPU, sync seconds merge vs adapter (run_lora.sh);
    defaults: the default step against the best flags at each shape (run_fast_defaults.sh)"""
    run_dir: tyro.conf.Positional[str]
    """the run folder grpo.py / ppo.py wrote (scaling, tools: the folder holding run_scaling.sh's or run_tools.sh's runs)"""
    out: str
    """JSON summary to write"""
    png: str | None = None
    """curve to draw (arith)"""
    command: str | None = None
    """the command as launched (default: run_info.json's argv)"""
    note: str | None = None
    """a sentence for the reader (e.g. why a run stopped early)"""
    compare: str | None = None
    """another run's metrics.jsonl to draw beside this one (arith): held-out accuracy by updates and by seconds"""
    compare_png: str | None = None
    """where to draw that comparison"""
    gpu: str | None = None
    """server: the GPU, for runs whose run_info.json did not come back (only metrics.jsonl)"""
    model_name: str | None = None
    """server: the model as the figure's title names it (default: the runs' --model folder name)"""
    task: Literal["addition", "tools", "addition-mb4"] = "addition"
    """variants: run_variants.sh's addition runs, its multiplication runs with the calculator, or the policy losses
    on addition with 4 updates a batch (the ratios move off 1: the clip ranges act)"""
    summary: str | None = None
    """variants: bench/results/summary.json, whose key `variants` gets this task's final accuracies (deterministic:
    `deterministic_rollout_cost`, `deterministic_mismatch_kl`; lora: lora_acc_vs_full, lora_7b_one_gpu_peak_gib,
    lora_sync_s)"""


def memory_summary(train):
    """Peak GiB (whole device, and the trainer's own) and mean seconds of every memory phase."""
    suffix = "_device_peak_gib"
    phases = sorted(
        {k[len("memory/") : -len(suffix)] for r in train for k in r if k.startswith("memory/") and k.endswith(suffix)}
    )
    return {
        "peak_gib_per_phase": {
            p: {
                "device_peak": max(r.get(f"memory/{p}_device_peak_gib", 0) for r in train),
                "training_process_peak": max(r.get(f"memory/{p}_peak_gib", 0) for r in train),
            }
            for p in phases
        },
        "seconds_per_phase": {p: statistics.mean(r.get(f"time/{p}", 0) for r in train) for p in phases},
    }


def eval_by_time(rows):
    """[(updates, seconds of training so far, strict acc)] for each evaluation row. Every step row
    counts its seconds, skipped updates and critic warm-up steps included."""
    elapsed, out = 0.0, []
    for r in rows:
        elapsed += r.get("perf/step_s", 0.0)
        if "eval/strict_acc" in r:
            out.append((r["step"], elapsed, r["eval/strict_acc"]))
    return out


def load(run_dir):
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    info = json.load(open(os.path.join(run_dir, "run_info.json")))
    args = json.load(open(os.path.join(run_dir, "args.json")))
    return [r for r in rows if "train/loss" in r], [r for r in rows if "eval/strict_acc" in r], info, args


def scaling(a: Args):
    """Weak scaling: per-GPU work fixed, so ideal rollout tokens/s grows with the GPU count.
    Efficiency = tokens/s at N GPUs / (N x tokens/s at the fewest GPUs, per GPU). Step 1 is left out."""
    runs = []
    for name in sorted(os.listdir(a.run_dir)):
        path = os.path.join(a.run_dir, name)
        if not os.path.isfile(os.path.join(path, "metrics.jsonl")):
            continue
        train, _, info, args = load(path)
        timed = train[1:] or train
        runs.append(
            {
                "run": name,
                "gpus": info["world_size"],
                "steps": len(train),
                "prompts_per_step": args["prompts_per_step"],
                "rollout_tokens_per_s": statistics.mean(r["perf/rollout_tokens_per_s"] for r in timed),
                "step_s": statistics.mean(r["perf/step_s"] for r in timed),
                "generate_s": statistics.mean(r["time/generate"] for r in timed),
                "sync_s": statistics.mean(r["time/sync_weights"] for r in timed),
                "gpu": info["gpu"],
                "date": info["date"],
            }
        )
    if not runs:
        raise SystemExit(f"{a.run_dir}: no run folders with metrics.jsonl (run bench/run_scaling.sh first)")
    runs.sort(key=lambda r: r["gpus"])
    base = runs[0]["rollout_tokens_per_s"] / runs[0]["gpus"]
    for r in runs:
        r["rollout_scaling_efficiency"] = r["rollout_tokens_per_s"] / (r["gpus"] * base)
    out = {"gpu": runs[0]["gpu"], "date": runs[0]["date"], "command": a.command, "runs": runs}
    if a.note:
        out["note"] = a.note
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(out, indent=2))


def tools(a: Args):
    """run_tools.sh's pair: held-out greedy accuracy and tool use by step, rollout tokens/s and the
    largest log-prob gap over model tokens, for the run with the calculator and the one without."""
    runs = {}
    for name in ("tools_calculator", "tools_none"):
        path = os.path.join(a.run_dir, name)
        if not os.path.isfile(os.path.join(path, "metrics.jsonl")):
            raise SystemExit(f"{path}: no metrics.jsonl (run bench/run_tools.sh first)")
        train, evals, info, args = load(path)
        evals = sorted(evals, key=lambda r: r["step"])
        timed = train[1:] or train  # step 1 includes warm-up
        runs[name] = {
            "steps": len(train),
            "eval_prompts": args["num_eval_prompts"],
            "tools": args["tools"],
            "eval_curve": [
                [r["step"], round(r["eval/strict_acc"], 4), round(r.get("eval/tool_used_frac", 0.0), 4)] for r in evals
            ],
            "final_strict_acc": evals[-1]["eval/strict_acc"],
            "best_strict_acc": max(r["eval/strict_acc"] for r in evals),
            "rollout_curve": [
                [
                    r["step"],
                    round(r["rollout/strict_acc"], 4),
                    round(r.get("tools/used_frac", 0.0), 4),
                    round(r.get("tools/calls_per_sample", 0.0), 3),
                    round(r["rollout/logprob_abs_diff"], 4),
                ]
                for r in train
            ],
            "logprob_abs_diff_max": max(r["rollout/logprob_abs_diff"] for r in train),
            "rollout_tokens_per_s": statistics.mean(r["perf/rollout_tokens_per_s"] for r in timed),
            "seconds_per_step": statistics.mean(r["perf/step_s"] for r in timed),
            "median_seconds_per_step": statistics.median(r["perf/step_s"] for r in timed),
            "tool_errors": sum(r.get("tools/errors", 0) for r in train),
            "tool_timeouts": sum(r.get("tools/timeouts", 0) for r in train),
            "tool_seconds_per_step": statistics.mean(r.get("tools/seconds", 0.0) for r in train),
            "gpu": info["gpu"],
            "date": info["date"],
            "command": info["command"],
        }
    w, wo = runs["tools_calculator"], runs["tools_none"]
    out = {
        "gpu": w["gpu"],
        "date": w["date"],
        "command": a.command,
        "note": a.note,
        "with_tools_final_strict_acc": w["final_strict_acc"],
        "without_tools_final_strict_acc": wo["final_strict_acc"],
        "multiturn_logprob_gap_max": w["logprob_abs_diff_max"],
        "rollout_tokens_per_s_ratio_with_over_without": w["rollout_tokens_per_s"] / wo["rollout_tokens_per_s"],
        "columns": {
            "eval_curve": ["updates", "strict acc (greedy)", "share of samples calling a tool (greedy)"],
            "rollout_curve": [
                "step",
                "strict acc (sampled)",
                "share of samples calling a tool",
                "tool calls per sample",
                "logprob_abs_diff (model tokens)",
            ],
        },
        "runs": runs,
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=2))
    if a.png:
        fig, ax = subplots(1, 2, figsize=(11, 4))
        for name, style in (("tools_calculator", "o-"), ("tools_none", "s--")):
            r = runs[name]
            ax[0].plot(
                [e[0] for e in r["eval_curve"]],
                [e[1] for e in r["eval_curve"]],
                style,
                label=f"{name} (greedy, held out)",
            )
            ax[1].plot(
                [e[0] for e in r["rollout_curve"]],
                [e[2] for e in r["rollout_curve"]],
                style[1:],
                label=f"{name} (sampled)",
            )
        ax[1].plot(
            [e[0] for e in w["eval_curve"]],
            [e[2] for e in w["eval_curve"]],
            "o",
            label="tools_calculator (greedy, held out)",
        )
        ax[0].set_ylabel("strict accuracy"), ax[1].set_ylabel("share of samples that call a tool")
        for x in ax:
            x.set_xlabel("updates"), x.set_ylim(-0.02, 1.02), x.legend(loc="center right")
        fig.suptitle(
            f"GRPO on 3-digit x 2-digit multiplication, SmolLM2-135M-Instruct, with and without the calculator ({w['gpu']})"
        )
        fig.tight_layout()
        fig.savefig(a.png, dpi=110)


SERVER_PHASES = ("generate", "sync_weights", "logprob", "update", "pause", "continue")  # pause, continue: k >= 2
SERVER_RUNS = (
    "colocate",
    "colocate_x2",
    "server_sync",
    "server_async",
    "injob_async",
    "injob_full_k2",
    "injob_full_k4",
    "server2_sync",
    "injob_async_tp2",
    "colocate_x4",
    "injob_async_2p2",
)


def server(a: Args):
    """run_server.sh's runs (those present): held-out accuracy by updates, the log-prob gap, step time
    and where it goes; colocate minus server accuracy after the same updates; async over sync steps/s."""
    runs = {}
    for name in SERVER_RUNS:
        path = os.path.join(a.run_dir, name)
        if not os.path.isfile(os.path.join(path, "metrics.jsonl")):
            continue
        rows = read_metrics(os.path.join(path, "metrics.jsonl"))
        train, evals = [r for r in rows if "train/loss" in r], [r for r in rows if "eval/strict_acc" in r]
        info_path = os.path.join(path, "run_info.json")
        log = os.path.join(a.run_dir, f"{name}.log")  # run_server.sh's: its first line "=== <UTC time> <run>"
        started = open(log).readline().split()[1][:10] if os.path.isfile(log) else None
        info = (
            json.load(open(info_path))
            if os.path.isfile(info_path)
            else {"gpu": a.gpu, "date": started, "command": None, "world_size": 2 if name == "colocate_x2" else 1}
        )
        evals, timed = sorted(evals, key=lambda r: r["step"]), train[1:] or train  # step 1 includes warm-up
        runs[name] = {
            "steps": len(train),
            "world_size": info["world_size"],
            "eval_curve": [
                [r["step"], round(r["eval/strict_acc"], 4), round(r["eval/flexible_acc"], 4)] for r in evals
            ],
            "logprob_abs_diff_max": max(r["rollout/logprob_abs_diff"] for r in train),
            "staleness_mean": statistics.mean(r.get("rollout/staleness", 0.0) for r in train),
            "staleness_max": max(r.get("rollout/staleness_max", 0.0) for r in train),
            "partial_frac_mean": statistics.mean(r.get("rollout/partial_frac", 0.0) for r in train),
            "dropped_groups": train[-1].get("rollout/dropped_groups", 0.0),  # so far, at the last step
            "response_len_mean": statistics.mean(r.get("rollout/response_len_mean", 0.0) for r in train),
            "response_len_max": max(r.get("rollout/response_len_max", 0.0) for r in train),
            "step_seconds": [round(r["perf/step_s"], 2) for r in train],
            "seconds_per_step": statistics.mean(r["perf/step_s"] for r in timed),
            "median_seconds_per_step": statistics.median(r["perf/step_s"] for r in timed),
            "seconds_per_phase": {
                k[len("time/") :]: statistics.mean(r.get(k, 0.0) for r in timed)
                for k in (f"time/{phase}" for phase in SERVER_PHASES)
            },
            "median_seconds_per_phase": {
                k[len("time/") :]: statistics.median(r.get(k, 0.0) for r in timed)
                for k in (f"time/{phase}" for phase in SERVER_PHASES)
            },
            "startup_to_first_step_s": train[0].get("time/startup_to_first_step_s"),
            "gpu": info["gpu"],
            "date": info["date"],
            "command": info["command"],
        }
    if not runs:
        raise SystemExit(
            f"{a.run_dir}: none of {', '.join(SERVER_RUNS)} has a metrics.jsonl (run bench/run_server.sh first)"
        )
    out = {
        "gpu": next(iter(runs.values()))["gpu"],
        "date": next(iter(runs.values()))["date"],
        "command": a.command,
        "note": a.note,
        "columns": {"eval_curve": ["updates", "strict acc (greedy)", "flexible acc (greedy)"]},
    }
    if "colocate" in runs and "server_sync" in runs:  # after the last update both evaluated
        done = {e[0]: e for e in runs["server_sync"]["eval_curve"]}
        last = max(e[0] for e in runs["colocate"]["eval_curve"] if e[0] in done)
        col = next(e for e in runs["colocate"]["eval_curve"] if e[0] == last)
        out.update(
            server_acc_gap=round(col[1] - done[last][1], 4),
            server_flexible_acc_gap=round(col[2] - done[last][2], 4),
            acc_gap_after_updates=last,
        )
    if "server_sync" in runs:
        out["server_logprob_gap_max"] = runs["server_sync"]["logprob_abs_diff_max"]
    if "server_sync" in runs and "server_async" in runs:
        out["async_speedup"] = runs["server_sync"]["seconds_per_step"] / runs["server_async"]["seconds_per_step"]
    for base, placements in (
        ("colocate_x2", ("server_sync", "server_async", "injob_async", "injob_full_k2", "injob_full_k4")),
        ("injob_async", ("injob_full_k2", "injob_full_k4")),  # fully async over one step off
        ("colocate_x4", ("injob_async_2p2",)),
    ):
        if base in runs:  # the same GPUs, colocated: the baseline a placement on them must beat (median steps)
            for key, by in (("median_seconds_per_step", ""), ("seconds_per_step", "_by_mean")):
                out[f"speedup_over_{base}{by}"] = {
                    n: round(runs[base][key] / runs[n][key], 3) for n in placements if n in runs
                }
    out["runs"] = runs
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=2))
    if a.png:
        evaluated = any(r["eval_curve"] for r in runs.values())  # no accuracy panel for runs that never evaluated
        if evaluated:
            fig, (acc_ax, time_ax) = subplots(1, 2, figsize=(11, 4))
        else:
            fig, time_ax = subplots(1, 1, figsize=(6, 4))
        for name, r in runs.items() if evaluated else ():
            (line,) = acc_ax.plot(
                [e[0] for e in r["eval_curve"]], [e[2] for e in r["eval_curve"]], "o-", label=f"{name} flexible"
            )
            acc_ax.plot(
                [e[0] for e in r["eval_curve"]],
                [e[1] for e in r["eval_curve"]],
                "x:",
                color=line.get_color(),
                label=f"{name} strict",
            )
        names = list(runs)
        bottom = [0.0] * len(names)
        for phase in SERVER_PHASES:
            height = [runs[n]["seconds_per_phase"][phase] for n in names]
            time_ax.bar(names, height, bottom=bottom, label=phase)
            bottom = [b + h for b, h in zip(bottom, height)]
        time_ax.plot(names, [runs[n]["seconds_per_step"] for n in names], "k_", markersize=30, label="step (all of it)")
        if evaluated:
            (
                acc_ax.set_xlabel("updates"),
                acc_ax.set_ylabel("held-out accuracy (greedy)"),
                acc_ax.set_ylim(-0.02, 1.02),
                acc_ax.legend(),
            )
        (
            time_ax.set_ylabel("seconds per step (mean, step 1 left out)"),
            time_ax.legend(loc="lower center", fontsize=8, framealpha=0.9),
        )
        model = a.model_name or os.path.basename(
            json.load(open(os.path.join(a.run_dir, names[0], "args.json")))["model"].rstrip("/")
        )
        data = ", ".join(
            os.path.basename(d.rstrip("/"))
            for d in json.load(open(os.path.join(a.run_dir, names[0], "args.json")))["dataset"]
        )
        fig.suptitle(f"GRPO on {data}, {model}:\ncolocated engine vs SGLang server ({out['gpu']})")
        fig.tight_layout()
        fig.savefig(a.png, dpi=110)


def rm_evals(run_dir):
    """A train_rm.py run's evaluation rows, and the last one's held-out accuracy by group."""
    evals = [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "eval/pair_acc" in r]
    return evals, {k.rsplit("/", 1)[1]: v for k, v in evals[-1].items() if k.startswith("eval/pair_acc/")}


def rm(a: Args):
    """run_rm.sh's stages: the pairs made, the reward model's held-out pairwise accuracy (all pairs and each group),
    and GRPO with that reward model alone: held-out strict accuracy (judged by the rule) and the RM's score by step."""
    pairs = json.load(open(os.path.join(a.run_dir, "pairs.summary.json")))
    evals_rm, by_group = rm_evals(os.path.join(a.run_dir, "rm"))
    train, evals, info, args = load(os.path.join(a.run_dir, "grpo_rm"))
    evals = sorted(evals, key=lambda r: r["step"])
    last = evals_rm[-1]
    out = {
        "gpu": info["gpu"],
        "date": info["date"],
        "command": a.command,
        "note": a.note,
        "pairs": {k: pairs[k] for k in ("train", "eval")},
        "rm_steps": last["step"],
        "rm_pair_acc": last["eval/pair_acc"],
        "rm_margin": last.get("eval/margin"),
        "rm_pair_acc_by_group": by_group,
        "rm_eval_curve": [[r["step"], round(r["eval/pair_acc"], 4)] for r in evals_rm],
        "grpo_steps": len(train),
        "grpo_command": info["command"],
        "baseline_strict_acc": evals[0]["eval/strict_acc"],
        "final_strict_acc": evals[-1]["eval/strict_acc"],
        "strict_acc_gain": evals[-1]["eval/strict_acc"] - evals[0]["eval/strict_acc"],
        "eval_curve": [[r["step"], round(r["eval/strict_acc"], 4), round(r["eval/format_rate"], 4)] for r in evals],
        "rm_score_curve": [
            [
                r["step"],
                round(r["rollout/rm_score"], 4),
                round(r["rollout/strict_acc"], 4),
                round(r.get("rollout/rm_rule_corr", math.nan), 4),
            ]
            for r in train
        ],
        "rm_seconds_per_step": statistics.mean(r["time/reward_model"] for r in train),
        "seconds_per_step": statistics.mean(r["perf/step_s"] for r in train),
        "columns": {
            "eval_curve": ["updates", "held-out strict acc (greedy, by the rule)", "format rate"],
            "rm_score_curve": [
                "step",
                "RM score (sampled, mean)",
                "strict acc (sampled, by the rule)",
                "correlation RM score / rule reward",
            ],
        },
    }
    out["rm_score_share_of_step"] = out["rm_seconds_per_step"] / out["seconds_per_step"]
    out["other_reward_models"] = {}  # rm_* beside rm: other starting points or learning rates on such pairs
    for name in sorted(
        d for d in os.listdir(a.run_dir) if d.startswith("rm_") and os.path.isdir(os.path.join(a.run_dir, d))
    ):
        other, other_by_group = rm_evals(os.path.join(a.run_dir, name))
        rm_args = json.load(open(os.path.join(a.run_dir, name, "args.json")))
        out["other_reward_models"][name] = {
            "init": rm_args["model"],
            "lr": rm_args["lr"],
            "steps": other[-1]["step"],
            "pair_acc": other[-1]["eval/pair_acc"],
            "pair_acc_by_group": other_by_group,
        }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps({k: v for k, v in out.items() if not k.endswith("curve")}, indent=2))
    if a.png:
        fig, ax = subplots(1, 2, figsize=(12, 4.2))
        plot_metric(ax[0], evals_rm, "eval/pair_acc", "o-", color="k", label="all held-out pairs")
        for i, group in enumerate(sorted(out["rm_pair_acc_by_group"])):
            plot_metric(ax[0], evals_rm, f"eval/pair_acc/{group}", ".--", color=f"C{i}", label=f"'{group}' pairs")
        (
            ax[0].set(
                xlabel="reward-model training step",
                ylabel="held-out pairwise accuracy",
                ylim=(0, 1.02),
                title="train_rm.py from SmolLM2 on its own labelled pairs",
            ),
            ax[0].legend(fontsize=8),
        )
        plot_metric(ax[1], evals, "eval/strict_acc", "o-", color="C0", label="held-out strict acc (rule, greedy)")
        plot_metric(ax[1], evals, "eval/flexible_acc", "s--", color="C2", label="held-out flexible acc (last number)")
        plot_metric(ax[1], train, "rollout/strict_acc", "-", color="C0", alpha=0.35, label="strict acc (rule, sampled)")
        ax[1].set(
            xlabel="GRPO step",
            ylabel="accuracy (judged by the rule)",
            ylim=(0, 1.02),
            title="GRPO with the reward model alone (--reward-weights 0 1)",
        )
        twin = ax[1].twinx()
        plot_metric(twin, train, "rollout/rm_score", "-", color="C3", label="RM score (sampled, mean)")
        twin.set_ylabel("reward-model score", color="C3")
        ax[1].legend(handles=ax[1].get_lines() + twin.get_lines(), fontsize=8, loc="lower right")
        fig.suptitle(f"The reward-model loop on addition, SmolLM2-135M-Instruct ({info['gpu']}, {info['date']})")
        fig.tight_layout()
        fig.savefig(a.png, dpi=110)


VARIANT_RUNS = {
    "addition": (
        "add_grpo",
        "add_gspo",
        "add_cispo",
        "add_rloo",
        "add_reinforcepp",
        "add_tis",
        "add_mis",
        "add_icepop",
        "add_seqmask",
    ),
    "tools": ("mul_ppoclip", "mul_gspo", "mul_cispo"),
    "addition-mb4": ("add_ppoclip_mb4", "add_gspo_mb4", "add_cispo_mb4", "add_sapo_mb4"),
}


def variants(a: Args):
    """run_variants.sh's runs of one task (those present): held-out accuracy by updates, the final one, seconds per
    step, the sampler-trainer mismatch and the share of tokens corrected; one figure of all of them (plot.py)."""
    runs = {}
    for name in VARIANT_RUNS[a.task]:
        path = os.path.join(a.run_dir, name)
        if not os.path.isfile(os.path.join(path, "metrics.jsonl")):
            continue
        train, evals, info, args = load(path)
        evals, timed = sorted(evals, key=lambda r: r["step"]), train[1:] or train  # step 1 includes warm-up

        def mean(key):
            return statistics.mean(r.get(key, 0.0) for r in train)

        runs[name] = {
            **{
                k: args.get(k)
                for k in (
                    "advantage",
                    "policy_loss",
                    "rollout_correction",
                    "clip_low",
                    "clip_high",
                    "tis_cap",
                    "correction_bounds",
                    "loss_agg",
                )
            },
            "steps": len(train),
            "of_steps": args["steps"],
            "final_eval_after": evals[-1]["step"],
            "final_strict_acc": evals[-1]["eval/strict_acc"],
            "final_flexible_acc": evals[-1]["eval/flexible_acc"],
            "eval_curve": [
                [r["step"], round(r["eval/strict_acc"], 4), round(r["eval/flexible_acc"], 4)] for r in evals
            ],
            "seconds_per_step": statistics.mean(r["perf/step_s"] for r in timed),
            "median_seconds_per_step": statistics.median(r["perf/step_s"] for r in timed),
            "mismatch_kl_mean": mean("rollout/mismatch_kl"),
            "mismatch_ratio_max": max(r["rollout/mismatch_ratio_max"] for r in train),
            "logprob_abs_diff_max": max(r["rollout/logprob_abs_diff"] for r in train),
            "correction_frac_mean": mean("rollout/correction_frac"),
            "clip_frac_mean": mean("train/clip_frac"),
            "nonfinite_skips": sum(r.get("train/nonfinite_skips", 0) for r in train),
            "gpu": info["gpu"],
            "date": info["date"],
            "command": info["command"],
        }
    if not runs:
        raise SystemExit(
            f"{a.run_dir}: none of {', '.join(VARIANT_RUNS[a.task])} has a metrics.jsonl (run bench/run_variants.sh first)"
        )
    gpus = sorted({r["gpu"] for r in runs.values()})
    gpu = (
        gpus[0]
        if len(gpus) == 1
        else "; ".join(  # runs finished on another machine: each GPU with its runs
            f"{g} ({', '.join(name for name, r in runs.items() if r['gpu'] == g)})" for g in gpus
        )
    )
    out = {
        "gpu": gpu,
        "date": max(r["date"] for r in runs.values()),
        "task": a.task,
        "command": a.command,
        "note": a.note,
        "variants": {name: r["final_strict_acc"] for name, r in runs.items() if r["steps"] == r["of_steps"]},
        "unfinished": {
            name: f"{r['steps']} of {r['of_steps']} steps" for name, r in runs.items() if r["steps"] < r["of_steps"]
        },
        "columns": {"eval_curve": ["updates", "strict acc (greedy, held out)", "flexible acc (greedy, held out)"]},
        "runs": runs,
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    print(
        f"{'run':16} {'steps':>5} {'final strict':>12} {'flexible':>8} {'s/step':>7} {'mismatch kl':>11} {'corrected':>9}"
    )
    for name, r in runs.items():
        print(
            f"{name:16} {r['steps']:5d} {r['final_strict_acc']:12.3f} {r['final_flexible_acc']:8.3f} {r['seconds_per_step']:7.2f} "
            f"{r['mismatch_kl_mean']:11.2e} {r['correction_frac_mean']:9.3f}"
        )
    if a.png:
        draw([os.path.join(a.run_dir, name) for name in runs], a.png)
    if a.summary:
        with open(a.summary) as f:
            summary = json.load(f)
        entry = summary.get("variants", {"value": {}, "sources": []})
        entry["value"][a.task] = out["variants"]
        entry["sources"] = sorted(set(entry["sources"]) | {os.path.basename(a.out)})
        entry.update(
            gpu=out["gpu"],
            date=out["date"],
            what="final held-out strict accuracy (greedy) of each run of "
            "bench/run_variants.sh: one policy loss, advantage or rollout correction changed from GRPO's defaults",
        )
        summary["variants"] = entry
        with open(a.summary, "w") as f:
            json.dump(summary, f, indent=1)


def peak_gib(train, which: str = "device_peak") -> float | None:
    """The most GiB any phase of any step reached: `device_peak` (the whole GPU: SGLang's processes too; beside other
    runs on the GPU, theirs too) or `peak` (this training process's own tensors). None: not logged (a CPU run)."""
    device = which == "device_peak"  # "_peak_gib" ends "_device_peak_gib" too
    values = [
        v
        for r in train
        for k, v in r.items()
        if k.startswith("memory/") and k.endswith(f"_{which}_gib") and (device or not k.endswith("_device_peak_gib"))
    ]
    return max(values) if values else None


def run_end(log: str) -> str:
    """run_lora.sh's last '=== exit RC STATUS SECONDS' line of a run's log: ok, oom, fail(RC); 'not run' without."""
    ends = [line.split() for line in open(log)] if os.path.isfile(log) else []
    ends = [x for x in ends if x[:2] == ["===", "exit"]]
    return ends[-1][3] if ends and len(ends[-1]) > 3 else ("not run" if not ends else f"exit {ends[-1][2]}")


def lora(a: Args):
    """run_lora.sh's parts, those present: acc (full fine-tuning vs LoRA ranks, held-out accuracy by updates on one
    figure, peak memory, step seconds), 7b (a 7B shape on one GPU: LoRA's memory and seconds by phase, full fine-tuning's
    end), sync (seconds merge vs adapter). Never a number that was not measured: a part that is missing is left out."""
    out, summary = {"command": a.command, "note": a.note}, {}
    acc = {}
    for name in (
        "full",
        "r1",
        "r8",
        "r32",
        "r1a",
        "r8a",
        "r32a",
        "r1m",
        "r8m",
        "r32m",
    ):  # a: --lora-sync adapter, m: merge
        path = os.path.join(a.run_dir, "acc", name)
        if not os.path.isfile(os.path.join(path, "metrics.jsonl")):
            continue
        train, evals, info, args = load(path)
        evals, timed = sorted(evals, key=lambda r: r["step"]), train[1:] or train  # step 1: start-up's warm-up
        acc[name] = {
            "model": os.path.basename(args["model"].rstrip("/")),
            "lora_rank": args.get("lora_rank", 0),
            "lora_alpha": args.get("lora_alpha") if args.get("lora_rank") else None,
            "lora_sync": args.get("lora_sync") if args.get("lora_rank") else None,
            "lr": args["lr"],
            "steps": len(train),
            "of_steps": args["steps"],
            "samples_per_step": args["prompts_per_step"] * args["group_size"],
            "final_eval_after": evals[-1]["step"] if evals else None,
            "final_strict_acc": evals[-1]["eval/strict_acc"] if evals else None,
            "eval_curve": [
                [r["step"], round(r["eval/strict_acc"], 4), round(r["eval/flexible_acc"], 4)] for r in evals
            ],
            "median_step_s": statistics.median(r["perf/step_s"] for r in timed) if timed else None,
            "update_s_mean": statistics.mean(r.get("time/update", 0.0) for r in timed) if timed else None,
            "training_process_peak_gib": peak_gib(train, "peak"),
            "logprob_abs_diff_max": max((r["rollout/logprob_abs_diff"] for r in train), default=None),
            "gpu": info["gpu"],
            "date": info["date"],
            "command": info["command"],
        }
    if acc:
        out["acc"] = {
            "runs": acc,
            "columns": {"eval_curve": ["updates", "strict acc (greedy, held out)", "flexible acc"]},
        }
        done = {  # strict: the answer in the asked '#### N' form (one event a run finds or not); flexible: right at all
            n: {"strict": r["eval_curve"][-1][1], "flexible": r["eval_curve"][-1][2]}
            for n, r in acc.items()
            if r["steps"] == r["of_steps"] and r["eval_curve"]
        }
        summary["lora_acc_vs_full"] = {
            "value": done,
            "gpu": acc[next(iter(acc))]["gpu"],
            "date": max(r["date"] for r in acc.values()),
            "what": "final held-out strict and flexible accuracy (greedy, 256 prompts) after the runs' steps, SmolLM2-135M-Instruct on "
            "addition, side by side on one GPU: full fine-tuning vs LoRA rank 1, 8, 32 at 10x its lr, alpha 32, every linear layer",
        }
        print(f"{'run':5} {'rank':>4} {'lr':>7} {'steps':>5} {'final strict':>12} {'s/step':>7} {'peak GiB':>8}")
        for n, r in acc.items():
            strict = "-" if r["final_strict_acc"] is None else f"{r['final_strict_acc']:.3f}"
            step_s = "-" if r["median_step_s"] is None else f"{r['median_step_s']:.2f}"
            peak = "-" if r["training_process_peak_gib"] is None else f"{r['training_process_peak_gib']:.2f}"
            print(f"{n:5} {r['lora_rank']:4d} {r['lr']:7.0e} {r['steps']:5d} {strict:>12} {step_s:>7} {peak:>8}")
        if a.png:
            fig, ax = subplots(1, 2, figsize=(12, 4.5))
            for n, r in acc.items():
                label = "full fine-tuning" if not r["lora_rank"] else f"LoRA rank {r['lora_rank']}, {r['lora_sync']}"
                label += f", lr {r['lr']:g}"
                style = "o:" if r["lora_sync"] == "merge" else "o-"
                for i, x in enumerate(ax):  # column 2 of eval_curve: flexible; 1: strict
                    x.plot([p[0] for p in r["eval_curve"]], [p[2 - i] for p in r["eval_curve"]], style, label=label)
            for x, what in zip(ax, ("flexible (right in any form)", "strict (right as '#### N')")):
                x.set_xlabel("updates"), x.set_ylabel(f"held-out accuracy, {what}"), x.set_ylim(0, 1)
            ax[0].legend(fontsize=8)
            first = acc[next(iter(acc))]
            fig.suptitle(f"{first['model']} on addition: full fine-tuning vs LoRA, side by side on one {first['gpu']}")
            fig.tight_layout()
            fig.savefig(a.png, dpi=110)
    b7 = {}
    for name in ("lora", "full_offload", "full"):
        path, log = os.path.join(a.run_dir, "7b", name), os.path.join(a.run_dir, "7b", f"{name}.log")
        if not os.path.isfile(log):
            continue
        entry = {"end": run_end(log)}
        if os.path.isfile(os.path.join(path, "metrics.jsonl")) and os.path.isfile(os.path.join(path, "run_info.json")):
            train, _, info, args = load(path)
            entry.update(
                lora_rank=args.get("lora_rank", 0),
                offload=args["offload"],
                mem_fraction=args["sglang_mem_fraction"],
                steps=len(train),
                of_steps=args["steps"],
                gpu=info["gpu"],
                date=info["date"],
                command=info["command"],
            )
            if train:
                entry.update(
                    device_peak_gib=peak_gib(train),
                    training_process_peak_gib=peak_gib(train, "peak"),
                    median_step_s=statistics.median(r["perf/step_s"] for r in (train[1:] or train)),
                    **memory_summary(train),
                )
        b7[name] = entry
    if b7:
        out["7b"] = b7
        lora_run = b7.get("lora", {})
        if lora_run.get("device_peak_gib") is not None:
            summary["lora_7b_one_gpu_peak_gib"] = {
                "value": round(lora_run["device_peak_gib"], 2),
                "training_process_peak_gib": round(lora_run["training_process_peak_gib"], 2),
                "median_step_s": round(lora_run["median_step_s"], 2),
                "full_fine_tuning": {n: r["end"] for n, r in b7.items() if n != "lora"},
                "gpu": lora_run["gpu"],
                "date": lora_run["date"],
                "what": "the whole GPU's peak GiB (SGLang's processes too) over every phase of 5 GRPO steps of a Qwen2.5-7B-"
                "shaped model (random weights) with LoRA rank 8 on one GPU; full fine-tuning of it on the same GPU: how it ended",
            }
        for n, r in b7.items():
            print(
                f"7b {n:13} {r['end']:8} "
                + (
                    f"peak {r['device_peak_gib'] or '-'} GiB, {r['median_step_s']:.1f} s a step"
                    if "median_step_s" in r
                    else ""
                )
            )
    sync = {}
    for shape in ("1p5b", "7b"):
        path = os.path.join(a.run_dir, "sync", f"lora_sync_{shape}.json")
        if os.path.isfile(path):
            sync[shape] = json.load(open(path))
    if sync:
        out["sync"] = sync
        summary["lora_sync_s"] = {
            "value": {shape: {way: round(x, 4) for way, x in r["sync_s"].items()} for shape, r in sync.items()},
            "first_adapter_sync_s": {shape: round(r["first_sync_s"]["adapter"], 3) for shape, r in sync.items()},
            "gpu": sync[next(iter(sync))]["gpu"],
            "date": max(r["date"] for r in sync.values()),
            "what": "median seconds of one weight sync of a LoRA policy (rank 8, every linear layer) to an in-process "
            "SGLang engine on the same GPU: merge (every weight, adapted ones merged as they are gathered) vs adapter (the "
            "adapter alone; the base went once, first_adapter_sync_s)",
        }
        for shape, r in sync.items():
            print(
                f"sync {shape}: merge {r['sync_s']['merge']:.3f} s, adapter {r['sync_s']['adapter']:.3f} s, gaps {r['gap']}"
            )
    if not (acc or b7 or sync):
        raise SystemExit(f"{a.run_dir}: no acc/, 7b/ or sync/ results of bench/run_lora.sh")
    out["gpu"] = "; ".join(
        sorted({r["gpu"] for r in [*acc.values(), *sync.values(), *[x for x in b7.values() if "gpu" in x]]})
    )
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    if a.summary:
        with open(a.summary) as f:
            whole = json.load(f)
        for key, entry in summary.items():
            whole[key] = {**entry, "sources": [os.path.basename(a.out)]}
        with open(a.summary, "w") as f:
            json.dump(whole, f, indent=1)


DETERMINISTIC_RUNS = ("normal", "det_a", "det_b")
NOT_REPEATABLE = ("time/", "perf/", "memory/")  # seconds, throughput, memory: every other metric must repeat


def same_run(a_dir: str, b_dir: str, steps: int) -> dict:
    """Two runs of one seed, step for step up to `steps`: samples.jsonl's rows and every metric but NOT_REPEATABLE's,
    equal as written (JSON floats: bit for bit); the first that differs."""

    def rows(run, name):
        path = os.path.join(run, name)
        return [json.loads(line) for line in open(path)] if os.path.isfile(path) else []

    samples = [[r for r in rows(d, "samples.jsonl") if r["step"] <= steps] for d in (a_dir, b_dir)]
    metrics = [
        [{k: v for k, v in r.items() if not k.startswith(NOT_REPEATABLE)} for r in rows(d, "metrics.jsonl")]
        for d in (a_dir, b_dir)
    ]
    metrics = [[r for r in m if "train/loss" in r and r["step"] <= steps] for m in metrics]
    first = next(
        (
            f"step {x['step']:g}: {k} {x.get(k)} vs {y.get(k)}"
            for x, y in zip(*metrics)
            for k in sorted(x.keys() | y.keys())
            if x.get(k) != y.get(k)
        ),
        None,
    ) or next((f"samples.jsonl row {i}: {x} vs {y}" for i, (x, y) in enumerate(zip(*samples)) if x != y), None)
    return {
        "steps_compared": min(len(m) for m in metrics),
        "sample_rows_compared": min(len(s) for s in samples),
        "samples_identical": samples[0] == samples[1] and bool(samples[0]),
        "metrics_identical": metrics[0] == metrics[1] and bool(metrics[0]),
        "first_difference": first,
    }


def deterministic(a: Args):
    """run_deterministic.sh's runs, over the steps every run finished: whether the two --deterministic-rollout runs
    sampled the same (same_run), what the mode costs against the normal run beside them (medians of seconds a step,
    generating, log-probs and update, rollout tokens/s; step 1, warm-up, left out) and the sampler-trainer mismatch in
    each (medians of rollout/mismatch_kl and logprob_abs_diff)."""
    paths = {name: os.path.join(a.run_dir, name) for name in DETERMINISTIC_RUNS}
    if missing := [p for p in paths.values() if not os.path.isfile(os.path.join(p, "metrics.jsonl"))]:
        raise SystemExit(f"{', '.join(missing)}: no metrics.jsonl (run bench/run_deterministic.sh first)")
    loaded = {name: load(path) for name, path in paths.items()}
    steps = min(len(train) for train, *_ in loaded.values())  # every run's numbers over the steps all finished
    if steps < 2:
        raise SystemExit(f"{a.run_dir}: a run finished {steps} step(s); the report needs 2 or more (step 1 is warm-up)")
    runs = {}
    for name, (train, _, info, args) in loaded.items():
        train = train[:steps]

        def median(key, rows=train[1:]):
            return statistics.median(r[key] for r in rows)

        runs[name] = {
            "deterministic_rollout": args.get("deterministic_rollout", False),
            "steps": len(loaded[name][0]),
            "of_steps": args["steps"],
            "step_s": median("perf/step_s"),
            "generate_s": median("time/generate"),
            "logprob_s": median("time/logprob"),
            "update_s": median("time/update"),
            "rollout_tokens_per_s": median("perf/rollout_tokens_per_s"),
            "mismatch_kl": median("rollout/mismatch_kl", train),
            "logprob_abs_diff": median("rollout/logprob_abs_diff", train),
            "mismatch_ratio_max": max(r["rollout/mismatch_ratio_max"] for r in train),
            "gpu": info["gpu"],
            "date": info["date"],
            "command": info["command"],
        }
    if not runs["det_a"]["deterministic_rollout"] or not runs["det_b"]["deterministic_rollout"]:
        raise SystemExit(f"{a.run_dir}: det_a and det_b must be runs with --deterministic-rollout")
    det, normal = (runs["det_a"], runs["det_b"]), runs["normal"]

    def ratio(key):  # the deterministic runs' mean over the normal run's
        return round(statistics.mean(r[key] for r in det) / normal[key], 3)

    cost = {f"{k}_ratio": ratio(k) for k in ("step_s", "generate_s", "logprob_s", "update_s", "rollout_tokens_per_s")}
    mismatch = {
        k: {"normal": normal[k], "deterministic": statistics.mean(r[k] for r in det)}
        for k in ("mismatch_kl", "logprob_abs_diff")
    }
    check = os.path.join(a.run_dir, "attention_check.txt")  # run_deterministic.sh: the copied list vs SGLang's
    out = {
        "gpu": normal["gpu"],
        "date": max(r["date"] for r in runs.values()),
        "steps_compared": steps,
        "command": a.command,
        "note": a.note,
        "repeatable": same_run(paths["det_a"], paths["det_b"], steps),
        "normal_vs_det_a": same_run(paths["normal"], paths["det_a"], steps),  # expected to differ: other kernels
        "cost": cost,
        "mismatch": mismatch,
        "attention_check": open(check).read().strip() if os.path.isfile(check) else None,
        "runs": runs,
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    print(
        f"{'run':8} {'steps':>5} {'step s':>7} {'gen s':>7} {'tok/s':>8} {'update s':>8} {'mismatch kl':>11} {'|dlogp|':>8}"
    )
    for name, r in runs.items():
        print(
            f"{name:8} {r['steps']:5d} {r['step_s']:7.2f} {r['generate_s']:7.2f} {r['rollout_tokens_per_s']:8.0f} "
            f"{r['update_s']:8.2f} {r['mismatch_kl']:11.2e} {r['logprob_abs_diff']:8.4f}"
        )
    print(f"det_a vs det_b over {steps} steps: {out['repeatable']}\ncost (deterministic / normal): {cost}")
    if a.summary:
        with open(a.summary) as f:
            summary = json.load(f)
        where = {"gpu": out["gpu"], "date": out["date"], "sources": [os.path.basename(a.out)]}
        summary["deterministic_rollout_cost"] = {
            "value": cost,
            **where,
            "what": "--deterministic-rollout over a normal run, same seed and settings, side by side on one GPU "
            "(bench/run_deterministic.sh, SmolLM2 on addition): medians a step after the first; tokens/s below 1 "
            "and seconds above 1 are its cost",
        }
        summary["deterministic_mismatch_kl"] = {
            "value": mismatch["mismatch_kl"],
            "logprob_abs_diff": mismatch["logprob_abs_diff"],
            "repeatable": out["repeatable"]["samples_identical"] and out["repeatable"]["metrics_identical"],
            **where,
            "what": "median rollout/mismatch_kl (k3 KL(sampler || trainer)) with and without --deterministic-rollout, "
            "the trainer's kernels as they are; repeatable: two deterministic runs' samples and metrics equal",
        }
        with open(a.summary, "w") as f:
            json.dump(summary, f, indent=1)


def defaults(a: Args):
    """run_fast_defaults.sh's runs, `<shape>__<variant>` (`default`: the command as typed): each run's median step,
    generate, log-prob and update seconds (step 1, warm-up and compiles, left out), update MFU, the update's peak GPU memory, the
    seconds to step 1 and the micro-batches it ran; each shape's default over its fastest run (>= 1: 1 where the
    default is the fastest); with --summary the keys default_vs_best (the worst shape's) and default_update_mfu_1p5b."""
    runs = {}
    for name in sorted(os.listdir(a.run_dir)):
        path = os.path.join(a.run_dir, name)
        if "__" not in name or not os.path.isfile(os.path.join(path, "metrics.jsonl")):
            continue
        train, _, info, args = load(path)
        if len(train) < 2:
            continue  # step 1 alone holds the warm-up: nothing to time
        timed = train[1:]

        def median(key, rows=timed):
            return round(statistics.median(r.get(key, 0.0) for r in rows), 3)

        runs[name] = {
            "steps": len(train),
            "median_step_s": median("perf/step_s"),
            "median_generate_s": median("time/generate"),
            "median_logprob_s": median("time/logprob"),
            "median_update_s": median("time/update"),
            "median_other_s": median("time/other"),  # outside every named phase (0: a run from before it was logged)
            "update_mfu": median("perf/update_mfu"),
            "update_peak_gib": round(max(r.get("memory/update_device_peak_gib", 0.0) for r in train), 2),
            "startup_to_first_step_s": round(train[0].get("time/startup_to_first_step_s", 0.0), 1),
            "micro_batch_size": args.get("micro_batch_size"),
            "max_tokens_per_micro_batch": args.get("max_tokens_per_micro_batch"),
            "attn_implementation": args.get("attn_implementation"),
            "compile": args.get("compile"),
            "gpu": info["gpu"],
            "date": info["date"],
            "command": info["command"],
        }
    shapes = {}
    for name, r in runs.items():
        shapes.setdefault(name.split("__")[0], {})[name.split("__")[1]] = r
    ratios = {}
    for shape, variants in shapes.items():
        if "default" in variants:
            fastest = min(variants, key=lambda v: variants[v]["median_step_s"])
            ratios[shape] = {
                "default_vs_best": round(variants["default"]["median_step_s"] / variants[fastest]["median_step_s"], 3),
                "fastest": fastest,
            }
    if not runs:
        raise SystemExit(
            f"{a.run_dir}: no <shape>__<variant> run with 2 steps or more (run bench/run_fast_defaults.sh)"
        )
    first = next(iter(runs.values()))
    out = {"gpu": first["gpu"], "date": first["date"], "command": a.command, "note": a.note, "by_shape": ratios}
    out["runs"] = runs
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(ratios, indent=2))
    if a.summary and ratios:
        with open(a.summary) as f:
            summary = json.load(f)
        worst = max(ratios, key=lambda s: ratios[s]["default_vs_best"])
        source = os.path.basename(a.out)
        summary["default_vs_best"] = {
            "value": ratios[worst]["default_vs_best"],
            "gpu": first["gpu"],
            "date": first["date"],
            "what": f"median GRPO step (steps 2-N) of the command as typed over the fastest flags found, the worst of "
            f"the shapes ({worst}); by shape: "
            + ", ".join(f"{s} {r['default_vs_best']} (fastest: {r['fastest']})" for s, r in ratios.items()),
            "target": "<= 1.1 at every shape",
            "sources": [source],
        }
        if "q1p5__default" in runs:
            summary["default_update_mfu_1p5b"] = {
                "value": runs["q1p5__default"]["update_mfu"],
                "gpu": first["gpu"],
                "date": first["date"],
                "what": "median update MFU (steps 2-N) of the command as typed at Qwen2.5-1.5B shapes, 256 samples x "
                "1024 tokens, one GPU",
                "target": ">= 0.45",
                "sources": [source],
            }
        with open(a.summary, "w") as f:
            json.dump(summary, f, indent=1)


def main(a: Args):
    if a.kind == "deterministic":
        return deterministic(a)
    if a.kind == "lora":
        return lora(a)
    if a.kind == "rm":
        return rm(a)
    if a.kind == "variants":
        return variants(a)
    if a.kind == "scaling":
        return scaling(a)
    if a.kind == "tools":
        return tools(a)
    if a.kind == "server":
        return server(a)
    if a.kind == "defaults":
        return defaults(a)
    train, evals, info, args = load(a.run_dir)
    out = {
        "gpu": info["gpu"],
        "command": a.command or info["command"],
        "date": info["date"],
        "world_size": info["world_size"],
        "steps": len(train),
        "torch": info["torch"],
        "rollout_logprob_abs_diff_max": max(r["rollout/logprob_abs_diff"] for r in train),
        "weight_sync_s_mean": statistics.mean(r["time/sync_weights"] for r in train),
    }
    if a.note:
        out["note"] = a.note
    if a.kind == "arith":
        evals = sorted(evals, key=lambda r: r["step"])
        out.update(
            {
                "baseline_strict_acc": evals[0]["eval/strict_acc"] if evals and evals[0]["step"] == 0 else None,
                "final_strict_acc": evals[-1]["eval/strict_acc"],
                "final_flexible_acc": evals[-1]["eval/flexible_acc"],
                "final_format_rate": evals[-1]["eval/format_rate"],
                "best_strict_acc": max(r["eval/strict_acc"] for r in evals),
                "eval_curve": [
                    [r["step"], round(r["eval/strict_acc"], 4), round(r["eval/format_rate"], 4)] for r in evals
                ],
                "seconds_per_step": statistics.mean(r["perf/step_s"] for r in train[1:]),
                "wall_clock_s": sum(r["perf/step_s"] for r in train),
                "startup_to_first_step_s": train[0].get("time/startup_to_first_step_s"),
                "eval_prompts": args["num_eval_prompts"],
                "prompts_per_step": args["prompts_per_step"],
                "samples_per_prompt": args.get("group_size", args.get("samples_per_prompt")),
                **memory_summary(train),
            }
        )
        if a.png:
            fig, ax = subplots(1, 2, figsize=(11, 4))
            plot_metric(ax[0], train, "rollout/reward_mean", label="reward (sampled)")
            plot_metric(ax[0], train, "rollout/strict_acc", label="strict acc (sampled)")
            plot_metric(ax[0], train, "rollout/format_rate", label="format rate (sampled)", alpha=0.6)
            ax[0].set_xlabel("step"), ax[0].legend(), ax[0].set_title("training rollouts")
            plot_metric(ax[1], evals, "eval/strict_acc", "o-", label="strict acc (greedy)")
            plot_metric(ax[1], evals, "eval/flexible_acc", "^:", label="flexible acc (greedy)")
            plot_metric(ax[1], evals, "eval/format_rate", "s--", label="format rate (greedy)")
            ax[1].set_xlabel("updates"), ax[1].set_ylim(0, 1), ax[1].legend()
            ax[1].set_title(f"held-out ({args['num_eval_prompts']} prompts)")
            fig.suptitle(f"{args['run_name']}: {os.path.basename(args['model'])} on {info['gpu']}")
            fig.tight_layout()
            fig.savefig(a.png, dpi=110)
        if a.compare:
            fig, ax = subplots(1, 2, figsize=(11, 4))
            name = os.path.basename(a.compare).split(".")[0]
            for label, rows in (
                (args["run_name"], read_metrics(os.path.join(a.run_dir, "metrics.jsonl"))),
                (name, read_metrics(a.compare)),
            ):
                pts = eval_by_time(rows)
                ax[0].plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=label)
                ax[1].plot([p[1] for p in pts], [p[2] for p in pts], "o-", label=label)
            ax[0].set_xlabel("updates"), ax[1].set_xlabel("training seconds (sum of step times, start-up excluded)")
            for x in ax:
                x.set_ylabel("held-out strict accuracy (greedy)"), x.set_ylim(0, 1), x.legend()
            fig.suptitle(f"{os.path.basename(args['model'])} on {info['gpu']}")
            fig.tight_layout()
            fig.savefig(a.compare_png, dpi=110)
    else:
        out["mem_fraction"] = args["sglang_mem_fraction"]
        out["offload"] = args["offload"]
        out.update(memory_summary(train))
        out["seconds_per_step"] = statistics.mean(r["perf/step_s"] for r in train)
        out["gpu_total_gib"] = info.get("gpu_total_gib")
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main(tyro.cli(Args))
