"""Prompts in, padded batches out.

    train, test = addition_task(seed=0)                       # built-in, no download
    train = load_examples("openai/gsm8k", "train")              # hub id (needs `datasets`)
    train = load_examples("../shared/data/gsm8k", "train")      # local folder: train.jsonl / test.parquet
    train = load_examples("math.jsonl", "train", system_prompt="You are a careful mathematician.")
    train, test, note = load_task("my.jsonl", None, seed=0, num_eval=256, template="{prompt}\\nAnswer after ####.")
    train, test, note = load_task(["openai/gsm8k", "math"], None, seed=0, num_eval=256)  # several: num_eval each
    prompts, kept, dropped = tokenize_prompts(tokenizer, train, max_prompt_len=256, source="my.jsonl")
    train, held, line = task_prompts(tokenizer, "addition", None, seed=0, num_eval=256, max_prompt_len=256)
    sampler = PromptSampler(len(prompts), seed=0)               # epoch shuffles; resumable position
    seed = seed_for(0, "update", step, epoch)                   # one seed per use of randomness
    seeds = shard(sample_seeds(0, "sample", step, prompts=32, group_size=16), rank, world_size)  # a sample's own
    label(samples, examples)                                    # each sample gets its prompt's answer and kind
    batch = collate(samples, pad_id)                            # list[Sample] -> Batch of tensors
    pairs, skipped = load_pairs("pairs.jsonl")                  # preference pairs (train_rm.py), bad rows counted
    train, held, note = split_pairs(pairs, seed=0, num_eval=512, where="pairs.jsonl")  # whole prompts held out

Rows: {"prompt": "..." or [chat messages], "answer": ...} (your own task), GSM8K's {"question", "answer":
"...#### 72"}, MATH's {"problem", "solution": "...\\boxed{...}"} or {"problem", "answer"}. Each Example
carries its answer `kind` (how reward.correct judges it) and its `source` (for per-source accuracy).
`Sample` is the one record that travels from the rollout to the loss. Preference pairs (train_rm.py):
{"prompt": text or chat messages, "chosen": text, "rejected": text, "group": optional text}.
"""

import copy
import json
import os
import random
import re
from collections import Counter
from dataclasses import dataclass, field

import torch

from common import TINY_MODEL, InputError, to_device
from reward import last_boxed, math_verify, normalize_number

# The default prompt templates ({prompt}, or {question}, is the row's question), by answer kind: int (the
# built-in tasks), math (MATH_PROMPT: the phrase Qwen2.5-Math and DeepSeek-R1 are evaluated with), else GSM8K_PROMPT
ADDITION_PROMPT = "{question} Put the final answer after ####."
GSM8K_PROMPT = "{question}\nThink step by step, then put the final answer after ####."
MATH_PROMPT = "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{}."
KIND_RULE = {
    "int": "#### N",
    "gsm8k": "#### N",
    "math": "\\boxed{}, math-verify",
    "text": "#### text",
}  # reward.correct
# Columns tried in order when none are given: your own rows, GSM8K, MATH-500, MATH
FIELDS = [("prompt", "answer"), ("question", "answer"), ("problem", "answer"), ("problem", "solution")]
_SLOT = re.compile(r"\{(?:prompt|question)\}")
# Other placeholders ({answer}, {0}, {x:.2f}): ask() would leave them as written; LaTeX's \boxed{x}, x^{n} are none
_FIELD = re.compile(r"(?<![\w\\}^_{])\{((?:[A-Za-z_]\w*|\d+)(?:[!:][^{}]*)?)\}")


# ----------------------------------------------------------------------------------------------
# Where a name points (a file, a folder, the hub), and whether prompts fit the model


def looks_like_path(name: str) -> bool:
    """A hub id is 'owner/name'; anything else that looks like a path is never sent to the hub."""
    return (
        name.startswith((".", "/", "~"))
        or os.path.exists(name)
        or name.count("/") != 1
        or name.endswith((".json", ".jsonl", ".parquet", ".safetensors", ".bin"))
    )


