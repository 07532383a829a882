"""Rule-based rewards: plain functions `(completion, answer) -> float`.

    gsm8k_reward(completion, "72")              # 1.0 if the extracted number equals 72
    int_match_reward(completion, "122")         # built-in addition task: exact integer match
    math_reward(completion, "\\frac{1}{2}")     # the last \\boxed{} equals it (math-verify: 0.5, 1/2 too)
    text_reward(completion, "Paris")            # the text after '####', case and spaces aside
    correct(kind, completion, answer, mode)     # the check of an Example's kind: int, gsm8k, math or text
    format_reward(completion, kind)             # 1.0 if the completion gives its answer in the kind's format
    score(reward_fn, completion, answer)        # never raises: (reward, "") or (0.0, "ValueError: ..."); NaN/inf: 0.0
    score_all(reward_fn, calls, workers=8, timeout_s=30)  # score() of each, in threads, each call within a time limit
    score_samples(reward, samples, workers=8, timeout_s=30)  # the same for samples: s.reward, s.reward_error
    reward_fn(completion, answer, kind, unformatted_credit=0.25, format_weight=0.0)  # what grpo.py and ppo.py train on
    reward_fn = load_reward("my_reward.py:reward")  # your own (completion, answer) -> float, from a file
    rollout_stats(samples, seconds)             # a step's reward, accuracy, lengths, over all ranks
    eval_stats(samples, answer_fn, sources)     # held-out accuracy, over all ranks, and per source

Two ways to find the final answer, as in lm-evaluation-harness's GSM8K:
  strict:   the number after the last "####"      ("... so 5 + 7 = 12.\\n#### 12" -> "12"); math: the last \\boxed{}
  flexible: strict if present, else the last number in the text ("The answer is 1,234." -> "1234"); math:
            what math-verify finds ("the final answer is ...", the last $...$); text: the last line ends in it
"""

import collections
import contextlib
import functools
import importlib.util
import inspect
import io
import math
import numbers
import os
import queue
import re
import sys
import threading
import time
import traceback
from decimal import Decimal, InvalidOperation

import torch
import torch.distributed as dist

from common import InputError, Interrupted, all_reduce, interruptible, print0

# A number: optional sign, digits with optional thousands commas, optional decimals; or ".5".
_NUM = r"-?(?:[0-9][0-9,]*(?:\.[0-9]+)?|\.[0-9]+)"
_NUMBER = re.compile(_NUM)
# "#### 1,234.50" / "####-3" / "#### $12": the number right after the marker.
_STRICT = re.compile(r"####\s*\$?\s*(" + _NUM + ")")


def normalize_number(text: str) -> str | None:
    """Canonical form of a number string: "1,234" -> "1234", "5.00" -> "5", "-0" -> "0".
    Returns None when `text` is not a number."""
    text = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = Decimal(text)  # exact: no float rounding of long integers or decimals
    except InvalidOperation:
        return None
    if not value.is_finite():  # "nan", "inf": not answers
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_strict(completion: str) -> str | None:
    """The number after the last '####', normalized; None if there is none."""
    matches = _STRICT.findall(completion)
    return normalize_number(matches[-1]) if matches else None


def extract_last_number(completion: str) -> str | None:
    """The last number anywhere in the text, normalized; None if there is none."""
    for match in reversed(_NUMBER.findall(completion)):
        number = normalize_number(match)
        if number is not None:
            return number
    return None


def extract_answer(completion: str, mode: str = "strict") -> str | None:
    """strict: only '#### N' counts. flexible: '#### N' if present, else the last number."""
    if mode not in ("strict", "flexible"):
        raise ValueError(f"answer mode {mode!r} is unknown; use 'strict' or 'flexible'")
    answer = extract_strict(completion)
    if answer is None and mode == "flexible":
        answer = extract_last_number(completion)
    return answer


def gsm8k_reward(completion: str, answer: str, mode: str = "strict") -> float:
    """1.0 if the final number of `completion` equals the reference `answer` (numerically)."""
    predicted = extract_answer(completion, mode)
    return float(predicted is not None and predicted == normalize_number(answer))


