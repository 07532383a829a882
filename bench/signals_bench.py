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
                     the trainer on the one GPU, weights over gloo; with --server-gpu on a GPU of its own, over NCCL)
With --server-gpu (a 2-GPU machine: the trainer on GPU 0, one SGLang server on GPU 1 that the server cases share,
weights over NCCL in --sync-bucket-mb buckets, so that a sync lasts long enough to be hit; issue 37):
  server_sync_ok     nothing: 2 steps against the server (the NCCL sync works; again later: the server outlived a trainer)
  sigterm_mid_sync   SIGTERM to the trainer --signal-delay-s after its step line: its next weight sync is under way
  sigkill_mid_sync   SIGKILL to the trainer there (the server may be left inside the broadcast)
  after_sigkill      nothing: a new trainer against that server: it trains, or says in one line to restart the server
                     (which the bench then does)
  nccl_cumem_mismatch  nothing: the trainer with NCCL_CUMEM_ENABLE=1 exported, the server with SGLang's 0 (the first
                     sync fails on the server's side): the run must end within --rollout-timeout 60, naming the server
  killed_server_mid_sync  SIGKILL to the server's processes --signal-delay-s after the step line
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
CASES = (
    "normal_end",
    "sigint_startup",
    "sigint_group",
    "sigterm_parent",
    "sigterm_group",
    "sigkill_parent",
    "killed_scheduler",
    "crashed_scheduler",
    "engine_no_memory",
    "killed_server",
)
SERVER_CASES = (
    "server_sync_ok",
    "sigterm_mid_sync",
    "sigkill_mid_sync",
    "after_sigkill",
    "nccl_cumem_mismatch",
    "server_sync_ok",
    "killed_server_mid_sync",
)  # in this order: each leaves the server as the next needs it
HOG = (
    "import time, torch; free = torch.cuda.mem_get_info()[0]; x = torch.empty(free - (1400 << 20), dtype=torch.uint8, "
    "device='cuda'); print('holding', flush=True); time.sleep(900)"
)
SERVER_PORT = 30556


