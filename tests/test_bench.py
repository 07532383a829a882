"""bench/report.py's arithmetic on hand-made run folders (the GPU runs themselves are in bench/)."""

import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def report(*args):
    """`python bench/report.py ARGS...` from the repository root, as the GPU runs' README commands call it."""
    subprocess.run([sys.executable, "bench/report.py", *map(str, args)], cwd=ROOT, check=True, capture_output=True)


def fake_run(folder, world_size, tokens_per_s):
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step, tps in enumerate(tokens_per_s, 1):
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "train/loss": 0.0,
                        "perf/rollout_tokens_per_s": tps,
                        "perf/step_s": 10.0,
                        "time/generate": 4.0,
                        "time/sync_weights": 0.1,
                    }
                )
                + "\n"
            )
    json.dump(
        {"world_size": world_size, "gpu": "H", "date": "d", "command": "c", "torch": "t"},
        open(os.path.join(folder, "run_info.json"), "w"),
    )
    json.dump({"prompts_per_step": 16 * world_size}, open(os.path.join(folder, "args.json"), "w"))


def test_scaling_efficiency_is_tokens_per_gpu_relative_to_one_gpu(tmp_path):
    fake_run(tmp_path / "runs" / "scale_1gpu", 1, [999.0, 1000.0, 1000.0])  # step 1 (warm-up) is left out
    fake_run(tmp_path / "runs" / "scale_4gpu", 4, [1.0, 3000.0, 3400.0])  # 3200 tok/s on 4 GPUs
    out = tmp_path / "scaling.json"
    report("scaling", tmp_path / "runs", "--out", out)
    runs = json.loads(out.read_text())["runs"]
    assert [r["gpus"] for r in runs] == [1, 4]
    assert runs[0]["rollout_scaling_efficiency"] == 1.0
    assert abs(runs[1]["rollout_scaling_efficiency"] - 3200 / 4000) < 1e-9


def fake_tool_run(folder, tools, evals, used, tokens_per_s, gap):
    """A run_tools.sh run folder: two steps, evaluations at `evals` (step -> strict acc)."""
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step, tps in enumerate(tokens_per_s, 1):
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "train/loss": 0.0,
                        "perf/rollout_tokens_per_s": tps,
                        "perf/step_s": 5.0,
                        "rollout/strict_acc": 0.5,
                        "rollout/logprob_abs_diff": gap * step / len(tokens_per_s),
                        **(
                            {
                                "tools/used_frac": used,
                                "tools/calls_per_sample": used,
                                "tools/errors": 2.0,
                                "tools/timeouts": 0.0,
                                "tools/seconds": 0.01,
                            }
                            if tools
                            else {}
                        ),
                    }
                )
                + "\n"
            )
        for step, acc in evals.items():
            f.write(
                json.dumps({"step": step, "eval/strict_acc": acc, "eval/tool_used_frac": used if tools else 0.0}) + "\n"
            )
    json.dump(
        {"world_size": 1, "gpu": "H", "date": "d", "command": "c", "torch": "t"},
        open(os.path.join(folder, "run_info.json"), "w"),
    )
    json.dump({"num_eval_prompts": 8, "tools": tools}, open(os.path.join(folder, "args.json"), "w"))


def test_tools_report_pairs_the_runs_with_and_without_tools(tmp_path):
    fake_tool_run(tmp_path / "runs" / "tools_calculator", "calculator", {0: 0.25, 2: 0.75}, 1.0, [1.0, 600.0], 0.03)
    fake_tool_run(tmp_path / "runs" / "tools_none", "", {0: 0.0, 2: 0.125}, 0.0, [1.0, 1000.0], 0.02)
    out = tmp_path / "tools.json"
    report("tools", tmp_path / "runs", "--out", out)
    r = json.loads(out.read_text())
    assert (r["with_tools_final_strict_acc"], r["without_tools_final_strict_acc"]) == (0.75, 0.125)
    assert r["multiturn_logprob_gap_max"] == 0.03
    assert r["rollout_tokens_per_s_ratio_with_over_without"] == 0.6  # step 1 (warm-up) left out
    assert r["runs"]["tools_calculator"]["eval_curve"] == [[0, 0.25, 1.0], [2, 0.75, 1.0]]
    assert r["runs"]["tools_calculator"]["tool_errors"] == 4.0 and r["runs"]["tools_none"]["tool_errors"] == 0


