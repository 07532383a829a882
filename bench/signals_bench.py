"""How a GRPO run on SGLang ends when it is told to stop, or when its engine dies (GPU).

    python bench/signals_bench.py --model $SMOLLM2 --out bench/results/signals_h100.json

Each case starts `grpo.py` in a session of its own, waits for the step line it names (`--wait-for`), then:
  normal_end         nothing: the run ends by itself after 2 steps (a clean exit has no traceback)
  sigint_startup     SIGINT to the whole process group while SGLang starts (5 s after the 'data:' line)
  sigint_group       SIGINT to the whole process group (Ctrl-C in a terminal)
  sigterm_parent     SIGTERM to the main process only (Kubernetes, torchrun)
  sigterm_group      SIGTERM to every process of the session (Slurm signals every process of a job)
  sigkill_parent     SIGKILL to the main process
  killed_scheduler   SIGKILL to SGLang's scheduler process
  crashed_scheduler  nothing: the scheduler raises an exception mid-generation (SGLang's own crash test,
                     SGLANG_TEST_CRASH_AFTER_STREAM_OUTPUTS), prints it and sends the trainer SIGQUIT
  engine_no_memory   nothing: another process holds all but 1.4 GiB of the GPU: the trainer starts, SGLang fails to (with 3 GiB left SGLang started and the first weight sync ran out; with 0.6 GiB NCCL did)
  killed_server      SIGKILL to an SGLang server the run samples from (`--rollout-url`, started by the bench beside
                     the trainer on the one GPU, weights over gloo)
and records the seconds to exit, the exit code, the session's processes still alive 5 s later,
the GPU memory in use then, and the run's last console line. Every run's console goes into one file.
"""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("normal_end", "sigint_startup", "sigint_group", "sigterm_parent", "sigterm_group", "sigkill_parent",
         "killed_scheduler", "crashed_scheduler", "engine_no_memory", "killed_server")
HOG = ("import time, torch; free = torch.cuda.mem_get_info()[0]; x = torch.empty(free - (1400 << 20), dtype=torch.uint8, "
       "device='cuda'); print('holding', flush=True); time.sleep(900)")
SERVER_PORT = 30556


