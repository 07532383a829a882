"""reward.py on tricky completions: markers, signs, currency, commas, decimals, trailing text; scoring
in threads with a time limit (score_all)."""

import os
import signal
import threading
import time

import pytest

from reward import (
    extract_answer,
    extract_last_number,
    extract_strict,
    format_reward,
    gsm8k_reward,
    int_match_reward,
    normalize_number,
    score,
)

# ----------------------------------------------------------------------------------------------
# normalize_number


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1,234", "1234"),  # thousands commas dropped
        ("5.00", "5"),  # integral floats print as integers
        ("12.50", "12.5"),
        ("-0", "0"),
        ("$12", "12"),
        ("72.", "72"),  # a sentence-ending dot
        (" 7 ", "7"),
        ("nan", None),  # float() parses it, but it is not an answer
        ("inf", None),
        ("seven", None),
        ("", None),
    ],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


def test_normalize_number_keeps_large_integers_exact():
    assert normalize_number("12345678901234567891") == "12345678901234567891"


# ----------------------------------------------------------------------------------------------
# extraction


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("so 1000 + 234 = 1234\n#### 1,234", "1234"),
        ("####-3", "-3"),  # no space, negative
        ("#### $12", "12"),  # currency sign after the marker
        ("#### 5.00", "5"),
        ("#### 1\nwait, no\n#### 2", "2"),  # several markers: the last one wins
        ("#### 72\n", "72"),
        ("The answer is 12.", None),  # no marker: strict finds nothing
        ("#### nan", None),
        ("#### twelve", None),
        ("", None),
    ],
)
def test_extract_strict(completion, expected):
    assert extract_strict(completion) == expected


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("The answer is 12.", "12"),  # the final period is not a decimal point
        ("3 apples and 4 pears, so 7", "7"),
        ("Total: $1,200.50.", "1200.5"),
        ("It went from 5 to -3", "-3"),
        ("abc12def", "12"),  # digits inside a word still count
        ("x2y3z", "3"),  # ... and the last of them wins
        ("no number here", None),
        ("nan", None),  # the word 'nan' is not a number
        ("NaN, so 5", "5"),
    ],
)
def test_extract_last_number(completion, expected):
    assert extract_last_number(completion) == expected


def test_extract_last_number_leading_decimal_point():
    assert extract_last_number("The probability is .5") == "0.5"


def test_extract_answer_strict_vs_flexible():
    """flexible falls back to the last number; strict only accepts '#### N'; with a marker both agree."""
    assert extract_answer("The answer is 12.", "flexible") == "12"
    assert extract_answer("The answer is 12.", "strict") is None
    # the marker beats a later number in flexible mode too
    assert extract_answer("#### 8\nThat is 8 out of 10", "flexible") == "8"
    assert extract_answer("#### 8\nThat is 8 out of 10", "strict") == "8"
    assert extract_answer("nothing", "flexible") is None


def test_extract_answer_unknown_mode_raises():
    with pytest.raises(ValueError, match="'loose'"):
        extract_answer("#### 3", "loose")


# ----------------------------------------------------------------------------------------------
# rewards


def test_gsm8k_reward_compares_numerically():
    assert gsm8k_reward("#### 72.0", "72") == 1.0
    assert gsm8k_reward("#### 72", "72.0") == 1.0
    assert gsm8k_reward("#### 1,234", "1234") == 1.0
    assert gsm8k_reward("#### 73", "72") == 0.0
    assert gsm8k_reward("The answer is 72.", "72") == 0.0  # default mode is strict
    assert gsm8k_reward("The answer is 72.", "72", "flexible") == 1.0
    assert gsm8k_reward("I don't know", "72", "flexible") == 0.0


