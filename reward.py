"""Rule-based rewards: plain functions `(completion, answer) -> float`.

    gsm8k_reward(completion, "72")              # 1.0 if the extracted number equals 72
    int_match_reward(completion, "122")         # built-in addition task: exact integer match
    format_reward(completion)                   # 1.0 if the completion gives a "#### <number>" answer
    score(reward_fn, completion, answer)        # never raises: (reward, "") or (0.0, "ValueError: ...")
    rollout_stats(samples, answer_fn, seconds)  # a step's reward, accuracy, lengths, over all ranks
    eval_stats(samples, answer_fn)              # held-out accuracy, over all ranks

Two ways to find the final answer, as in lm-evaluation-harness's GSM8K:
  strict:   the number after the last "####"      ("... so 5 + 7 = 12.\n#### 12" -> "12")
  flexible: strict if present, else the last number in the text ("The answer is 1,234." -> "1234")
"""

import math
import re
from decimal import Decimal, InvalidOperation

import torch
import torch.distributed as dist

from fsdp import all_reduce
from runlog import print0

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


def format_reward(completion: str) -> float:
    """1.0 if the completion gives a '#### <number>' answer (what strict extraction reads), as
    lm-evaluation-harness's strict match counts format; text after the answer is allowed."""
    return float(extract_strict(completion) is not None)


def score(reward_fn, completion: str, answer: str) -> tuple[float, str]:
    """Call a reward function; a function that raises scores 0.0 and reports what it raised.

    A buggy or unlucky reward function (a regex on a pathological string, a parser that chokes)
    must never stop a training run: the caller counts the errors in its metrics instead.
    """
    try:
        return float(reward_fn(completion, answer)), ""
    except Exception as e:  # noqa: BLE001 -- deliberately broad: any reward bug becomes a counted 0
        return 0.0, f"{type(e).__name__}: {e}"


# ----------------------------------------------------------------------------------------------
# Task metrics, summed over ranks. answer_fn(completion, answer, mode) -> 0/1, mode "strict" or "flexible".


def judge(samples, answer_fn) -> dict[str, float]:
    """Sums over this rank's samples: strict accuracy ('#### N' right), flexible accuracy (else the
    last number), format ('#### N' present)."""
    return {"strict": sum(score(lambda c, a: answer_fn(c, a, "strict"), s.text, s.answer)[0] for s in samples),
            "flexible": sum(score(lambda c, a: answer_fn(c, a, "flexible"), s.text, s.answer)[0] for s in samples),
            "format": sum(format_reward(s.text) for s in samples)}


def rollout_stats(samples, answer_fn, seconds: float) -> dict:
    """Reward, accuracy, format, length (tool replies included), truncation and sampled tokens/s of a
    step's samples, over all ranks.
    A reward function that raised on most samples is also said on the console."""
    counts = judge(samples, answer_fn)
    sampled = sum(len(s.response_ids) if s.model_mask is None else sum(s.model_mask) for s in samples)  # tools' tokens not
    tot = all_reduce(torch.tensor([
        len(samples), sum(s.reward for s in samples), sum(s.reward ** 2 for s in samples), counts["strict"],
        counts["format"], sum(len(s.response_ids) for s in samples), sum(s.truncated for s in samples),
        sum(bool(s.reward_error) for s in samples), sum(not math.isfinite(s.reward) for s in samples), sampled],
        dtype=torch.float64))
    n, mean = tot[0], tot[1] / tot[0]
    if tot[7] > n / 2:  # a broken reward function: say so on the console, not only in the metrics
        first = next((s.reward_error for s in samples if s.reward_error), "")
        print0(f"warning: the reward function raised on {int(tot[7])} of {int(n)} samples (scored 0)" + (f", e.g. {first}" if first else ""))
    return {"rollout/reward_mean": mean, "rollout/reward_std": (tot[2] / n - mean**2).clamp(min=0).sqrt(),
            "rollout/strict_acc": tot[3] / n, "rollout/format_rate": tot[4] / n,
            "rollout/response_len_mean": tot[5] / n,
            "rollout/response_len_max": all_reduce(max(len(s.response_ids) for s in samples), dist.ReduceOp.MAX),
            "rollout/truncated_frac": tot[6] / n, "rollout/reward_errors": tot[7], "rollout/reward_nonfinite": tot[8],
            "perf/rollout_tokens_per_s": tot[9] / seconds}  # tokens the engine sampled


def eval_stats(samples, answer_fn) -> dict:
    """Greedy held-out accuracy of the samples of all ranks."""
    counts = judge(samples, answer_fn)
    tot = all_reduce(torch.tensor([counts["strict"], counts["flexible"], counts["format"], len(samples),
                                   sum(bool(s.tool_calls) for s in samples)]))
    return {"eval/strict_acc": float(tot[0] / tot[3]), "eval/flexible_acc": float(tot[1] / tot[3]),
            "eval/format_rate": float(tot[2] / tot[3]), "eval/tool_used_frac": float(tot[4] / tot[3])}


EVAL_LINE = [("eval strict acc", "eval/strict_acc", ".3f"), ("flexible acc", "eval/flexible_acc", ".3f"),
             ("format", "eval/format_rate", ".3f")]  # the console line of an evaluation
EVAL_TOOLS_LINE = [("used a tool", "eval/tool_used_frac", ".3f")]  # and with tools
