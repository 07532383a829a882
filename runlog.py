"""A run's record on rank 0: its folder, its console lines, its progress bars.

    run_dir = claim_run_dir("runs", "my-run", resume=False)   # this script's folder, locked for the run's life
    log = RunLog(run_dir, config=asdict(args), start_step=0, info=run_info(world_size, "sglang"))
    log.log({"step": 3, "rollout/reward_mean": 0.41, ...})     # metrics.jsonl (+ wandb with track=True);
                                                               # an eval row (and finish) redraws curves.png
    log.samples(3, samples)                                    # a few completions: console, samples.jsonl
    print0(legend(console))                                    # once: what each name of a step's line is
    clock = StepClock(total=200, start=0)                      # the start-up's seconds from the launch (launch_time)
    metrics |= clock.times(3, seconds, mem.metrics())          # perf/step_s, time/ and memory/ by phase; the start-up's
    print0(log_line(clock.label(3), metrics, console, rare))   # 'step 3/200 | eta 1:02:03 | reward 0.41 | ...'
    clock.summary(run_dir, eval_line)                          # the run's last lines: time, held-out metrics, files
    for rows in progress(micro_batches, "update", rank):       # a bar on rank 0 when a person watches

PLUMBING: nothing here changes what is trained.
"""

import atexit
import contextlib
import fcntl
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import textwrap
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from checkpoint import gib, latest_checkpoint, out_of_space
from common import InputError, RunFailed, print0
from plot import parse_row, read_metrics, write_curves
from preflight import check_writable, run_folder
from sandbox import memory_bound

WRITE_CHECK = ".write-check-"  # preflight.check_writable's probe folders
LOCK = "run.lock"  # in the run's folder: rank 0 holds an OS lock on it for the run's life; it names the holder
_held = []  # the open lock file, closed (the lock released) when the process ends, however it ends


def claim_run_dir(output_dir: str, run_name: str, *, resume: bool) -> str:
    """output_dir/run_name, checked before anything loads, then held for the run's life: `~` expanded, a plain name
    (preflight.run_folder), writable, not another script's (run_info.json names the script that made it), not in use
    (flock on run.lock: the lock dies with its process, so a crashed run's does not block), an earlier run there only
    with --resume. A refusal is an InputError on every rank. A run that stops before its args.json (bad input found
    later) takes its lock file and the folders it made away at exit."""
    run_dir = run_folder(output_dir, run_name)
    check_writable(run_dir)
    problem = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        problem[0] = claim(run_dir, script=os.path.basename(sys.argv[0]), resume=resume)
    if dist.is_initialized():
        dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise InputError(problem[0])
    return run_dir


def default_run_name(script: str, model: str, sources: list[str], seed: int) -> str:
    """A run's folder name where --run-name is not given: grpo-<model>-<source>[+<source>...]-s<seed>, each dataset by
    its short name (data.source_name)."""
    return f"{script}-{os.path.basename(model.rstrip('/'))}-{'+'.join(sources)}-s{seed}"