def fake_server_run(folder, evals, step_s, gap, staleness=0.0):
    """A run_server.sh run folder: three steps, evaluations at `evals` (step -> (strict, flexible))."""
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step in (1, 2, 3):
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "train/loss": 0.0,
                        "perf/step_s": 99.0 if step == 1 else step_s,
                        "rollout/logprob_abs_diff": gap / step,
                        "rollout/staleness": staleness * (step > 1),
                        "time/generate": 1.0,
                        "time/sync_weights": 0.1,
                        "time/logprob": 1.0,
                        "time/update": 2.0,
                    }
                )
                + "\n"
            )
        for step, (strict, flexible) in evals.items():
            f.write(json.dumps({"step": step, "eval/strict_acc": strict, "eval/flexible_acc": flexible}) + "\n")
    json.dump(
        {"world_size": 1, "gpu": "H", "date": "d", "command": "c", "torch": "t"},
        open(os.path.join(folder, "run_info.json"), "w"),
    )
    json.dump({"num_eval_prompts": 8}, open(os.path.join(folder, "args.json"), "w"))


def test_server_report_compares_after_the_same_updates(tmp_path):
    fake_server_run(tmp_path / "runs" / "colocate", {0: (0.0, 0.1), 2: (0.5, 0.6), 3: (0.75, 0.8)}, 5.0, 0.04)
    fake_server_run(tmp_path / "runs" / "server_sync", {0: (0.0, 0.1), 2: (0.625, 0.7)}, 4.0, 0.05)  # stopped before 3
    fake_server_run(tmp_path / "runs" / "server_async", {0: (0.0, 0.1), 3: (0.5, 0.5)}, 2.5, 0.3, staleness=1.0)
    out = tmp_path / "server.json"
    report("server", tmp_path / "runs", "--out", out)
    r = json.loads(out.read_text())
    assert (r["acc_gap_after_updates"], r["server_acc_gap"], r["server_flexible_acc_gap"]) == (2, -0.125, -0.1)
    assert r["server_logprob_gap_max"] == 0.05 and r["async_speedup"] == 4.0 / 2.5  # step 1 (warm-up) left out
    assert r["runs"]["server_async"]["staleness_mean"] == 2 / 3 and set(r["runs"]) == {
        "colocate",
        "server_sync",
        "server_async",
    }


def test_server_report_compares_fully_async_with_one_step_off_and_colocated(tmp_path):
    """run_fully_async.sh's shapes: k = 2, 4 over one step off and over colocated x2 (median steps after the first),
    with each fully async run's staleness bound."""
    fake_server_run(tmp_path / "runs" / "colocate_x2", {}, 10.0, 0.04)
    fake_server_run(tmp_path / "runs" / "injob_async", {}, 8.0, 0.04, staleness=1.0)
    fake_server_run(tmp_path / "runs" / "injob_full_k2", {}, 5.0, 0.04, staleness=2.0)
    with open(tmp_path / "runs" / "injob_full_k2" / "metrics.jsonl", "a") as f:  # a step with the producer's metrics
        f.write(
            json.dumps(
                {
                    "step": 4,
                    "train/loss": 0.0,
                    "perf/step_s": 6.0,
                    "rollout/logprob_abs_diff": 0.01,
                    "rollout/staleness_max": 2.0,
                    "rollout/partial_frac": 0.4,
                    "rollout/dropped_groups": 3.0,
                }
            )
            + "\n"
        )
    out = tmp_path / "server.json"
    report("server", tmp_path / "runs", "--out", out)
    r = json.loads(out.read_text())
    assert r["speedup_over_injob_async"] == {"injob_full_k2": 1.6}  # the median of 5, 5, 6: 5
    assert r["speedup_over_colocate_x2"] == {"injob_async": 1.25, "injob_full_k2": 2.0}
    assert r["speedup_over_injob_async_by_mean"] == {"injob_full_k2": round(8.0 / (16.0 / 3), 3)}
    k2 = r["runs"]["injob_full_k2"]
    assert (k2["staleness_max"], k2["dropped_groups"], k2["partial_frac_mean"]) == (2.0, 3.0, 0.1)
    assert k2["step_seconds"] == [99.0, 5.0, 5.0, 6.0]


