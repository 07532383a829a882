"""Rule-based rewards: plain functions `(completion, answer) -> float`.

    gsm8k_reward(completion, "72")              # 1.0 if the extracted number equals 72
    int_match_reward(completion, "122")         # built-in addition task: exact integer match
    format_reward(completion)                   # 1.0 if the completion gives a "#### <number>" answer
    score(reward_fn, completion, answer)        # never raises: (reward, "") or (0.0, "ValueError: ...")

Two ways to find the final answer, as in lm-evaluation-harness's GSM8K:
  strict:   the number after the last "####"      ("... so 5 + 7 = 12.\n#### 12" -> "12")
  flexible: strict if present, else the last number in the text ("The answer is 1,234." -> "1234")
"""

import re
from decimal import Decimal, InvalidOperation

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