def claim(run_dir: str, *, script: str, resume: bool) -> str | None:
    """claim_run_dir on rank 0: what is wrong with the folder, or None once this process holds its lock."""
    if (owner := made_by(run_dir)) not in (None, script):  # refused before anything is written there
        return f"{run_dir} holds a {owner} run (its run_info.json), not a {script} one: pass another --run-name" + (
            f", or resume it with {owner}" * resume
        )
    made, folder = [], os.path.abspath(run_dir)  # the folders this run makes, deepest first
    while not os.path.exists(folder):
        made, folder = made + [folder], os.path.dirname(folder)
    os.makedirs(run_dir, exist_ok=True)
    lock = open(path := os.path.join(run_dir, LOCK), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _held.append(lock)
    except BlockingIOError:
        lock.seek(0)  # "a+" opens at the end
        holder = lock.read().strip() or "another run"
        return f"{run_dir} is in use by {holder} ({path}): wait for it to end or stop it, or pass another --run-name"
    except OSError as e:  # a file system without locks (an NFS mount without its lock service)
        print(f"note: {path} can't be locked ({e.strerror}): nothing stops a second run in this folder", flush=True)
    mine = f"{script}, pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%F %T')}"
    with contextlib.suppress(OSError):  # a full disk: locked all the same, the holder unnamed
        os.ftruncate(lock.fileno(), 0)
        os.write(lock.fileno(), mine.encode())
    atexit.register(leave_no_trace, run_dir, made)
    # another rank's preflight.check_writable may have a probe folder in there this moment (it probes the nearest
    # folder that exists, this one once rank 0 made it): a 2-rank start once took it for an earlier run
    earlier = {name for name in os.listdir(run_dir) if name != LOCK and not name.startswith(WRITE_CHECK)}
    if earlier and not resume:
        again = "start it again from step 0 in this folder (it has no checkpoint)"
        how = "continue it" if latest_checkpoint(run_dir) else again
        return f"{run_dir} holds an earlier run: pass --resume to {how}, or a new --run-name"
    if resume and not earlier:
        fix = "check --output-dir and --run-name, or drop --resume to start a new run"
        return f"--resume: there is no run at {run_dir} ({fix})"
    return None


def made_by(run_dir: str) -> str | None:
    """The script that made a run folder: run_info.json's 'script' (older ones: its command's first word), else None."""
    try:
        with open(os.path.join(run_dir, "run_info.json")) as f:
            info = json.load(f)
        return info.get("script") or os.path.basename(info["command"].split(" ")[0])
    except (OSError, ValueError, KeyError, AttributeError):
        return None


def leave_no_trace(run_dir: str, made: list[str]):
    """At exit, where the run never wrote its args.json: its lock file and the folders it made go (empty ones)."""
    if os.path.exists(os.path.join(run_dir, LOCK)) and not os.path.exists(os.path.join(run_dir, "args.json")):
        os.remove(os.path.join(run_dir, LOCK))
        for folder in made:
            if os.listdir(folder):
                break
            os.rmdir(folder)


def write(path: str, text: str, append: bool = False):
    """Append `text` to the file, or replace the file through a temporary one and a rename (a failed write leaves
    the old file whole). A full disk ends the run in one line (RunFailed), not a traceback."""
    tmp = path + ".tmp"
    try:
        with open(path if append else tmp, "a" if append else "w") as f:
            f.write(text)
        if not append:
            os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if not out_of_space(e, folder := os.path.dirname(path) or "."):
            raise
        free = gib(shutil.disk_usage(folder).free)
        raise RunFailed(
            f"no space left at {folder} while writing {os.path.basename(path)} ({free} free); what the run wrote "
            "before is intact: free some space, then add --resume"
        ) from None


class RunLog:
    """A run's folder on rank 0: args.json, run_info.json, metrics.jsonl, samples.jsonl (+ wandb with `track`).

    On resume from step N, rows of steps after N are dropped from metrics.jsonl and samples.jsonl
    (they are redone), and so is the eval row of step N if the run evaluates it again (`eval_redone`).
    A line cut short by a kill is dropped too.
    """

    def __init__(
        self,
        run_dir: str,
        *,
        config: dict,
        start_step: int,
        info: dict,
        track: bool = False,
        project: str = "",
        run_name: str = "",
        eval_redone: bool = False,
    ):
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.rank0, self.run_dir, self.wandb = rank == 0, run_dir, None
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.undrawn = (
            True  # rows in metrics.jsonl that curves.png does not show yet (a resumed run's trimmed ones too)
        )
        if not self.rank0:
            return
        os.makedirs(run_dir, exist_ok=True)
        for name, content in (("args.json", config), ("run_info.json", info)):
            write(os.path.join(run_dir, name), json.dumps(content, indent=2))

        def redone(row: dict) -> bool:
            return row["step"] > start_step or (
                row["step"] == start_step and eval_redone and any(k.startswith("eval/") for k in row)
            )

        for path in (self.path, os.path.join(run_dir, "samples.jsonl")):
            if os.path.exists(path):
                with open(path) as f:
                    kept = [line for line in f if (row := parse_row(line)) is not None and not redone(row)]
                write(path, "".join(kept))
        if track:
            import wandb  # lazy: only with --track

            self.wandb = wandb.init(project=project, name=run_name, config=config)

    def log(self, row: dict):
        if self.rank0:
            write(self.path, json.dumps(row) + "\n", append=True)
            if self.wandb is not None:
                self.wandb.log(row, step=int(row["step"]))
            self.undrawn = not any(k.startswith("eval/") for k in row)
            if not self.undrawn:
                write_curves(os.path.dirname(self.path))  # plot.py; a failure is one line, never the run's end

    def evaluation(self, step: int, metrics: dict, columns: list[tuple]):
        """A held-out evaluation after `step` updates (rollout.held_out_eval's metrics): its console line (`columns`,
        as log_line takes them) and its row."""
        print0(log_line(f"eval after step {step}", metrics, columns))
        self.log({"step": step, **metrics})

    def samples(self, step: int, samples, n: int = 4, shown: int = 2):
        """`n` completions as text: `shown` printed, all appended to samples.jsonl and a wandb table."""
        rows = [{"step": step, "reward": s.reward, "answer": s.answer, "completion": s.text} for s in samples[:n]]
        for r in rows[:shown]:
            print0(f"  sample (reward {r['reward']:.2f}, answer {r['answer']}): {r['completion'][:300]!r}")
        if self.rank0:
            lines = "".join(json.dumps(r) + "\n" for r in rows)
            write(self.path.replace("metrics.jsonl", "samples.jsonl"), lines, append=True)
            if self.wandb is not None:
                import wandb

                table = wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])
                self.wandb.log({"samples": table}, step=step)

    def finish(self):
        if self.rank0 and self.undrawn and os.path.exists(self.path):  # not again after an evaluation at the last step
            write_curves(os.path.dirname(self.path))
        if self.wandb is not None:
            self.wandb.finish()