def hub_unreachable(name: str, flag: str, repo_type: str = "model") -> str | None:
    """One request of at most 10 s about a hub id: None if the hub answers, else why it can't be reached (no
    network, DNS, a proxy: the caller decides whether a cache will do). Gated or missing: an InputError."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi().repo_info(name, repo_type=repo_type, timeout=10)
    except GatedRepoError:
        raise InputError(
            f"{flag} {name!r} is gated on the hub: accept its licence on its page and log in "
            f"(hf auth login), or pass a local {'folder' if repo_type == 'model' else 'file'}"
        ) from None
    except RepositoryNotFoundError:
        raise InputError(
            f"{flag} {name!r}: no such {repo_type} on the hub (check the spelling; private ones need "
            f"hf auth login), and no such local {'folder' if repo_type == 'model' else 'file or folder'}"
        ) from None
    except Exception as e:  # no network, DNS, proxy, timeout: all mean the same here
        return f"{type(e).__name__}: {e}"
    return None


def check_context(
    context: int | None,
    max_prompt_len: int,
    max_new_tokens: int,
    flag: str = "--max-prompt-len",
    *,
    tools_prompt: int = 0,
):
    """A prompt of max_prompt_len tokens (after the tools' prompt, if any) plus max_new_tokens must fit the model's
    context. The error offers only fixes that fit: flags lowered to at least 1 token, or a model with a longer context."""
    total = max_prompt_len + tools_prompt + max_new_tokens
    if context is not None and total > context:
        tools = f" + the tools' prompt {tools_prompt}" if tools_prompt else ""
        new, prompt = context - tools_prompt - max_prompt_len, context - tools_prompt - max_new_tokens  # what would fit
        lower = [f"--max-new-tokens to {new}"] * (new >= 1) + [f"{flag} to {prompt} (longer prompts are dropped)"] * (
            prompt >= 1
        )
        both = context - tools_prompt  # neither alone, both together: a prompt and a response of a token each at least
        lower = lower or [f"{flag} and --max-new-tokens so that they add up to {both} or less"] * (both >= 2)
        model = (
            f"a model with a context of {total} or more (a tiny one for a CPU try-out: python {TINY_MODEL} ./tiny-model "
            f"--context {1 << (total - 1).bit_length()})"
        )
        room = "the tools' prompt alone leaves no room: " if tools_prompt else ""
        fix = f"lower {' or '.join(lower)}, or use {model}" if lower else f"{room}use {model}"
        raise InputError(
            f"{flag} {max_prompt_len}{tools} + --max-new-tokens {max_new_tokens} = {total} tokens, "
            f"more than the model's context of {context} (max_position_embeddings): {fix}"
        )


@dataclass
class Example:
    prompt: str | list[dict]  # the user message before the chat template, or chat messages (a system prompt, own turns)
    answer: str  # the reference final answer, e.g. "72", "\\frac{1}{2}", "Paris"
    kind: str = "gsm8k"  # how reward.correct judges it: "int", "gsm8k", "math" or "text"
    source: str = ""  # the dataset's short name (source_name), e.g. "gsm8k"


def ask(prompt: str | list[dict], template: str, system_prompt: str | None = None) -> str | list[dict]:
    """`prompt` through `template`: each {prompt} or {question} becomes the prompt, nothing else changes (a
    literal '\\boxed{}' stays). Chat messages: the template fills the last user message. `system_prompt`: chat
    messages with it first."""
    if not _SLOT.search(template):
        raise InputError(
            f"template {template!r} has no {{prompt}}: the question would not be asked; "
            "e.g. '{prompt}\\nPut the final answer after ####.'"
        )
    if isinstance(prompt, str) and not system_prompt:
        return _SLOT.sub(lambda _: prompt, template)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    messages[last]["content"] = _SLOT.sub(lambda _: messages[last]["content"], template)
    return [{"role": "system", "content": system_prompt}] * bool(system_prompt) + messages


def template_rule(template: str | None, flag: str = "--prompt-template") -> tuple[str, str, bool, str]:
    """preflight.check_flags' rule for a prompt template (None: each kind's own): it has {prompt} (or {question}),
    where the row's question goes, and no other placeholder: ask() fills in that one only, the rest reach the model."""
    others = [f"{{{f}}}" for f in _FIELD.findall(template or "") if f not in ("prompt", "question")]
    must = (
        f"text whose only placeholder is {{prompt}} (the row's question): {', '.join(others)} would reach the model "
        "as written, not filled in; write its words into the template"
        if others
        else "text with {prompt} in it, where the row's question goes: e.g. '{prompt}\\nAnswer after ####.'"
    )
    return flag, repr(template), template is None or (bool(_SLOT.search(template)) and not others), must


# ----------------------------------------------------------------------------------------------
# Tasks


def addition_task(
    seed: int, num_test: int = 500, template: str = ADDITION_PROMPT, system_prompt: str | None = None
) -> tuple[list[Example], list[Example]]:
    """Two-digit addition, 'What is a + b?' for a, b in 10..99 (8100 pairs), asked through `template`.

    A seeded shuffle of all pairs; the first `num_test` are the held-out split, so the split is
    the same on every rank and in every run with the same seed, and no test pair is trained on.
    """
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    examples = [
        Example(ask(f"What is {a} + {b}?", template, system_prompt), str(a + b), "int", "addition") for a, b in pairs
    ]
    return examples[num_test:], examples[:num_test]


def multiplication_task(
    seed: int, num_test: int = 500, template: str = ADDITION_PROMPT, system_prompt: str | None = None
) -> tuple[list[Example], list[Example]]:
    """'What is a * b?' for a in 100..999 and b in 10..99: beyond what a small model does in its
    head, easy with a calculator (grpo.py --tools calculator). 8100 seeded pairs, split as addition's."""
    rng = random.Random(seed)
    pairs = list(dict.fromkeys((rng.randrange(100, 1000), rng.randrange(10, 100)) for _ in range(9000)))[:8100]
    examples = [
        Example(ask(f"What is {a} * {b}?", template, system_prompt), str(a * b), "int", "multiplication")
        for a, b in pairs
    ]
    return examples[num_test:], examples[:num_test]


BUILTIN_TASKS = {"addition": addition_task, "multiplication": multiplication_task}