def test_int_match_reward_needs_an_exact_integer():
    assert int_match_reward("#### 122", "122") == 1.0
    assert int_match_reward("#### 122.5", "122") == 0.0  # normalized to '122.5': not an integer
    assert int_match_reward("#### -3", "-3") == 1.0
    assert int_match_reward("#### 121", "122") == 0.0
    assert int_match_reward("12 + 110 = 122", "122") == 0.0  # strict: no marker
    assert int_match_reward("12 + 110 = 122", "122", "flexible") == 1.0


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("so 5 + 7 = 12\n#### 12", 1.0),
        ("#### 72\n", 1.0),  # trailing newline is fine
        ("#### 72.", 1.0),  # so is a final period
        ("####-3", 1.0),
        ("#### $1,234.50 ", 1.0),
        ("#### 72 because 70 + 2", 1.0),  # text after the answer is allowed (lm-eval strict match)
        ("##### 58\nThe final answer is 58.", 1.0),  # extra '#' and chatter: still parses strictly
        ("#### oops", 0.0),  # a marker without a number
        ("The answer is 72", 0.0),  # no marker
        ("#### ", 0.0),
    ],
)
def test_format_reward(completion, expected):
    assert format_reward(completion) == expected


def test_score_normal_and_raising_reward():
    """score() returns (reward, ""), or (0.0, what it raised) when the reward function raises."""
    assert score(lambda c, a: 0.75, "x", "y") == (0.75, "")
    assert score(gsm8k_reward, "#### 5", "5") == (1.0, "")

    def broken(completion, answer):
        raise RuntimeError("a buggy reward")

    assert score(broken, "#### 5", "5") == (0.0, "RuntimeError: a buggy reward")
    # a real failure: int('seven') in int_match_reward
    value, error = score(int_match_reward, "#### 5", "seven")
    assert value == 0.0 and error.startswith("ValueError: ")


def test_a_nonfinite_reward_scores_zero_and_says_so():
    """NaN/inf would poison the whole step's advantages (a group's mean, PPO's whitening): it costs its sample only."""
    assert score(lambda c, a: float("nan"), "x", "y") == (0.0, "not finite: nan")
    assert score(lambda c, a: float("-inf"), "x", "y") == (0.0, "not finite: -inf")
    assert score(lambda c, a: 1e308, "x", "y") == (1e308, "")  # large but finite: the function's own business


# ----------------------------------------------------------------------------------------------
# score_all: rewards in threads, each call within a time limit


@pytest.fixture
def release():
    """An event that hung reward calls wait on; set after the test, and every abandoned call waited for, so the
    next test starts with none (reward._abandoned is module state)."""
    import reward

    event = threading.Event()
    yield event
    event.set()
    for t in list(reward._abandoned):
        t.join(timeout=10)
    reward._abandoned.clear()


def test_score_all_gives_what_score_gives_in_order():
    """Values, errors and NaN as one call at a time would give them, in the calls' order, whatever order they end in."""
    from reward import score_all

    def reward_fn(completion, answer, kind):
        time.sleep(0.02 * (len(completion) % 3))  # later calls end first
        if completion == "boom":
            raise ValueError("boom")
        return float("nan") if completion == "nan" else gsm8k_reward(completion, answer) + (kind == "text")

    calls = [("#### 5", "5", "gsm8k"), ("boom", "5", "gsm8k"), ("#### 4", "5", "text"), ("nan", "5", "gsm8k")] * 3
    assert score_all(reward_fn, calls, workers=3, timeout_s=5) == [score(reward_fn, *c) for c in calls]
    threads = set()  # a few workers serve all the calls: no thread per call (0.5 ms each on a busy CPU)
    out = score_all(
        lambda c, a: threads.add(threading.current_thread()) or 1.0, [("", "")] * 100, workers=3, timeout_s=5
    )
    assert out == [(1.0, "")] * 100 and 1 <= len(threads) <= 3
    assert score_all(reward_fn, calls[:4], workers=3, timeout_s=5) == [
        (1.0, ""),
        (0.0, "ValueError: boom"),
        (1.0, ""),
        (0.0, "not finite: nan"),
    ]
    assert score_all(reward_fn, [], workers=3, timeout_s=5) == []