# a step's console line, what grpo.py and ppo.py share: (name, metric, format, what it is: the legend printed before step 1)
SAMPLES_LINE = [
    ("reward", "rollout/reward_mean", ".3f", "mean reward of the step's samples"),
    ("acc", "rollout/strict_acc", ".2f", "share right in the asked format (judged as the data line says)"),
    ("format", "rollout/format_rate", ".2f", "share with an answer in the asked format"),
    ("len", "rollout/response_len_mean", ".0f", "mean response tokens"),
    ("ent", "train/entropy", ".2f", "entropy per response token (nats)"),
]
TIMES_LINE = [
    ("rollout s", "time/generate", ".1f", "seconds generating"),
    ("step s", "perf/step_s", ".1f", "seconds of the step"),
    ("tok/s", "perf/rollout_tokens_per_s", ".0f", "tokens sampled per second"),
]
TRUNC = ("trunc", "rollout/truncated_frac", ".2f", "share cut at --max-new-tokens (where not 0)")
CLIP = ("clip", "train/clip_frac", ".2g", "share of tokens clipped (where not 0: several updates a batch)")


def log_line(label: str, metrics: dict, keys: list[tuple], rare: list[tuple] = ()) -> str:
    """One console line: 'step 12/200 | reward 0.41 | acc 0.33 | ...' from (name, metric key, format[, meaning]);
    then those of `rare` whose value is not 0 (a share truncated, samples that scored 0 for an error, ...)."""
    keys = list(keys) + [k for k in rare if metrics.get(k[1])]
    shown = [f"{name} {format(metrics[key], fmt)}" for name, key, fmt, *_ in keys if key in metrics]
    return " | ".join([label, *shown])


def legend(keys: list[tuple]) -> str:
    """What the names of a step's line mean, from its (name, metric key, format, meaning) entries: printed once."""
    names = ["eta = time left (the steps left x the median seconds of the last 10)"]
    names += [f"{key[0]} = {key[3]}" for key in keys if len(key) > 3]
    return textwrap.fill("step lines: " + "; ".join(names), width=120, subsequent_indent="  ")


def hms(seconds: float) -> str:
    """'1:02:03', '2:03'."""
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{s:02d}" if minutes >= 60 else f"{minutes}:{s:02d}"


