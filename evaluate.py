"""Greedy accuracy of a model folder (e.g. a checkpoint's model/) on held-out prompts.

    python evaluate.py --model runs/<run>/checkpoints/step_000200/model --out eval.json
    python evaluate.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k --num-eval-prompts 1319

Reports strict accuracy (the answer in the asked format is right: '#### N', \boxed{}), flexible accuracy
(right in any form), format rate, as grpo.py judges them, and writes every completion next to the summary.
A run's checkpoint is evaluated on the prompts that run held out (its args.json: data, --seed, --eval-dataset),
asked as it asked them (--prompt-template, --system-prompt, fields, --answer-kind) and with its tools (--tools and
their flags); a first line says which rows, another which tools. Another model: ask the prompts as its training run
did. A Ctrl-C or SIGTERM ends it in a line, exit 130 or 143, writing nothing (a part would read as the whole).
"""

import json
import os
import signal
import sys
from dataclasses import dataclass, replace
from typing import Literal

# first (stdlib only): a Ctrl-C while torch loads (~1.5 s) is one line
from common import InputError, exit_on_interrupt, handle_signals, requested

exit_on_interrupt("evaluate.py")
import torch

from data import (
    BUILTIN_TASKS,
    check_context,
    context_tokens,
    load_examples,
    load_task,
    seed_for,
    source_name,
    template_rule,
    tokenize_prompts,
)
from preflight import check_engine, check_flags, check_model, friendly_errors, parse_args, sampling_rules
from reward import eval_stats, sampled_eval_stats
from rollout import Sampling, SGLangOptions, generate, generate_groups, start_engine, stop_engine, stop_token_ids
from runlog import code_commit
from tools import select_tools, tool_call_stop_ids, tool_rules, tool_stats, tools_for


# a run's, if not given (an older run's args.json without one: TOOL_DEFAULTS, grpo.py's defaults)
RUN_FLAGS = ("prompt_template", "system_prompt", "prompt_field", "answer_field", "answer_kind", "tools", "max_turns")
RUN_FLAGS += ("max_tool_reply_tokens", "python_sandbox", "tool_timeout_s")
TOOL_DEFAULTS = {
    "tools": "",
    "max_turns": 4,
    "max_tool_reply_tokens": 256,
    "python_sandbox": "bwrap",
    "tool_timeout_s": 10.0,
}


@dataclass
class Args:
    # --- model and data
    model: str
    """model to evaluate: hub id or local folder"""
    dataset: str | None = None
    """'addition', 'multiplication', a hub id ('openai/gsm8k'), or a file (all its rows) or folder, as grpo.py's;
    default: the data of the run whose checkpoint --model is (runs/<run>/checkpoints/step_N/model), else addition"""
    split: str = "test"
    """split of --dataset: 'test' (a run's own data: what it held out) or 'train' (a single file has no splits)"""
    num_eval_prompts: int = 256
    """first N prompts of the split"""
    max_prompt_len: int = 256
    """longer prompts are dropped"""
    max_new_tokens: int = 256
    """response length limit"""
    seed: int | None = None
    """the built-in tasks' split seed and the samples'; default: the run's --seed (a run's checkpoint), else 0"""
    eval_samples: int = 0
    """beside the greedy answer, this many samples a prompt at --eval-temperature: avg@K, pass@1,2,4..K (Chen et
    al.'s unbiased estimator), maj@K (majority vote) of strict answers (0: greedy only)"""
    eval_temperature: float = 1.0
    """temperature of those samples"""
    eval_top_p: float = 1.0
    """top-p of those samples"""
    # --- how prompts are asked and judged (unset: as the run whose checkpoint --model is)
    prompt_field: str | None = None
    """the prompt's column, as the training run's (grpo.py -H says more of these five)"""
    answer_field: str | None = None
    """the answer's column"""
    answer_kind: Literal["gsm8k", "math", "text"] | None = None
    """how an answer is judged"""
    prompt_template: str | None = None
    """how a prompt is asked ({prompt})"""
    system_prompt: str | None = None
    """a system message before each prompt"""
    # --- tools (unset: as the run whose checkpoint --model is, else none)
    tools: str | None = None
    """comma-separated tools a sample may call mid-answer (calculator, python: grpo.py's --tools); default: the run's;
    '' evaluates a run that trained with tools without them"""
    max_turns: int | None = None
    """with --tools: model turns per sample at most (default: the run's, else 4)"""
    max_tool_reply_tokens: int | None = None
    """with --tools: a tool's reply is cut to this many tokens (default: the run's, else 256)"""
    python_sandbox: str | None = None
    """with --tools python: 'bwrap', a SandboxFusion server's URL, or 'process' (default: the run's, else bwrap)"""
    tool_timeout_s: float | None = None
    """with --tools python: wall-clock limit of one program (default: the run's, else 10)"""
    tool_workers: int = 16
    """with --tools: tool calls that run at once"""
    # --- engine and output
    rollout_engine: Literal["auto", "sglang", "hf"] = "auto"
    """'sglang' on a GPU, 'hf' on CPU; 'auto' picks"""
    sglang_mem_fraction: float = 0.6
    """SGLang memory fraction"""
    deterministic_rollout: bool = False
    """the same --seed samples the same completions (SGLang's deterministic inference; slower; grpo.py -H says more)"""
    out: str | None = None
    """write the summary here and the completions to <out>.samples.jsonl"""


