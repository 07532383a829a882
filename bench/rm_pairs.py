"""Preference pairs for train_rm.py from a policy's own completions, labelled by the task's rule.

    python bench/rm_pairs.py --model HuggingFaceTB/SmolLM2-135M-Instruct --dataset addition --out pairs.jsonl
    python train_rm.py --model HuggingFaceTB/SmolLM2-135M-Instruct --dataset pairs.jsonl --eval-dataset pairs.eval.jsonl

Samples `--group-size` completions of each prompt (temperature 1), judges each by the rule grpo.py
rewards with (reward.correct), and writes rows {"prompt", "chosen", "rejected", "group"}, the chosen side
earning more under that rule. From one sampled completion c with a number in it, c' = c with its last number
set to the right answer N, and c'' = c with it set to a wrong M within 10 of N:

    group "format": c' + "\n#### N" vs c'                               (only the format line differs)
    group "number": c' + "\n#### N" vs c'' + "\n#### M"                 (only the number differs, both places)
    group "wrong":  a sampled completion that is right vs one that is wrong, the nearest in length

"number" pairs differ in nothing but the answer, consistent within each side: a reward model right on them
checks the sum. Every prompt gives "format" and "number" pairs; "wrong" ones need a right sample (few: the
policy's own accuracy). The train split's prompts go to --out, the held-out split's to <out>.eval.jsonl (never trained on).
"""

import json
import os
import random
import re
import sys
import time
from dataclasses import dataclass
from typing import Literal

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from data import BUILTIN_TASKS, load_examples, tokenize_prompts  # noqa: E402
from preflight import check_engine, check_flags, check_model, friendly_errors, parse_args  # noqa: E402
from common import InputError
from reward import correct  # noqa: E402
from rollout import Sampling, SGLangOptions, generate, start_engine, stop_engine, stop_token_ids  # noqa: E402


@dataclass
class Args:
    model: str
    """the policy whose completions are paired: hub id or local folder"""
    out: str = "pairs.jsonl"
    """train pairs; the held-out prompts' pairs go to <out without .jsonl>.eval.jsonl"""
    dataset: str = "addition"
    """a built-in task ('addition', 'multiplication') or a file of rows with answers, as grpo.py's"""
    train_prompts: int = 2000
    """prompts of the train split to sample"""
    eval_prompts: int = 400
    """prompts of the held-out split to sample"""
    group_size: int = 8
    """completions of each prompt"""
    number_pairs: int = 1
    """'number' pairs per prompt, each from another of its samples (the group a reward model learns last)"""
    max_new_tokens: int = 128
    """response length limit"""
    seed: int = 0
    """the task's split (use the training runs' --seed) and the sampling"""
    rollout_engine: Literal["auto", "sglang", "hf"] = "auto"
    """'sglang' on a GPU, 'hf' on CPU"""
    sglang_mem_fraction: float = 0.5
    """SGLang memory fraction"""
    prompts_per_call: int = 256
    """prompts sent to the engine at once (x --group-size requests): with all 3000 x 8 at once, SGLang's
    scheduler grew to 70 GB of an H100 at --sglang-mem-fraction 0.15 (bench/README.md)"""


_NUMBER = re.compile(r"\d+")


def with_last_number(text: str, number: int) -> str:
    """`text` with its last run of digits replaced by `number`."""
    last = list(_NUMBER.finditer(text))[-1]
    return f"{text[: last.start()]}{number}{text[last.end() :]}"


def pairs_of(
    prompt, answer: str, kind: str, completions: list[str], rng: random.Random, number_pairs: int = 1
) -> list[dict]:
    """The rows one prompt gives (module docstring): a 'format' pair, `number_pairs` 'number' pairs (each from another
    sample), a 'wrong' pair; none from completions without a number."""
    n, rows = int(answer), []
    numbered = [c.rstrip() for c in completions if _NUMBER.search(c)]
    for k, c in enumerate(rng.sample(numbered, min(number_pairs, len(numbered)))):
        m = rng.choice([m for m in range(max(n - 10, 0), n + 11) if m != n])
        right, wrong = f"{with_last_number(c, n)}\n#### {n}", f"{with_last_number(c, m)}\n#### {m}"
        assert correct(kind, right, answer, "strict") and not correct(kind, wrong, answer, "flexible")
        rows += [{"prompt": prompt, "chosen": right, "rejected": with_last_number(c, n), "group": "format"}] * (k == 0)
        rows.append({"prompt": prompt, "chosen": right, "rejected": wrong, "group": "number"})
    good = [c for c in completions if correct(kind, c, answer, "flexible")]
    bad = [c for c in completions if not correct(kind, c, answer, "flexible")]
    if good and bad:
        c = rng.choice(good)
        rows.append(
            {
                "prompt": prompt,
                "chosen": c,
                "group": "wrong",
                "rejected": min(bad, key=lambda w: (abs(len(w) - len(c)), rng.random())),
            }
        )
    return rows


