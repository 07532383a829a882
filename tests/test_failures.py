"""Runs that stop and fail cleanly: resume bookkeeping, damaged checkpoints, non-finite numbers,
signals and a dead engine (CPU, HF engine, subprocess runs of grpo.py and ppo.py)."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from test_smoke import metrics, run_grpo

from checkpoint import damage
from conftest import copy_run

pytestmark = pytest.mark.slow  # the suite launches scripts (the fast tier: pytest -m "not slow")

QUIET = ["--eval-every", "0", "--log-samples-every", "1"]


def rows(out_dir, name="metrics.jsonl"):
    return [json.loads(line) for line in open(os.path.join(out_dir, "r", name))]


# ----------------------------------------------------------------------------------------------
# Resume bookkeeping


def test_resume_without_a_checkpoint_refuses(tiny_model_dir, tmp_path):
    """A typo in --run-name must not silently start from step 0."""
    proc = run_grpo(tiny_model_dir, tmp_path, "--resume", *QUIET, expect_ok=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"--resume: there is no run at {tmp_path / 'r'} (check --output-dir and --run-name" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_a_folder_with_metrics_is_never_wiped(trained_tiny_model_dir, one_grpo_step, tmp_path):
    copy_run(one_grpo_step, tmp_path)  # a finished run, its checkpoint taken away: what --save-every -1 leaves
    shutil.rmtree(tmp_path / "r" / "checkpoints")
    before = (tmp_path / "r" / "metrics.jsonl").read_text()
    proc = run_grpo(trained_tiny_model_dir, tmp_path, "--steps", "1", *QUIET, expect_ok=False)
    assert (
        proc.returncode == 2
        and (
            "holds an earlier run: pass --resume to start it again from step 0 in this folder "
            "(it has no checkpoint), or a new --run-name"
        )
        in proc.stderr
    )
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize("script", ["ppo.py"])  # runlog's trim and checkpoint's resume: the same code for grpo.py
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


def test_damage_names_what_is_wrong(one_grpo_step, tmp_path):
    copy_run(one_grpo_step, tmp_path)
    good = tmp_path / "r" / "checkpoints" / "step_000001"
    assert damage(str(good)) is None
    shard = next(p.name for p in (good / "state").iterdir() if p.suffix == ".distcp")
    cases = {
        "shard_truncated": (
            lambda d: (d / "state" / shard).write_bytes((d / "state" / shard).read_bytes()[:100]),
            f"state/{shard} is 100 bytes, expected",
        ),
        "shard_missing": (lambda d: (d / "state" / shard).unlink(), f"state/{shard} is missing"),
        "metadata_missing": (lambda d: (d / "state" / ".metadata").unlink(), "FileNotFoundError"),
        "rng_truncated": (lambda d: (d / "rng_rank0.pt").write_bytes(b"\x80\x02"), "Error"),
        "rng_missing": (lambda d: (d / "rng_rank0.pt").unlink(), "FileNotFoundError"),
        "shard_overwritten": (
            lambda d: overwrite(d / "state" / shard, 200_000),
            f"state/{shard} changed since the save: bytes 0-",
        ),
        "model_overwritten": (
            lambda d: overwrite(d / "model" / "model.safetensors", 1000),
            "model/model.safetensors changed since the save: bytes 0-",
        ),
        "manifest_missing": (lambda d: (d / "manifest.json").unlink(), "FileNotFoundError"),
        "manifest_garbled": (lambda d: (d / "manifest.json").write_text("{"), "JSONDecodeError"),
    }
    for name, (hurt, expected) in cases.items():
        copy = tmp_path / name
        shutil.copytree(good, copy)
        hurt(copy)
        problem = damage(str(copy))
        assert problem is not None and expected in problem, (name, problem)
    old = tmp_path / "saved_before_checksums"  # no manifest and no mention of one in trainer.pt: still resumable
    shutil.copytree(good, old)
    (old / "manifest.json").unlink()
    state = torch.load(old / "trainer.pt", weights_only=False)
    torch.save({k: v for k, v in state.items() if k != "manifest"}, old / "trainer.pt")
    assert damage(str(old)) is None


def overwrite(path, n: int):
    """n random bytes in the middle of a file, its size unchanged (a bad disk, a stray write)."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek((size - n) // 2)
        f.write(os.urandom(n))
    assert path.stat().st_size == size