def start_helper(case: str, args: "Args", log_dir: str):
    """What a case needs running beside the run: a process holding the GPU's memory, or the SGLang server."""
    if case == "engine_no_memory":
        cmd = [sys.executable, "-c", HOG]
    elif case in SERVER_CASES or case == "killed_server":
        return shared_server(args)
    else:
        return None
    log = open(os.path.join(log_dir, "helper.txt"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    wait_ready(proc, log.name, "holding")
    return proc


def wait_ready(proc, log: str, ready: str):
    for _ in range(600):
        if ready in open(log).read() or proc.poll() is not None:
            break
        time.sleep(0.5)


SERVER = {"proc": None, "starts": 0}


def shared_server(args: "Args") -> subprocess.Popen:
    """The SGLang server the server cases share (a server outlives its trainers), started again once gone."""
    if SERVER["proc"] is not None and SERVER["proc"].poll() is None:
        return SERVER["proc"]
    SERVER["starts"] += 1
    gpu = "0" if args.server_gpu is None else str(args.server_gpu)  # of the GPUs this process sees
    log = os.path.join(args.logs, f"server_{SERVER['starts']}.txt")
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        args.server_model or args.model,
        "--port",
        str(SERVER_PORT),
        "--skip-tokenizer-init",
        "--mem-fraction-static",
        "0.3" if args.server_gpu is None else "0.6",
        "--attention-backend",
        "triton",
        "--sampling-backend",
        "pytorch",
        "--cuda-graph-backend-prefill",
        "disabled",
        "--disable-cuda-graph",
        "--base-gpu-id",
        gpu,
    ]
    os.makedirs(args.logs, exist_ok=True)
    SERVER["proc"] = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    wait_ready(SERVER["proc"], log, "The server is fired up")
    return SERVER["proc"]


def drop_server():
    if SERVER["proc"] is not None and SERVER["proc"].poll() is None:
        os.killpg(SERVER["proc"].pid, signal.SIGKILL)
        SERVER["proc"].wait()
    SERVER["proc"] = None


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
    wait_for: str = "step 1/"
    """the console text after which the signal is sent"""
    consoles: str | None = None
    """also write every case's console output into this one file"""
    grpo_flags: str = "--sglang-disable-cuda-graph"
    """more grpo.py flags (no CUDA graphs: a faster engine start)"""
    server_gpu: int | None = None
    """the server cases' SGLang server on this GPU, the trainer on GPU 0, weights over NCCL (None: beside the trainer
    on GPU 0, weights over gloo)"""
    server_model: str | None = None
    """the server cases' model (default: --model), for the trainer and its server"""
    sync_bucket_mb: int = 1
    """the server cases' --sync-bucket-mb: small buckets make a weight sync last long enough to be hit"""
    signal_delay_s: float = 0.3
    """the *_mid_sync cases: seconds after the step line before the signal (the next sync starts right after it)"""


def session_processes(sid: int) -> list[str]:
    """'pid name' of every live process in session `sid`."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
            if int(fields[3]) == sid and fields[0] != "Z":  # field 6 of stat: session id
                out.append(f"{pid} {name}")
        except (OSError, ValueError):
            pass
    return out


def gpu_mem_used_mib() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True
    ).stdout
    return int(out.split()[0])


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the direct children of pid."""
    found = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                stat = f.read()
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                with open(f"/proc/{p}/cmdline") as f:
                    found.append((int(p), f.read().replace("\0", " ")))
        except (OSError, ValueError):
            pass
    return found


def run_case(case: str, args: Args, index: int) -> dict:
    out_dir = os.path.join(args.logs, f"{index}-{case}")
    os.makedirs(out_dir, exist_ok=True)
    served = case in SERVER_CASES or case == "killed_server"
    steps = "2" if case in ("normal_end", "server_sync_ok", "after_sigkill") else "500"
    model = args.server_model or args.model if served else args.model
    cmd = [
        sys.executable,
        "grpo.py",
        "--model",
        model,
        "--steps",
        steps,
        "--lr",
        "1e-5",
        "--micro-batch-size",
        "128",
        "--eval-every",
        "0",
        "--save-every",
        "100",
        "--output-dir",
        out_dir,
        "--run-name",
        "r",
        *args.grpo_flags.split(),
    ]
    if served:
        cmd += [
            "--rollout-mode",
            "server",
            "--rollout-url",
            f"http://127.0.0.1:{SERVER_PORT}",
            "--rollout-timeout",
            "60",
        ]
        cmd += (
            ["--rollout-sync-backend", "gloo"]
            if args.server_gpu is None
            else ["--sync-bucket-mb", str(args.sync_bucket_mb)]
        )
    helper = start_helper(case, args, out_dir)
    console_path = os.path.join(out_dir, "console.txt")
    console = open(console_path, "w")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if case == "crashed_scheduler":  # the scheduler raises after this many output batches: in step 2 or 3
        env["SGLANG_TEST_CRASH_AFTER_STREAM_OUTPUTS"] = "400"
    if case == "nccl_cumem_mismatch":
        env["NCCL_CUMEM_ENABLE"] = "1"
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=console, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    sid, t_start = proc.pid, time.time()
    wait_for = {
        "normal_end": None,
        "crashed_scheduler": "Scheduler hit an exception",
        "sigint_startup": "data:",
        "engine_no_memory": None,
        "server_sync_ok": None,
        "after_sigkill": None,
        "nccl_cumem_mismatch": None,
    }.get(case, args.wait_for)  # crashed_scheduler: seconds to exit count from the scheduler's error line
    if wait_for:
        while wait_for not in open(console_path).read():
            if proc.poll() is not None or time.time() - t_start > 300:
                break
            time.sleep(0.2)
    if case == "sigint_startup":
        time.sleep(5)  # SGLang's scheduler is starting (it takes 15-100 s)
    if case.endswith("mid_sync"):
        time.sleep(args.signal_delay_s)
    t0 = time.time()
    if case in ("sigint_group", "sigint_startup"):
        os.killpg(proc.pid, signal.SIGINT)
    elif case in ("sigterm_parent", "sigterm_mid_sync"):
        proc.send_signal(signal.SIGTERM)
    elif case == "sigterm_group":
        os.killpg(proc.pid, signal.SIGTERM)
    elif case in ("sigkill_parent", "sigkill_mid_sync"):
        proc.send_signal(signal.SIGKILL)
    elif case == "killed_scheduler":
        schedulers = [p for p, cmdline in children(proc.pid) if "scheduler" in cmdline.lower()]
        victims = schedulers or [p for p, _ in children(proc.pid)]
        os.kill(victims[0], signal.SIGKILL)
    elif case in ("killed_server", "killed_server_mid_sync"):
        os.killpg(helper.pid, signal.SIGKILL)
    try:
        code = proc.wait(timeout=300 if wait_for is None or case == "crashed_scheduler" else 120)
    except subprocess.TimeoutExpired:
        code = None
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    seconds = time.time() - t0
    if helper is not None and helper is not SERVER["proc"] and helper.poll() is None:
        os.killpg(helper.pid, signal.SIGKILL)
        helper.wait()
    server_after = None
    if served:  # can the server still serve? (after_sigkill's trainer said so if not: the next case gets a new one)
        server_after = "gone" if helper.poll() is not None else health(SERVER_PORT)
        if server_after != "200" or case == "after_sigkill":
            drop_server()
    time.sleep(5)
    text = open(console_path).read()
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return {
        "case": case,
        "seconds_to_exit": round(seconds, 1),
        "exit_code": code,
        "server_after": server_after,
        "step_lines": [line[:160] for line in lines if line.startswith("step ")],
        "leftover_processes": session_processes(sid),
        "gpu_mem_after_mib": gpu_mem_used_mib(),
        "traceback_in_output": "Traceback" in text,
        "last_line": lines[-1] if lines else "",
        "checkpoints": sorted(os.listdir(os.path.join(out_dir, "r", "checkpoints")))
        if os.path.isdir(os.path.join(out_dir, "r", "checkpoints"))
        else [],
        "run_folder": sorted(os.listdir(os.path.join(out_dir, "r")))
        if os.path.isdir(os.path.join(out_dir, "r"))
        else [],
    }


def health(port: int) -> str:
    """/health_generate's answer ('200', '503', or why none), within SGLang's own 20 s limit."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health_generate", timeout=30) as answer:
            return str(answer.status)
    except urllib.error.HTTPError as e:
        return str(e.code)
    except OSError as e:
        return f"no answer ({e})"


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
            json.dump(
                {
                    "gpu": gpu.stdout.strip(),
                    "date": time.strftime("%Y-%m-%d"),
                    "model": args.model,
                    "server_model": args.server_model,
                    "server_gpu": args.server_gpu,
                    "command": " ".join(sys.argv),
                    "cases": results,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    try:
        main(tyro.cli(Args))
    finally:
        drop_server()
