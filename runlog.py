"""A run's record on rank 0: its folder, its console lines, its progress bars.

    log = RunLog(run_dir, config=asdict(args), start_step=0, info=run_info(world_size, "sglang"))
    log.log({"step": 3, "rollout/reward_mean": 0.41, ...})     # metrics.jsonl (+ wandb with track=True);
                                                               # an eval row (and finish) redraws curves.png
    log.samples(3, samples)                                    # a few completions: console, samples.jsonl
    print0(legend(console))                                    # once: what each name of a step's line is
    clock = StepClock(total=200, start=0, launched=launch_time())
    print0(log_line(clock.label(3), metrics, console))         # 'step 3/200 | eta 1:02:03 | reward 0.41 | ...'
    clock.summary(run_dir, eval_line)                          # the run's last lines: time, held-out metrics, files
    for rows in progress(micro_batches, "update", rank):       # a bar on rank 0 when a person watches

PLUMBING: nothing here changes what is trained.
"""

import json
import os
import statistics
import sys
import textwrap
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from checkpoint import latest_checkpoint
from plot import parse_row, read_metrics, write_curves
from sandbox import memory_bound


class RunLog:
    """A run's folder on rank 0: args.json, run_info.json, metrics.jsonl, samples.jsonl (+ wandb with `track`).

    On resume from step N, rows of steps after N are dropped from metrics.jsonl and samples.jsonl
    (they are redone), and so is the eval row of step N if the run evaluates it again (`eval_redone`).
    A line cut short by a kill is dropped too.
    """

    def __init__(self, run_dir: str, *, config: dict, start_step: int, info: dict, track: bool = False,
                 project: str = "", run_name: str = "", eval_redone: bool = False):
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.rank0, self.path, self.wandb = rank == 0, os.path.join(run_dir, "metrics.jsonl"), None
        self.undrawn = True  # rows in metrics.jsonl that curves.png does not show yet (a resumed run's trimmed ones too)
        if not self.rank0:
            return
        os.makedirs(run_dir, exist_ok=True)
        for name, content in (("args.json", config), ("run_info.json", info)):
            with open(os.path.join(run_dir, name), "w") as f:
                json.dump(content, f, indent=2)

        def redone(row: dict) -> bool:
            return row["step"] > start_step or (row["step"] == start_step and eval_redone
                                                and any(k.startswith("eval/") for k in row))

        for path in (self.path, os.path.join(run_dir, "samples.jsonl")):
            if os.path.exists(path):
                with open(path) as f:
                    kept = [line for line in f if (row := parse_row(line)) is not None and not redone(row)]
                with open(path, "w") as f:
                    f.writelines(kept)
        if track:
            import wandb  # lazy: only with --track

            self.wandb = wandb.init(project=project, name=run_name, config=config)

    def log(self, row: dict):
        if self.rank0:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
            if self.wandb is not None:
                self.wandb.log(row, step=int(row["step"]))
            self.undrawn = not any(k.startswith("eval/") for k in row)
            if not self.undrawn:
                write_curves(os.path.dirname(self.path))  # plot.py; a failure is one line, never the run's end

    def samples(self, step: int, samples, n: int = 4, shown: int = 2):
        """`n` completions as text: `shown` printed, all appended to samples.jsonl and a wandb table."""
        rows = [{"step": step, "reward": s.reward, "answer": s.answer, "completion": s.text} for s in samples[:n]]
        for r in rows[:shown]:
            print0(f"  sample (reward {r['reward']:.2f}, answer {r['answer']}): {r['completion'][:300]!r}")
        if self.rank0:
            with open(self.path.replace("metrics.jsonl", "samples.jsonl"), "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
            if self.wandb is not None:
                import wandb

                table = wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])
                self.wandb.log({"samples": table}, step=step)

    def finish(self):
        if self.rank0 and self.undrawn and os.path.exists(self.path):  # not again after an evaluation at the last step
            write_curves(os.path.dirname(self.path))
        if self.wandb is not None:
            self.wandb.finish()


def print0(*args, **kwargs):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def log_line(label: str, metrics: dict, keys: list[tuple]) -> str:
    """One console line: 'step 12/200 | reward 0.41 | acc 0.33 | ...' from (name, metric key, format[, meaning])."""
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

    def __init__(self, *, total: int, start: int, launched: float):
        self.total, self.start, self.done, self.launched = total, start, start, launched
        self.seconds, self.last = [], time.time()

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


def progress(items, desc: str, rank: int):
    """A progress bar over `items` on rank 0, when a person is watching (stderr is a terminal)."""
    return tqdm(items, desc=desc, leave=False, disable=rank != 0 or not sys.stderr.isatty())


def launch_time() -> float:
    """time.time() at which this process started (Linux; elsewhere: now), so start-up times include
    the seconds spent importing torch, transformers and the rest before main() runs."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def run_info(world_size: int, engine: str, python_sandbox: str | None = None, tool_workers: int = 1) -> dict:
    """What ran where: for reports (and where the python tool ran programs, 'process' marked weaker, and the most
    memory its programs can hold)."""
    cuda = torch.cuda.is_available()
    return {"command": " ".join(sys.argv), "world_size": world_size, "engine": engine,
            "gpu": torch.cuda.get_device_name() if cuda else "cpu",
            "gpu_total_gib": torch.cuda.mem_get_info()[1] / 2**30 if cuda else None,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            **({"python_sandbox": python_sandbox + " (warning: a plain subprocess, not a jail)" * (python_sandbox == "process"),
                "python_sandbox_memory": memory_bound(tool_workers)} if python_sandbox else {})}