def test_a_slow_reward_call_costs_its_own_sample_only(release):
    """One call hangs: it scores 0.0 at the limit, the other calls run beside it; it then runs on abandoned."""
    import reward

    def reward_fn(completion, answer):
        if completion == "hang":
            release.wait()
        return 1.0

    t0 = time.time()
    out = reward.score_all(reward_fn, [("a", ""), ("hang", ""), ("b", ""), ("c", "")], workers=2, timeout_s=0.3)
    assert out == [(1.0, ""), (0.0, "timed out: still running after 0.3 s"), (1.0, ""), (1.0, "")]
    assert 0.3 <= time.time() - t0 < 1.5 and len(reward._abandoned) == 1 and reward._abandoned[0].daemon


def test_a_hanging_reward_never_piles_up_threads(release):
    """Every call hangs: fewer than 2 x workers threads ever run; once `workers` abandoned calls still run, new calls
    wait for one to end for timeout_s, then score 0 unrun; a step then costs timeout_s, not a thread per call."""
    from reward import score_all

    def alive():
        return sum(t.name == "reward" and t.is_alive() for t in threading.enumerate())

    t0 = time.time()
    out = score_all(lambda c, a: release.wait(), [(i, "") for i in range(10)], workers=2, timeout_s=0.2)
    assert all(v == 0.0 and e.startswith("timed out: ") for v, e in out) and time.time() - t0 < 2.0
    assert "timed out: not run, " in out[-1][1] and 2 <= alive() < 4
    t0 = time.time()
    out = score_all(lambda c, a: release.wait(), [(i, "") for i in range(10)], workers=2, timeout_s=0.2)
    assert all(e.startswith("timed out: not run, ") for v, e in out) and time.time() - t0 < 1.5 and alive() < 4
    release.set()  # the hung calls end: the next step scores again
    time.sleep(0.1)
    assert score_all(lambda c, a: 1.0, [(1, "")], workers=2, timeout_s=0.2) == [(1.0, "")]


def test_math_verify_in_score_all_runs_in_the_main_thread():
    """math-verify's timeout is a SIGALRM: a call that needs it runs again in the main thread, and gives what it
    gives there (rather than an error per sample for every MATH run)."""
    from reward import correct, score_all

    returned_in = []  # the thread each math call that returned ran in

    def reward_fn(completion, answer, kind, mode="strict"):
        value = correct(kind, completion, answer, mode)
        returned_in.append((kind, threading.current_thread() is threading.main_thread()))
        return value

    calls = [
        (r"so \boxed{\frac{3}{7}}", "3/7", "math"),
        ("the answer is $19$", "19", "math"),
        ("#### 3", "3", "gsm8k"),
        (r"\boxed{29}", "31", "math"),
    ]  # answers no other test asks math-verify about: math_equal caches its verdicts
    assert score_all(reward_fn, calls, workers=2, timeout_s=5) == [(1.0, ""), (0.0, ""), (1.0, ""), (0.0, "")]
    assert sorted(returned_in) == [
        ("gsm8k", False),
        ("math", False),
        ("math", True),
        ("math", True),
    ]  # no box: no math-verify
    flexible = [c + ("flexible",) for c in calls[1:2]]
    assert score_all(reward_fn, flexible, workers=2, timeout_s=5) == [(1.0, "")] and returned_in[-1] == ("math", True)