def test_arith_report_draws_its_curves_with_plot_py(tmp_path):
    """The arith summary and both PNGs (curve, --compare), drawn with plot.py's helpers."""
    run = tmp_path / "runs" / "grpo_arith"
    fake_server_run(run, {0: (0.0, 0.1), 3: (0.5, 0.6)}, 5.0, 0.04)
    with open(run / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    sampled = {"rollout/reward_mean": 0.5, "rollout/strict_acc": 0.4, "rollout/format_rate": 0.9}
    with open(run / "metrics.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({**r, **(sampled if "train/loss" in r else {"eval/format_rate": 0.8})}) + "\n")
    json.dump(
        {"num_eval_prompts": 8, "prompts_per_step": 4, "group_size": 4, "run_name": "grpo_arith", "model": "m"},
        open(run / "args.json", "w"),
    )
    out, png, compare_png = tmp_path / "arith.json", tmp_path / "arith.png", tmp_path / "compare.png"
    report("arith", run, "--out", out, "--png", png, "--compare", run / "metrics.jsonl", "--compare-png", compare_png)
    r = json.loads(out.read_text())
    assert (r["baseline_strict_acc"], r["final_strict_acc"]) == (0.0, 0.5)
    assert r["eval_curve"] == [[0, 0.0, 0.8], [3, 0.5, 0.8]]
    for path in (png, compare_png):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def fake_variant_run(folder, policy_loss, evals, step_s, mismatch_kl, corrected, of_steps=3, gpu="H"):
    """A run_variants.sh run folder: three steps of `of_steps`, evaluations at `evals` (step -> strict acc; flexible
    acc 0.1 more)."""
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step in (1, 2, 3):
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "train/loss": 0.0,
                        "perf/step_s": 99.0 if step == 1 else step_s,
                        "rollout/mismatch_kl": mismatch_kl * step,
                        "rollout/mismatch_ratio_max": 1.0 + step,
                        "rollout/logprob_abs_diff": 0.04,
                        "rollout/correction_frac": corrected,
                        "train/clip_frac": 0.1,
                        "rollout/reward_mean": 0.5,
                    }
                )
                + "\n"
            )
        for step, acc in evals.items():
            f.write(json.dumps({"step": step, "eval/strict_acc": acc, "eval/flexible_acc": acc + 0.1}) + "\n")
    json.dump(
        {"world_size": 1, "gpu": gpu, "date": "d", "command": "c", "torch": "t"},
        open(os.path.join(folder, "run_info.json"), "w"),
    )
    json.dump(
        {
            "policy_loss": policy_loss,
            "advantage": "grpo",
            "rollout_correction": "none",
            "clip_low": 0.2,
            "clip_high": 0.2,
            "steps": of_steps,
        },
        open(os.path.join(folder, "args.json"), "w"),
    )