def start_helper(case: str, model: str, log_dir: str):
    """What a case needs running beside the run: a process holding the GPU's memory, or an SGLang server."""
    if case == "engine_no_memory":
        cmd = [sys.executable, "-c", HOG]
    elif case == "killed_server":
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", str(SERVER_PORT),
               "--skip-tokenizer-init", "--mem-fraction-static", "0.3", "--attention-backend", "triton",
               "--sampling-backend", "pytorch", "--cuda-graph-backend-prefill", "disabled"]
    else:
        return None
    log = open(os.path.join(log_dir, "helper.txt"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    ready = "holding" if case == "engine_no_memory" else "The server is fired up"
    for _ in range(600):
        if ready in open(log.name).read() or proc.poll() is not None:
            break
        time.sleep(0.5)
    return proc


@dataclass
class Args:
    model: str
    """a local model folder (SmolLM2-135M-Instruct)"""
    out: str
    """JSON to write, one entry per case"""
    logs: str = "/tmp/signals"
    """where each case's run folder and console log go"""
    cases: tuple[str, ...] = CASES
    """which cases to run"""
    wait_for: str = "step 1 |"
    """the console text after which the signal is sent"""
    consoles: str | None = None
    """also write every case's console output into this one file"""
    grpo_flags: str = "--sglang-disable-cuda-graph"
    """more grpo.py flags (no CUDA graphs: a faster engine start)"""


def session_processes(sid: int) -> list[str]:
    """'pid name' of every live process in session `sid`."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            if int(fields[3]) == sid and fields[0] != "Z":  # field 6 of stat: session id
                out.append(f"{pid} {name}")
        except (OSError, ValueError):
            pass
    return out


def gpu_mem_used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    return int(out.split()[0])


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the direct children of pid."""
    found = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                stat = f.read()
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                with open(f"/proc/{p}/cmdline") as f:
                    found.append((int(p), f.read().replace("\0", " ")))
        except (OSError, ValueError):
            pass
    return found


def run_case(case: str, args: Args, index: int) -> dict:
    out_dir = os.path.join(args.logs, f"{index}-{case}")
    os.makedirs(out_dir, exist_ok=True)
    steps = "2" if case == "normal_end" else "500"
    cmd = [sys.executable, "grpo.py", "--model", args.model, "--steps", steps, "--lr", "1e-5", "--micro-batch-size", "128",
           "--eval-every", "0", "--save-every", "100", "--output-dir", out_dir, "--run-name", "r", *args.grpo_flags.split()]
    if case == "killed_server":
        cmd += ["--rollout-mode", "server", "--rollout-url", f"http://127.0.0.1:{SERVER_PORT}", "--rollout-sync-backend", "gloo"]
    helper = start_helper(case, args.model, out_dir)
    console_path = os.path.join(out_dir, "console.txt")
    console = open(console_path, "w")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if case == "crashed_scheduler":  # the scheduler raises after this many output batches: in step 2 or 3
        env["SGLANG_TEST_CRASH_AFTER_STREAM_OUTPUTS"] = "400"
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=console, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    sid, t_start = proc.pid, time.time()
    wait_for = {"normal_end": None, "crashed_scheduler": "Scheduler hit an exception", "sigint_startup": "data:",
                "engine_no_memory": None}.get(
        case, args.wait_for)  # crashed_scheduler: seconds to exit count from the scheduler's error line
    if wait_for:
        while wait_for not in open(console_path).read():
            if proc.poll() is not None or time.time() - t_start > 300:
                break
            time.sleep(0.2)
    if case == "sigint_startup":
        time.sleep(5)  # SGLang's scheduler is starting (it takes 15-100 s)
    t0 = time.time()
    if case in ("sigint_group", "sigint_startup"):
        os.killpg(proc.pid, signal.SIGINT)
    elif case == "sigterm_parent":
        proc.send_signal(signal.SIGTERM)
    elif case == "sigterm_group":
        os.killpg(proc.pid, signal.SIGTERM)
    elif case == "sigkill_parent":
        proc.send_signal(signal.SIGKILL)
    elif case == "killed_scheduler":
        schedulers = [p for p, cmdline in children(proc.pid) if "scheduler" in cmdline.lower()]
        victims = schedulers or [p for p, _ in children(proc.pid)]
        os.kill(victims[0], signal.SIGKILL)
    elif case == "killed_server":
        os.killpg(helper.pid, signal.SIGKILL)
    try:
        code = proc.wait(timeout=300 if case in ("normal_end", "crashed_scheduler", "engine_no_memory") else 120)
    except subprocess.TimeoutExpired:
        code = None
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    seconds = time.time() - t0
    if helper is not None and helper.poll() is None:
        os.killpg(helper.pid, signal.SIGKILL)
        helper.wait()
    time.sleep(5)
    text = open(console_path).read()
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return {"case": case, "seconds_to_exit": round(seconds, 1), "exit_code": code,
            "leftover_processes": session_processes(sid), "gpu_mem_after_mib": gpu_mem_used_mib(),
            "traceback_in_output": "Traceback" in text, "last_line": lines[-1] if lines else "",
            "checkpoints": sorted(os.listdir(os.path.join(out_dir, "r", "checkpoints")))
            if os.path.isdir(os.path.join(out_dir, "r", "checkpoints")) else [],
            "run_folder": sorted(os.listdir(os.path.join(out_dir, "r"))) if os.path.isdir(os.path.join(out_dir, "r")) else []}


def main(args: Args):
    results = []
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    for index, case in enumerate(args.cases):  # a case may be named more than once: each run is kept
        results.append(run_case(case, args, index))
        print(json.dumps(results[-1]), flush=True)
        if args.consoles:
            with open(args.consoles, "a") as f, open(os.path.join(args.logs, f"{index}-{case}", "console.txt")) as c:
                f.write(f"===== {case}\n{c.read()}\n")
        for leftover in results[-1]["leftover_processes"]:  # nothing carries over into the next case
            os.kill(int(leftover.split()[0]), signal.SIGKILL)
        with open(args.out, "w") as f:  # after every case: a run cut short keeps what it measured
            json.dump({"gpu": gpu.stdout.strip(), "date": time.strftime("%Y-%m-%d"), "model": args.model,
                       "command": " ".join(sys.argv), "cases": results}, f, indent=2)


if __name__ == "__main__":
    main(tyro.cli(Args))