def source_name(dataset: str) -> str:
    """A dataset's short name, Example.source and its metrics' key: 'openai/gsm8k' -> 'gsm8k', 'data/my.jsonl' -> 'my'."""
    return os.path.basename(dataset.rstrip("/")).removesuffix(".jsonl").removesuffix(".parquet")


def read_rows(path: str) -> list[tuple[int, dict]]:
    """(line number, row) of a .jsonl file, or (row number, row) of a .parquet file, 1-based.
    A line that is not a JSON object stops with an error naming the file and the line."""
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq  # lazy: only for parquet input
        except ImportError:
            raise InputError(f"data file {path!r} is parquet: pip install pyarrow, or convert it to .jsonl") from None
        try:
            return list(enumerate(pq.read_table(path).to_pylist(), start=1))
        except Exception as e:  # pyarrow's ArrowInvalid and kin: a file cut short, or not parquet at all
            raise InputError(
                f"data file {path!r} can't be read as parquet ({type(e).__name__}: {str(e)[:200]})"
            ) from None
    if not path.endswith(".jsonl"):
        raise InputError(f"data file {path!r}: expected a .jsonl or .parquet file")
    rows = []
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is named by its number
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")  # -sig: a BOM some editors write
            except UnicodeDecodeError as e:
                raise InputError(
                    f"{path}, line {line_no}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                    f"save it as UTF-8 (from Latin-1: iconv -f latin1 -t utf-8 {path} > utf8.jsonl)"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}, line {line_no}: not valid JSON ({e.msg}); fix or delete that line") from None
            if not isinstance(row, dict):
                raise InputError(f"{path}, line {line_no}: expected a JSON object, got {type(row).__name__}")
            rows.append((line_no, row))
    return rows


def is_chat(prompt) -> bool:
    """A list of {"role": str, "content": str} messages, one of them the user's."""
    return (
        isinstance(prompt, list)
        and any(isinstance(m, dict) and m.get("role") == "user" for m in prompt)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
        )
    )


def examples_from_rows(
    rows: list[tuple[int, dict]],
    where: str,
    name: str,
    *,
    template: str | None = None,
    system_prompt: str | None = None,
    prompt_field: str | None = None,
    answer_field: str | None = None,
    kind: str | None = None,
) -> list[Example]:
    """Rows (line, dict) of one dataset (`where` in errors, `name` its source) -> Examples, each prompt asked through
    `template` (None: the kind's default) after `system_prompt`. Columns: prompt_field / answer_field, else the first
    pair of FIELDS in the first row. Kind: `kind`, else 'gsm8k' for 'question' rows, 'math' for 'problem' rows, and
    for others 'gsm8k' if every answer is a number, else 'text'. The answer: for math the last \\boxed{} if it has
    one (a 'solution' must), else the text after the last '####' (GSM8K's "...\\n#### 72", or just "72" or 72)."""
    if not rows:
        raise InputError(
            f'{where} has no rows; each line needs {{"prompt": ..., "answer": ...}} (or GSM8K\'s '
            "question/answer, MATH's problem/solution)"
        )
    first = rows[0][1]
    found = [
        (p, a)
        for p, a in FIELDS
        if prompt_field in (None, p) and answer_field in (None, a) and p in first and a in first
    ]
    pf, af = (
        found[0]
        if found
        else (prompt_field or next((p for p, _ in FIELDS if p in first), "prompt"), answer_field or "answer")
    )
    if kind not in (None, "gsm8k", "math", "text"):
        raise InputError(
            f"answer kind {kind!r} (--answer-kind) is unknown: use 'gsm8k', 'math' or 'text', or leave it out"
        )
    kind = kind or {"question": "gsm8k", "problem": "math"}.get(pf)  # None: decided by the answers, below
    parsed = []  # (line, prompt, final answer)
    for line_no, row in rows:
        prompt, answer = row.get(pf), row.get(af)
        if (
            not (isinstance(prompt, str) or is_chat(prompt))
            or not isinstance(answer, (str, int, float))
            or isinstance(answer, bool)
        ):
            raise InputError(
                f"{where}, line {line_no}: needs a {pf!r} string and an {af!r} (the final answer, or text "
                f"ending in '#### <answer>'; a prompt may also be a list of chat messages, one with role "
                f"'user'); found { ({k: type(v).__name__ for k, v in row.items()}) }; other columns: "
                f"--prompt-field, --answer-field"
            )
        if system_prompt and isinstance(prompt, list) and prompt[0]["role"] == "system":
            raise InputError(
                f"{where}, line {line_no}: has a system message, and --system-prompt adds another: drop one"
            )
        text = str(answer).strip()
        if kind == "math":
            final = last_boxed(text) if "\\boxed" in text or "\\fbox" in text else None if af == "solution" else text
        else:
            final = text.split("####")[-1].strip()
        parsed.append((line_no, prompt.strip() if isinstance(prompt, str) else prompt, final))
    kind = kind or ("gsm8k" if all(normalize_number(a) is not None for _, _, a in parsed) else "text")
    for line_no, _, final in parsed:
        if kind == "gsm8k" and normalize_number(final) is None:
            raise InputError(
                f"{where}, line {line_no}: field {af!r} has no final number: "
                f"end it with '#### <number>' or give just the number"
            )
        if not final:
            raise InputError(
                f"{where}, line {line_no}: field {af!r} has no answer" + " in a \\boxed{...} (or its "
                "braces don't close): box the final answer, or give it alone in 'answer'" * (kind == "math")
            )
    if kind == "math":
        math_verify()  # not installed: say so now, not as a reward of 0 for every sample
    template = template or (MATH_PROMPT if kind == "math" else GSM8K_PROMPT)
    return [
        Example(ask(p, template, system_prompt), a.replace(",", "") if kind == "gsm8k" else a, kind, name)
        for _, p, a in parsed
    ]


