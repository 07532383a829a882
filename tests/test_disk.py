"""The disk and the checkpoints, as a person meets them (subprocess runs of grpo.py and ppo.py, CPU):
a disk that fills up during a save, an --output-dir that can't be written, a checkpoint damaged
without changing its size, a run stopped before its first checkpoint."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest
from test_smoke import ROOT, command, run_grpo

pytestmark = pytest.mark.slow  # the suite launches scripts (the fast tier: pytest -m "not slow")

QUIET = ["--eval-every", "0", "--log-samples-every", "0"]


def steps_logged(run_dir) -> list[int]:
    return [json.loads(line)["step"] for line in open(os.path.join(run_dir, "metrics.jsonl"))]


# ----------------------------------------------------------------------------------------------
# A disk that fills up during a save

# Run in a user and mount namespace of its own (unshare -rm: no root needed, and the mount goes when
# it exits): a tmpfs with room for the first checkpoint and half of the next.
DISK_FULL = r"""
set -u
mount -t tmpfs -o size=64m tmpfs "$DISK"
"$@" --steps 1 > "$OUT/first.txt" 2>&1 || exit 3
sums() { (cd "$DISK/r/checkpoints/step_000001" && find . -type f -exec sha256sum {} + | sort); }
sums > "$OUT/before.sum"
ckpt=$(du -sk "$DISK/r/checkpoints/step_000001" | cut -f1)
mount -o remount,size=$(( $(df -k --output=used "$DISK" | tail -1) + ckpt / 2 ))k "$DISK"
"$@" --steps 3 --resume > "$OUT/full.out" 2> "$OUT/full.err"; echo $? > "$OUT/full.rc"
sums > "$OUT/after.sum"; ls "$DISK/r/checkpoints" > "$OUT/after.ls"
mount -o remount,size=64m "$DISK"  # space freed
"$@" --steps 3 --resume > "$OUT/resumed.txt" 2>&1; echo $? > "$OUT/resumed.rc"
cp "$DISK/r/metrics.jsonl" "$OUT/"; ls "$DISK/r/checkpoints" > "$OUT/resumed.ls"
"""


def can_mount_a_tmpfs() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not can_mount_a_tmpfs(), reason="needs unshare -rm (a user namespace) to mount a small tmpfs")
@pytest.mark.parametrize("script", ["ppo.py"])  # the save is checkpoint.py's for both; ppo.py's holds the critic too
def test_a_full_disk_during_a_save_is_one_line_and_loses_nothing(trained_tiny_model_dir, tmp_path, script):
    """Step 2's save runs out of space: one line naming the folder, what is free and what a checkpoint
    takes, exit 1; step 1's checkpoint is byte for byte as it was, the unfinished one is gone, and
    once there is space --resume goes on from step 1."""
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir(), out.mkdir()
    cmd = command(trained_tiny_model_dir, disk, "--save-every", "1", *QUIET, launcher=[sys.executable], script=script)
    env = {**os.environ, "DISK": str(disk), "OUT": str(out), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        ["unshare", "-rm", "bash", "-c", DISK_FULL, "disk_full", *cmd],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr + (out / "first.txt").read_text()[-3000:]
    err = (out / "full.err").read_text().strip().splitlines()
    assert (out / "full.rc").read_text().strip() == "1" and len(err) == 1, err
    assert err[0].startswith(f"{script}: no space left at {disk}/r/checkpoints while saving step 2 (")
    assert (
        "MiB free, a checkpoint takes " in err[0]
        and "the earlier checkpoints are intact (newest: step_000001)" in err[0]
    )
    assert err[0].endswith("then add --resume") and "Traceback" not in (out / "full.out").read_text()
    assert (out / "after.sum").read_text() == (out / "before.sum").read_text()  # step 1's files untouched
    assert (out / "after.ls").read_text().split() == ["step_000001"]  # no step_000002.tmp left
    resumed = (out / "resumed.txt").read_text()
    assert (out / "resumed.rc").read_text().strip() == "0" and "step_000001: step 1" in resumed, resumed[-3000:]
    assert steps_logged(out) == [1, 2, 3] and (out / "resumed.ls").read_text().split() == ["step_000002", "step_000003"]


# Two runs of one command 0.5 s apart into a 64 KiB tmpfs: one holds the folder, the other is refused; the holder fills
# the disk with rows of metrics.jsonl and samples.jsonl; then --resume, its lock now a dead run's, on the full disk.
TWO_RUNS_ONE_DISK = r"""
set -u
mount -t tmpfs -o size=64k tmpfs "$DISK"
"$@" > "$OUT/a.out" 2> "$OUT/a.err" & a=$!
sleep 0.5
"$@" > "$OUT/b.out" 2> "$OUT/b.err" & b=$!
echo "$a $b" > "$OUT/pids"
wait $a; echo $? > "$OUT/a.rc"
wait $b; echo $? > "$OUT/b.rc"
sums() { (cd "$DISK/r" && sha256sum args.json run_info.json metrics.jsonl samples.jsonl); }
sums > "$OUT/before.sum"; cp "$DISK/r/metrics.jsonl" "$OUT/"
"$@" --resume > "$OUT/c.out" 2> "$OUT/c.err"; echo $? > "$OUT/c.rc"
sums > "$OUT/after.sum"; ls "$DISK/r" > "$OUT/after.ls"
"""


@pytest.mark.skipif(not can_mount_a_tmpfs(), reason="needs unshare -rm (a user namespace) to mount a small tmpfs")
def test_a_run_folder_in_use_is_refused_and_a_disk_that_fills_while_logging_is_one_line(
    trained_tiny_model_dir, tmp_path
):
    """Two runs of one command 0.5 s apart both ran to the end, every step twice in metrics.jsonl: now the second is
    refused in one line naming the first's pid and host. A disk that filled while a row was written was a 19-line
    traceback: now one line naming the file, exit 1, each step's row once. --resume after it is not blocked by the
    dead run's lock; on the still full disk it stops at args.json, and the files the run wrote are as they were."""
    import socket

    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir(), out.mkdir()
    cmd = command(
        trained_tiny_model_dir,
        disk,
        "--steps",
        "100",
        "--save-every",
        "-1",
        "--eval-every",
        "0",
        launcher=[sys.executable],
    )
    env = {**os.environ, "DISK": str(disk), "OUT": str(out), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        ["unshare", "-rm", "bash", "-c", TWO_RUNS_ONE_DISK, "two_runs", *cmd],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    pids, run_dir = dict(zip("ab", (out / "pids").read_text().split())), disk / "r"
    codes = {k: int((out / f"{k}.rc").read_text()) for k in "ab"}
    refused = next(k for k in "ab" if codes[k] == 2)  # either may take the folder first
    held = "b" if refused == "a" else "a"
    err = (out / f"{refused}.err").read_text().strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"grpo.py: {run_dir} is in use by grpo.py, pid {pids[held]} on {socket.gethostname()}, since "
    ), err
    assert err[0].endswith(f" ({run_dir}/run.lock): wait for it to end or stop it, or pass another --run-name")
    err = (out / f"{held}.err").read_text().strip().splitlines()
    assert codes[held] == 1 and len(err) == 1 and "Traceback" not in (out / f"{held}.out").read_text(), err
    assert re.fullmatch(
        rf"grpo\.py: no space left at {run_dir} while writing (metrics|samples)\.jsonl \(0\.0 MiB free\); "
        r"what the run wrote before is intact: free some space, then add --resume",
        err[0],
    ), err
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if x.endswith("}")]
    assert len(steps) >= 3 and steps == list(range(1, len(steps) + 1))  # each step once; a row cut short at most
    err = (out / "c.err").read_text().strip().splitlines()
    assert (out / "c.rc").read_text().strip() == "1" and len(err) == 1, err
    assert err[0].startswith(f"grpo.py: no space left at {run_dir} while writing args.json (0.0 MiB free)"), err
    assert (out / "after.sum").read_text() == (out / "before.sum").read_text()  # args.json, metrics.jsonl, ...: intact
    assert "args.json.tmp" not in (out / "after.ls").read_text().split()