def test_a_signal_ends_the_wait_for_rewards_at_once(monkeypatch, release):
    """SIGTERM (or Ctrl-C) while rewards are scored: score_all returns within a second, the calls not done
    'stopped' (the loop then stops as after generation), and the signal is noted for it."""
    import common
    from reward import score_all

    monkeypatch.setitem(common._state, "signum", 0)  # restored after the test, as are the handlers below
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    common.handle_signals()
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        t0 = time.time()
        out = score_all(lambda c, a: release.wait() or 1.0, [(i, "") for i in range(4)], workers=4, timeout_s=60)
        assert time.time() - t0 < 1.5 and out == [(0.0, "stopped")] * 4 and common.requested() == signal.SIGTERM
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def test_task_metrics_by_hand_without_a_process_group():
    """A notebook calls these with no torch.distributed set up: all_reduce is then the identity."""
    import torch.distributed as dist

    from data import Sample
    from reward import eval_stats, rollout_stats

    assert not dist.is_initialized()
    texts = ["5 + 7 = 12\n#### 12", "the answer is 12", "#### 13"]  # strict right; flexible right; wrong
    samples = [
        Sample([1], [2] * n, [0.0] * n, truncated=n == 4, answer="12", text=t, reward=r)
        for t, n, r in zip(texts, (2, 4, 6), (1.0, 0.25, 0.0))
    ]
    samples[0].tool_calls = [("calculator", "ok", 0.01)]
    out = eval_stats(samples, gsm8k_reward)
    assert out == {
        "eval/strict_acc": 1 / 3,
        "eval/flexible_acc": 2 / 3,
        "eval/format_rate": 2 / 3,
        "eval/tool_used_frac": 1 / 3,
    }
    stats = rollout_stats(samples, seconds=2.0, answer_fn=gsm8k_reward)
    assert float(stats["rollout/reward_mean"]) == 1.25 / 3 and float(stats["rollout/response_len_max"]) == 6
    assert float(stats["rollout/truncated_frac"]) == 1 / 3 and float(stats["perf/rollout_tokens_per_s"]) == 6.0
    assert [float(stats[f"rollout/reward_{k}"]) for k in ("errors", "nonfinite", "timeouts")] == [0, 0, 0]
    # samples scored 0.0 by score / score_all, each counted under its cause
    for s, error in zip(samples, ["not finite: nan", "timed out: still running after 30 s", "ValueError: x"]):
        s.reward, s.reward_error = 0.0, error
    stats = rollout_stats(samples, seconds=2.0, answer_fn=gsm8k_reward)
    assert [float(stats[f"rollout/reward_{k}"]) for k in ("errors", "nonfinite", "timeouts")] == [1, 1, 1]


# ----------------------------------------------------------------------------------------------
# MATH: the last \boxed{}, compared by math-verify; own text answers; the check of each kind


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),  # nested braces
        (r"\boxed{1} then \boxed{\{1, 2\}}", r"\{1, 2\}"),  # the last box; escaped braces balance
        (r"\fbox{7}", "7"),
        ("$\\boxed 5$ apples", "5"),  # MATH's '\boxed 5': up to the '$'
        (r"\boxed{}", None),  # empty
        (r"\boxed{\frac{1}{2}", None),  # never closes (a truncated completion)
        ("no box", None),
    ],
)
def test_last_boxed(text, expected):
    from reward import last_boxed

    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    "answer, completion, expected",
    [
        (r"\frac{1}{2}", r"\boxed{0.5}", 1.0),
        (r"\frac{1}{2}", r"\boxed{1/2}", 1.0),
        ("0.5", r"so \boxed{\dfrac12}", 1.0),
        (r"2\sqrt{2}", r"\boxed{\sqrt{8}}", 1.0),
        ("(0,1]", r"\boxed{(0, 1]}", 1.0),
        ("(0,1]", r"\boxed{[0,1]}", 0.0),  # the closed interval is another answer
        (r"\text{(C)}", r"\boxed{\text{(C)}}", 1.0),
        (r"\text{(C)}", r"\boxed{\text{(D)}}", 0.0),
        (r"5 \text{ cm}", r"\boxed{5}", 1.0),  # units aside
        ("5", r"\boxed{5\text{ cm}}", 1.0),
        ("3", r"\boxed{4}", 0.0),  # wrong
        ("3", r"\boxed{4} ... no wait, \boxed{3}", 1.0),  # the last box counts
        ("3", "The answer is $3$.", 0.0),  # strict: no box, no credit
    ],
)
def test_math_reward_strict(answer, completion, expected):
    from reward import math_reward

    assert math_reward(completion, answer) == expected