def main(args: Args):
    a = args
    check_flags(
        [  # (flag, value, holds, what it must be): before any file is opened
            (
                "--out",
                a.out,
                a.out.endswith(".jsonl") and os.path.isdir(os.path.dirname(os.path.abspath(a.out))),
                "a .jsonl file in a folder that exists (train_rm.py reads .jsonl)",
            ),
            ("--train-prompts", a.train_prompts, a.train_prompts >= 1, ">= 1"),
            ("--eval-prompts", a.eval_prompts, a.eval_prompts >= 1, ">= 1"),
            ("--group-size", a.group_size, a.group_size >= 1, ">= 1"),
            ("--number-pairs", a.number_pairs, a.number_pairs >= 0, ">= 0"),
            ("--max-new-tokens", a.max_new_tokens, a.max_new_tokens >= 1, ">= 1"),
            ("--prompts-per-call", a.prompts_per_call, a.prompts_per_call >= 1, ">= 1"),
        ]
    )
    kind = check_engine(args.rollout_engine)
    tokenizer, _ = check_model(args.model)
    if args.dataset in BUILTIN_TASKS:
        train, test = BUILTIN_TASKS[args.dataset](args.seed)
    else:
        train, test = load_examples(args.dataset, "train"), load_examples(args.dataset, "test")
    if any(not re.fullmatch(r"-?\d+", e.answer) for e in train[:10] + test[:10]):
        raise InputError(f"--dataset {args.dataset!r}: the 'number' pairs need whole-number answers")
    sglang = SGLangOptions(mem_fraction=args.sglang_mem_fraction, load_format="auto")
    engine = start_engine(kind, args.model, seed=args.seed, sglang=sglang)
    sampling = Sampling(
        max_new_tokens=args.max_new_tokens, stop_ids=stop_token_ids(tokenizer, args.model), temperature=1.0
    )
    rng, counts = random.Random(args.seed), {}
    for split, examples, path in [
        ("train", train[: args.train_prompts], args.out),
        ("eval", test[: args.eval_prompts], args.out.removesuffix(".jsonl") + ".eval.jsonl"),
    ]:
        ids, kept, _ = tokenize_prompts(tokenizer, examples, 1024, args.dataset)
        n = args.group_size
        t0 = time.time()
        samples = []  # request j's seed is j, however the prompts are split into calls
        for k in range(0, len(ids), args.prompts_per_call):
            chunk = ids[k : k + args.prompts_per_call]
            samples += generate(
                engine,
                [p for p in chunk for _ in range(n)],
                list(range(k * n, (k + len(chunk)) * n)),
                sampling=sampling,
                tokenizer=tokenizer,
            )
        rows = [
            row
            for k, e in enumerate(kept)
            for row in pairs_of(
                e.prompt, e.answer, e.kind, [s.text for s in samples[k * n : (k + 1) * n]], rng, args.number_pairs
            )
        ]
        with open(path + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(path + ".tmp", path)  # an earlier file is replaced only by a whole new one
        right = sum(
            correct(e.kind, s.text, e.answer, "flexible")
            for k, e in enumerate(kept)
            for s in samples[k * n : (k + 1) * n]
        )
        counts[split] = {
            "prompts": len(kept),
            "completions": len(samples),
            "right_frac": right / len(samples),
            "pairs": {g: sum(r["group"] == g for r in rows) for g in ("wrong", "format", "number")},
            "seconds": round(time.time() - t0, 1),
            "file": path,
        }
        print(f"{split}: {json.dumps(counts[split])}", flush=True)
    stop_engine(engine, None)
    with open(args.out.removesuffix(".jsonl") + ".summary.json", "w") as f:
        json.dump(
            {
                "model": args.model,
                "dataset": args.dataset,
                "engine": kind,
                **counts,
                "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            },
            f,
            indent=2,
        )


if __name__ == "__main__":  # SGLang spawns its scheduler: keep this guard
    with friendly_errors("bench/rm_pairs.py"):
        main(parse_args(Args))