def test_out_of_space_sees_the_errno_through_wrappers_or_a_full_disk(tmp_path):
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    from checkpoint import out_of_space

    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise full
        except OSError as e:
            raise RuntimeError("unexpected pos 704 vs 598") from e
    except RuntimeError as e:
        wrapped = e
    assert out_of_space(full, str(tmp_path)) and out_of_space(wrapped, str(tmp_path))
    assert out_of_space(
        CheckpointException("", {0: (OSError(errno.EDQUOT, "Disk quota exceeded"), None)}), str(tmp_path)
    )
    assert not out_of_space(RuntimeError("unexpected pos 704 vs 598"), str(tmp_path))  # this disk has room
    assert not out_of_space(OSError(errno.EACCES, "Permission denied"), str(tmp_path))


def test_no_space_line_says_where_what_is_free_what_a_checkpoint_takes(tmp_path):
    from checkpoint import gib, no_space_line

    line = no_space_line(str(tmp_path), 3)
    assert (
        line.startswith(f"no space left at {tmp_path}/checkpoints while saving step 3 (")
        and " free); no earlier" in line
    )
    step = tmp_path / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    (step / "trainer.pt").write_bytes(b"x" * 3 * 2**20)
    assert no_space_line(str(tmp_path), 3).endswith(
        " free, a checkpoint takes 3.0 MiB); the earlier checkpoints are intact (newest: step_000002): free some space "
        "or lower --keep-checkpoints, then add --resume"
    )
    assert (gib(3 * 2**30), gib(2**19)) == ("3.0 GiB", "0.5 MiB")


