"""reward.py on tricky completions: markers, signs, currency, commas, decimals, trailing text."""

import pytest

from reward import (extract_answer, extract_last_number, extract_strict, format_reward, gsm8k_reward,
                    int_match_reward, normalize_number, score)

# ----------------------------------------------------------------------------------------------
# normalize_number


@pytest.mark.parametrize("text, expected", [
    ("1,234", "1234"),      # thousands commas dropped
    ("5.00", "5"),          # integral floats print as integers
    ("12.50", "12.5"),
    ("-0", "0"),
    ("$12", "12"),
    ("72.", "72"),          # a sentence-ending dot
    (" 7 ", "7"),
    ("nan", None),          # float() parses it, but it is not an answer
    ("inf", None),
    ("seven", None),
    ("", None),
])
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


def test_normalize_number_keeps_large_integers_exact():
    assert normalize_number("12345678901234567891") == "12345678901234567891"


# ----------------------------------------------------------------------------------------------
# extraction


@pytest.mark.parametrize("completion, expected", [
    ("so 1000 + 234 = 1234\n#### 1,234", "1234"),
    ("####-3", "-3"),                      # no space, negative
    ("#### $12", "12"),                    # currency sign after the marker
    ("#### 5.00", "5"),
    ("#### 1\nwait, no\n#### 2", "2"),     # several markers: the last one wins
    ("#### 72\n", "72"),
    ("The answer is 12.", None),           # no marker: strict finds nothing
    ("#### nan", None),
    ("#### twelve", None),
    ("", None),
])
def test_extract_strict(completion, expected):
    assert extract_strict(completion) == expected


@pytest.mark.parametrize("completion, expected", [
    ("The answer is 12.", "12"),           # the final period is not a decimal point
    ("3 apples and 4 pears, so 7", "7"),
    ("Total: $1,200.50.", "1200.5"),
    ("It went from 5 to -3", "-3"),
    ("abc12def", "12"),                    # digits inside a word still count
    ("x2y3z", "3"),                        # ... and the last of them wins
    ("no number here", None),
    ("nan", None),                         # the word 'nan' is not a number
    ("NaN, so 5", "5"),
])
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
    assert gsm8k_reward("The answer is 72.", "72") == 0.0           # default mode is strict
    assert gsm8k_reward("The answer is 72.", "72", "flexible") == 1.0
    assert gsm8k_reward("I don't know", "72", "flexible") == 0.0


def test_int_match_reward_needs_an_exact_integer():
    assert int_match_reward("#### 122", "122") == 1.0
    assert int_match_reward("#### 122.5", "122") == 0.0             # normalized to '122.5': not an integer
    assert int_match_reward("#### -3", "-3") == 1.0
    assert int_match_reward("#### 121", "122") == 0.0
    assert int_match_reward("12 + 110 = 122", "122") == 0.0         # strict: no marker
    assert int_match_reward("12 + 110 = 122", "122", "flexible") == 1.0


@pytest.mark.parametrize("completion, expected", [
    ("so 5 + 7 = 12\n#### 12", 1.0),
    ("#### 72\n", 1.0),                    # trailing newline is fine
    ("#### 72.", 1.0),                     # so is a final period
    ("####-3", 1.0),
    ("#### $1,234.50 ", 1.0),
    ("#### 72 because 70 + 2", 1.0),       # text after the answer is allowed (lm-eval strict match)
    ("##### 58\nThe final answer is 58.", 1.0),  # extra '#' and chatter: still parses strictly
    ("#### oops", 0.0),                    # a marker without a number
    ("The answer is 72", 0.0),             # no marker
    ("#### ", 0.0),
])
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


def test_task_metrics_by_hand_without_a_process_group():
    """A notebook calls these with no torch.distributed set up: all_reduce is then the identity."""
    import torch.distributed as dist

    from data import Sample
    from reward import eval_stats, rollout_stats

    assert not dist.is_initialized()
    texts = ["5 + 7 = 12\n#### 12", "the answer is 12", "#### 13"]  # strict right; flexible right; wrong
    samples = [Sample([1], [2] * n, [0.0] * n, truncated=n == 4, answer="12", text=t, reward=r)
               for t, n, r in zip(texts, (2, 4, 6), (1.0, 0.25, 0.0))]
    samples[0].tool_calls = [("calculator", "ok", 0.01)]
    out = eval_stats(samples, gsm8k_reward)
    assert out == {"eval/strict_acc": 1 / 3, "eval/flexible_acc": 2 / 3, "eval/format_rate": 2 / 3, "eval/tool_used_frac": 1 / 3}
    stats = rollout_stats(samples, gsm8k_reward, seconds=2.0)
    assert float(stats["rollout/reward_mean"]) == 1.25 / 3 and float(stats["rollout/response_len_max"]) == 6
    assert float(stats["rollout/truncated_frac"]) == 1 / 3 and float(stats["perf/rollout_tokens_per_s"]) == 6.0