class StepClock:
    """A step line's 'step 3/200 | eta 1:02:03' (the steps left times the median seconds of the last 10 steps: an
    evaluation or a checkpoint makes one step slow, not the estimate), and the run's closing lines."""

    def __init__(self, *, total: int, start: int = 0, launched: float | None = None, startup: dict | None = None):
        launched = launch_time() if launched is None else launched  # None: this process's start
        self.total, self.start, self.done, self.launched = total, start, start, launched
        self.seconds, self.last, self.startup, self.lapped = [], time.time(), startup or {}, launched

    def lap(self, part: str):
        """The start-up's seconds of `part` (set-up, engine, models: time/startup_<part>), since the last lap or launch."""
        now = time.time()
        self.startup[part], self.lapped = now - self.lapped, now

    def begin(self, start: int) -> int:
        """The loop begins after `start` steps (a resumed run's; 0: a new one): the step clock runs from now."""
        self.start = self.done = start
        self.last = time.time()
        return start

    def times(self, step: int, seconds: float, phases: dict) -> dict:
        """A step's perf/step_s (`seconds`), its phases' time/ and memory/ metrics (MemoryLog.metrics), time/other: the
        step's seconds outside every named phase (the batch's assembly, the statistics, the checks between phases),
        and on the first step of this launch the start-up's: time/startup_to_first_step_s, and time/startup_<part> of
        each part of `startup` (seconds: set-up, engine, models)."""
        timed = sum(v for k, v in phases.items() if k.startswith("time/"))
        out = {"perf/step_s": seconds, **phases, "time/other": max(seconds - timed, 0.0)}
        if step == self.start + 1:
            out["time/startup_to_first_step_s"] = time.time() - self.launched
            out.update({f"time/startup_{k}": v for k, v in self.startup.items()})
        return out

    def label(self, step: int) -> str:
        now, self.done = time.time(), step
        self.seconds, self.last = (self.seconds + [now - self.last])[-10:], now
        left = (self.total - step) * statistics.median(self.seconds)
        return f"step {step}/{self.total}" + f" | eta {hms(left)}" * (step < self.total)

    def summary(self, run_dir: str, eval_line: list[tuple], stopped: bool = False):
        """The run's closing lines on rank 0: the steps done and the time since launch, the last held-out evaluation,
        where the last checkpoint, curves.png and metrics.jsonl are."""
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        metrics, curves = os.path.join(run_dir, "metrics.jsonl"), os.path.join(run_dir, "curves.png")
        evals = [r for r in read_metrics(metrics) if eval_line[0][1] in r] if os.path.exists(metrics) else []
        held = "no held-out evaluation"
        if evals:
            held = log_line(f"held out after step {int(evals[-1]['step'])}", evals[-1], eval_line)
        steps = f"{self.done}/{self.total} steps" + f" ({self.done - self.start} in this launch)" * (self.start > 0)
        took = hms(time.time() - self.launched) + " since launch"
        took += f", {statistics.median(self.seconds):.1f} s a step" if self.seconds else ""
        print0(f"{'stopped' if stopped else 'done'}: {steps} in {took} | {held}")
        curves = curves if os.path.exists(curves) else "not drawn"
        print0(f"  checkpoint: {latest_checkpoint(run_dir) or 'none saved'} | curves: {curves} | metrics: {metrics}")


def eval_due(done: int, *, every: int, before_train: bool) -> bool:
    """Evaluate after `done` updates (at the start of step done + 1)? Every `every` steps (0: never), and before the
    first update with `before_train`."""
    return bool(every) and done % every == 0 and (done > 0 or before_train)


def progress(items, desc: str, rank: int):
    """A progress bar over `items` on rank 0, when a person is watching (stderr is a terminal)."""
    return tqdm(items, desc=desc, leave=False, disable=rank != 0 or not sys.stderr.isatty())


IMPORTED = time.time()  # launch_time where /proc can't say: before the script's main, after Python's start


def launch_time() -> float:
    """time.time() at which this process started (Linux; elsewhere: when this module was imported), so start-up times
    include the seconds spent importing torch, transformers and the rest before main() runs."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return IMPORTED


def code_commit() -> str | None:
    """This code's commit (git's short hash, '+' where the tree has changes); None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "-C", os.path.dirname(os.path.abspath(__file__)), "describe", "--always", "--dirty=+"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def run_info(world_size: int, engine: str, python_sandbox: str | None = None, tool_workers: int = 1) -> dict:
    """What ran where: for reports (and where the python tool ran programs, 'process' marked weaker, and the most
    memory its programs can hold)."""
    cuda = torch.cuda.is_available()
    return {
        "script": os.path.basename(sys.argv[0]),  # the one script that may write into its folder (claim_run_dir)
        "command": " ".join(sys.argv),
        "commit": code_commit(),
        "world_size": world_size,
        "engine": engine,
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "gpu_total_gib": torch.cuda.mem_get_info()[1] / 2**30 if cuda else None,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        **(
            {
                "python_sandbox": python_sandbox
                + " (warning: a plain subprocess, not a jail)" * (python_sandbox == "process"),
                "python_sandbox_memory": memory_bound(tool_workers),
            }
            if python_sandbox
            else {}
        ),
    }
