"""Runs that stop and fail cleanly: resume bookkeeping, damaged checkpoints, non-finite numbers,
signals and a dead engine (CPU, HF engine, subprocess runs of grpo.py and ppo.py)."""

import json
import os
import shutil

import pytest
from test_smoke import metrics, run_grpo

from checkpoint import damage

QUIET = ["--eval-every", "0", "--log-samples-every", "1"]


def rows(out_dir, name="metrics.jsonl"):
    return [json.loads(line) for line in open(os.path.join(out_dir, "r", name))]


# ----------------------------------------------------------------------------------------------
# Resume bookkeeping


def test_resume_without_a_checkpoint_refuses(tiny_model_dir, tmp_path):
    """A typo in --run-name must not silently start from step 0."""
    proc = run_grpo(tiny_model_dir, tmp_path, "--resume", *QUIET, expect_ok=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--resume: " in proc.stderr and "has no checkpoint (check --output-dir and --run-name" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_a_folder_with_metrics_is_never_wiped(trained_tiny_model_dir, tmp_path):
    run_grpo(trained_tiny_model_dir, tmp_path, "--steps", "1", "--save-every", "-1", *QUIET)
    before = (tmp_path / "r" / "metrics.jsonl").read_text()
    proc = run_grpo(trained_tiny_model_dir, tmp_path, "--steps", "1", *QUIET, expect_ok=False)
    assert proc.returncode == 2 and "holds an earlier run: pass --resume to continue it, or a new --run-name" in proc.stderr
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize("script", ["grpo.py", "ppo.py"])
def test_resume_trims_metrics_and_samples_alike_and_never_doubles_an_eval_row(trained_tiny_model_dir, tmp_path, script):
    """Steps 1-3 ran, evaluations after steps 0 and 2, the newest checkpoint is step 2 (step 3's was
    lost), and the kill cut the last metrics line short. --resume redoes step 3 and the eval after
    step 2 (evaluated again at the start of step 3): each row exactly once."""
    args = ["--eval-every", "2", "--eval-before-train", "--save-every", "2", "--log-samples-every", "1"]
    run_grpo(trained_tiny_model_dir, tmp_path, "--steps", "3", *args, script=script)
    shutil.rmtree(tmp_path / "r" / "checkpoints" / "step_000003")
    with open(tmp_path / "r" / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rollout/rew')  # a row cut short
    proc = run_grpo(trained_tiny_model_dir, tmp_path, "--steps", "3", "--resume", *args, script=script)
    assert "resumed from" in proc.stdout and "step_000002" in proc.stdout
    all_rows = rows(tmp_path)
    evals = [r["step"] for r in all_rows if "eval/strict_acc" in r]
    steps = [r["step"] for r in all_rows if "rollout/reward_mean" in r]
    assert evals == [0, 2, 3] and steps == [1, 2, 3]
    assert [r["step"] for r in rows(tmp_path, "samples.jsonl")] == [1] * 4 + [2] * 4 + [3] * 4


def test_damage_names_what_is_wrong(trained_tiny_model_dir, tmp_path):
    run_grpo(trained_tiny_model_dir, tmp_path, "--steps", "1", *QUIET)
    good = tmp_path / "r" / "checkpoints" / "step_000001"
    assert damage(str(good)) is None
    shard = next(p.name for p in (good / "state").iterdir() if p.suffix == ".distcp")
    cases = {
        "shard_truncated": (lambda d: (d / "state" / shard).write_bytes((d / "state" / shard).read_bytes()[:100]),
                            f"state/{shard} is 100 bytes, expected"),
        "shard_missing": (lambda d: (d / "state" / shard).unlink(), f"state/{shard} is missing"),
        "metadata_missing": (lambda d: (d / "state" / ".metadata").unlink(), "FileNotFoundError"),
        "rng_truncated": (lambda d: (d / "rng_rank0.pt").write_bytes(b"\x80\x02"), "Error"),
    }
    for name, (hurt, expected) in cases.items():
        copy = tmp_path / name
        shutil.copytree(good, copy)
        hurt(copy)
        problem = damage(str(copy))
        assert problem is not None and expected in problem, (name, problem)


def test_damaged_newest_checkpoint_falls_back_to_the_older_one(trained_tiny_model_dir, tmp_path):
    args = ["--save-every", "1", "--keep-checkpoints", "0", *QUIET]
    run_grpo(trained_tiny_model_dir, tmp_path, "--steps", "2", *args)
    ckpts = tmp_path / "r" / "checkpoints"
    (ckpts / "step_000002" / "rng_rank0.pt").unlink()
    proc = run_grpo(trained_tiny_model_dir, tmp_path, "--steps", "3", "--resume", *args)
    assert f"checkpoint {ckpts / 'step_000002'} is damaged (FileNotFoundError" in proc.stdout
    assert "moved aside to" in proc.stdout and "resumed from" in proc.stdout and "step 1, data epoch" in proc.stdout
    assert sorted(os.listdir(ckpts)) == ["step_000001", "step_000002", "step_000002.damaged", "step_000003"]
    assert [r["step"] for r in metrics(tmp_path)[0]] == [1, 2, 3]


def test_every_checkpoint_damaged_refuses_naming_them(trained_tiny_model_dir, tmp_path):
    run_grpo(trained_tiny_model_dir, tmp_path, "--steps", "1", *QUIET)
    (tmp_path / "r" / "checkpoints" / "step_000001" / "state" / ".metadata").write_bytes(b"")
    proc = run_grpo(trained_tiny_model_dir, tmp_path, "--steps", "2", "--resume", *QUIET, expect_ok=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "has no intact checkpoint (damaged: " in proc.stderr and "step_000001" in proc.stderr
