"""plot.py on hand-made run folders: the overlay from the command line, write_curves as the training scripts
call it (never raising), and the errors a person sees."""

import json
import os
import struct
import subprocess
import sys

from plot import draw, read_metrics, write_curves

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_run(folder, gpu: bool, evals: bool, steps: int = 6):
    """A GPU GRPO-like run (memory/*, evaluations with a per-source key, a last line a kill cut short) or a
    CPU PPO-like one (no memory/*, no evaluations, kl per response and critic keys)."""
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step in range(1, steps + 1):
            row = {
                "step": step,
                "rollout/reward_mean": step / steps,
                "rollout/response_len_mean": 40.0 - step,
                "train/loss": 0.1,
                "train/entropy": 2.0 - step / 10,
                "perf/step_s": 3.0,
                "time/generate": 1.0,
                "time/update": 1.5,
                "time/startup_to_first_step_s": 30.0,
            }
            if gpu:
                row.update(
                    {
                        "train/kl": 0.001 * step,
                        "train/approx_kl": 0.0,
                        "time/sync_weights": 0.1,
                        "memory/generate_peak_gib": 1.5,
                        "memory/generate_device_peak_gib": 50.0,
                        "memory/update_peak_gib": 20.0,
                        "memory/update_device_peak_gib": 24.0,
                    }
                )
            else:
                row.update({"train/kl_per_response": 0.05 * step, "critic/value_loss": 0.3})
            f.write(json.dumps(row) + "\n")
            if evals and step % 3 == 0:
                f.write(
                    json.dumps(
                        {
                            "step": step,
                            "eval/strict_acc": step / 10,
                            "eval/flexible_acc": step / 8,
                            "eval/gsm8k/strict_acc": step / 12,
                        }
                    )
                    + "\n"
                )
        if gpu:
            f.write('{"step": 7, "rollout/rew')  # killed mid-write
    return str(folder)


def png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_a_torn_last_line_is_skipped(tmp_path):
    run = fake_run(tmp_path / "a", gpu=True, evals=True)
    rows = read_metrics(os.path.join(run, "metrics.jsonl"))
    assert len(rows) == 6 + 2 and rows[-1]["step"] == 6


def test_cli_overlays_runs_with_and_without_memory_and_evals(tmp_path):
    a, b = fake_run(tmp_path / "a", gpu=True, evals=True), fake_run(tmp_path / "b", gpu=False, evals=False)
    out = tmp_path / "x.png"
    proc = subprocess.run(
        [sys.executable, "plot.py", a, b, "--out", str(out)], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out}" in proc.stdout
    assert png_size(out) == (1600, 850) and out.stat().st_size > 20_000  # six panels, not an empty canvas
    assert not os.path.exists(str(out) + ".tmp")


def test_cli_one_run_writes_curves_png_in_its_folder(tmp_path):
    a = fake_run(tmp_path / "a", gpu=False, evals=True)
    proc = subprocess.run([sys.executable, "plot.py", a], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {os.path.join(a, 'curves.png')}" in proc.stdout and png_size(os.path.join(a, "curves.png"))


def test_cli_names_a_folder_without_metrics(tmp_path):
    a, empty = fake_run(tmp_path / "a", gpu=True, evals=True), tmp_path / "not_a_run"
    empty.mkdir()
    proc = subprocess.run([sys.executable, "plot.py", a, str(empty)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2  # bad input
    assert proc.stderr.strip().count("\n") == 0, proc.stderr  # one line, no traceback
    assert str(empty) in proc.stderr and "metrics.jsonl" in proc.stderr


def test_write_curves_draws_and_says_where_once(tmp_path, capsys):
    run = tmp_path / "a"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/strict_acc": 0.0}) + "\n")  # eval before step 1
    write_curves(str(run))
    assert png_size(run / "curves.png") == (533, 425)  # the one panel it has: held-out accuracy
    assert capsys.readouterr().out == f"curves: {run / 'curves.png'} (redrawn at each evaluation and at the end)\n"
    run = fake_run(tmp_path / "b", gpu=True, evals=True)
    write_curves(run)
    write_curves(run)  # the next evaluation: redrawn, not announced again
    assert capsys.readouterr().out.count("\n") == 1 and png_size(os.path.join(run, "curves.png"))


def test_write_curves_never_raises(tmp_path, capsys, monkeypatch):
    write_curves(str(tmp_path / "no_run"))  # no metrics.jsonl
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "not written" in out and "metrics.jsonl" in out and "training goes on" in out
    run = fake_run(tmp_path / "a", gpu=True, evals=True)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if matplotlib were not installed
    write_curves(run)
    write_curves(run)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "pip install matplotlib" in out  # said once, not at every evaluation
    assert not os.path.exists(os.path.join(run, "curves.png"))


def test_a_run_log_redraws_at_the_end_only_rows_no_evaluation_drew(tmp_path):
    """RunLog draws curves.png at each evaluation; at the end only if steps were logged after the last one."""
    from runlog import RunLog

    log = RunLog(str(tmp_path), config={}, start_step=0, info={})
    png = tmp_path / "curves.png"
    log.log({"step": 1, "train/loss": 0.5})
    assert not png.exists()  # a step alone draws nothing
    log.log({"step": 1, "eval/strict_acc": 0.25})
    assert png_size(png) == (1066, 425)  # two panels: the loss, the accuracy
    png.unlink()
    log.finish()  # the evaluation was the last row: the figure is up to date
    assert not png.exists()
    log.log({"step": 2, "train/loss": 0.4})
    log.finish()
    assert png_size(png) == (1066, 425)


def test_only_the_panels_a_run_logs_are_drawn(tmp_path):
    """Issue 40, item 19: a CPU run's GPU-memory panel was empty (and train_rm.py's KL, seconds and memory panels):
    drawn now are the panels some run logs, three a row (a GPU run's six: test_cli_overlays_runs_...)."""
    cpu = fake_run(tmp_path / "cpu", gpu=False, evals=True)
    titles = [
        "reward (sampled, mean)",
        "held-out accuracy (greedy; a reward model's: pairwise)",
        "response length (tokens, sampled, mean)",
        "KL and entropy (log scale above 1e-4)",
        "seconds per phase (mean, step 1 left out)",
        "GPU memory per phase (peak)",
    ]
    assert draw([cpu], str(tmp_path / "cpu.png")) == titles[:5] and png_size(tmp_path / "cpu.png") == (1600, 850)
    rm = tmp_path / "rm"  # train_rm.py's rows: no rollouts, no phases, no GPU memory on a CPU
    rm.mkdir()
    (rm / "metrics.jsonl").write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {
                    "step": 1,
                    "train/loss": 0.69,
                    "train/pair_acc": 0.5,
                    "train/margin": 0.0,
                    "train/grad_norm": 1.0,
                    "perf/step_s": 2.0,
                },
                {"step": 1, "eval/pair_acc": 0.6, "eval/margin": 0.1, "eval/loss": 0.6, "eval/pair_acc/format": 0.9},
            ]
        )
    )
    assert draw([str(rm)], str(rm / "curves.png")) == [
        "Bradley-Terry loss",
        titles[1],
        "margin r(chosen) - r(rejected), mean",
    ]
    assert png_size(rm / "curves.png") == (1600, 425)