def test_variants_report_one_row_per_run_and_the_summary_key(tmp_path):
    fake_variant_run(tmp_path / "runs" / "add_grpo", "ppo-clip", {0: 0.0, 3: 0.5}, 4.0, 0.001, 0.0)
    fake_variant_run(
        tmp_path / "runs" / "add_cispo", "cispo", {0: 0.0, 2: 0.25}, 5.0, 0.002, 0.125, of_steps=4, gpu="H2"
    )  # stopped early, on another machine
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"other": {"value": 1}}))
    out, png = tmp_path / "variants.json", tmp_path / "variants.png"
    report("variants", tmp_path / "runs", "--task", "addition", "--out", out, "--png", png, "--summary", summary)
    r = json.loads(out.read_text())
    assert r["variants"] == {"add_grpo": 0.5} and list(r["runs"]) == ["add_grpo", "add_cispo"]  # finished runs only
    assert r["unfinished"] == {"add_cispo": "3 of 4 steps"} and r["runs"]["add_grpo"]["final_flexible_acc"] == 0.6
    assert r["gpu"] == "H (add_grpo); H2 (add_cispo)"  # each GPU with its runs
    cispo = r["runs"]["add_cispo"]
    assert (cispo["policy_loss"], cispo["final_eval_after"], cispo["seconds_per_step"]) == (
        "cispo",
        2,
        5.0,
    )  # step 1 left out
    assert abs(cispo["mismatch_kl_mean"] - 0.004) < 1e-12 and cispo["mismatch_ratio_max"] == 4.0
    assert cispo["correction_frac_mean"] == 0.125
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    s = json.loads(summary.read_text())
    assert s["other"] == {"value": 1} and s["variants"]["value"] == {"addition": {"add_grpo": 0.5}}
    assert s["variants"]["sources"] == ["variants.json"]


def fake_deterministic_run(folder, deterministic, step_s, kl, completions, loss=0.5, steps=3):
    """A run_deterministic.sh run folder: `steps` steps (step 1 slow: warm-up), a few samples a step."""
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step in range(1, steps + 1):
            row = {
                "step": step,
                "train/loss": loss / step,
                "rollout/reward_mean": 0.25 * step,
                "rollout/mismatch_kl": kl * step,
                "rollout/logprob_abs_diff": 10 * kl,
                "rollout/mismatch_ratio_max": 1.5,
                "perf/step_s": 99.0 if step == 1 else step_s * (1 + 0.01 * deterministic * step),  # seconds vary
                "perf/rollout_tokens_per_s": 1000.0 / step_s,
                "time/generate": step_s / 2,
                "time/logprob": 0.5,
                "time/update": 1.0,
            }
            f.write(json.dumps(row) + "\n")
    with open(os.path.join(folder, "samples.jsonl"), "w") as f:
        for step in range(1, steps + 1):
            for c in completions:
                f.write(json.dumps({"step": step, "reward": 1.0, "answer": "3", "completion": f"{c} {step}"}) + "\n")
    json.dump(
        {"world_size": 1, "gpu": "NVIDIA H100 80GB HBM3", "date": "d", "command": "c", "torch": "t"},
        open(os.path.join(folder, "run_info.json"), "w"),
    )
    json.dump({"deterministic_rollout": deterministic, "steps": 3}, open(os.path.join(folder, "args.json"), "w"))