def main(args: Args):
    check_flags(
        [  # (flag, value, holds, what it must be)
            ("--num-eval-prompts", args.num_eval_prompts, args.num_eval_prompts >= 1, ">= 1"),
            ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, ">= 1"),
            ("--max-prompt-len", args.max_prompt_len, args.max_prompt_len >= 1, ">= 1"),
            ("--sglang-mem-fraction", args.sglang_mem_fraction, 0 < args.sglang_mem_fraction < 1, "in (0, 1)"),
            ("--split", args.split, args.split in ("test", "train"), "'test' or 'train'"),
            *sampling_rules(
                num_eval_prompts=args.num_eval_prompts,
                eval_samples=args.eval_samples,
                eval_temperature=args.eval_temperature,
                engines=1,
                deterministic=args.deterministic_rollout,
                attention_backend=SGLangOptions.attention_backend,
            ),  # K, T, the eval batch
            ("--eval-top-p", args.eval_top_p, 0 < args.eval_top_p <= 1, "in (0, 1]"),
            template_rule(args.prompt_template),  # {prompt}, and no other placeholder (data.py)
        ]
    )
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        raise InputError(f"--out {args.out!r}: its folder does not exist; create it first")
    kind = check_engine(args.rollout_engine)
    tokenizer, context_len = check_model(args.model, generates=True)  # before SGLang starts
    run_dir, run = run_of(args.model)
    if run is not None:  # a flag not given is the run's: prompts asked as it asked them, with its tools
        args = replace(args, **{k: run.get(k) for k in RUN_FLAGS if getattr(args, k) is None})
    args = replace(args, **{k: v for k, v in TOOL_DEFAULTS.items() if getattr(args, k) is None})
    check_flags(
        tool_rules(
            tools=args.tools,
            system_prompt=args.system_prompt,
            max_turns=args.max_turns,
            max_reply_tokens=args.max_tool_reply_tokens,
            workers=args.tool_workers,
            timeout_s=args.tool_timeout_s,
        )
    )
    tools = select_tools(
        args.tools, python_sandbox=args.python_sandbox, seconds=args.tool_timeout_s, workers=args.tool_workers
    )
    context, tool_specs, tool_use = tools_for(  # the tools' system prompt and worked calls, as the run asked
        tokenizer,
        tools,
        template=args.prompt_template,
        datasets=run["dataset"] if run else [args.dataset or "addition"],
        workers=args.tool_workers,
        max_turns=args.max_turns,
        max_reply_tokens=args.max_tool_reply_tokens,
    )
    tools_prompt = context_tokens(tokenizer, context, tool_specs) if tools else 0  # before every question
    check_context(context_len, args.max_prompt_len, args.max_new_tokens, tools_prompt=tools_prompt)
    stop_ids = stop_token_ids(tokenizer, args.model) + (tool_call_stop_ids(tokenizer) if tools else [])
    examples, rows, trained = rows_to_score(args, run_dir, run)
    prompts, kept, dropped = tokenize_prompts(
        tokenizer, examples[: args.num_eval_prompts], args.max_prompt_len, rows, context=context, tools=tool_specs
    )
    if tools or (run and run.get("tools")):
        whose = "the run's --tools" if run and args.tools == run.get("tools") else "--tools"
        print(
            f"tools: {', '.join(tools)} ({whose}), up to {args.max_turns} turns a sample"
            if tools
            else f"tools: none (--tools ''; {run_dir} trained with --tools {run['tools']})",
            flush=True,
        )
    if trained:
        print(f"note: {run_dir} trained on these rows ({trained}): this is not held-out accuracy", flush=True)
    print(
        f"evaluating {len(prompts)} prompts, {rows} ({dropped} dropped as longer than "
        f"{args.max_prompt_len} tokens) with {args.model}, engine {kind}",
        flush=True,
    )
    sglang = SGLangOptions(
        mem_fraction=args.sglang_mem_fraction,
        load_format="auto",
        disable_cuda_graph=True,
        deterministic=args.deterministic_rollout,
    )
    seed = args.seed if args.seed is not None else run["seed"] if run else 0  # the split's, and the samples'
    handle_signals()  # Ctrl-C and SIGTERM end a generation at once (it returns no samples): stop_if_signalled
    engine = start_engine(kind, args.model, seed=seed, sglang=sglang)
    greedy = Sampling(max_new_tokens=args.max_new_tokens, stop_ids=stop_ids, temperature=0.0)
    samples = generate(engine, prompts, [seed] * len(prompts), sampling=greedy, tokenizer=tokenizer, tool_use=tool_use)
    stop_if_signalled(engine, args.out)
    sampled = Sampling(
        max_new_tokens=args.max_new_tokens, stop_ids=stop_ids, temperature=args.eval_temperature, top_p=args.eval_top_p
    )
    K = args.eval_samples
    groups = (
        generate_groups(
            engine,
            prompts,
            K,
            seeds=[seed_for(seed, "eval", i) for i in range(len(prompts))],
            sampling=sampled,
            tokenizer=tokenizer,
            tool_use=tool_use,
        )
        if K
        else []
    )
    stop_if_signalled(engine, args.out)
    for s, e in zip(samples + sum(groups, []), kept + [e for e in kept for _ in range(K)]):
        s.answer, s.kind, s.source = e.answer, e.kind, e.source
    n, sources = len(samples), list(dict.fromkeys(e.source for e in kept))  # several datasets: each one's numbers too
    greedy_stats = {k.removeprefix("eval/"): v for k, v in eval_stats(samples, sources=sources).items()}
    summary = {
        "model": args.model,
        "rows": rows,
        "trained_on": bool(trained),
        "prompts": n,
        "dropped": dropped,
        **{k: v for k, v in greedy_stats.items() if k != "tool_used_frac"},  # strict_acc, ..., <source>/strict_acc
        "truncated_frac": sum(s.truncated for s in samples) / n,
        "response_len_mean": sum(len(s.response_ids) for s in samples) / n,
        "engine": kind,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    if tools:  # the greedy answers' turns and calls
        summary |= {"tools": args.tools, "max_turns": args.max_turns}
        summary |= {k.removeprefix("tools/"): float(v) for k, v in tool_stats(samples).items()}
    if K:  # what a paper reports beside the greedy numbers, with every setting that made them
        summary |= {k.removeprefix("eval/"): v for k, v in sampled_eval_stats(groups, sources).items()}
        summary |= {"eval_samples": K, "eval_temperature": args.eval_temperature, "eval_top_p": args.eval_top_p}
    summary |= {
        "max_new_tokens": args.max_new_tokens,
        "seed": seed,
        "dataset": args.dataset,
        "split": args.split,
        "commit": code_commit(),
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
        with open(args.out.removesuffix(".json") + ".samples.jsonl", "w") as f:
            for e, s, group in zip(kept, samples, groups or [[]] * len(kept)):
                row = {"prompt": e.prompt, "answer": e.answer, "completion": s.text}
                f.write(json.dumps(row | ({"samples": [g.text for g in group]} if K else {})) + "\n")
    stop_engine(engine, None)


def stop_if_signalled(engine, out: str | None):
    """After a generation: where Ctrl-C or SIGTERM cut it short, stop the engine and exit 130 or 143 in one line,
    printing no summary and writing no --out file (a summary of the prompts that finished would read as a whole one;
    a file already there is left as it was)."""
    if signum := requested():
        stop_engine(engine, None)
        unwritten = f", {out} not written" if out else ""
        name = signal.Signals(signum).name
        print(f"evaluate.py: stopped by {name} before the evaluation finished: no summary{unwritten}", file=sys.stderr)
        raise SystemExit(128 + signum)


def run_of(model: str) -> tuple[str | None, dict | None]:
    """The run folder and its args.json where `model` is a checkpoint's model folder of a grpo.py or ppo.py run
    (<run>/checkpoints/step_N/model), else (None, None)."""
    run_dir = os.path.normpath(os.path.join(model, "..", "..", ".."))
    path = os.path.join(run_dir, "args.json")
    if os.path.basename(os.path.normpath(os.path.join(model, "..", ".."))) != "checkpoints" or not os.path.isfile(path):
        return None, None
    with open(path) as f:
        run = json.load(f)
    return (run_dir, run) if "num_eval_prompts" in run else (None, None)  # train_rm.py's: a reward model


def rows_to_score(args: Args, run_dir: str | None, run: dict | None) -> tuple[list, str, str]:
    """(examples, which rows they are, why the run trained on them or ""). A run's own data (no --dataset, or one of
    its --dataset): the rows it held out, as its --seed and --num-eval-prompts chose them (load_task, as the run called
    it); with --split train, or where it trained on all of a file, the rows it trained on. Other data: its split (a
    file: all its rows)."""
    ask = dict(template=args.prompt_template, system_prompt=args.system_prompt)
    fields = dict(prompt_field=args.prompt_field, answer_field=args.answer_field, kind=args.answer_kind)
    if run is None or (args.dataset is not None and not any(same(args.dataset, d) for d in run["dataset"])):
        dataset, seed = args.dataset or "addition", args.seed or 0
        if dataset in BUILTIN_TASKS:
            examples = BUILTIN_TASKS[dataset](seed, **{k: v for k, v in ask.items() if v})[args.split == "test"]
            return examples, f"the {args.split} pairs of {dataset} (seed {seed})", ""
        examples = load_examples(dataset, args.split, **ask, **fields)
        return examples, f"all rows of {dataset}" if os.path.isfile(dataset) else f"{dataset}'s {args.split} split", ""
    if args.seed not in (None, run["seed"]):
        raise InputError(f"--seed {args.seed}: {run_dir} split its data with seed {run['seed']}; leave --seed out")
    datasets, evals = [args.dataset] if args.dataset else run["dataset"], run["eval_dataset"]
    if args.dataset and evals and os.path.isfile(args.dataset):  # trained on whole: its held-out rows came from evals
        rows = load_examples(args.dataset, "train", **ask, **fields)
        return rows, f"all rows of {args.dataset}", f"it held out {evals} instead"
    evals = None if args.dataset else evals  # a built-in task's or a folder's test split: never trained on
    train, held, _ = load_task(datasets, evals, seed=run["seed"], num_eval=run["num_eval_prompts"], **ask, **fields)
    if args.split == "train":
        return train, f"the rows {run_dir} trained on ({', '.join(datasets)}, seed {run['seed']})", "--split train"
    if evals:
        also = [
            f"they are its --dataset {d} too" for d in datasets if same(evals, d)
        ]  # docs/data-and-reward.md's capitals
        return held, f"the rows of {evals}, {run_dir}'s --eval-dataset", (also or [""])[0]
    return held, f"the prompts {run_dir} held out of {', '.join(datasets)} (seed {run['seed']})", ""


def same(a: str, b: str) -> bool:
    """One dataset: the same name or paths of one file or folder; a run's path not found here (it ran in another
    folder): the same short name (my.jsonl)."""
    if not os.path.exists(b):
        return a == b or source_name(a) == source_name(b)
    return os.path.exists(a) and os.path.samefile(a, b)


if __name__ == "__main__":  # SGLang spawns its scheduler: keep this guard
    with friendly_errors("evaluate.py", oom_hint="lower --sglang-mem-fraction or --num-eval-prompts"):
        main(parse_args(Args, shown={k: f"the run's, else {v!r}" for k, v in TOOL_DEFAULTS.items()}))