def int_match_reward(completion: str, answer: str, mode: str = "strict") -> float:
    """Built-in addition task: 1.0 only for an exact integer match ("122", not "122.5")."""
    predicted = extract_answer(completion, mode)
    return float(predicted is not None and predicted.lstrip("-").isdigit() and int(predicted) == int(answer))


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} or \\fbox{...}, nested braces matched ('\\boxed{\\frac{1}{2}}' ->
    '\\frac{1}{2}'), or of '\\boxed 5' (to a '$' or the line's end); None if there is none, or it is empty or open."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    i = start + (6 if text.startswith("\\boxed", start) else 5)
    if start < 0 or not text.startswith(("{", " "), i):
        return None
    if text[i] == " ":  # '\boxed 5'
        return text[i:].split("$")[0].split("\n")[0].strip() or None
    depth = 0
    for j in range(i, len(text)):
        depth += (text[j] == "{") - (text[j] == "}")
        if depth == 0:
            return text[i + 1 : j].strip() or None
    return None


def math_verify():
    """(parse, verify) of Hugging Face's math-verify, imported on first use."""
    try:
        from math_verify import parse, verify  # lazy: only for math answers
    except ImportError:
        raise InputError("math answers are checked with Hugging Face's math-verify: pip install math-verify") from None
    return parse, verify


def math_reward(completion: str, answer: str, mode: str = "strict", timeout_s: int = 5) -> float:
    """1.0 if the completion's last \\boxed{} equals the LaTeX `answer` by math-verify: 1/2 = 0.5 = \\frac{1}{2},
    2\\sqrt{2} = \\sqrt{8}, (0,1] != [0,1], 5 \\text{ cm} = 5. flexible: with no box, what math-verify finds itself
    ('the final answer is ...', else the last $...$ or \\[...\\], else the last number).
    A call takes at most about 3 * timeout_s: math-verify stops each parse and comparison with SIGALRM, which only
    the main thread can set; in any other this raises (score() counts it), where it could hang."""
    boxed = last_boxed(completion)
    if boxed is None and mode == "strict":
        return 0.0
    return float(math_equal(completion if boxed is None else f"\\boxed{{{boxed}}}", answer, timeout_s))


@functools.lru_cache(maxsize=1024)  # a reward's strict and flexible checks and the metrics ask the same question
def math_equal(predicted: str, answer: str, timeout_s: int) -> bool:
    """math-verify's verdict on the answer it finds in `predicted` against the LaTeX `answer`."""
    parse, verify = math_verify()
    if threading.current_thread() is not threading.main_thread():
        raise NeedsMainThread("math_reward runs in the main thread only: math-verify's timeout is a SIGALRM")
    gold = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout_s)
    return verify(gold, parse(predicted, parsing_timeout=timeout_s), timeout_seconds=timeout_s)


def extract_text(completion: str) -> str | None:
    """The rest of the line after the last '####', case-folded, spaces collapsed, a final '.' dropped; None if none."""
    marker = completion.rfind("####")
    return normalize_text(completion[marker + 4 :].lstrip().split("\n")[0]) or None if marker >= 0 else None


def normalize_text(text: str) -> str:
    return " ".join(text.casefold().split()).rstrip(".")


def text_reward(completion: str, answer: str, mode: str = "strict") -> float:
    """Own tasks whose answer is not a number: 1.0 if the text after the last '####' equals `answer`, both
    normalized as in extract_text. flexible: with no '####', the last non-empty line ends in the answer."""
    predicted, target = extract_text(completion), normalize_text(answer)
    if predicted is not None or mode == "strict":
        return float(predicted == target)
    last = normalize_text(([line for line in completion.splitlines() if line.strip()] or [""])[-1])
    return float(bool(target) and (last == target or last.endswith(" " + target)))


def correct(kind: str, completion: str, answer: str, mode: str = "strict") -> float:
    """1.0 if `completion` gives `answer`, checked as an Example's `kind` says: 'int' (the built-in tasks),
    'gsm8k' ('#### N', numerically), 'math' (\\boxed{}, math-verify) or 'text' ('#### <text>')."""
    if mode not in ("strict", "flexible"):
        raise ValueError(f"answer mode {mode!r} is unknown; use 'strict' or 'flexible'")
    if kind == "int":
        return int_match_reward(completion, answer, mode)
    elif kind == "gsm8k":
        return gsm8k_reward(completion, answer, mode)
    elif kind == "math":
        return math_reward(completion, answer, mode)
    elif kind == "text":
        return text_reward(completion, answer, mode)
    raise ValueError(f"answer kind {kind!r} is unknown; use 'int', 'gsm8k', 'math' or 'text'")