def test_deterministic_report_compares_the_two_runs_and_prices_the_mode(tmp_path):
    """bench/report.py deterministic on hand-made folders: det_a and det_b equal but for seconds (repeatable), the
    normal run's samples differ; cost = the deterministic runs' medians over the normal run's (step 1 left out); the
    summary gets both keys. A det_b that drifts at step 3 is named there; steps past the others' are not compared."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("report", os.path.join(ROOT, "bench", "report.py"))
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    runs = tmp_path / "runs"
    fake_deterministic_run(runs / "normal", False, 4.0, 2e-3, ["a", "b"])
    fake_deterministic_run(runs / "det_a", True, 5.0, 1e-3, ["c", "d"])
    fake_deterministic_run(runs / "det_b", True, 5.0, 1e-3, ["c", "d"], steps=4)  # one step more: not compared
    (runs / "attention_check.txt").write_text("attention list matches SGLang 0.5.16's")
    summary, out = tmp_path / "summary.json", tmp_path / "det.json"
    summary.write_text(json.dumps({"other": {"value": 1}}))
    report.main(report.Args(kind="deterministic", run_dir=str(runs), out=str(out), summary=str(summary)))
    r = json.loads(out.read_text())
    assert r["repeatable"] == {
        "steps_compared": 3,
        "sample_rows_compared": 6,
        "samples_identical": True,
        "metrics_identical": True,
        "first_difference": None,
    }
    assert r["normal_vs_det_a"]["first_difference"].startswith("step 1: rollout/logprob_abs_diff 0.02 vs 0.01")
    assert r["runs"]["det_a"]["step_s"] == statistics.median([5.0 * 1.02, 5.0 * 1.03])  # step 1 left out
    assert r["cost"]["rollout_tokens_per_s_ratio"] == 0.8 and r["cost"]["generate_s_ratio"] == 1.25
    assert r["mismatch"]["mismatch_kl"] == {"normal": 4e-3, "deterministic": 2e-3}  # medians of the steps
    assert r["attention_check"].startswith("attention list matches")
    s = json.loads(summary.read_text())
    assert s["other"] == {"value": 1} and s["deterministic_rollout_cost"]["value"] == r["cost"]
    assert s["deterministic_mismatch_kl"]["repeatable"] is True
    assert s["deterministic_mismatch_kl"]["sources"] == ["det.json"]
    with open(runs / "det_b" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    rows[2]["train/loss"] += 1e-9
    (runs / "det_b" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    report.main(report.Args(kind="deterministic", run_dir=str(runs), out=str(out)))
    r = json.loads(out.read_text())
    assert not r["repeatable"]["metrics_identical"] and r["repeatable"]["samples_identical"]
    assert r["repeatable"]["first_difference"].startswith("step 3: train/loss 0.1666")


def fake_lora_run(folder, rank, evals, step_s, peak, of_steps=3, gpu="H"):
    """A run_lora.sh run folder: steps with their seconds and memory, evaluations at `evals` (step -> strict acc)."""
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step, s in enumerate(step_s, 1):
            row = {"step": step, "train/loss": 0.0, "perf/step_s": s, "time/update": s / 2}
            row |= {
                "rollout/logprob_abs_diff": 0.03,
                "memory/update_peak_gib": peak,
                "memory/update_device_peak_gib": 2 * peak,
            }
            f.write(json.dumps(row) + "\n")
        for step, acc in evals.items():
            f.write(json.dumps({"step": step, "eval/strict_acc": acc, "eval/flexible_acc": acc}) + "\n")
    json.dump({"gpu": gpu, "date": "d", "command": "c"}, open(os.path.join(folder, "run_info.json"), "w"))
    args = {"model": "/m/SmolLM2-135M-Instruct", "lora_rank": rank, "lora_alpha": 32.0, "lr": 1e-4 if rank else 1e-5}
    args |= {"steps": of_steps, "prompts_per_step": 16, "group_size": 8, "offload": False, "sglang_mem_fraction": 0.5}
    json.dump(args, open(os.path.join(folder, "args.json"), "w"))


def test_lora_report_of_run_lora_parts(tmp_path):
    """report.py lora: the accuracy runs (final strict accuracy of finished runs, median step seconds after step 1,
    the training process's peak), the 7B runs' ends from run_lora.sh's exit lines (an out-of-memory run has no metrics),
    the sync seconds; the three summary keys; a part not there is left out, never made up."""
    root = tmp_path / "lora"
    fake_lora_run(root / "acc" / "full", 0, {0: 0.0, 3: 0.75}, [9.0, 2.0, 4.0], 3.0)
    fake_lora_run(root / "acc" / "r8", 8, {0: 0.0, 3: 0.5}, [9.0, 1.0, 1.0], 1.5)
    fake_lora_run(root / "acc" / "r1", 1, {0: 0.0}, [9.0], 1.5)  # stopped after 1 of 3 steps: no final accuracy
    fake_lora_run(root / "7b" / "lora", 8, {}, [30.0, 10.0, 12.0], 40.0, of_steps=3)
    (root / "7b" / "lora.log").write_text("=== 2026 lora\nstep 1/3 | ...\n=== exit 0 ok 200s\n")
    (root / "7b" / "full_offload.log").write_text(
        "=== 2026 full_offload\ntorch.OutOfMemoryError: ...\n=== exit 1 oom 90s\n"
    )
    os.makedirs(root / "sync")
    sync = {
        "gpu": "H",
        "date": "d",
        "sync_s": {"merge": 1.2, "adapter": 0.05},
        "first_sync_s": {"merge": 2, "adapter": 1.3},
    }
    (root / "sync" / "lora_sync_7b.json").write_text(json.dumps({**sync, "gap": {"merge": 0.01}}))
    summary, out, png = tmp_path / "summary.json", tmp_path / "lora.json", tmp_path / "lora.png"
    summary.write_text(json.dumps({"other": {"value": 1}}))
    report("lora", root, "--out", out, "--png", png, "--summary", summary)
    r = json.loads(out.read_text())
    full, r8 = r["acc"]["runs"]["full"], r["acc"]["runs"]["r8"]
    assert (full["final_strict_acc"], full["median_step_s"], full["training_process_peak_gib"]) == (0.75, 3.0, 3.0)
    assert (r8["lora_rank"], r8["lr"], r8["median_step_s"]) == (8, 1e-4, 1.0) and r8["eval_curve"][-1] == [3, 0.5, 0.5]
    assert r["7b"]["lora"]["end"] == "ok" and r["7b"]["lora"]["device_peak_gib"] == 80.0
    assert r["7b"]["full_offload"] == {"end": "oom"} and "full" not in r["7b"]  # not run: no log
    assert r["sync"]["7b"]["sync_s"] == {"merge": 1.2, "adapter": 0.05} and "1p5b" not in r["sync"]
    s = json.loads(summary.read_text())
    assert s["other"] == {"value": 1} and s["lora_acc_vs_full"]["value"] == {
        "full": {"strict": 0.75, "flexible": 0.75},
        "r8": {"strict": 0.5, "flexible": 0.5},
    }  # r1 unfinished
    assert s["lora_7b_one_gpu_peak_gib"]["value"] == 80.0
    assert s["lora_7b_one_gpu_peak_gib"]["full_fine_tuning"] == {"full_offload": "oom"}
    assert s["lora_sync_s"]["value"] == {"7b": {"merge": 1.2, "adapter": 0.05}}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def fake_defaults_run(folder, step_s, mfu, args):
    """A run_fast_defaults.sh run folder: three steps (the first slow: warm-up), its micro-batch flags in args.json."""
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step, s in enumerate([99.0, *step_s], 1):
            row = {"step": step, "train/loss": 0.0, "perf/step_s": s, "time/logprob": s / 4, "time/update": s / 2}
            row["time/other"] = row["time/generate"] = s / 8  # generate; outside every named phase
            row.update({"perf/update_mfu": mfu, "memory/update_device_peak_gib": 40.0 + step})
            f.write(json.dumps({**row, "time/startup_to_first_step_s": 50.0} if step == 1 else row) + "\n")
    json.dump({"gpu": "H200", "date": "d", "command": "c"}, open(os.path.join(folder, "run_info.json"), "w"))
    json.dump(args, open(os.path.join(folder, "args.json"), "w"))


def test_defaults_report_is_the_default_over_the_fastest_run_of_each_shape(tmp_path):
    """Issue 55's numbers: each shape's default over its fastest run (medians of steps 2-N), the worst shape's ratio
    and the 1.5B default's update MFU into the summary."""
    runs, packed = tmp_path / "fd", {"micro_batch_size": 8, "max_tokens_per_micro_batch": 15360}
    fake_defaults_run(runs / "add__default", [2.0, 2.2], 0.1, {**packed, "attn_implementation": "varlen"})
    fake_defaults_run(runs / "add__mbs128", [2.4, 2.4], 0.1, {"micro_batch_size": 128, "max_tokens_per_micro_batch": 0})
    fake_defaults_run(runs / "q1p5__default", [11.0, 13.0], 0.4, packed)
    fake_defaults_run(runs / "q1p5__t16k_compile", [10.0, 10.0], 0.47, {**packed, "compile": True})
    (runs / "q7__default").mkdir()  # a run that never logged a step: left out
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"other": {"value": 1}}))
    out = tmp_path / "defaults.json"
    report("defaults", runs, "--out", out, "--summary", summary)
    r = json.loads(out.read_text())
    assert r["by_shape"] == {
        "add": {"default_vs_best": 1.0, "fastest": "default"},  # 2.1 against mbs128's 2.4
        "q1p5": {"default_vs_best": 1.2, "fastest": "t16k_compile"},  # 12 against 10
    }
    default = r["runs"]["q1p5__default"]
    assert (default["median_update_s"], default["update_peak_gib"], default["startup_to_first_step_s"]) == (6.0, 43, 50)
    assert default["median_other_s"] == default["median_generate_s"] == 1.5  # 12 / 8
    assert r["runs"]["add__default"]["attn_implementation"] == "varlen" and "q7__default" not in r["runs"]
    s = json.loads(summary.read_text())
    assert s["default_vs_best"]["value"] == 1.2 and "q1p5 1.2 (fastest: t16k_compile)" in s["default_vs_best"]["what"]
    assert s["default_update_mfu_1p5b"]["value"] == 0.4 and s["other"] == {"value": 1}