def load_examples(
    dataset: str,
    split: str,
    template: str | None = None,
    *,
    system_prompt: str | None = None,
    prompt_field: str | None = None,
    answer_field: str | None = None,
    kind: str | None = None,
) -> list[Example]:
    """Examples (examples_from_rows) from a local file, a local folder holding `{split}.jsonl` or
    `{split}.parquet`, or a Hugging Face hub id (e.g. 'openai/gsm8k'). Anything that looks like a
    path (a .jsonl/.parquet name, './', '/', an existing folder) is never sent to the hub."""
    fmt = dict(
        template=template, system_prompt=system_prompt, prompt_field=prompt_field, answer_field=answer_field, kind=kind
    )
    if os.path.isfile(dataset):
        return examples_from_rows(read_rows(dataset), dataset, source_name(dataset), **fmt)
    if os.path.isdir(dataset):
        for ext in (".jsonl", ".parquet"):
            path = os.path.join(dataset, split + ext)
            if os.path.isfile(path):
                return examples_from_rows(read_rows(path), path, source_name(dataset), **fmt)
        raise InputError(f"dataset folder {dataset!r} has no {split}.jsonl or {split}.parquet")
    if looks_like_path(dataset):
        raise InputError(
            f"dataset {dataset!r}: no such file or folder ({os.path.abspath(dataset)}); "
            f"a hub dataset is named like 'openai/gsm8k'"
        )
    try:
        import datasets  # lazy: only for hub datasets
    except ImportError:
        raise InputError(
            f"dataset {dataset!r} is a hub id: pip install datasets, or pass a local .jsonl file"
        ) from None
    # PLUMBING: without the hub, `datasets` retries for half a minute before it reads its cache: ask once, quickly
    why = None if datasets.config.HF_HUB_OFFLINE else hub_unreachable(dataset, "dataset", repo_type="dataset")
    if why:
        datasets.config.HF_HUB_OFFLINE = True  # its cache now, or a ConnectionError now
    try:
        rows = datasets.load_dataset(dataset, "main" if dataset.endswith("gsm8k") else None, split=split)
    except ConnectionError as e:  # offline, and not in its cache
        raise InputError(
            f"dataset {dataset!r} is not in the datasets cache and the hub can't be reached ({why or e}); "
            f"pass a local .jsonl file or folder of its rows, or load it once where the hub is reachable"
        ) from None
    return examples_from_rows(list(enumerate(rows, start=1)), f"{dataset}[{split}]", source_name(dataset), **fmt)


def load_task(
    dataset: str | list[str],
    eval_dataset: str | None,
    *,
    seed: int,
    num_eval: int,
    template: str | None = None,
    system_prompt: str | None = None,
    prompt_field: str | None = None,
    answer_field: str | None = None,
    kind: str | None = None,
):
    """(train, at most `num_eval` held-out examples, a line saying where the held-out ones come from), every
    prompt asked through `template` (None: each kind's default) after `system_prompt`; columns and kind as in
    examples_from_rows.

    'addition', 'multiplication': the task's seeded split (with `eval_dataset`: its train part, that file's rows held
    out). Otherwise the 'train' split of `dataset` and the 'test' split of `eval_dataset` (default: of `dataset`). A
    single file with no --eval-dataset has no test split: a seeded 1 in 10 of its rows, by prompt, is held out.
    Several datasets (a list): their train examples concatenated and each one's held-out examples (`num_eval`
    each), every Example tagged with its source; the options apply to all of them."""
    fmt = dict(
        template=template, system_prompt=system_prompt, prompt_field=prompt_field, answer_field=answer_field, kind=kind
    )
    if not isinstance(dataset, str) and len(dataset) == 1:
        dataset = dataset[0]
    if not isinstance(dataset, str):
        names = [source_name(d) for d in dataset]
        if eval_dataset is not None:
            raise InputError(
                f"--eval-dataset {eval_dataset!r} goes with one dataset; with several, each is evaluated "
                f"on its own test split or held-out part"
            )
        if len(set(names)) < len(names):
            raise InputError(
                f"datasets {dataset} share a short name ({names}): each needs its own for its metrics; rename one"
            )
        parts = [load_task(d, None, seed=seed, num_eval=num_eval, **fmt) for d in dataset]
        return [e for p in parts for e in p[0]], [e for p in parts for e in p[1]], "; ".join(p[2] for p in parts)
    if dataset in BUILTIN_TASKS:
        train, test = BUILTIN_TASKS[dataset](seed, template=template or ADDITION_PROMPT, system_prompt=system_prompt)
        if eval_dataset is None:
            return train, test[:num_eval], f"{dataset}: {len(test)} held-out pairs"
    else:
        train = load_examples(dataset, "train", **fmt)
    if eval_dataset is not None:  # a built-in task's own held-out pairs stay out of training all the same
        return train, load_examples(eval_dataset, "test", **fmt)[:num_eval], f"eval prompts from {eval_dataset}"
    if not os.path.isfile(dataset):
        return train, load_examples(dataset, "test", **fmt)[:num_eval], f"eval prompts from {dataset}'s test split"
    return split_rows(train, seed=seed, num_eval=num_eval, where=dataset)


