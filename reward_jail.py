"""Where a `--reward FILE.py:function` runs (PLUMBING): code the run did not write, in sandbox.py's bubblewrap jail.

    reward = load_user_reward("my_reward.py:reward", sandbox="bwrap", timeout_s=30.0)  # sandbox="none": here
    reward("... #### 4", "4")        # -> the function's number, computed in a jail; a jail that dies or hangs is
                                     #    replaced, that call an error that scores 0 (reward.score_all counts it)

The file is imported, and every call made, in long-lived jails of sandbox.jail_command, one call at a time each (as
many as reward.score_all's threads ask for, --reward-workers): the namespaces, the seccomp filter, no network, a
read-only file system with a size-capped /tmp, rlimits, a cgroup per jail where this process may make one. Nothing
the function does reaches the trainer: it can't signal it (its own pid namespace), write its files (the trainer's
folder and the file's are bound read-only, to import it and its neighbours), exhaust its memory (REWARD_LIMITS per
jail), print into its console (fd 1 and 2 lead to /dev/null in there) or stop the run (an exit, a crash, a kill, a
hang each cost that call only: 0, and a new jail for the next). It answers on a descriptor of its own, one JSON line
per call, read with a deadline and a size cap here.

What it costs: a jail's start (Python, torch through reward.py, the file's own imports: 1.3 s on a 2-core AMD EPYC VM,
8 at once 4.9 s) once per worker, and again after a call that killed it; a call, 0.1 ms of JSON over two pipes. `--reward-sandbox none` runs the function in the
trainer's threads instead (bounded in time only: reward.score_all): for a function that must reach the network (a
judge behind an API) or the run's state, code you trust.
"""

import atexit
import concurrent.futures
import contextlib
import json
import os
import selectors
import subprocess
import sys
import threading
import time

from common import InputError, print0
from reward import NotANumber, load_reward
from sandbox import JAIL_ENV, _memfd, bootstrap_args, end_note, jail_command, make_cgroups, missing_jail_parts
from sandbox import seccomp_filter, start_jail, stop_jail

# a jail's: `memory_mb` of address space for the calls, past what the imports took (a CUDA build of torch maps a few
# GiB of libraries it never touches), which may take up to `import_mb`; a memory cgroup, where there is one, holds the
# whole jail to `memory_mb` of memory actually used
REWARD_LIMITS = {"memory_mb": 4096, "import_mb": 32768, "file_mb": 16, "disk_mb": 64, "processes": 16}
START_S = 120.0  # a jail's start may take this long (a cold disk, torch, the file's imports) before it is given up
ANSWER_BYTES = 1 << 20  # an answer line is read up to this size
HERE = os.path.dirname(os.path.abspath(__file__))

# main.py of a jail: our descriptor for answers, then fd 1 and 2 to /dev/null (whatever the function prints goes
# nowhere), the file imported by reward.load_reward (its InputError lines as they are), then one call per stdin line.
_DRIVER = r"""
import json, os, sys
spec, cwd, here, sys.argv, MEMORY_MB = SPEC, CWD, HERE, ARGV, MB  # argv: the trainer's (argparse may read it)
answers = os.fdopen(os.dup(1), "w", buffering=1)
null = os.open(os.devnull, os.O_WRONLY)
os.dup2(null, 1)
os.dup2(null, 2)
def say(**message):
    answers.write(json.dumps(message) + "\n")
sys.path.insert(0, here)
os.chdir(cwd)
try:
    from common import InputError
    from reward import NotANumber, load_reward
    fn = load_reward(spec)
except InputError as e:
    say(input_error=str(e))
    sys.exit(0)
except BaseException as e:
    say(input_error=f"--reward {spec!r}: could not be imported in its jail ({type(e).__name__}: {e})")
    sys.exit(0)
import resource
mapped = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
resource.setrlimit(resource.RLIMIT_AS, (mapped + (MEMORY_MB << 20),) * 2)  # the calls' own, past the imports
say(ready=True)
for line in sys.stdin:
    n, completion, answer = json.loads(line)
    try:
        say(n=n, value=float(fn(completion, answer)))
    except NotANumber as e:
        say(n=n, not_a_number=str(e))
    except BaseException as e:  # an exit or a KeyboardInterrupt of its own too: this call's error, the jail goes on
        # OSError: the jail's refusals (a socket, a name to resolve, a write, a file outside the folders it sees) among
        # others; the way out goes with each, in the error the step's warning quotes
        why = "its jail: no network, only its folder and the run's, read-only; --reward-sandbox none runs it here"
        say(n=n, error=f"{type(e).__name__}: {e}"[:2000] + (f" ({why})" if isinstance(e, OSError) else ""))
"""


