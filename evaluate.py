"""Greedy accuracy of a model folder (e.g. a checkpoint's model/) on held-out prompts.

    python evaluate.py --model runs/<run>/checkpoints/step_000200/model --out eval.json
    python evaluate.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k --num-prompts 1319

Reports strict accuracy (the answer in the asked format is right: '#### N', \boxed{}), flexible accuracy
(right in any form), format rate, as grpo.py judges them, and writes every completion next to the summary.
Ask the prompts as the run did: its --prompt-template, --system-prompt, fields and --answer-kind.
"""

import json
import os
from dataclasses import dataclass
from typing import Literal

from preflight import exit_on_interrupt  # first (stdlib only): a Ctrl-C while torch loads (~1.5 s) is one line

exit_on_interrupt("evaluate.py")
import torch
import tyro

from data import BUILTIN_TASKS, load_examples, tokenize_prompts
from preflight import ENGINE_HINT, InputError, check_context, check_engine, check_flags, check_model, friendly_errors
from reward import judge
from rollout import HFEngine, SGLangOptions, Sampling, generate, start_sglang, stop_token_ids
from stop import stop_engine


@dataclass
class Args:
    model: str
    """model to evaluate: hub id or local folder"""
    dataset: str = "addition"
    """'addition', 'multiplication', a hub id ('openai/gsm8k'), or a file (all its rows) or folder, as grpo.py's"""
    split: str = "test"
    """split of --dataset: 'test' or 'train' (a single file has no splits)"""
    num_prompts: int = 256
    """first N prompts of the split"""
    max_prompt_len: int = 256
    """longer prompts are dropped"""
    max_new_tokens: int = 256
    """response length limit"""
    prompt_field: str | None = None
    """the prompt's column, as the training run's (grpo.py --help says more of these five)"""
    answer_field: str | None = None
    """the answer's column"""
    answer_kind: Literal["gsm8k", "math", "text"] | None = None
    """how an answer is judged"""
    prompt_template: str | None = None
    """how a prompt is asked ({prompt})"""
    system_prompt: str | None = None
    """a system message before each prompt"""
    seed: int = 0
    """the addition task's split seed (use the training run's --seed)"""
    engine: Literal["auto", "sglang", "hf"] = "auto"
    """'sglang' on a GPU, 'hf' on CPU; 'auto' picks"""
    mem_fraction: float = 0.6
    """SGLang memory fraction"""
    out: str | None = None
    """write the summary here and the completions to <out>.samples.jsonl"""


def main(args: Args):
    check_flags([  # (flag, value, holds, what it must be)
        ("--num-prompts", args.num_prompts, args.num_prompts >= 1, ">= 1"),
        ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, ">= 1"),
        ("--max-prompt-len", args.max_prompt_len, args.max_prompt_len >= 1, ">= 1"),
        ("--mem-fraction", args.mem_fraction, 0 < args.mem_fraction < 1, "in (0, 1)"),
        ("--split", args.split, args.split in ("test", "train"), "'test' or 'train'"),
    ])
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        raise InputError(f"--out {args.out!r}: its folder does not exist; create it first")
    kind = check_engine(args.engine, "--engine")
    tokenizer, context = check_model(args.model)  # before SGLang starts
    check_context(context, args.max_prompt_len, args.max_new_tokens)
    stop_ids = stop_token_ids(tokenizer, args.model)
    ask = {"template": args.prompt_template, "system_prompt": args.system_prompt}
    if args.dataset in BUILTIN_TASKS:
        examples = BUILTIN_TASKS[args.dataset](args.seed, **{k: v for k, v in ask.items() if v})[args.split == "test"]
    else:
        examples = load_examples(args.dataset, args.split, **ask, prompt_field=args.prompt_field,
                                 answer_field=args.answer_field, kind=args.answer_kind)
    prompts, kept, dropped = tokenize_prompts(tokenizer, examples[:args.num_prompts], args.max_prompt_len, args.dataset)
    print(f"evaluating {len(prompts)} prompts of {args.dataset} ({dropped} dropped as longer than "
          f"{args.max_prompt_len} tokens) with {args.model}, engine {kind}", flush=True)
    if kind == "sglang":
        engine = start_sglang(args.model, gpu_id=0, seed=args.seed, options=SGLangOptions(
            mem_fraction=args.mem_fraction, load_format="auto", disable_cuda_graph=True))
    else:
        engine = HFEngine(args.model)
    greedy = Sampling(max_new_tokens=args.max_new_tokens, stop_ids=stop_ids, temperature=0.0)
    samples = generate(engine, prompts, [args.seed] * len(prompts), sampling=greedy, tokenizer=tokenizer)
    for s, e in zip(samples, kept):
        s.answer, s.kind = e.answer, e.kind
    n, counts = len(samples), judge(samples)
    summary = {
        "model": args.model, "dataset": args.dataset, "split": args.split, "prompts": n, "dropped": dropped,
        "strict_acc": counts["strict"] / n, "flexible_acc": counts["flexible"] / n, "format_rate": counts["format"] / n,
        "truncated_frac": sum(s.truncated for s in samples) / n,
        "response_len_mean": sum(len(s.response_ids) for s in samples) / n,
        "engine": kind, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
        with open(args.out.removesuffix(".json") + ".samples.jsonl", "w") as f:
            for e, s in zip(kept, samples):
                f.write(json.dumps({"prompt": e.prompt, "answer": e.answer, "completion": s.text}) + "\n")
    stop_engine(engine, None)


if __name__ == "__main__":  # SGLang spawns its scheduler: keep this guard
    with friendly_errors("evaluate.py", oom_hint="lower --mem-fraction or --num-prompts",
                         engine_hint=ENGINE_HINT.replace("--sglang-mem-fraction", "--mem-fraction")):
        main(tyro.cli(Args))