def test_math_reward_flexible_reads_what_math_verify_finds_without_a_box():
    from reward import math_reward

    assert math_reward("We get $x = 1$, so the answer is $\\frac{1}{2}$.", "0.5", "flexible") == 1.0
    assert math_reward("The final answer is 3. Earlier we had $5$.", "3", "flexible") == 1.0
    assert math_reward(r"\boxed{4}, though the final answer is 3", "3", "flexible") == 0.0  # a box wins
    assert math_reward("no math here", "3", "flexible") == 0.0


def test_math_reward_cannot_stall_and_refuses_threads():
    """A pathological answer is cut off by math-verify's timeout (SIGALRM, main thread only); in a thread the
    call raises, and score() counts it, rather than running without a timeout."""
    import threading
    import time

    from reward import math_reward

    t = time.time()
    assert math_reward(r"\boxed{10^{10^{10^{10}}}}", "1", timeout_s=1) == 0.0
    assert time.time() - t < 10
    out = []  # (an answer not checked before: a cached one would need no math-verify, and no timeout)
    thread = threading.Thread(target=lambda: out.append(score(math_reward, r"\boxed{17}", "17")))
    thread.start(), thread.join()
    assert out[0][0] == 0.0 and "main thread" in out[0][1]


def test_math_verify_missing_says_how_to_install(monkeypatch):
    import sys

    from common import InputError
    from reward import math_reward

    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify now raises ImportError
    with pytest.raises(InputError, match="pip install math-verify"):
        math_reward(r"\boxed{18}", "18")


@pytest.mark.parametrize(
    "completion, mode, expected",
    [
        ("It is in France.\n#### Paris", "strict", 1.0),
        ("####   PARIS.\nDone", "strict", 1.0),  # case, spaces and a final '.' aside
        ("#### Lyon", "flexible", 0.0),  # a '####' answer wins in flexible mode too
        ("The answer is Paris.", "strict", 0.0),
        ("The answer is Paris.", "flexible", 1.0),  # the last line ends in the answer
        ("Paris, then Lyon.", "flexible", 0.0),
    ],
)
def test_text_reward(completion, mode, expected):
    from reward import text_reward

    assert text_reward(completion, "Paris", mode) == expected


def test_correct_picks_the_check_of_each_kind():
    from reward import correct

    assert correct("int", "#### 122", "122") == correct("gsm8k", "#### 1,234.0", "1234") == 1.0
    assert correct("text", "#### 1,234", "1234") == 0.0  # text: no numeric reading
    assert correct("math", r"\boxed{\frac{2}{4}}", "0.5") == correct("text", "#### yes", "Yes") == 1.0
    assert correct("text", "yes", "Yes", "flexible") == 1.0 and correct("text", "yes", "Yes") == 0.0
    with pytest.raises(ValueError, match="kind 'latex' is unknown"):
        correct("latex", "", "1")
    with pytest.raises(ValueError, match="mode 'loose' is unknown"):
        correct("text", "", "1", "loose")


def test_format_reward_of_each_kind():
    assert format_reward(r"\boxed{x}", "math") == 1.0 and format_reward("#### 5", "math") == 0.0
    assert format_reward("#### Paris", "text") == 1.0 and format_reward("####  \n", "text") == 0.0
    assert format_reward("#### Paris") == 0.0 and format_reward("#### 5", "int") == 1.0