class InJail(Exception):
    """What the function raised in its jail (its type and message: 'InJail: ValueError: ...'), or the jail's death."""


class Jail:
    """One jail running the driver for `spec`: started at once, `ask`ed one call at a time, `close`d for good."""

    def __init__(self, spec: str, lim: dict):
        values = f"{spec!r}, {os.getcwd()!r}, {HERE!r}, {sys.argv!r}, {lim['memory_mb']}"
        driver = _DRIVER.replace("SPEC, CWD, HERE, ARGV, MB", values)
        files = [_memfd("main.py", driver.encode()), _memfd("seccomp", seccomp_filter())]
        path = spec.rpartition(":")[0]
        binds = sorted({HERE, os.getcwd(), os.path.dirname(os.path.abspath(path))})
        cmd = jail_command(code_fd=files[0], seccomp_fd=files[1], lim=lim, binds=binds)
        self.cpu_s = 10**6  # no CPU-time cap on a jail that lives as long as the run: each call has its deadline
        cmd += bootstrap_args("/tmp", lim, memory_mb=lim["import_mb"], cpu_s=self.cpu_s)
        self.groups, self.lim, self.buffer, self.calls, self.closed = make_cgroups(lim), lim, b"", 0, False
        self.stray = False
        self.proc = start_jail(cmd, groups=self.groups, files=files, env=JAIL_ENV, stdin=subprocess.PIPE)
        os.set_blocking(self.proc.stdout.fileno(), False)

    def read(self, seconds: float) -> dict | None:
        """The jail's next answer line, or None: it closed its end (it died), or `seconds` passed."""
        deadline = time.monotonic() + seconds
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout.fileno(), selectors.EVENT_READ)
            while b"\n" not in self.buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    return None
                chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
                self.closed = not chunk  # its end closed: it died (or closed the descriptor it answers on)
                if not chunk or len(self.buffer) > ANSWER_BYTES:
                    return None
                self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return None

    def ask(self, completion: str, answer: str, seconds: float) -> dict | None:
        """One call's answer ({'n', 'value' | 'error' | 'not_a_number'}), or None (dead, late, or not its answer)."""
        self.calls += 1
        try:
            self.proc.stdin.write(json.dumps([self.calls, completion, answer]).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:  # it died
            return None
        got = self.read(seconds)
        self.stray = got is not None and got.get("n") != self.calls  # a line of the function's own on our descriptor
        return None if self.stray else got

    def why_dead(self) -> str:
        """Once it closed its end: how it died, in a few words (the signal and the likely limit, or bwrap's words)."""
        try:
            code = self.proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            return "it closed the descriptor it answers on"
        os.set_blocking(self.proc.stderr.fileno(), False)
        try:
            said = (self.proc.stderr.read(2000) or b"").decode(errors="replace").strip()
        except OSError:
            said = ""
        note = end_note(code, sandbox="bwrap", memory_mb=self.lim["memory_mb"], cpu_s=self.cpu_s)
        return note or (f"exit code {code}" + (f": {said.splitlines()[-1]}" if said else ""))

    def close(self):
        """Kill the jail (sandbox.stop_jail), then close our ends of its pipes."""
        stop_jail(self.proc, self.groups)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(OSError):  # a call's line still in stdin's buffer: the pipe is broken
                stream.close()


class JailedReward:
    """The function of `spec` as a callable `(completion, answer) -> float`, each call in a jail (Jail) of a pool;
    a call not answered within `timeout_s` + 1 s kills its jail and raises TimeoutError (reward.score_all has given
    up on it at `timeout_s` already). The first jail starts here: a file that can't serve is an InputError now."""

    def __init__(self, spec: str, *, timeout_s: float, limits: dict | None = None):
        self.spec, self.timeout_s, self.lim = spec, timeout_s, {**REWARD_LIMITS, **(limits or {})}
        self.idle, self.all, self.lock = [], set(), threading.Lock()
        # bwrap's --die-with-parent is the parent THREAD's death (PR_SET_PDEATHSIG): a jail started by one of
        # score_all's threads would be killed when that thread ends, after its step. One thread of our own starts them
        self.spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reward-jails")
        atexit.register(self.close)
        self.idle.append(self.start())
        print0(
            f"reward: {spec} in bubblewrap jails, one a reward worker (no network; its folder and this one read-only; "
            f"{self.lim['memory_mb']} MiB each; what it prints goes nowhere): --reward-sandbox none runs it here"
        )

    def start(self) -> Jail:
        jail = self.spawner.submit(Jail, self.spec, self.lim).result()
        with self.lock:
            self.all.add(jail)
        first = jail.read(max(START_S, self.timeout_s))
        if first is not None and first.get("ready"):
            return jail
        self.drop(jail)
        if first is not None and "input_error" in first:
            raise InputError(first["input_error"])
        raise InputError(
            f"--reward {self.spec!r}: its jail did not start ({jail.why_dead() if first is None else first}); "
            "--reward-sandbox none runs it in the trainer's threads instead (trusted code only)"
        )

    def drop(self, jail: Jail):
        with self.lock:
            self.all.discard(jail)
        jail.close()

    def __call__(self, completion: str, answer: str) -> float:
        with self.lock:
            jail = self.idle.pop() if self.idle else None
        try:
            jail = jail or self.start()
        except InputError as e:  # a file that imported at start and not now (it reads something that changed)
            raise InJail(str(e)) from None
        got = jail.ask(completion, answer, self.timeout_s + 1.0)
        if got is None:
            why = jail.why_dead() if jail.closed else "it answered out of turn" if jail.stray else None
            self.drop(jail)
            if why is None:
                raise TimeoutError(f"no answer from its jail in {self.timeout_s + 1.0:g} s: the jail was killed")
            raise InJail(f"its jail {'died' if jail.closed else 'was killed'} ({why}); a new one takes the next call")
        with self.lock:
            self.idle.append(jail)
        if "not_a_number" in got:
            raise NotANumber(got["not_a_number"])
        if "error" in got:
            raise InJail(got["error"])  # reward.score reports it: 'InJail: <its type>: <its message>'
        return got["value"]  # NaN and inf too: reward.score counts them

    def close(self):
        """Every jail killed (at exit, whatever way the trainer exits short of SIGKILL: then bwrap's parent-death)."""
        with self.lock:
            jails, self.all, self.idle = list(self.all), set(), []
        for jail in jails:
            jail.close()


def load_user_reward(spec: str, *, sandbox: str, timeout_s: float):
    """--reward's function: in jails (`sandbox` 'bwrap', JailedReward), or imported here ('none', reward.load_reward:
    trusted code, in the trainer's threads). A jail that can't be made is an InputError naming the fix."""
    if sandbox == "none":
        return load_reward(spec)
    fixes = "; or --reward-sandbox none to run your function in the trainer's threads (trusted code only)"
    if missing := missing_jail_parts("--reward's jail", fixes):
        raise InputError(missing)
    return JailedReward(spec, timeout_s=timeout_s)