def gives_answer(completion: str, kind: str = "gsm8k") -> bool:
    """The completion gives an answer in the kind's format (what strict extraction reads): math a \\boxed{},
    text '#### <text>', else '#### <number>'; text after the answer is allowed."""
    if kind == "math":
        return last_boxed(completion) is not None
    return (extract_text if kind == "text" else extract_strict)(completion) is not None


def format_reward(completion: str, kind: str = "gsm8k") -> float:
    """1.0 if the completion gives an answer in the kind's format (gives_answer), as lm-evaluation-harness's
    strict match counts format."""
    return float(gives_answer(completion, kind))


TIMED_OUT, NONFINITE = "timed out", "not finite"  # how reward_error starts for these (rollout_stats counts each)
_abandoned: list[threading.Thread] = []  # reward calls past their time limit that still run, over all steps


def reward_fn(
    completion: str, answer: str, kind: str, *, user_reward=None, unformatted_credit: float, format_weight: float
) -> float:
    """What a completion earns in grpo.py and ppo.py (their flags bound by functools.partial): your --reward function
    (`user_reward`), else: right by `kind`'s rule (correct: the number after '####', the last \\boxed{}, ...): 1.0;
    right but not in that format: unformatted_credit; plus format_weight for an answer in the asked format. Credit for
    the format alone is format_weight's (0 by default), so the policy can't score by emitting '#### <guess>'."""
    if user_reward is not None:
        return user_reward(completion, answer)
    if correct(kind, completion, answer, "strict"):
        right = 1.0
    else:
        right = unformatted_credit * correct(kind, completion, answer, "flexible")
    return right + format_weight * format_reward(completion, kind)


class NeedsMainThread(RuntimeError):
    """A check only the main thread can bound in time (math-verify's SIGALRM): score_all runs it there."""


class NotANumber(ValueError):
    """A --reward value that is not a number ('1', None, a list): score_all raises it as bad input."""