def test_step_clock_eta_from_the_median_of_recent_steps(monkeypatch, capsys):
    """'step 4/10 | eta 0:06': the steps left x the median of the last 10 steps' seconds, so one slow step (an
    evaluation, a save) does not move it; h:mm:ss from an hour; none on the last step."""
    import runlog

    now = [1000.0]
    monkeypatch.setattr(runlog.time, "time", lambda: now[0])
    clock = runlog.StepClock(total=10, start=0, launched=990.0)
    labels = []
    for step, seconds in enumerate([1.0, 1.0, 100.0, 1.0], 1):
        now[0] += seconds
        labels.append(clock.label(step))
    assert labels == ["step 1/10 | eta 0:09", "step 2/10 | eta 0:08", "step 3/10 | eta 0:07", "step 4/10 | eta 0:06"]
    assert runlog.hms(3725) == "1:02:05" and clock.label(10) == "step 10/10"
    # a step's seconds outside its named phases are time/other: 2.5 - (1.5 + 0.75); memory/ values are not seconds
    phases = {"time/generate": 1.5, "time/update": 0.75, "memory/update_peak_gib": 40.0}
    assert clock.times(5, 2.5, phases) == {"perf/step_s": 2.5, **phases, "time/other": 0.25}


def test_a_reward_model_and_tools_have_panels_and_idle_phases_no_bars(tmp_path):
    """Issue 53, item 7: a run with --reward-model and --tools had no panel for the RM's score or for tool use, and a
    CPU run's phase chart drew seven empty bars (its memory phases take no time): the two panels are drawn where a run
    logs them, and phases under 1% of the largest bar are left out, counted in the title."""
    folder = tmp_path / "rm-tools"
    folder.mkdir()
    rows = []
    for step in range(1, 5):
        rows.append(
            {
                "step": step,
                "rollout/reward_mean": 0.2 * step,
                "rollout/rm_score": 0.1 * step,
                "rollout/rule_reward": 0.2 * step,
                "rollout/rm_rule_corr": 0.5,
                "tools/calls_per_sample": 1.0,
                "tools/turns_mean": 2.0,
                "tools/used_frac": 0.9,
                "perf/step_s": 3.0,
                "time/generate": 2.0,
                "time/update": 0.5,
                "time/free_grads": 0.0,
                "time/sync_weights": 0.007,  # under 1% of 3 s: left out with free_grads
            }
        )
    rows.append({"step": 4, "eval/strict_acc": 0.5, "eval/tool_used_frac": 1.0})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    titles = draw([str(folder)], str(folder / "curves.png"))
    assert titles == [
        "reward (sampled, mean)",
        "held-out accuracy (greedy; a reward model's: pairwise)",
        "reward model (sampled, mean)",
        "seconds per phase (mean, step 1 left out)\n2 phases under 1% of the largest bar not drawn",
        "tool use (sampled, mean)",
    ]
    assert png_size(folder / "curves.png") == (1600, 850)