def test_eval_stats_of_mixed_sources():
    """Each sample judged by its own kind; per-source keys when there are several sources; a source with no
    samples anywhere has no keys."""
    from data import Sample
    from reward import eval_stats

    def sample(text, answer, kind, source):
        return Sample([1], [2], [0.0], truncated=False, answer=answer, text=text, kind=kind, source=source)

    samples = [
        sample("#### 12", "12", "gsm8k", "gsm8k"),
        sample("it is 12", "12", "gsm8k", "gsm8k"),
        sample(r"\boxed{0.5}", r"\frac{1}{2}", "math", "math"),
        sample(r"\boxed{3}", "2", "math", "math"),
    ]
    out = eval_stats(samples, sources=["gsm8k", "math", "empty"])
    assert out == {
        "eval/strict_acc": 0.5,
        "eval/flexible_acc": 0.75,
        "eval/format_rate": 0.75,
        "eval/gsm8k/strict_acc": 0.5,
        "eval/gsm8k/flexible_acc": 1.0,
        "eval/gsm8k/format_rate": 0.5,
        "eval/math/strict_acc": 0.5,
        "eval/math/flexible_acc": 0.5,
        "eval/math/format_rate": 1.0,
        "eval/tool_used_frac": 0.0,
    }
    assert eval_stats(samples, sources=["gsm8k"]).keys() == {
        "eval/strict_acc",
        "eval/flexible_acc",
        "eval/format_rate",
        "eval/tool_used_frac",
    }  # one source: no per-source keys


# ----------------------------------------------------------------------------------------------
# load_reward: your own reward from a file


def test_load_reward_imports_a_function_from_a_file(tmp_path):
    from reward import load_reward

    path = tmp_path / "my_reward.py"
    path.write_text("def reward(completion, answer):\n    return float(answer in completion)\n")
    fn = load_reward(f"{path}:reward")
    assert fn("the answer is 7", "7") == 1.0 and score(fn, "none", "7") == (0.0, "")


@pytest.mark.parametrize(
    "content, spec, message",
    [
        (None, "{path}", "expected FILE.py:function"),
        (None, "{dir}/missing.py:reward", "no such file"),
        (None, "{dir}/r.txt:reward", "is not a .py file"),
        ("def other(c, a):\n    return 0.0\n", "{path}:reward", r"has no 'reward'; its functions: \['other'\]"),
        ("reward = 1.0\n", "{path}:reward", "reward is a float; it must be a function"),
        (
            "def reward(completion):\n    return 0.0\n",
            "{path}:reward",
            r"reward\(completion\) can't be called as reward\(completion, answer\)",
        ),
        ("x = 1\ndef reward(c, a)\n    return 0.0\n", "{path}:reward", r"syntax error at .*r.py:2: "),
        (
            "async def reward(c, a):\n    return 1.0\n",
            "{path}:reward",
            "reward is an async def, its calls coroutines: make it a",
        ),
    ],
)
def test_load_reward_errors_name_the_spec_and_the_fix(tmp_path, content, spec, message):
    from common import InputError
    from reward import load_reward

    path = tmp_path / "r.py"
    if content is not None:
        path.write_text(content)
    spec = spec.format(path=path, dir=tmp_path)
    with pytest.raises(InputError, match=message) as e:
        load_reward(spec)
    assert f"--reward {spec!r}" in str(e.value)