def test_checksums_by_hand(tmp_path):
    import zlib

    from checkpoint import checksums, owner

    (tmp_path / "f").write_bytes(b"0123456789")
    (tmp_path / "empty").write_bytes(b"")
    crc = [f"{zlib.crc32(b):08x}" for b in (b"0123", b"4567", b"89", b"")]
    assert checksums(str(tmp_path), {"f": 10, "empty": 0}, piece=4) == {"f": crc[:3], "empty": [crc[3]]}
    assert crc[3] == "00000000" and checksums(str(tmp_path), {"f": 10}, piece=16) == {
        "f": [f"{zlib.crc32(b'0123456789'):08x}"]
    }
    assert [
        owner(n)
        for n in ("state/__3_0.distcp", "rng_rank2.pt", "state/.metadata", "model/model.safetensors", "trainer.pt")
    ] == [3, 2, 0, 0, 0]


def test_every_checkpoint_damaged_refuses_naming_them(trained_tiny_model_dir, one_grpo_step, tmp_path):
    copy_run(one_grpo_step, tmp_path)
    (tmp_path / "r" / "checkpoints" / "step_000001" / "state" / ".metadata").write_bytes(b"")
    proc = run_grpo(trained_tiny_model_dir, tmp_path, "--steps", "2", "--resume", *QUIET, expect_ok=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "has no intact checkpoint (damaged: " in proc.stderr and "step_000001" in proc.stderr
    assert proc.stderr.strip().endswith("moved aside): --resume again starts it from step 0")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_evaluate_stopped_by_a_signal_writes_nothing_that_looks_whole(tiny_model_dir, tmp_path, signum):
    """evaluate.py cut short by Ctrl-C (or SIGTERM) mid-generation exited 0 and wrote a summary of 256 'prompts' with
    pass@k over the 28 that finished: now one line, exit 130 (143), the engine stopped, no summary printed, --out
    neither written nor touched where a file was there."""
    from test_smoke import ROOT

    out = tmp_path / "eval.json"
    out.write_text("an earlier evaluation")
    cmd = [sys.executable, "evaluate.py", "--model", tiny_model_dir, "--num-eval-prompts", "64", "--eval-samples", "64"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [*map(str, cmd), "--out", str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in proc.stdout:  # the generation has begun once the 'evaluating' line is out
        lines.append(line)
        if line.startswith("evaluating 64 prompts"):
            break
    time.sleep(3)
    proc.send_signal(signum)
    t0 = time.time()
    rest = proc.communicate(timeout=60)[0]
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum and time.time() - t0 < 10, rest
    assert rest.strip().splitlines()[-1] == (
        f"evaluate.py: stopped by {name} before the evaluation finished: no summary, {out} not written"
    )
    assert '"strict_acc"' not in rest and "Traceback" not in rest
    assert out.read_text() == "an earlier evaluation" and not os.path.exists(tmp_path / "eval.samples.jsonl")


def test_a_hub_models_fingerprint_fetches_the_files_transformers_loads(tmp_path, monkeypatch):
    """checkpoint.model_fingerprint on a hub id asks the Hugging Face cache for its safetensors, and for its .bin files
    only where it has none (not both formats, as transformers loads one); the same files as a local folder, the same
    fingerprint; no weight file or no hub: "" (check_model names the problem)."""
    import huggingface_hub

    import checkpoint

    asked = []
    snapshots = {"org/safe": tmp_path / "safe", "org/old": tmp_path / "old"}
    for folder, name in ((snapshots["org/safe"], "model.safetensors"), (snapshots["org/old"], "pytorch_model.bin")):
        folder.mkdir()
        (folder / name).write_bytes(bytes(range(256)) * 5000)

    def snapshot_download(repo, allow_patterns):
        asked.append((repo, allow_patterns))
        if repo not in snapshots:
            raise OSError("not reachable")
        return str(snapshots[repo])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    checkpoint.model_fingerprint.cache_clear()
    assert checkpoint.model_fingerprint("org/safe") == checkpoint.model_fingerprint(str(snapshots["org/safe"])) != ""
    assert checkpoint.model_fingerprint("org/old") not in ("", checkpoint.model_fingerprint("org/safe"))
    assert checkpoint.model_fingerprint("org/none") == ""
    assert asked == [
        ("org/safe", ["*.safetensors"]),
        ("org/old", ["*.safetensors"]),
        ("org/old", ["*.bin"]),
        ("org/none", ["*.safetensors"]),
    ]
    checkpoint.model_fingerprint.cache_clear()


def test_resume_refuses_other_weights_and_steps_it_already_trained(trained_tiny_model_dir, one_grpo_step, tmp_path):
    """--resume with a --model of the same shapes and other weights (LoRA's frozen base and the KL's reference come
    from --model again) is refused in one line, and so is --steps at or below the checkpoint's step (it trained
    nothing and said 'done'); nothing in the run folder changes. A copy of the same files elsewhere is the same model."""
    from safetensors.torch import load_file, save_file
    from test_first_hour import files_of

    copy_run(one_grpo_step, tmp_path)
    other, same = tmp_path / "other-model", tmp_path / "same-model"
    shutil.copytree(trained_tiny_model_dir, other), shutil.copytree(trained_tiny_model_dir, same)
    weights = load_file(other / "model.safetensors")
    name = sorted(weights)[-1]
    weights[name] = weights[name] + 0.01  # a fine-tune of the same shapes
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    before = files_of(tmp_path / "r")
    before.pop("run.lock")  # each start claims the folder (its pid and time): the rest must stay as it was
    proc = run_grpo(other, tmp_path, "--steps", "3", "--resume", *QUIET, expect_ok=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert f"was trained from --model {trained_tiny_model_dir}, and --model {other} holds other weights" in line
    assert line.endswith("resume with the model it started from, or start a new run (--run-name)")
    proc = run_grpo(trained_tiny_model_dir, tmp_path, "--steps", "1", "--resume", *QUIET, expect_ok=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.endswith(
        "is at step 1 and --steps 1 ends there or before: give the steps in all (--steps 101 trains 100 more)"
    )
    assert {
        k: v for k, v in files_of(tmp_path / "r").items() if k != "run.lock"
    } == before  # args.json, metrics, checkpoints: as they were
    run_grpo(same, tmp_path, "--steps", "2", "--resume", *QUIET)  # the same weights at another path: it resumes
    assert len(rows(tmp_path)) >= 2


# ----------------------------------------------------------------------------------------------
# Non-finite numbers and broken rewards


def patched(mode, model, out_dir, *extra, script="grpo.py", env=None, expect_ok=True):
    """run_grpo through tests/patched_run.py MODE."""
    return run_grpo(
        model,
        out_dir,
        *extra,
        script=script,
        expect_ok=expect_ok,
        launch=[os.path.join("tests", "patched_run.py"), mode],
        env=env,
    )


@pytest.mark.parametrize("script", ["grpo.py", "ppo.py"])
def test_a_nan_reward_costs_only_its_own_sample(trained_tiny_model_dir, tmp_path, script):
    """One reward in 16 is NaN, step after step (normal at GPU batch sizes): it scores 0 and is counted and said,
    every update is taken, the run ends as usual (exit 0, a checkpoint of finite weights)."""
    proc = patched(
        "nan_reward",
        trained_tiny_model_dir,
        tmp_path,
        "--steps",
        "3",
        "--max-nonfinite-steps",
        "1",
        *QUIET,
        script=script,
        env={"PATCH_ONE_IN": "16"},
    )
    train = [r for r in rows(tmp_path) if "train/nonfinite_skips" in r]
    assert [(r["rollout/reward_nonfinite"], r["train/nonfinite_skips"]) for r in train] == [(1, 0)] * 3
    assert all(math.isfinite(r["rollout/reward_mean"]) and math.isfinite(r["train/grad_norm"]) for r in train)
    assert proc.stdout.count("warning: 1 NaN/inf of 16 rewards, scored 0\n") == 3 and "| NaN rewards 1" in proc.stdout
    assert "updates skipped" not in proc.stdout
    assert all(math.isfinite(r["reward"]) for r in rows(tmp_path, "samples.jsonl"))
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "r" / "checkpoints" / "step_000003" / "model" / "model.safetensors")
    assert all(t.float().isfinite().all() for t in weights.values())


def test_nan_rewards_step_after_step_never_stop_the_run(trained_tiny_model_dir, tmp_path):
    """Every reward NaN for 3 steps, with --max-nonfinite-steps 2: only a NaN loss or gradient skips an update."""
    proc = patched("nan_reward", trained_tiny_model_dir, tmp_path, "--steps", "3", "--max-nonfinite-steps", "2", *QUIET)
    train = metrics(tmp_path)[0]
    assert [(r["rollout/reward_nonfinite"], r["train/nonfinite_skips"], r["rollout/reward_mean"]) for r in train] == [
        (16, 0, 0.0)
    ] * 3
    assert "warning: 16 NaN/inf of 16 rewards, scored 0" in proc.stdout and "Traceback" not in proc.stderr


def test_a_nan_loss_skips_one_update(trained_tiny_model_dir, tmp_path):
    proc = patched("nan_loss", trained_tiny_model_dir, tmp_path, "--steps", "2", *QUIET)
    train = metrics(tmp_path)[0]
    assert [r["train/nonfinite_skips"] for r in train] == [1, 0] and "step 1: 1 of 1 updates skipped" in proc.stdout


def test_a_reward_that_always_raises_is_on_the_console(trained_tiny_model_dir, tmp_path):
    proc = patched("raising_reward", trained_tiny_model_dir, tmp_path, "--steps", "1", *QUIET)
    assert "reward errors 16" in proc.stdout
    assert (
        "warning: the reward function raised on 16 of 16 samples (scored 0), e.g. RuntimeError: a buggy reward"
        in proc.stdout
    )


# ----------------------------------------------------------------------------------------------
# Signals and a dead engine


def start(model, out_dir, *extra, script="grpo.py", launch=(), nproc=1, env=None):
    """Start a run in the background, its output going to out_dir/console.txt; `env` added to the environment."""
    from test_smoke import COMMON, PER_SCRIPT, ROOT

    launcher = (
        [sys.executable]
        if nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    )
    cmd = launcher + [
        *launch,
        script,
        "--model",
        model,
        "--output-dir",
        str(out_dir),
        "--run-name",
        "r",
        *COMMON,
        *PER_SCRIPT[script],
        *extra,
    ]
    os.makedirs(out_dir, exist_ok=True)
    console = open(os.path.join(out_dir, "console.txt"), "w")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return subprocess.Popen(cmd, cwd=ROOT, stdout=console, stderr=subprocess.STDOUT, text=True, env=env)


def wait_for(out_dir, text: str, proc, timeout: float = 120) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        console = open(os.path.join(out_dir, "console.txt")).read()
        if text in console:
            return console
        assert proc.poll() is None, f"exited {proc.returncode} before {text!r}:\n{console[-3000:]}"
        time.sleep(0.05)
    raise AssertionError(f"no {text!r} in {timeout} s")


def stop_with(proc, signum, timeout: float = 30) -> float:
    """Send signum, return the seconds the process took to exit."""
    t0 = time.time()
    proc.send_signal(signum)
    proc.wait(timeout=timeout)
    return time.time() - t0


def console_lines(out_dir) -> list[str]:
    return open(os.path.join(out_dir, "console.txt")).read().strip().splitlines()


@pytest.mark.parametrize("script", ["grpo.py", "ppo.py"])
@pytest.mark.parametrize("when", ["start-up", "step 1/", "step 2/"])
def test_ctrl_c_stops_promptly_and_says_how_to_go_on(trained_tiny_model_dir, tmp_path, script, when):
    """SIGINT during start-up or anywhere in a step: out in seconds, exit code 130, a last line
    that says so, and no traceback; the finished steps are saved (none during start-up), long before the first
    checkpoint (--save-every 100) as SIGTERM does; the last line names the command that goes on (run as printed in
    test_sigterm_saves_and_resume_matches_an_uninterrupted_run: the same stop.stop_run line)."""
    proc = start(
        trained_tiny_model_dir, tmp_path, "--steps", "200", "--eval-every", "3", "--save-every", "100", script=script
    )
    wait_for(tmp_path, "model " if when == "start-up" else when, proc)
    seconds = stop_with(proc, signal.SIGINT)
    lines = console_lines(tmp_path)
    assert proc.returncode == 130 and seconds < 30, lines[-5:]
    assert not any("Traceback" in x for x in lines)
    if when == "start-up":
        assert lines[-1] in (f"{script}: stopped by SIGINT during start-up",) or lines[-1].startswith(
            "stopped by SIGINT after step 0"
        )
        assert not (tmp_path / "r" / "checkpoints").exists()
    else:
        done = int(lines[-1].split("after step ")[1].split(";")[0])
        assert os.listdir(tmp_path / "r" / "checkpoints") == [f"step_{done:06d}"]
        # the closing summary before it (issue 40, item 16): steps, time, the last evaluation, where things are
        assert re.match(
            rf"stopped: {done}/200 steps in \d+:\d\d since launch.* \| (held out after step \d+ \| eval strict "
            rf"acc|no held-out evaluation)",
            lines[-3],
        ), lines[-3]
        assert lines[-2].startswith(f"  checkpoint: {tmp_path / 'r' / 'checkpoints' / f'step_{done:06d}'} | curves: ")
        last = f"stopped by SIGINT after step {done}; continue from step {done} with: python {script} "
        assert lines[-1].startswith(last) and lines[-1].endswith(" --resume")


OTHER_FLAGS = {  # resumed with other algorithm flags: the refusal names them as saved and as given
    "grpo.py": (
        ["--beta", "0.02", "--policy-loss", "cispo"],
        "was trained with --policy-loss ppo-clip --clip-low 0.2 "
        "--clip-high 0.2 --beta 0.01, this command gives --policy-loss cispo --clip-low 1.0 --clip-high 4.0 --beta 0.02",
    ),
    "ppo.py": (
        ["--kl-coef", "0.1", "--adaptive-kl"],
        "was trained with --kl-coef 0.05, this command gives --kl-coef 0.1",
    ),
}


@pytest.mark.parametrize(
    "script, algo", [("grpo.py", ["--beta", "0.01"]), ("ppo.py", ["--kl-coef", "0.05", "--adaptive-kl"])]
)
def test_sigterm_saves_and_resume_matches_an_uninterrupted_run(trained_tiny_model_dir, tmp_path, script, algo):
    """Preemption: SIGTERM mid-run saves the finished steps, exit code 143. --resume with other algorithm flags is
    refused in one line before anything loads; the last line's command, run as printed, goes on, and its next step has
    the numbers of a run that never stopped (weights, optimizer, RNG, the data position, grpo's reference model, ppo's adaptive KL coefficient),
    and no row is written twice."""
    stopped, straight = tmp_path / "stopped", tmp_path / "straight"
    args = ["--eval-every", "0", "--save-every", "100", "--log-samples-every", "0"]
    proc = start(trained_tiny_model_dir, stopped, "--steps", "8", *args, *algo, script=script)
    wait_for(stopped, "step 3/", proc)
    seconds = stop_with(proc, signal.SIGTERM)
    lines = console_lines(stopped)
    assert proc.returncode == 143 and seconds < 30, lines[-5:]
    done = int(lines[-1].split("after step ")[1].split(";")[0])
    assert lines[-1].startswith("stopped by SIGTERM after step") and lines[-1].endswith("--resume")
    assert f"saved {stopped / 'r' / 'checkpoints' / f'step_{done:06d}'}" in "\n".join(lines)
    other, said = OTHER_FLAGS[script]
    saved_args = (stopped / "r" / "args.json").read_text()
    refused = run_grpo(
        trained_tiny_model_dir,
        stopped,
        "--steps",
        str(done + 1),
        "--resume",
        *args,
        *other,
        script=script,
        expect_ok=False,
    )
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr[-3000:]
    assert f"{said}: resume with the flags it started with" in refused.stderr
    assert (stopped / "r" / "args.json").read_text() == saved_args
    from test_disk import run_printed  # the last line's command, run as printed, goes on from there

    resumed = run_printed(lines[-1], "--steps", str(done + 1))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"\ndone: {done + 1}/{done + 1} steps (1 in this launch) in " in resumed.stdout  # the closing summary
    run_grpo(trained_tiny_model_dir, straight, "--steps", str(done + 1), *args, *algo, script=script)
    keep = ("rollout/", "train/", "critic/")
    a = {k: v for k, v in rows(straight)[-1].items() if k.startswith(keep)}
    b = {k: v for k, v in rows(stopped)[-1].items() if k.startswith(keep)}
    assert [r["step"] for r in rows(stopped)] == list(range(1, done + 2)) and a == pytest.approx(b, rel=1e-6, abs=1e-9)

    def final_state(d):
        return torch.load(d / "r" / "checkpoints" / f"step_{done + 1:06d}" / "trainer.pt", weights_only=False)

    assert final_state(straight)["sampler"] == final_state(stopped)["sampler"]


@pytest.mark.parametrize("script", ["grpo.py", "ppo.py"])
def test_a_reward_past_its_time_limit_scores_zero_and_the_run_goes_on(trained_tiny_model_dir, tmp_path, script):
    """Every reward call sleeps 10 s, --reward-timeout-s 1: each step waits about 2 s for its rewards, not 16 x 10 s;
    the timeouts are counted and said; the sleeping calls hold up neither the next step nor the exit."""
    t0 = time.time()
    proc = patched(
        "slow_reward",
        trained_tiny_model_dir,
        tmp_path,
        "--steps",
        "2",
        "--reward-timeout-s",
        "1",
        *QUIET,
        script=script,
    )
    seconds = time.time() - t0
    train = metrics(tmp_path)[0]
    assert [r["rollout/reward_timeouts"] for r in train] == [16, 16] and all(r["time/generate"] < 5 for r in train)
    assert proc.stdout.count("warning: 16 timed out (--reward-timeout-s) of 16 rewards, scored 0; ") == 2
    assert "calls still run in the background" in proc.stdout and "| reward timeouts 16" in proc.stdout
    assert seconds < 60 and os.path.isdir(tmp_path / "r" / "checkpoints" / "step_000002")


@pytest.mark.parametrize(  # one handler takes both signals (common._on_signal): each script with one, each signal once
    "script, signum", [("grpo.py", signal.SIGINT), ("ppo.py", signal.SIGTERM)], ids=["grpo.py-SIGINT", "ppo.py-SIGTERM"]
)
def test_a_signal_while_a_slow_reward_runs_stops_the_run_in_seconds(trained_tiny_model_dir, tmp_path, script, signum):
    """Step 2's rewards sleep 10 s each (under the 30 s limit): Ctrl-C or SIGTERM ends the run within seconds, as a
    signal between phases does: 130 / 143, step 1 saved (both save the finished steps)."""
    proc = start(
        trained_tiny_model_dir,
        tmp_path,
        "--steps",
        "5",
        "--save-every",
        "100",
        *QUIET,
        script=script,
        launch=[os.path.join("tests", "patched_run.py"), "slow_reward"],
        env={"PATCH_FROM": "2"},
    )
    wait_for(tmp_path, "slow reward: step 2", proc)
    seconds = stop_with(proc, signum)
    lines = console_lines(tmp_path)
    assert proc.returncode == 128 + signum and seconds < 10, lines[-5:]  # 161 s before reward.score_all
    assert lines[-1].startswith(
        f"stopped by {signal.Signals(signum).name} after step 1"
    ) and "Traceback" not in "\n".join(lines)
    saved = os.listdir(tmp_path / "r" / "checkpoints") if (tmp_path / "r" / "checkpoints").exists() else []
    assert saved == ["step_000001"]


def test_sigterm_under_torchrun_stops_every_rank_and_saves(trained_tiny_model_dir, tmp_path):
    proc = start(
        trained_tiny_model_dir, tmp_path, "--steps", "200", "--eval-every", "0", "--save-every", "100", nproc=2
    )
    wait_for(tmp_path, "step 2/", proc, timeout=240)
    seconds = stop_with(proc, signal.SIGTERM, timeout=60)
    console = "\n".join(console_lines(tmp_path))
    assert seconds < 30 and "stopped by SIGTERM after step" in console
    ckpts = os.listdir(tmp_path / "r" / "checkpoints")
    assert len(ckpts) == 1 and ckpts[0].startswith("step_") and not ckpts[0].endswith(".tmp")


def test_a_killed_save_is_never_resumed(trained_tiny_model_dir, one_grpo_step, tmp_path):
    """A save killed half-way leaves step_N.tmp: --resume takes the older complete checkpoint."""
    copy_run(one_grpo_step, tmp_path)
    ckpts = tmp_path / "r" / "checkpoints"
    shutil.copytree(ckpts / "step_000001", ckpts / "step_000002.tmp")
    proc = run_grpo(trained_tiny_model_dir, tmp_path, "--steps", "2", "--resume", *QUIET)
    assert "resumed from" in proc.stdout and "step_000001: step 1" in proc.stdout


def test_a_dead_engine_process_ends_the_run_naming_it(trained_tiny_model_dir, tmp_path):
    """The engine's child process (SGLang's scheduler on a GPU) is killed: the run exits within
    60 s, naming the process, its exit code and the phase, instead of waiting forever."""
    proc = start(
        trained_tiny_model_dir,
        tmp_path,
        "--steps",
        "200",
        "--eval-every",
        "0",
        launch=[os.path.join("tests", "patched_run.py"), "engine_child"],
    )
    console = wait_for(tmp_path, "step 2/", proc)
    pid = int(console.split("engine child pid ")[1].split()[0])
    t0 = time.time()
    os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=60)
    lines = console_lines(tmp_path)
    assert proc.returncode == 1 and time.time() - t0 < 60
    assert f"the rollout engine's process scheduler-stand-in (pid {pid}) died with exit code -9 during " in lines[-1]


@pytest.mark.parametrize("how", ["sglang's handler", "ours", "killed"])
def test_an_engine_that_fails_to_start_ends_with_our_line(tiny_model_dir, tmp_path, how):
    """SGLang's scheduler fails while starting (three runs on one GPU: its KV cache does not fit): it prints its
    traceback and sends the trainer SIGQUIT, and SGLang's own handler SIGKILLs the whole process tree (exit 137,
    its traceback last, no word of ours). With ours: our line last, naming the phase and our flag, exit 1, nothing
    written. A scheduler killed before it could say anything (the OOM killer) is named too."""
    env = {
        "sglang's handler": {"PATCH_SGLANG_HANDLER": "sglang"},
        "killed": {"PATCH_SGLANG_FAIL": "killed"},
        "ours": {},
    }[how]
    t0 = time.time()
    proc = patched(
        "sglang_start_fails", tiny_model_dir, tmp_path, "--sglang-mem-fraction", "0.9", env=env, expect_ok=False
    )
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert time.time() - t0 < 60
    if how == "sglang's handler":  # what a failed start did before
        assert proc.returncode == -signal.SIGKILL and not any(
            x.startswith("grpo.py: the rollout engine") for x in lines
        )  # 137
        # SIGKILLed, the run could not take back its claim: the folder holds the lock file alone, which binds no one
        assert os.listdir(tmp_path / "r") == ["run.lock"]
        return
    assert not (tmp_path / "r").exists()
    assert proc.returncode == 1, lines[-10:]
    assert lines[-2].startswith(
        "grpo.py: the rollout engine (SGLang) failed while starting, on GPU 0 with mem_fraction 0.9 ("
    )
    assert lines[-2].endswith("); nothing was trained or written")
    assert lines[-1] == (
        "  SGLang's --mem-fraction-static is --sglang-mem-fraction here: change it as that error says, "
        "or free the GPU of other processes (nvidia-smi)"
    )
    if how == "ours":
        assert "(its error is above)" in lines[-2] and "Not enough memory" in lines[-4]  # SGLang's traceback, then ours
        assert not any("Using custom SIGQUIT handler" in x for x in lines)  # SGLang's log line of the handler it got
    else:
        assert "(RuntimeError: Rank 0 scheduler died during initialization (exit code: -9).)" in lines[-2]


def test_quit_while_starting_cuts_the_start_short_once():
    """Each TP rank's scheduler sends its own SIGQUIT: the first cuts the start short, the others find it ignored."""
    from common import Interrupted
    from rollout import quit_while_starting

    signal.signal(signal.SIGQUIT, quit_while_starting)  # conftest restores the handler after the test
    with pytest.raises(Interrupted) as info:
        os.kill(os.getpid(), signal.SIGQUIT)
        time.sleep(5)
    assert info.value.args[0] == signal.SIGQUIT and signal.getsignal(signal.SIGQUIT) == signal.SIG_IGN
    assert quit_while_starting.ran  # what rollout.start_sglang reads
    os.kill(os.getpid(), signal.SIGQUIT)  # the second rank's: nothing happens
    time.sleep(0.1)


def ignored_signals(pid: int) -> int:
    """The mask of signals process `pid` ignores (bit n-1 for signal n)."""
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)


def test_a_start_cut_short_stops_the_engine_it_started(monkeypatch):
    """Ctrl-C while SGLang starts: the trainer gets it (the engine's own processes ignore Ctrl-C and
    SIGTERM), and the processes the start had begun are stopped before the exception goes on."""
    import multiprocessing

    import rollout
    from conftest import install_fake_sglang
    from common import Interrupted

    seen = {}

    class FakeEngine:
        run_scheduler_process_func = run_detokenizer_process_func = staticmethod(time.sleep)

        def __init__(self, **kwargs):
            child = multiprocessing.get_context("fork").Process(target=self.run_scheduler_process_func, args=(600,))
            child.start()
            deadline = time.time() + 10
            both = 1 << (signal.SIGINT - 1) | 1 << (signal.SIGTERM - 1)
            while ignored_signals(child.pid) & both != both and time.time() < deadline:
                time.sleep(0.01)
            os.kill(child.pid, signal.SIGINT)
            os.kill(child.pid, signal.SIGTERM)
            time.sleep(0.2)
            seen["child"], seen["alive after SIGINT and SIGTERM"] = child, child.is_alive()
            raise Interrupted(signal.SIGINT)  # what common._on_signal raises during start-up

        def shutdown(self):
            seen["shutdown"] = True

    install_fake_sglang(monkeypatch, FakeEngine)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)  # a trainer started with SIGQUIT ignored: a Ctrl-C is still one
    with pytest.raises(Interrupted):
        rollout.start_sglang("/nowhere", gpu_id=0, options=rollout.SGLangOptions(mem_fraction=0.5))
    assert seen["alive after SIGINT and SIGTERM"] and seen["child"].exitcode == -signal.SIGKILL
    assert "shutdown" not in seen  # stop_engine, not Engine.shutdown (see rollout.stop_engine)


FAKE_SGLANG = """
import asyncio, multiprocessing, os, signal, sys, time, types
import common, stop

class Watchdog:  # SGLang's SubprocessWatchdog: it would SIGQUIT the trainer when a child dies
    def __init__(self, processes):
        self._processes, self._names, self.stopped = processes, ["scheduler_0"], False
    def stop(self):
        self.stopped = True

child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,), daemon=True)
child.start()
loop = asyncio.new_event_loop()
manager = types.SimpleNamespace(event_loop=None, _subprocess_watchdog=Watchdog([child]))
def auto_create_handle_loop():  # as SGLang's TokenizerManager: its loop, with its signal handlers
    if manager.event_loop is None:
        manager.event_loop = loop
        loop.add_signal_handler(signal.SIGTERM, print, "SGLang drains its requests, then kills the trainer")
        loop.add_signal_handler(signal.SIGQUIT, print, "SGLang kills the process tree")
manager.auto_create_handle_loop = auto_create_handle_loop
engine = types.SimpleNamespace(tokenizer_manager=manager, processes=[child], shutdown=lambda: None)
common.handle_signals()
watch = stop.EngineWatch(engine, phase=lambda: "generate", interval=0.1)
assert manager._subprocess_watchdog.stopped and not loop._signal_handlers
assert signal.getsignal(signal.SIGTERM) is common._on_signal
if sys.argv[1] == "sigquit":  # the scheduler hit an exception, printed it and sent SIGQUIT
    os.kill(os.getpid(), signal.SIGQUIT)
else:  # the scheduler was killed
    os.kill(child.pid, signal.SIGKILL)
time.sleep(10)
print("still running")
"""


@pytest.mark.parametrize("how", ["sigquit", "killed"])
def test_the_engine_watch_takes_over_from_sglang(how):
    """SGLang's own watchdog and event-loop handlers would SIGKILL the trainer without a word on the
    phase (or, for SIGTERM, without a checkpoint); the watch replaces them and names what failed."""
    from test_smoke import ROOT

    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", FAKE_SGLANG, how], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1 and time.time() - t0 < 10 and "still running" not in proc.stdout, proc.stderr
    expected = {
        "sigquit": "the rollout engine reported an error (its traceback is above) during generate: stopping",
        "killed": "the rollout engine's process scheduler_0 (pid ",
    }[how]
    assert expected in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert "SGLang" not in proc.stdout  # neither of SGLang's handlers ran


def test_an_error_or_a_start_cut_short_leaves_the_process_group(monkeypatch, capsys):
    """On GPUs, NCCL warns at exit that destroy_process_group() was never called, and that warning
    was the last line under our own (seen on an H100): friendly_errors leaves the group first."""
    import torch.distributed as dist

    from preflight import friendly_errors
    from common import InputError, Interrupted

    monkeypatch.delenv("RL_DEBUG", raising=False)
    for error, code in ((Interrupted(signal.SIGINT), 130), (InputError("--lr 0 must be > 0"), 2)):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        with pytest.raises(SystemExit) as exit_info:
            with friendly_errors("grpo.py"):
                raise error
        assert exit_info.value.code == code and not dist.is_initialized()
    assert capsys.readouterr().err.splitlines() == [
        "grpo.py: stopped by SIGINT during start-up",
        "grpo.py: --lr 0 must be > 0",
    ]


def test_torchrun_reads_our_message_as_the_ranks_error(tmp_path, monkeypatch, capsys):
    """Under torchrun a rank hands its message to torchrun's agent, in the JSON of torch's own @record: torchrun's
    summary (ChildFailedError) shows it as the rank's traceback. A rank other than its node's first waits for the
    SIGTERM torchrun sends once a rank has exited, and then leaves the console to that rank."""
    import threading

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from preflight import report

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    old = signal.getsignal(signal.SIGTERM)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()  # torchrun, once rank 0 has exited
    t0 = time.time()
    try:
        report("grpo.py: bad arguments:\n  --lr -1.0 must be > 0")
    finally:
        signal.signal(signal.SIGTERM, old)
    assert time.time() - t0 < 5 and capsys.readouterr().err == ""
    failure = ProcessFailure(local_rank=1, pid=123, exitcode=2, error_file=str(tmp_path / "error.json"))
    summary = str(ChildFailedError("grpo.py", {1: failure})).splitlines()
    assert summary[-3:-1] == ["  traceback : grpo.py: bad arguments:", "    --lr -1.0 must be > 0"], summary


def test_out_of_memory_keeps_its_traceback_and_says_which_flags_help(capsys):
    import torch

    from preflight import friendly_errors

    with pytest.raises(SystemExit) as exit_info:
        with friendly_errors("grpo.py"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 15.09 GiB.")
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 1 and "Traceback" in err[0] and "Tried to allocate 15.09 GiB" in err[-2]
    assert err[-1].startswith("grpo.py: the GPU ran out of memory: lower --micro-batch-size"), err
    with pytest.raises(ValueError):  # any other error passes through as it is
        with friendly_errors("grpo.py"):
            raise ValueError("not ours")
