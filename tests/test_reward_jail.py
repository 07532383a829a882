"""A --reward function is code the run did not write (reward_jail.py): in its jail it can't stop the run, reach the
trainer, fill its memory or its console; each thing it tries costs that call only, and the next call still runs."""

import os
import shutil
import sys
import threading
import time

import pytest

import sandbox
from common import InputError
from reward import load_reward, score, score_all

PROBLEM = (
    "bubblewrap is not installed (apt-get install bubblewrap)"
    if shutil.which("bwrap") is None
    else sandbox.sandbox_problem("bwrap")
)
REFUSED = "(its jail: no network, only its folder and the run's, read-only; --reward-sandbox none runs it here)"
needs_jail = pytest.mark.skipif(PROBLEM is not None, reason=f"the jail cannot run here: {PROBLEM}")

ATTACKS = """
import os, signal, subprocess, sys, time

def fine(completion, answer):
    print("a line the console never sees" * 1000)
    os.write(1, b"and one more, to its fd 1" * 1000)
    return 1.0 if answer in completion else 0.0

def hog(completion, answer):
    return len(bytearray(8 << 30))

def kill_them_all(completion, answer):
    for pid in (os.getppid(), 1, int(answer)):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    os.kill(-1, signal.SIGKILL)

def write_home(completion, answer):
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "written.txt"), "w") as f:
        f.write("x")
    return 1.0

def hang(completion, answer):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(1000)

def leave_a_daemon(completion, answer):
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"], start_new_session=True)
    return 0.5

def exit_early(completion, answer):
    os._exit(3)

def network(completion, answer):
    import socket
    socket.create_connection(("1.1.1.1", 53), timeout=2)
    return 1.0
"""


def jailed(tmp_path, name: str, timeout_s: float = 5.0):
    from reward_jail import load_user_reward

    (tmp_path / "attacks.py").write_text(ATTACKS)
    return load_user_reward(f"{tmp_path}/attacks.py:{name}", sandbox="bwrap", timeout_s=timeout_s)


@pytest.mark.slow
@needs_jail
def test_each_attack_costs_its_own_call_and_the_next_call_runs(tmp_path, capfd):
    """Every attack scores 0 with the reason (or its own value), the trainer lives on, nothing is written, nothing
    printed: and the same function's next call is answered by a jail (a new one where the last died)."""
    fine = jailed(tmp_path, "fine")
    assert [score(fine, "it is 4", "4"), score(fine, "it is 5", "4")] == [(1.0, ""), (0.0, "")]
    expected = {
        "hog": "InJail: MemoryError",
        "kill_them_all": "InJail: ",  # the trainer's pid, its parent's, kill(-1): none exists in there
        "write_home": "InJail: OSError: [Errno 30] Read-only file system",
        "exit_early": "InJail: its jail died (exit code 3)",
        "network": "InJail: PermissionError",  # no TCP socket in there (sandbox.DENIED_STREAMS)
    }
    for name, error in expected.items():
        fn = jailed(tmp_path, name)
        for _ in range(2):  # the second call meets a new jail where the first died
            value, said = score(fn, "x", str(os.getpid()))
            assert value == 0.0 and said.startswith(error), (name, said)
            if name in ("write_home", "network"):  # what the jail refused, and the way out, in the warning's example
                assert said.endswith(REFUSED)
        fn.close()
    daemon = jailed(tmp_path, "leave_a_daemon")
    assert score(daemon, "x", "y") == (0.5, "") and score(daemon, "x", "y") == (0.5, "")
    jails = [j.proc.pid for j in daemon.all]
    daemon.close()  # its pid namespace goes with the jail: the daemon too
    assert not any(sandbox.descendants(pid) for pid in jails)
    assert not (tmp_path / "written.txt").exists()
    out, err = capfd.readouterr()  # the function's prints reached neither of the trainer's streams: our lines only
    assert err == "" and all(line.startswith("reward: ") for line in out.splitlines()), out[-500:]
    fine.close()


@pytest.mark.slow
@needs_jail
def test_a_hung_call_is_given_up_on_time_and_its_jail_replaced(tmp_path):
    """A call that never returns (SIGTERM ignored) scores 0 'timed out' at the limit through score_all; its jail is
    killed a second later, and the next step's calls run in a new one."""
    hang = jailed(tmp_path, "hang", timeout_s=1.0)
    t0 = time.monotonic()
    ((value, said),) = score_all(hang, [("x", "y")], workers=1, timeout_s=1.0)
    assert value == 0.0 and said.startswith("timed out") and time.monotonic() - t0 < 3.0
    while hang.all and time.monotonic() - t0 < 5.0:  # its thread, abandoned, kills the jail at 1 + 1 s
        time.sleep(0.1)
    assert not hang.all and not hang.idle and time.monotonic() - t0 < 3.0
    hang.close()


@needs_jail
def test_jails_outlive_the_threads_that_first_called(tmp_path):
    """bwrap's --die-with-parent is the starting thread's death: jails started from score_all's threads died with
    them after a step, and the next step's calls met dead jails. Started by a thread of its own, they serve on."""
    fine = jailed(tmp_path, "fine")
    for _ in range(3):  # three steps, each with its own worker threads
        results = score_all(fine, [("it is 4", "4")] * 64, workers=4, timeout_s=10.0)
        assert results == [(1.0, "")] * 64
    assert len(fine.all) <= 4 and all(j.proc.poll() is None for j in fine.all)
    done = threading.Event()
    threading.Thread(target=lambda: (fine("it is 4", "4"), done.set())).start()
    assert done.wait(10)
    fine.close()


@pytest.mark.slow
@needs_jail
def test_a_file_that_cannot_serve_is_the_same_line_as_in_process(tmp_path, monkeypatch):
    """The file is imported in the jail by reward.load_reward: its InputError lines are the ones the trainer gives
    for --reward-sandbox none (a syntax error, a missing function, argparse reading the trainer's flags)."""
    from reward_jail import load_user_reward

    cases = {
        "syntax.py": "def reward(completion, answer)\n    return 1.0\n",
        "nameless.py": "def other(completion, answer):\n    return 1.0\n",
        "flags.py": "import argparse\nargparse.ArgumentParser().parse_args()\ndef reward(c, a):\n    return 1.0\n",
    }
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--model", "m", "--reward", "r.py:reward"])  # the jail's too
    for file, source in cases.items():
        (tmp_path / file).write_text(source)
        spec = f"{tmp_path / file}:reward"
        with pytest.raises(InputError) as in_process:
            load_reward(spec)
        with pytest.raises(InputError) as in_jail:
            load_user_reward(spec, sandbox="bwrap", timeout_s=5.0)
        assert str(in_jail.value) == str(in_process.value), file


def test_without_bubblewrap_the_line_names_both_ways_on(monkeypatch, tmp_path):
    """No bwrap: one line, how to install it and --reward-sandbox none; with none, the function runs here."""
    import reward_jail

    (tmp_path / "r.py").write_text("def reward(completion, answer):\n    return 0.25\n")
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)  # where the check is (sandbox.missing_jail_parts)
    with pytest.raises(InputError) as e:
        reward_jail.load_user_reward(f"{tmp_path}/r.py:reward", sandbox="bwrap", timeout_s=5.0)
    assert "apt-get install bubblewrap" in str(e.value) and "--reward-sandbox none" in str(e.value)
    assert reward_jail.load_user_reward(f"{tmp_path}/r.py:reward", sandbox="none", timeout_s=5.0)("c", "a") == 0.25