# ----------------------------------------------------------------------------------------------
# An --output-dir that can't be written


@pytest.mark.parametrize(  # the check is preflight.check_writable's for both scripts: ppo.py once
    "output_dir, near, why, script",
    [
        ("README.md/runs", "README.md", "is a file", "grpo.py"),
        ("/proc/runs", "/proc", "refuses a new folder", "grpo.py"),
        ("README.md/runs", "README.md", "is a file", "ppo.py"),
    ],
)
def test_an_output_dir_that_cant_be_written_stops_before_anything_loads(tiny_model_dir, output_dir, near, why, script):
    readme = open(os.path.join(ROOT, "README.md")).read()
    proc = run_grpo(tiny_model_dir, output_dir, "--steps", "1", script=script, expect_ok=False)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert err[0].startswith(f"{script}: --output-dir: the run's folder {output_dir}/r can't be ")
    assert f"{near} {why}" in err[0] and "pass another --output-dir" in err[0]
    assert "model " not in proc.stdout  # before the model is even looked at
    assert open(os.path.join(ROOT, "README.md")).read() == readme and not os.path.exists("/proc/runs")


def test_check_writable_makes_nothing_and_names_the_file_in_the_way(tmp_path):
    from preflight import check_writable
    from common import InputError

    check_writable(str(tmp_path / "runs" / "r"))  # to be made later: fine, and nothing is made now
    check_writable(str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "notes").write_text("x")
    with pytest.raises(InputError, match=f"{tmp_path}/notes is a file: pass another --output-dir"):
        check_writable(str(tmp_path / "notes" / "runs" / "r"))


def test_another_ranks_write_probe_in_a_new_run_folder_is_not_an_earlier_run(tmp_path):
    """Rank 0 makes the run's folder (runlog.claim) while rank 1's check_writable probes the nearest folder that exists:
    by then the run's own. CI once met the probe there: '... holds an earlier run' on a fresh 2-rank start."""
    import tempfile

    from runlog import claim

    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    tempfile.mkdtemp(prefix=".write-check-", dir=run_dir)  # rank 1's probe, caught between its mkdtemp and rmdir
    assert claim(str(run_dir), script="grpo.py", resume=False) is None
    earlier = tmp_path / "runs" / "r2"  # a real earlier run, beside a probe, is still one
    earlier.mkdir()
    (earlier / "metrics.jsonl").write_text("{}\n")
    tempfile.mkdtemp(prefix=".write-check-", dir=earlier)
    assert "holds an earlier run" in claim(str(earlier), script="grpo.py", resume=False)


# ----------------------------------------------------------------------------------------------
# A checkpoint damaged without a change of size


