"""Before RL with tools: does the model call them at all? Step-0 tool-call rate and accuracy.

    python bench/tool_probe.py --model $SMOLLM2 --dataset multiplication --tools calculator --out probe.json
    python bench/tool_probe.py --model ./smollm2 --rollout-engine hf --num-eval-prompts 8 --group-size 4     # on a CPU

Samples `--group-size` completions of `--num-eval-prompts` held-out prompts at the sampling temperature,
through the same prompt (system prompt or the template's tools), episode loop and tools as
`grpo.py --tools`, and reports the share of samples with a tool call, with a well-formed call, with
a right strict answer (with tools and, for comparison, without), and a few transcripts. If no
sample calls a tool, RL has nothing to reinforce: change the system prompt first.
"""

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from data import ADDITION_PROMPT, task_prompts  # noqa: E402
from preflight import check_model  # noqa: E402
from reward import int_match_reward, judge  # noqa: E402
from rollout import HFEngine, Sampling, SGLangOptions, generate, start_sglang, stop_engine, stop_token_ids  # noqa: E402
from tools import TOOLS, ToolUse, tool_call_stop_ids, tools_prompt  # noqa: E402


@dataclass
class Args:
    model: str
    """model folder"""
    dataset: str = "multiplication"
    """a built-in task ('multiplication', 'addition')"""
    tools: str = "calculator"
    """comma-separated tools"""
    num_eval_prompts: int = 64
    """held-out prompts"""
    group_size: int = 4
    """samples per prompt"""
    temperature: float = 1.0
    """sampling temperature (as in training)"""
    max_new_tokens: int = 256
    """response budget, tool replies included"""
    max_turns: int = 4
    """model turns per sample at most"""
    rollout_engine: str = "sglang"
    """'sglang', or 'hf' on a CPU"""
    out: str | None = None
    """write the summary here"""


def main(args: Args):
    tokenizer, _ = check_model(args.model)
    tools = {name: TOOLS[name] for name in args.tools.split(",")}
    context, specs = tools_prompt(tokenizer, tools, ADDITION_PROMPT)
    stop_ids = stop_token_ids(tokenizer, args.model)
    engine = (
        start_sglang(args.model, gpu_id=0, options=SGLangOptions(load_format="auto", disable_cuda_graph=True))
        if args.rollout_engine == "sglang"
        else HFEngine(args.model)
    )
    result = {
        "model": args.model,
        "dataset": args.dataset,
        "tools": args.tools,
        "engine": args.rollout_engine,
        "context": context,
        "samples": args.num_eval_prompts * args.group_size,
    }
    for with_tools in (True, False):
        chat = {"context": context, "tools": specs} if with_tools else {}
        _, held, _ = task_prompts(
            tokenizer,
            args.dataset,
            None,
            seed=0,
            num_eval=args.num_eval_prompts,
            max_prompt_len=4096,
            template=ADDITION_PROMPT,
            **chat,
        )
        ids = [p for p in held.ids for _ in range(args.group_size)]
        sampling = Sampling(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            stop_ids=stop_ids + (tool_call_stop_ids(tokenizer) if with_tools else []),
        )
        tool_use = ToolUse(tools, tokenizer, ThreadPoolExecutor(16), max_turns=args.max_turns) if with_tools else None
        samples = generate(
            engine, ids, list(range(len(ids))), sampling=sampling, tokenizer=tokenizer, tool_use=tool_use
        )
        for s, e in zip(samples, [e for e in held.examples for _ in range(args.group_size)]):
            s.answer = e.answer
        n, counts = len(samples), judge(samples, int_match_reward)
        key = "with_tools" if with_tools else "without_tools"
        result[key] = {
            "strict_acc": counts["strict"] / n,
            "format_rate": counts["format"] / n,
            "truncated_frac": sum(s.truncated for s in samples) / n,
        }
        if with_tools:
            result[key].update(
                {
                    "called_frac": sum(bool(s.tool_calls) for s in samples) / n,
                    "well_formed_call_frac": sum(any(st != "error" for _, st, _ in s.tool_calls) for s in samples) / n,
                    "turns_mean": sum(s.turns for s in samples) / n,
                    "transcripts": [tokenizer.decode(s.response_ids) for s in samples[:6]],
                }
            )
        print(json.dumps({k: v for k, v in result[key].items() if k != "transcripts"}), key, flush=True)
    stop_engine(engine, None)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main(tyro.cli(Args))