def test_spy_report_puts_each_sample_on_the_line_main_ran(tmp_path):
    """bench/spy_report.py reads py-spy's folded stacks: a sample counts on the line of grpo.py's main() it fell in
    (not on a line of another main, nor a stack without main), with its innermost frame; seconds at the rate."""
    spy = tmp_path / "spy.txt"
    spy.write_text(
        "<module> (grpo.py:1395);main (grpo.py:1319);update (grpo.py:868);backward (torch/autograd/graph.py:979) 30\n"
        "<module> (grpo.py:1395);main (grpo.py:1319);update (grpo.py:870);step (torch/optim/adam.py:879) 10\n"
        "<module> (/x/grpo.py:1395);main (/x/grpo.py:1199);send_prompts (rollout.py:505) 50\n"
        "<module> (grpo.py:1395);main (grpo.py:1284) 5\n"
        "<module> (ppo.py:900);main (ppo.py:1319);update (ppo.py:700) 99\n"
        "Thread.run (threading.py:1010);_sample (memory.py:281) 77\n"
    )
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from spy_report import main_lines

    by_line, leaves = main_lines(spy.read_text().splitlines(), "grpo.py")
    assert by_line == {1199: 50, 1319: 40, 1284: 5}
    assert leaves[1319] == {"backward (torch/autograd/graph.py:979)": 30, "step (torch/optim/adam.py:879)": 10}
    assert leaves[1284] == {"(main itself)": 5}
    out = subprocess.run(
        [sys.executable, "bench/spy_report.py", str(spy), "--rate", "10", "--top", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert out.splitlines()[0] == "main() of grpo.py: 9.5 s in 95 samples at 10/s"
    assert "5.00 s  52.6%  grpo.py:1199" in out and "4.00 s  42.1%  grpo.py:1319" in out and ":1284" not in out