def is_number(value) -> bool:
    """A value a reward may return: bool, int, float, Decimal, a numpy scalar or 0-d array, a 0-d tensor (real)."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not value.is_complex()
    kind = getattr(getattr(value, "dtype", None), "kind", None)  # numpy's: bool, signed, unsigned, float
    return isinstance(value, (numbers.Real, Decimal)) or (getattr(value, "ndim", None) == 0 and kind in tuple("biuf"))


def score(reward_fn, *args) -> tuple[float, str]:
    """Call a reward function; one that raises scores 0.0 and reports what it raised, one whose value
    is NaN/inf scores 0.0 and reports it ('not finite: nan').

    A buggy or unlucky reward function (a regex on a pathological string, a parser that chokes)
    must never stop a training run, nor skip a whole step's update for one sample: the caller
    counts these in its metrics instead.
    """
    try:
        value = float(reward_fn(*args))
    except Exception as e:  # noqa: BLE001 -- deliberately broad: any reward bug becomes a counted 0
        return 0.0, f"{type(e).__name__}: {e}"
    return (value, "") if math.isfinite(value) else (0.0, f"{NONFINITE}: {value}")


def score_all(reward_fn, calls: list[tuple], *, workers: int, timeout_s: float) -> list[tuple[float, str]]:
    """score(reward_fn, *args) of each args in `calls`, in their order, by `workers` threads, each call waited for at
    most `timeout_s` (then it scores 0.0, 'timed out: ...'). A signal ends the wait at once: the calls not done score
    0.0, 'stopped', and the loop stops at its next check, as after generation. A call that raised NeedsMainThread
    (math-verify) runs again in this thread, after the others, within its own timeouts.

    PLUMBING: threads, not processes: a reward may be a closure over the script's state (no pickling), and a fork of
    a trainer that holds CUDA is unsafe. A thread can't be stopped, so a worker whose call is past its limit is
    abandoned: a daemon thread, it holds up neither the other calls nor the exit, and quits when the call returns.
    A new worker replaces it only while fewer than `workers` abandoned ones still run (fewer than 2 x workers threads
    in all); with none left, the rest wait for one to end, and after `timeout_s` score 0.0 unrun: a hung reward
    costs a step timeout_s or two, never a pile of threads. A --reward value that is not a number (NotANumber, from
    load_reward's function) is bad input: an InputError naming it, once the calls are done.
    """
    results, left, todo = [None] * len(calls), len(calls), collections.deque(range(len(calls)))
    finished, lock = queue.SimpleQueue(), threading.Lock()  # finished: (index, result) from the workers
    now_in = {}  # worker -> (index, deadline) of the call it is in; a worker given up on is taken out

    def work():
        me = threading.current_thread()
        while True:
            with lock:
                if not todo:
                    return
                i = todo.popleft()
                now_in[me] = (i, time.monotonic() + timeout_s)
            result = score(reward_fn, *calls[i])
            with lock:
                if now_in.pop(me, None) is None:  # given up on: too late, and no more calls for this worker
                    return
                finished.put((i, result))

    active, stuck_since = set(), None  # this call's workers not abandoned; since when none could run
    try:
        with contextlib.suppress(Interrupted), interruptible():  # a signal raises Interrupted in this wait
            while left:
                _abandoned[:], active = [t for t in _abandoned if t.is_alive()], {t for t in active if t.is_alive()}
                while todo and len(active) < workers and len(_abandoned) < workers:
                    worker = threading.Thread(target=work, daemon=True, name="reward")
                    worker.start()
                    active.add(worker)
                stuck_since = (stuck_since or time.monotonic()) if todo and not active else None
                if stuck_since and time.monotonic() - stuck_since > timeout_s:
                    with lock:
                        for i in todo:
                            results[i] = (
                                0.0,
                                f"{TIMED_OUT}: not run, {len(_abandoned)} earlier calls still run past the limit",
                            )
                        left -= len(todo)
                        todo.clear()
                    continue
                with lock:
                    wait = min([0.5] + [d - time.monotonic() for _, d in now_in.values()])
                with contextlib.suppress(queue.Empty):
                    i, results[i] = finished.get(timeout=max(0.0, wait))
                    left -= 1
                    while True:
                        i, results[i] = finished.get_nowait()
                        left -= 1
                with lock:
                    for worker, (i, deadline) in list(now_in.items()):
                        if time.monotonic() > deadline:
                            results[i], left = (0.0, f"{TIMED_OUT}: still running after {timeout_s:g} s"), left - 1
                            del now_in[worker]
                            _abandoned.append(worker)
                            active.discard(worker)
            for i, (_, error) in enumerate(results):
                if error.startswith(NeedsMainThread.__name__):
                    results[i] = score(reward_fn, *calls[i])
    finally:
        with lock:
            todo.clear()  # after a signal: the workers take no more calls
    results = [r or (0.0, "stopped") for r in results]
    if bad := next((e for _, e in results if e.startswith(f"{NotANumber.__name__}: ")), None):
        raise InputError(bad.removeprefix(f"{NotANumber.__name__}: "))  # not a counted 0 at every step: bad input
    return results


def score_samples(reward_fn, samples: list, *, workers: int, timeout_s: float) -> list:
    """score_all of reward_fn(s.text, s.answer, s.kind) for each sample: sets s.reward, and s.reward_error (why it
    scored 0: raised, NaN/inf, timed out; "" if nothing went wrong). Returns the samples."""
    scored = score_all(reward_fn, [(s.text, s.answer, s.kind) for s in samples], workers=workers, timeout_s=timeout_s)
    for s, (reward, error) in zip(samples, scored):
        s.reward, s.reward_error = reward, error
    return samples


def load_reward(spec: str):
    """'FILE.py:function' -> that function, imported from the file: your own reward `(completion, answer) -> float`,
    with no edit of the script. A file or function that can't serve is an InputError naming `spec` and the fix, and so,
    at the step that meets it, is a value that is not a number (through score_all)."""
    path, _, name = spec.rpartition(":")
    if not path or not name.isidentifier():
        raise InputError(f"--reward {spec!r}: expected FILE.py:function, e.g. my_reward.py:reward")
    if not path.endswith(".py"):
        raise InputError(f"--reward {spec!r}: {path!r} is not a .py file; write the function in one")
    if not os.path.isfile(path):
        raise InputError(f"--reward {spec!r}: no such file {os.path.abspath(path)}")
    module_spec = importlib.util.spec_from_file_location(f"user_reward_{name}", path)
    module = sys.modules[module_spec.name] = importlib.util.module_from_spec(module_spec)  # dataclasses look it up
    said = io.StringIO()  # what its top level prints to stderr, shown once it imports (argparse's usage: in the error)
    try:
        with contextlib.redirect_stderr(said):
            module_spec.loader.exec_module(module)
    except SyntaxError as e:
        raise InputError(f"--reward {spec!r}: syntax error at {e.filename}:{e.lineno}: {e.msg}; fix the file") from None
    except ImportError as e:  # ModuleNotFoundError too: a package this environment lacks, a misspelt name
        raise InputError(
            f"--reward {spec!r}: an import in {path} fails ({e}); pip install it into {sys.prefix}, "
            f"or fix or drop the import"
        ) from None
    except SystemExit as e:  # sys.exit at its top level, or argparse there, reading the training script's own flags
        printed = said.getvalue().strip().splitlines()
        why = f"calls sys.exit({e.code!r})"
        if printed and printed[0].startswith("usage:"):
            why = f"parses the command line (argparse: {printed[-1].split('error: ')[-1]})"
        raise InputError(f"--reward {spec!r}: {path} {why} on import; put it under if __name__ == '__main__'") from None
    except Exception as e:  # its top level raised: the error and its line, in one line
        where = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == module_spec.origin]
        raise InputError(
            f"--reward {spec!r}: {path}, line {where[-1] if where else '?'}, raised {type(e).__name__}: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}; fix the file"
        ) from e
    sys.stderr.write(said.getvalue())
    if not hasattr(module, name):
        functions = [k for k, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__]
        raise InputError(f"--reward {spec!r}: {path} has no {name!r}; its functions: {functions or 'none'}")
    fn = getattr(module, name)
    if not callable(fn):
        raise InputError(
            f"--reward {spec!r}: {name} is a {type(fn).__name__}; it must be a function (completion, answer) -> float"
        )
    try:
        inspect.signature(fn).bind("completion", "answer")
    except TypeError:
        raise InputError(
            f"--reward {spec!r}: {name}{inspect.signature(fn)} can't be called as {name}(completion, answer)"
        ) from None
    if inspect.iscoroutinefunction(fn):
        raise InputError(f"--reward {spec!r}: {name} is an async def, its calls coroutines: make it a plain def")

    @functools.wraps(fn)
    def checked(completion: str, answer: str):
        """fn's value if it is a number (is_number), else NotANumber: score_all raises it as bad input."""
        if is_number(value := fn(completion, answer)):
            return value
        if inspect.iscoroutine(value):
            value.close()  # never awaited: no warning of it after our line
        raise NotANumber(
            f"--reward {spec!r} returned {repr(value)[:80]} ({type(value).__name__}), not a number: return a float "
            "(a bool, an int, a numpy or 0-d torch number do too), e.g. 1.0 for a right answer"
        )

    return checked


# ----------------------------------------------------------------------------------------------
# Task metrics, summed over ranks. answer_fn(completion, answer, mode) -> 0/1, mode "strict" or "flexible";
# None: each sample judged by its own kind, correct(s.kind, ...).


def judge(samples, answer_fn=None) -> dict[str, float]:
    """Sums over this rank's samples: strict accuracy ('#### N' right), flexible accuracy (else the
    last number), format ('#### N' present); each as the sample's kind has it, answer_fn or not."""

    def right(s, mode):
        check = (lambda c, a: answer_fn(c, a, mode)) if answer_fn else (lambda c, a: correct(s.kind, c, a, mode))
        return score(check, s.text, s.answer)[0]

    return {
        "strict": sum(right(s, "strict") for s in samples),
        "flexible": sum(right(s, "flexible") for s in samples),
        "format": sum(gives_answer(s.text, s.kind) for s in samples),
    }


def rollout_stats(samples, seconds: float, answer_fn=None) -> dict:
    """Reward, accuracy, format, length (tool replies included), truncation and sampled tokens/s of a
    step's samples, over all ranks; rewards scored 0.0 because the function raised, gave NaN/inf or timed out.
    A reward function that raised on most samples, and any NaN/inf or timed-out reward, is also said on the console."""
    counts = judge(samples, answer_fn)
    sampled = sum(
        len(s.response_ids) if s.model_mask is None else sum(s.model_mask) for s in samples
    )  # tools' tokens not
    nonfinite, timeouts = (sum(s.reward_error.startswith(why) for s in samples) for why in (NONFINITE, TIMED_OUT))
    tot = all_reduce(
        torch.tensor(
            [
                len(samples),
                sum(s.reward for s in samples),
                sum(s.reward**2 for s in samples),
                counts["strict"],
                counts["format"],
                sum(len(s.response_ids) for s in samples),
                sum(s.truncated for s in samples),
                sum(bool(s.reward_error) for s in samples) - nonfinite - timeouts,
                nonfinite,
                sampled,
                timeouts,
                sum(t.is_alive() for t in _abandoned),
            ],  # reward calls past their limit that still run
            dtype=torch.float64,
        )
    )
    n, mean = tot[0], tot[1] / tot[0]
    if tot[7] > n / 2:  # a broken reward function: say so on the console, not only in the metrics
        first = next(
            (
                s.reward_error
                for s in samples
                if s.reward_error and not s.reward_error.startswith((NONFINITE, TIMED_OUT))
            ),
            "",
        )
        print0(
            f"warning: the reward function raised on {int(tot[7])} of {int(n)} samples (scored 0)"
            + (f", e.g. {first}" if first else "")
        )
    why = " and ".join(
        f"{int(k)} {what}" for k, what in ((tot[8], "NaN/inf"), (tot[10], "timed out (--reward-timeout-s)")) if k
    )
    if why:  # each cost its own sample only, but a person must know
        print0(
            f"warning: {why} of {int(n)} rewards, scored 0"
            + (f"; {int(tot[11])} calls still run in the background" if tot[11] else "")
        )
    return {
        "rollout/reward_mean": mean,
        "rollout/reward_std": (tot[2] / n - mean**2).clamp(min=0).sqrt(),
        "rollout/strict_acc": tot[3] / n,
        "rollout/format_rate": tot[4] / n,
        "rollout/response_len_mean": tot[5] / n,
        "rollout/response_len_max": all_reduce(max(len(s.response_ids) for s in samples), dist.ReduceOp.MAX),
        "rollout/truncated_frac": tot[6] / n,
        "rollout/reward_errors": tot[7],
        "rollout/reward_nonfinite": tot[8],
        "rollout/reward_timeouts": tot[10],
        "perf/rollout_tokens_per_s": tot[9] / seconds,
    }  # tokens the engine sampled


def eval_stats(samples, answer_fn=None, sources: list[str] = ()) -> dict:
    """Greedy held-out accuracy of the samples of all ranks. With several `sources` (Prompts.sources: the same list
    on every rank, so the reduced tensors agree), each one's too: eval/<source>/strict_acc, flexible_acc, format_rate."""
    names = list(sources) if len(sources) > 1 else []
    parts = [[s for s in samples if s.source == n] for n in names] + [[s for s in samples if s.source not in names]]
    tot = all_reduce(
        [
            [c["strict"], c["flexible"], c["format"], len(p), sum(bool(s.tool_calls) for s in p)]
            for p, c in ((p, judge(p, answer_fn)) for p in parts)
        ]
    )  # [sources + 1, 5]
    out = {}
    for key, row in [("eval", tot.sum(0))] + [(f"eval/{n}", row) for n, row in zip(names, tot) if row[3]]:
        out |= {
            f"{key}/strict_acc": float(row[0] / row[3]),
            f"{key}/flexible_acc": float(row[1] / row[3]),
            f"{key}/format_rate": float(row[2] / row[3]),
        }
    return out | {"eval/tool_used_frac": float(tot[:, 4].sum() / tot[:, 3].sum())}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. (2021)'s unbiased pass@k from n samples of a prompt, c of them right: 1 - C(n-c, k) / C(n, k),
    the chance that k of them drawn without replacement hold a right one (k <= n). k = 1: c / n, avg@n."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def vote_key(kind: str, completion: str) -> str | None:
    """What a sample votes for in maj@k: its strict final answer as its kind reads it ('#### N' normalized, math's
    last \\boxed{} without spaces, text's line after '####' case-folded); None: no vote."""
    if kind == "math":
        boxed = last_boxed(completion)
        return boxed.replace(" ", "") if boxed else None
    return extract_text(completion) if kind == "text" else extract_strict(completion)


def vote_classes(kind: str, completions: list[str], timeout_s: int = 5) -> list[int | None]:
    """What each sample votes for in maj@k, as the number of the first sample that gave the same answer (None: no
    vote). Math answers are the same where math-verify says so (\\frac{1}{2}, 0.5 and 1/2 are one answer, as
    correctness counts them): each new answer string is compared with one string of each answer seen before (math_equal
    caches the verdicts); other kinds by their strict answer as vote_key reads it."""
    keys = [vote_key(kind, c) for c in completions]
    classes: dict[str, int] = {}  # each answer string seen: its class (the first sample of an equal answer)
    founders: list[tuple[str, int]] = []  # each class's first string, (string, class)
    for i, key in enumerate(keys):
        if key is None or key in classes:
            continue
        classes[key] = next((c for k, c in founders if kind == "math" and same_math(key, k, timeout_s)), i)
        if classes[key] == i:
            founders.append((key, i))
    return [None if key is None else classes[key] for key in keys]


def same_math(one: str, other: str, timeout_s: int) -> bool:
    """math-verify's verdict on two \\boxed{} contents; one it cannot read is no match."""
    try:
        return math_equal(f"\\boxed{{{one}}}", other, timeout_s)
    except Exception:  # noqa: BLE001 (a parse timeout, an unreadable answer: two answers, not one)
        return False


def majority(keys: list) -> int | None:
    """The first sample whose answer has the most votes (a tie: the answer given first wins); None: no sample gives
    one (maj@k counts the prompt wrong)."""
    votes = collections.Counter(k for k in keys if k is not None)
    top = max(votes.values(), default=0)
    return next((i for i, k in enumerate(keys) if k is not None and votes[k] == top), None)


def sampled_eval_stats(groups: list[list], sources: list[str] = ()) -> dict:
    """avg@K, pass@k (k = 1, 2, 4, ... and K) and maj@K of K samples a held-out prompt (`groups`: this rank's prompts,
    each its K samples), strict answers, over all ranks and per source as eval_stats; eval/avg@K = eval/pass@1."""
    K = int(all_reduce(len(groups[0]) if groups else 0, op=dist.ReduceOp.MAX))  # a rank may hold no prompt
    ks = sorted({2**i for i in range(K.bit_length()) if 2**i <= K} | {K})
    names = list(sources) if len(sources) > 1 else []
    parts = [[g for g in groups if g[0].source == n] for n in names] + [[g for g in groups if g[0].source not in names]]
    rows = []
    for part in parts:  # per prompt: c right of K, the majority's verdict
        right = [[score(lambda c, a, s=s: correct(s.kind, c, a), s.text, s.answer)[0] for s in g] for g in part]
        maj = [
            r[i] if g and (i := majority(vote_classes(g[0].kind, [s.text for s in g]))) is not None else 0.0
            for g, r in zip(part, right)
        ]
        rows.append([len(part), sum(maj)] + [sum(pass_at_k(K, int(sum(r)), k) for r in right) for k in ks])
    tot = all_reduce(torch.tensor(rows, dtype=torch.float64))  # [sources + 1, 2 + len(ks)]
    out = {}
    for key, row in [("eval", tot.sum(0))] + [(f"eval/{n}", row) for n, row in zip(names, tot) if row[0]]:
        out |= {f"{key}/avg@{K}": float(row[2] / row[0]), f"{key}/maj@{K}": float(row[1] / row[0])}
        out |= {f"{key}/pass@{k}": float(v / row[0]) for k, v in zip(ks, row[2:])}
    return out


EVAL_LINE = [
    ("eval strict acc", "eval/strict_acc", ".3f"),
    ("flexible acc", "eval/flexible_acc", ".3f"),
    ("format", "eval/format_rate", ".3f"),
]  # the console line of an evaluation
EVAL_TOOLS_LINE = [("used a tool", "eval/tool_used_frac", ".3f")]  # and with tools


def sampled_line(k: int) -> list[tuple]:
    """The console's part of --eval-samples K (K = 0: nothing is logged under these names)."""
    return [(f"{name}@{k}", f"eval/{name}@{k}", ".3f") for name in ("avg", "pass", "maj")]


REWARD_LINE = [
    ("reward errors", "rollout/reward_errors", ".0f"),
    ("NaN rewards", "rollout/reward_nonfinite", ".0f"),
    ("reward timeouts", "rollout/reward_timeouts", ".0f"),
]  # a step's console line shows those not 0