@pytest.mark.parametrize(
    "value, shown",
    [
        ("1", "'1'"),  # float() took it for 1.0
        (None, "None"),
        ([1.0], "[1.0]"),
        (float, "<class 'float'>"),  # each scored 0 at every step, the run went on
        (
            "coroutine",
            "<coroutine object later at",
        ),  # a plain def that returns a coroutine (an async def: refused at load)
        ("tensor", "tensor([0.5000])"),  # one element, but not 0-d
    ],
)
def test_a_reward_that_returns_no_number_is_bad_input(tmp_path, value, shown):
    """score_all raises what the first call of the step met as bad input: --reward and the value, in one line."""
    import sys
    import warnings

    from common import InputError
    from reward import load_reward, score_all

    (tmp_path / "r.py").write_text(
        "import torch\nVALUE = None\nasync def later():\n    return 1.0\n"
        "def reward(completion, answer):\n    if VALUE == 'coroutine':\n        return later()\n"
        "    return torch.tensor([0.5]) if VALUE == 'tensor' else VALUE\n"
    )
    fn = load_reward(f"{tmp_path / 'r.py'}:reward")
    fn.__wrapped__.__globals__["VALUE"] = value
    with warnings.catch_warnings(), pytest.raises(InputError) as e:
        warnings.simplefilter("error")  # a coroutine never awaited would warn: it is closed
        score_all(fn, [("c", "a")] * 4, workers=2, timeout_s=5)
    message = str(e.value)
    assert message.startswith(f"--reward '{tmp_path / 'r.py'}:reward' returned {shown}") and "\n" not in message, (
        message
    )
    assert "not a number: return a float" in message
    del sys.modules["user_reward_reward"]


def test_every_kind_of_number_is_a_reward():
    """bool, int, float, Decimal, numpy scalars and 0-d arrays, 0-d tensors: numbers, scored as float() gives them."""
    from decimal import Decimal

    import numpy as np
    import torch

    from reward import is_number

    numbers = [
        True,
        1,
        0.5,
        Decimal("0.5"),
        np.float32(0.5),
        np.int64(1),
        np.bool_(True),
        np.array(0.5),
        torch.tensor(0.5),
        torch.tensor(True, device="cpu"),
    ]
    assert all(is_number(v) for v in numbers) and [score(lambda c, a, v=v: v, "c", "a")[0] for v in numbers] == [
        1.0,
        1.0,
        0.5,
        0.5,
        0.5,
        1.0,
        1.0,
        0.5,
        0.5,
        1.0,
    ]
    assert not any(is_number(v) for v in ("1", None, [1.0], float, 1j, np.array([0.5]), torch.tensor([0.5]), {}))


def test_pass_at_k_is_chens_unbiased_estimator_by_hand():
    """n = 4 samples: c = 1 right: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6, pass@4 = 1 (3 wrong can't fill
    4 draws); c = 2: 1/2, 1 - C(2,2)/C(4,2) = 5/6, 1; none right: 0; all right: 1."""
    from reward import pass_at_k

    assert [pass_at_k(4, 1, k) for k in (1, 2, 4)] == [0.25, 0.5, 1.0]
    assert [pass_at_k(4, 2, k) for k in (1, 2, 4)] == [0.5, 1 - 1 / 6, 1.0]
    assert [pass_at_k(4, 0, k) for k in (1, 2, 4)] == [0.0] * 3 and [pass_at_k(4, 4, k) for k in (1, 2, 4)] == [1.0] * 3


def test_majority_vote_ties_and_no_answer():
    """The most given answer wins; a tie goes to the answer given first; samples without an answer don't vote; no
    answer at all: no winner. Votes are strict answers as the kind reads them (normalized)."""
    from reward import majority, vote_key

    assert majority(["12", "7", "7", "12"]) == 0 and majority(["7", "12", "12", "7", "12"]) == 1
    assert majority([None, "5", "5", "3"]) == 1 and majority([None, None]) is None and majority([]) is None
    assert [vote_key("gsm8k", t) for t in ("so #### 1,234", "#### 1234.0", "the answer is 7")] == ["1234", "1234", None]
    assert vote_key("math", "x = \\boxed{\\frac{1}{2} }") == "\\frac{1}{2}" and vote_key("math", "no box") is None
    assert vote_key("text", "#### Paris.") == vote_key("text", "####  paris") == "paris"