def split_rows(examples: list[Example], *, seed: int, num_eval: int, where: str):
    """(train, held out, a line saying so) of one file's rows: whole prompts, in a seeded order, are held out until they
    hold 1 in 10 of the rows, and at most `num_eval` of those rows are evaluated. A prompt's copies (repeated rows) are
    all on one side: no held-out prompt is trained on. Without copies, the first 1 in 10 rows of a seeded shuffle."""
    rows = {}  # the prompt as asked -> its rows, in order of first appearance
    for e in examples:
        rows.setdefault(json.dumps(e.prompt), []).append(e)
    groups = list(rows.values())
    order = random.Random(seed).sample(range(len(groups)), len(groups))
    want, held, taken = min(num_eval, len(examples) // 10), 0, 0
    while taken < want:
        taken, held = taken + len(groups[order[held]]), held + 1
    train = [e for i in order[held:] for e in groups[i]]
    if not want or not train:
        distinct = f", {len(groups)} of them distinct prompts" if want else ""  # one prompt held out, none left
        raise InputError(
            f"dataset {where!r} has {len(examples)} rows{distinct}, too few to hold 1 in 10 out for evaluation: "
            "pass --eval-dataset FILE"
        )
    copies = f" (every copy of {held} prompt{'s' * (held > 1)})" if taken > held else ""
    note = (
        f"held out {taken} of {len(examples)} rows{copies} of {where} for evaluation "
        f"(seed {seed}; --eval-dataset FILE to choose them)"
    )
    return train, [e for i in order[:held] for e in groups[i]][:num_eval], note


# ----------------------------------------------------------------------------------------------
# Preference pairs (train_rm.py)


@dataclass
class Pair:
    """One preference: `chosen` is a better response to `prompt` than `rejected`."""

    prompt: str | list[dict]  # the user message, or chat messages
    chosen: str
    rejected: str
    group: str = ""  # the row's "group", if any (e.g. "number": the sides differ only in the number): metrics per group


def load_pairs(path: str, flag: str = "--dataset") -> tuple[list[Pair], dict[str, int]]:
    """The pairs of a .jsonl or .parquet file (given as `flag`), and how many rows were skipped: {"empty": a side is
    empty, "identical": the two sides are the same}. A row without the fields stops with an error naming the file and
    the line."""
    if not os.path.isfile(path):
        what = (
            "is a folder: pass a .jsonl or .parquet file"
            if os.path.isdir(path)
            else f"no such file ({os.path.abspath(path)})"
        )
        raise InputError(f"{flag} {path!r}: {what}")
    rows, pairs, skipped = read_rows(path), [], {"empty": 0, "identical": 0}
    if not rows:
        raise InputError(f'{path} has no rows; each line needs {{"prompt": ..., "chosen": ..., "rejected": ...}}')
    for line_no, row in rows:
        prompt, chosen, rejected, group = (row.get(k) for k in ("prompt", "chosen", "rejected", "group"))
        group = "" if group is None else group  # absent or null: no group; 0, false, [] are not text
        if not (isinstance(prompt, str) or is_chat(prompt)) or not all(
            isinstance(x, str) for x in (chosen, rejected, group)
        ):
            raise InputError(
                f"{path}, line {line_no}: needs a 'prompt' (text, or chat messages of text contents, one with role 'user'), "
                f"'chosen' and 'rejected' texts and optionally a 'group' text; found "
                f"{ ({k: type(v).__name__ for k, v in row.items()}) }"
            )
        if not chosen.strip() or not rejected.strip():
            skipped["empty"] += 1
        elif chosen.strip() == rejected.strip():
            skipped["identical"] += 1
        else:
            pairs.append(Pair(prompt, chosen, rejected, group))
    if not pairs:
        raise InputError(
            f"{path}: all {len(rows)} pairs were skipped ({skipped['empty']} with an empty side, "
            f"{skipped['identical']} with identical sides): nothing to {'train on' if flag == '--dataset' else 'evaluate'}"
        )
    return pairs, skipped


def split_pairs(pairs: list[Pair], *, seed: int, num_eval: int, where: str) -> tuple[list[Pair], list[Pair], str]:
    """(train, held out, a line saying so): whole prompts, in a seeded order, are held out until they hold 1 in 10 of
    the pairs (at most num_eval): a prompt's pairs (several completions of it) are all on one side, so held-out
    accuracy is measured on prompts never trained on."""
    keys = [
        json.dumps(p.prompt if isinstance(p.prompt, list) else [{"role": "user", "content": p.prompt}]) for p in pairs
    ]
    count, want, held, taken = Counter(keys), min(num_eval, len(pairs) // 10), set(), 0
    for key in random.Random(seed).sample(sorted(count), len(count)):
        if taken >= want:
            break
        held.add(key)
        taken += count[key]
    train, out = [p for p, k in zip(pairs, keys) if k not in held], [p for p, k in zip(pairs, keys) if k in held]
    if not want or not train:
        raise InputError(
            f"{where} has {len(pairs)} pairs of {len(count)} prompts, too few to hold 1 in 10 out for "
            f"evaluation by prompt: pass --eval-dataset FILE"
        )
    return (
        train,
        out,
        (
            f"held out {len(out)} pairs ({len(held)} prompts) of {where} for evaluation (seed {seed}; "
            f"--eval-dataset FILE to choose them)"
        ),
    )


@dataclass
class Prompts:
    """A task's prompts, tokenized: ids[i] is examples[i].prompt through the chat template."""

    ids: list[list[int]]
    examples: list[Example]
    dropped: int  # prompts longer than max_prompt_len, left out

    @property
    def sources(self) -> list[str]:
        """The examples' sources in order of first appearance: the same list on every rank (reward.eval_stats)."""
        return list(dict.fromkeys(e.source for e in self.examples))


def task_prompts(
    tokenizer,
    dataset: str | list[str],
    eval_dataset: str | None,
    *,
    seed: int,
    num_eval: int,
    max_prompt_len: int,
    template: str | None = None,
    system_prompt: str | None = None,
    prompt_field: str | None = None,
    answer_field: str | None = None,
    kind: str | None = None,
    context: list[dict] | None = None,
    tools: list[dict] | None = None,
    context_len: int | None = None,
    max_new_tokens: int = 0,
) -> tuple[Prompts, Prompts, str]:
    """(train prompts, held-out prompts, a line saying what was loaded): load_task, then tokenize_prompts. Given the
    model's `context_len`, first checks that a prompt, the tools' `context` and `max_new_tokens` fit in it
    (check_context: before any data loads)."""
    if context_len is not None:
        check_context(
            context_len, max_prompt_len, max_new_tokens, tools_prompt=context_tokens(tokenizer, context, tools)
        )
    train, held, note = load_task(
        dataset,
        eval_dataset,
        seed=seed,
        num_eval=num_eval,
        template=template,
        kind=kind,
        system_prompt=system_prompt,
        prompt_field=prompt_field,
        answer_field=answer_field,
    )
    chat, name = {"context": context, "tools": tools}, dataset if isinstance(dataset, str) else ", ".join(dataset)
    train = Prompts(*tokenize_prompts(tokenizer, train, max_prompt_len, name, **chat))
    held = Prompts(*tokenize_prompts(tokenizer, held, max_prompt_len, eval_dataset or name, **chat))
    extra = context_tokens(tokenizer, context, tools)
    kinds = {e.source: e.kind for e in train.examples + held.examples}  # what acc and format judge (reward.correct)
    judged = ", ".join(f"{source} {kind} ({KIND_RULE[kind]})" for source, kind in kinds.items())
    return (
        train,
        held,
        (
            f"{len(train.ids)} train prompts, {len(held.ids)} eval prompts (dropped as longer than "
            f"{max_prompt_len} tokens: {train.dropped} train, {held.dropped} eval"
            + (f"; before each, the tools' prompt: {extra} tokens" if extra else "")
            + f"); {note}; "
            f"answers judged as {judged}"
        ),
    )


def plain_ids(tokenizer, text: str) -> list[int]:
    """`text` as tokens with no special token in them: '<|im_end|>' in it stays the characters."""
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


def prompt_tokens(
    tokenizer, question: str | list[dict], context: list[dict] | None = None, tools: list[dict] | None = None
) -> list[int]:
    """The question as one user turn (or its chat messages) after the `context` messages, through the chat
    template with the generation prompt; a base model without a template: the contents joined by blank lines."""
    return prompts_tokens(tokenizer, [question], context, tools)[0]


def prompts_tokens(tokenizer, questions: list, context: list[dict] | None = None, tools: list[dict] | None = None):
    """prompt_tokens of each question: every conversation rendered, then the texts tokenized as one batch (what
    apply_chat_template(tokenize=True) does one at a time; 7600 addition prompts in half the time)."""
    chats = [(context or []) + (q if isinstance(q, list) else [{"role": "user", "content": q}]) for q in questions]
    if not chats:
        return []
    if tokenizer.chat_template is None:
        return [list(ids) for ids in tokenizer(["\n\n".join(m["content"] for m in c) for c in chats])["input_ids"]]
    texts = tokenizer.apply_chat_template(chats, tools=tools, add_generation_prompt=True, tokenize=False)
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def context_tokens(tokenizer, context: list[dict] | None, tools: list[dict] | None = None) -> int:
    """Tokens the `context` messages (the tools' system prompt and worked calls) add before every
    question. --max-prompt-len counts the question; these come on top."""
    if not context:
        return 0
    return len(prompt_tokens(tokenizer, "?", context, tools)) - len(prompt_tokens(tokenizer, "?"))


def tokenize_prompts(
    tokenizer,
    examples: list[Example],
    max_prompt_len: int,
    source: str = "the dataset",
    *,
    context: list[dict] | None = None,
    tools: list[dict] | None = None,
):
    """Chat-template each prompt as one user turn, after the `context` messages if given (a system
    prompt, worked examples; `tools`: their JSON schemas, for templates that show tools). Prompts
    longer than `max_prompt_len` tokens, the context's not counted, are dropped (never truncated: a
    cut question has a different answer) and counted; if every prompt is dropped, an error names
    `source`. Returns (token ids, kept examples, number dropped)."""
    ids, kept, lengths, extra = [], [], [], context_tokens(tokenizer, context, tools)
    for ex, tokens in zip(examples, prompts_tokens(tokenizer, [ex.prompt for ex in examples], context, tools)):
        lengths.append(len(tokens) - extra)  # the question's own tokens
        if lengths[-1] <= max_prompt_len:
            ids.append(tokens)
            kept.append(ex)
    if examples and not kept:
        raise InputError(
            f"all {len(examples)} prompts of {source} are longer than --max-prompt-len {max_prompt_len} "
            f"tokens (the shortest: {min(lengths)}): raise it"
        )
    return ids, kept, len(examples) - len(kept)


def seed_for(*parts) -> int:
    """The seed of one use of randomness, from the run's seed and where it is used:
    seed_for(seed, "update", step, epoch). Different parts give unrelated seeds (a formula such as
    seed * 1000 + step * 10 + epoch gives step 1, epoch 10 the seed of step 2, epoch 0). A
    non-negative 31-bit int: what torch generators and SGLang's sampling_seed take."""
    return random.Random("-".join(map(str, parts))).getrandbits(31)


def sample_seeds(*parts, prompts: int, group_size: int) -> list[int]:
    """The sampling seed of each sample of a step's whole draw (all ranks, before `shard`): the j-th sample of the
    p-th prompt drawn gets seed_for(*parts, p, j), made `distinct`. It travels with its request, so it is the same
    whichever rank or engine generates it and wherever the request sits in a batch: with --deterministic-rollout the
    same seed samples the same completions on any number of ranks (a prompt drawn twice in one step gets two
    positions, two seeds)."""
    return distinct([seed_for(*parts, p, j) for p in range(prompts) for j in range(group_size)])


def distinct(seeds: list[int]) -> list[int]:
    """The seeds as given, but one an earlier seed of the list took: that one moves to the next free value up (mod
    2^31). 31-bit hashes collide: 16,384 seeds a step share one about every 16 steps, and two samples of one prompt
    with one seed are one sample twice. The whole list on every rank, so the same on any number of ranks."""
    taken, out = set(), []
    for seed in seeds:
        while seed in taken:
            seed = (seed + 1) % 2**31
        taken.add(seed)
        out.append(seed)
    return out


class PromptSampler:
    """Walks a seeded shuffle of the prompt pool, epoch after epoch.

    Every rank holds an identical sampler and makes the same global draw, then keeps its own
    slice (`shard`), so (epoch, index) is one position for the whole job: the resume state.
    """

    def __init__(self, num_prompts: int, seed: int):
        if num_prompts == 0:
            raise ValueError(
                "the prompt pool is empty: every prompt was dropped or the dataset has no rows; "
                "raise --max-prompt-len or check --dataset"
            )
        self.num_prompts, self.seed, self.epoch, self.index = num_prompts, seed, 0, 0
        self._order_epoch, self._order = -1, []

    def order(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            g = torch.Generator().manual_seed(seed_for(self.seed, "epoch", epoch))
            self._order, self._order_epoch = torch.randperm(self.num_prompts, generator=g).tolist(), epoch
        return self._order

    def draw(self, count: int) -> list[int]:
        out = []
        while len(out) < count:
            if self.index == self.num_prompts:
                self.epoch, self.index = self.epoch + 1, 0
            take = min(count - len(out), self.num_prompts - self.index)
            out += self.order(self.epoch)[self.index : self.index + take]
            self.index += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "num_prompts": self.num_prompts, "seed": self.seed}

    def load_state_dict(self, state: dict):
        if state["num_prompts"] != self.num_prompts:
            raise InputError(
                f"--resume: the checkpoint was taken with {state['num_prompts']} training rows (prompts or "
                f"pairs), this run has {self.num_prompts}: the data changed since; resume with the data it started with"
            )
        self.epoch, self.index = state["epoch"], state["index"]


def shard(items: list, rank: int, world_size: int) -> list:
    """This rank's contiguous slice of a global list whose length divides by world_size."""
    n = len(items) // world_size
    return items[rank * n : (rank + 1) * n]


# ----------------------------------------------------------------------------------------------
# The record from rollout to loss, and its padded batch


@dataclass
class Sample:
    """One completion of one prompt: what the rollout hands to the loss."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]  # the sampler's log-prob of each response token
    truncated: bool  # stopped by the length limit, not by a stop token
    answer: str = ""  # reference answer of the prompt
    kind: str = "gsm8k"  # how the answer is judged (reward.correct): the prompt's Example.kind
    source: str = ""  # the prompt's dataset (Example.source): per-source eval accuracy
    text: str = ""  # decoded response
    reward: float = 0.0
    reward_error: str = ""  # what the reward function raised ("" if it did not; scored 0.0)
    group_id: int = -1  # the samples of one prompt share it (GRPO's groups)
    model_mask: list[int] | None = None  # per response token: 1 sampled by the model, 0 a tool's reply (None: all 1)
    turns: int = 1  # model turns (multi-turn with tools)
    tool_calls: list = field(default_factory=list)  # (tool name, "ok" | "error" | "timeout", seconds) per call
    prompt: str | list[dict] = ""  # the question as asked (Example.prompt): a reward model reads it (reward_model.py)
    messages: list[dict] | None = None  # multi-turn: the model's turns and the tools' replies as chat messages
    versions: list[int] | None = None  # --max-staleness >= 2: per response token, the weight version that sampled it


def label(samples: list[Sample], examples: list[Example]) -> list[Sample]:
    """Each sample gets its prompt's reference answer, answer kind, source and question as asked (what the reward, the
    metrics and a reward model read). Returns the samples."""
    for s, ex in zip(samples, examples):
        s.answer, s.kind, s.source, s.prompt = ex.answer, ex.kind, ex.source, ex.prompt
    return samples


@dataclass
class Batch:
    """Padded tensors for a list of samples (right padding).

    Token t of `input_ids` is predicted at position t-1, so every per-token tensor is [B, T-1] and
    lines up with `input_ids[:, 1:]`. The script fills in what its loss needs: the fields below, or
    its own (`batch.values = ...` in ppo.py). `select` and `to` carry every tensor field along, cut
    by its shape: [B, T], [B, T-1] or [B].
    """

    input_ids: torch.Tensor  # [B, T]   prompt + response token ids, then pad
    attention_mask: torch.Tensor  # [B, T]   1 on real tokens
    response_mask: torch.Tensor  # [B, T-1] 1.0 where the target token is a response token the model sampled
    rollout_logprobs: torch.Tensor  # [B, T-1] the sampler's log-prob of each response token, 0 elsewhere
    loss_mask: torch.Tensor | None = None  # [B, T-1] response tokens that count in the loss
    old_logprobs: torch.Tensor | None = None  # [B, T-1] log-probs under the policy that sampled
    ref_logprobs: torch.Tensor | None = None  # [B, T-1] log-probs under the reference model
    advantages: torch.Tensor | None = None  # [B, T-1]
    is_weight: torch.Tensor | None = None  # [B, T-1] a rollout correction's weight per token (None: 1)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor) -> "Batch":
        """Rows `rows`, with the columns cut to their longest sequence (less padding per micro-batch).
        No rows: a stand-in, row 0 with its masks zero, for a rank that runs fewer packed micro-batches
        than another: it adds nothing to a loss, but its forward and backward join FSDP's collectives."""
        if len(rows) == 0:
            out = self.select(torch.zeros(1, dtype=torch.long))
            out.response_mask = torch.zeros_like(out.response_mask)
            out.loss_mask = None if out.loss_mask is None else torch.zeros_like(out.loss_mask)
            return out
        T, t = self.input_ids.shape[1], int(self.attention_mask[rows].sum(-1).max())

        def cut(x):
            x = x[rows]
            return x if x.dim() == 1 else x[:, :t] if x.shape[1] == T else x[:, : t - 1]

        return self.apply(cut)

    def to(self, device) -> "Batch":
        """A copy on `device`; to a GPU the copies are queued, the CPU not waiting for the GPU (common.to_device)."""
        return self.apply(lambda x: to_device(x, device))

    def apply(self, fn) -> "Batch":
        """A copy with fn applied to every tensor field, the script's own included."""
        out = copy.copy(self)
        for name, x in vars(self).items():
            if isinstance(x, torch.Tensor):
                setattr(out, name, fn(x))
        return out


def collate(samples: list[Sample], pad_id: int) -> Batch:
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    T = max(lengths)
    input_ids = torch.full((len(samples), T), pad_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros(len(samples), T, dtype=torch.long)  # [B, T]
    response_mask = torch.zeros(len(samples), T - 1)  # [B, T-1]
    rollout_logprobs = torch.zeros(len(samples), T - 1)  # [B, T-1]
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, : p + r] = torch.tensor(s.prompt_ids + s.response_ids)
        attention_mask[i, : p + r] = 1
        # targets input_ids[p : p+r] sit at positions p-1 ...; a tool's reply tokens are no target
        response_mask[i, p - 1 : p - 1 + r] = (
            1.0 if s.model_mask is None else torch.tensor(s.model_mask, dtype=torch.float)
        )
        rollout_logprobs[i, p - 1 : p - 1 + r] = torch.tensor(s.rollout_logprobs)
    return Batch(input_ids, attention_mask, response_mask, rollout_logprobs)