def file_bytes(folder) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("script, nproc", [("grpo.py", 2)])  # checkpoint.py's check, the last of 2 ranks checking
def test_a_shard_overwritten_in_place_is_named_moved_aside_and_the_older_checkpoint_taken(
    trained_tiny_model_dir, tmp_path, script, nproc
):
    """200 kB of random bytes in the middle of step 2's shard (of the last rank, which checks it), its
    size unchanged: --resume names the file, moves the checkpoint aside as it is and goes on from
    step 1, with no traceback. (Any damage takes this way: what `damage` names for each kind, a missing file among
    them, is test_failures.test_damage_names_what_is_wrong.)"""
    from test_failures import overwrite

    args, shard = ["--save-every", "1", "--keep-checkpoints", "0", *QUIET], f"state/__{nproc - 1}_0.distcp"
    run_grpo(trained_tiny_model_dir, tmp_path, "--steps", "2", *args, script=script, nproc=nproc)
    ckpts = tmp_path / "r" / "checkpoints"
    overwrite(ckpts / "step_000002" / shard, 200_000)
    step1, step2 = file_bytes(ckpts / "step_000001"), file_bytes(ckpts / "step_000002")
    proc = run_grpo(trained_tiny_model_dir, tmp_path, "--steps", "3", "--resume", *args, script=script, nproc=nproc)
    lines = [x for x in proc.stdout.splitlines() if "damaged" in x]
    assert lines == [
        f"checkpoint {ckpts / 'step_000002'} is damaged ({shard} changed since the save: bytes "
        f"0-{len(step2[shard])} fail their checksum in manifest.json): moved aside to "
        f"{ckpts / 'step_000002'}.damaged"
    ], proc.stdout
    assert (
        f"resumed from {ckpts / 'step_000001'}: step 1, data epoch " in proc.stdout and "Traceback" not in proc.stderr
    )
    assert sorted(os.listdir(ckpts)) == ["step_000001", "step_000002", "step_000002.damaged", "step_000003"]
    assert file_bytes(ckpts / "step_000002.damaged") == step2 and file_bytes(ckpts / "step_000001") == step1
    assert steps_logged(tmp_path / "r") == [1, 2, 3]


# ----------------------------------------------------------------------------------------------
# Stopped before the first checkpoint


def run_printed(line: str, *extra: str) -> subprocess.CompletedProcess:
    """Run the command a 'stopped by ...; continue from step N with: CMD' line names, as a person would."""
    cmd = shlex.split(line.split(" with: ", 1)[1])
    assert cmd[0] == "python"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [sys.executable, *cmd[1:], *extra], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env
    )


@pytest.mark.parametrize("script", ["grpo.py"])  # stop.stop_run's and runlog's, the same for ppo.py
def test_a_run_stopped_before_its_first_checkpoint_has_one_way_on(trained_tiny_model_dir, tmp_path, script):
    """Stopped with nothing saved (--no-save-on-signal): the last line, the plain rerun's refusal and
    --resume all name the same way on, --resume, which starts the run again from step 0 in its folder."""
    from test_failures import console_lines, start, stop_with, wait_for

    proc = start(trained_tiny_model_dir, tmp_path, "--steps", "200", "--no-save-on-signal", *QUIET, script=script)
    wait_for(tmp_path, "step 2/", proc)
    assert stop_with(proc, signal.SIGINT) < 30 and proc.returncode == 130
    last, run_dir = console_lines(tmp_path)[-1], tmp_path / "r"
    assert " after step " in last and "; continue from step 0 with: " in last and last.endswith(" --resume")
    assert not (run_dir / "checkpoints").exists()
    logged = (run_dir / "metrics.jsonl").read_text()
    plain = run_grpo(trained_tiny_model_dir, tmp_path, "--steps", "2", *QUIET, script=script, expect_ok=False)
    err = plain.stderr.strip().splitlines()
    assert plain.returncode == 2 and err == [
        f"{script}: {run_dir} holds an earlier run: pass --resume to start it again "
        f"from step 0 in this folder (it has no checkpoint), or a new --run-name"
    ]
    assert (run_dir / "metrics.jsonl").read_text() == logged
    resumed = run_printed(last, "--steps", "2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        f"--resume: {run_dir} has no checkpoint (its run stopped before the first save): starting it again from step 0"
    ) in resumed.stdout
    assert steps_logged(run_dir) == [1, 2]
