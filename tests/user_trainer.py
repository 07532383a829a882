"""A stand-in trainer run as an ordinary user (most cluster jobs: no cgroup of its own, rlimits only), for
tests/test_sandbox.py's test_attacks_as_an_ordinary_user. Run from a folder holding this file, sandbox.py
and pyseccomp, by a Python that user can read:

    setpriv --reuid 65534 --regid 65534 --clear-groups -- python3 user_trainer.py < programs.json

Reads {"programs": {name: [code, limits]}, "values": {NAME: value}} on stdin and runs every program through
sandbox.run_program, 16 at once in threads (as grpo.py's rollout does with --tool-workers 16), each program's
NAMES replaced by their values: the host's (given) and this trainer's (below). Prints one JSON object: each
program's reply (or {"timeout": message}) and seconds, then what must hold after them all. Then waits for
stdin to close, so that the test can look for the jails' leftover processes while their trainer still lives.

What a program could reach here: WANDB_API_KEY and HF_TOKEN in this process's environment (given), a worker
child holding them in its environment and SECRET_ARGV in its argv, a TCP server on 127.0.0.1, an abstract unix
socket, and a home folder (0700) with SECRET_FILE in secret.txt, .bashrc, .netrc and a Hugging Face token.
"""

import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sandbox  # noqa: E402


def meminfo_mb(field: str, path: str = "/proc/meminfo") -> float:
    return int(re.search(rf"^{field}:\s+(\d+) kB", open(path).read(), re.M).group(1)) / 1024


def run(code: str, limits: dict) -> tuple[str | dict, float]:
    t0 = time.monotonic()
    try:
        reply = sandbox.run_program(code, sandbox="bwrap", limits=limits or None)
    except TimeoutError as e:
        reply = {"timeout": str(e)}
    return reply, time.monotonic() - t0


def main():
    given = json.loads(sys.stdin.readline())
    home = tempfile.mkdtemp(prefix="user-trainer-")
    for name, text in (
        (".bashrc", "export HF_TOKEN=" + os.environ["HF_TOKEN"]),
        ("secret.txt", os.environ["SECRET_FILE"]),
        (".netrc", "machine huggingface.co password " + os.environ["HF_TOKEN"]),
    ):
        with open(os.path.join(home, name), "w") as f:
            f.write(text)
    os.makedirs(os.path.join(home, ".cache", "huggingface"))
    with open(os.path.join(home, ".cache", "huggingface", "token"), "w") as f:
        f.write(os.environ["HF_TOKEN"])
    tcp, unix = socket.create_server(("127.0.0.1", 0)), socket.socket(socket.AF_UNIX)
    unix.bind(f"\0user-trainer-{os.getpid()}")
    unix.listen()
    worker = subprocess.Popen(  # the keys in its environment; not holding the test's pipes open
        [sys.executable, "-c", "import time; time.sleep(3600)", os.environ["SECRET_ARGV"]],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    try:
        report(given, home, tcp, unix, worker)
    finally:
        worker.kill()
        shutil.rmtree(home)


def report(given: dict, home: str, tcp: socket.socket, unix: socket.socket, worker: subprocess.Popen):
    values = {
        **given["values"],
        "TRAINER_PID": os.getpid(),
        "TRAINER_PGID": os.getpgid(0),
        "WORKER_PID": worker.pid,
        "PORT": tcp.getsockname()[1],
        "ABSTRACT": f"user-trainer-{os.getpid()}",
        "SECRET_DIR": home,
        "HOME_DIR": home,
        "REPO": os.path.dirname(os.path.abspath(__file__)),
    }
    pattern = re.compile("|".join(rf"\b{name}\b" for name in values))
    programs = {
        name: (pattern.sub(lambda m: str(values[m.group(0)]), code), limits)
        for name, (code, limits) in given["programs"].items()
    }

    samples, done = [], threading.Event()  # the host's available memory and this process's RSS, every 10 ms

    def sample():
        while not done.wait(0.01):
            samples.append((meminfo_mb("MemAvailable"), meminfo_mb("VmRSS", "/proc/self/status")))

    before = (meminfo_mb("MemAvailable"), meminfo_mb("VmRSS", "/proc/self/status"))
    watcher = threading.Thread(target=sample)
    watcher.start()
    with ThreadPoolExecutor(16) as pool:
        results = dict(zip(programs, pool.map(lambda p: run(*p), programs.values())))
    done.set()
    watcher.join()
    reached = select.select([tcp, unix], [], [], 0)[0]
    print(
        json.dumps(
            {
                "replies": {name: reply for name, (reply, _) in results.items()},
                "seconds": {name: took for name, (_, took) in results.items()},
                "uid": os.getuid(),
                "pid": os.getpid(),
                "home": home,
                "cgroups": sandbox.cgroup_parents(),
                "memory_bound": sandbox.memory_bound(16),
                "worker_alive": worker.poll() is None,
                "reached": ["tcp" if s is tcp else "unix" for s in reached],
                "available_drop_mb": before[0] - min(a for a, _ in samples + [before]),
                "rss_growth_mb": max(r for _, r in samples + [before]) - before[1],
                "folders_left": [
                    f for f in os.listdir(tempfile.gettempdir()) if f.startswith(f"sandbox-{os.getpid()}-")
                ],
            }
        ),
        flush=True,
    )
    sys.stdin.read()  # the test looks for leftover processes of these jails now


if __name__ == "__main__":
    main()