def test_sampled_eval_stats_per_prompt_and_source_by_hand():
    """Two prompts of source a, one of b, K = 4 samples each (strict '#### N'). a1: 1 right of 4, its majority wrong
    ('#### 9' twice); a2: 2 right, a tie of right and wrong broken by the first given (right); b1: none gives an answer.
    a: avg@4 = (1/4 + 2/4) / 2, pass@2 = (1/2 + 5/6) / 2, pass@4 = 1, maj@4 = 1/2; b: 0; overall over 3 prompts."""
    from types import SimpleNamespace as S

    from reward import sampled_eval_stats

    def group(source, answer, texts):
        return [S(source=source, kind="gsm8k", answer=answer, text=t) for t in texts]

    groups = [
        group("a", "3", ["#### 3", "#### 9", "#### 9", "#### 4"]),
        group("a", "5", ["#### 5", "#### 6", "#### 5", "#### 6"]),
        group("b", "1", ["one", "two", "three", "four"]),
    ]
    out = sampled_eval_stats(groups, sources=["a", "b"])
    assert out["eval/a/avg@4"] == pytest.approx(0.375) and out["eval/a/pass@1"] == pytest.approx(0.375)
    assert out["eval/a/pass@2"] == pytest.approx((0.5 + 5 / 6) / 2) and out["eval/a/pass@4"] == 1.0
    assert out["eval/a/maj@4"] == 0.5 and out["eval/b/maj@4"] == 0.0 and out["eval/b/pass@4"] == 0.0
    assert out["eval/avg@4"] == pytest.approx(0.75 / 3) and out["eval/pass@4"] == pytest.approx(2 / 3)
    assert out["eval/maj@4"] == pytest.approx(1 / 3) and set(k for k in out if k.startswith("eval/pass")) == {
        "eval/pass@1",
        "eval/pass@2",
        "eval/pass@4",
    }
    three = sampled_eval_stats([group("a", "3", ["#### 3", "#### 2", "#### 2"])])  # K = 3: powers of 2 and K itself
    assert sorted(k for k in three if "pass" in k) == ["eval/pass@1", "eval/pass@2", "eval/pass@3"]


def test_maj_at_k_votes_math_answers_by_equivalence():
    """Issue 54, item 4: maj@k voted by the raw \\boxed{} string while correctness used math-verify, so \\frac{1}{2},
    0.5, 1/2, 3, 3 against 1/2 gave avg@5 0.6 and maj@5 0 ('3' won 2 to 1). By equivalence 1/2 has 3 votes: maj@5 1.
    A group of 3, 3, \\frac{1}{2}, 0.5 ties 2-2: the answer given first (3) wins, maj@4 0; a box math-verify cannot
    read is its own answer."""
    from types import SimpleNamespace as S

    pytest.importorskip("math_verify")
    from reward import majority, sampled_eval_stats, vote_classes

    texts = ["so \\boxed{\\frac{1}{2}}", "\\boxed{0.5}", "\\boxed{1/2}", "\\boxed{3}", "\\boxed{3}"]
    assert vote_classes("math", texts) == [0, 0, 0, 3, 3] and majority(vote_classes("math", texts)) == 0
    out = sampled_eval_stats([[S(source="m", kind="math", answer="\\frac{1}{2}", text=t) for t in texts]])
    assert out["eval/avg@5"] == pytest.approx(0.6) and out["eval/maj@5"] == 1.0
    tie = ["\\boxed{3}", "\\boxed{3}", "\\boxed{\\frac{1}{2}}", "\\boxed{0.5}"]
    out = sampled_eval_stats([[S(source="m", kind="math", answer="1/2", text=t) for t in tie]])
    assert out["eval/avg@4"] == 0.5 and out["eval/maj@4"] == 0.0
    assert vote_classes("math", ["\\boxed{\\foo bar}", "\\boxed{2}", "none", "\\boxed{\\foo bar}"]) == [0, 1, None, 0]
    assert vote_classes("gsm8k", ["#### 5", "#### 5.0", "x", "#### 7"]) == [0, 0, None, 3]  # as before: by value
