"""Tools a policy calls mid-answer: the tools, their prompt, parsing and running calls.

    TOOLS["calculator"]("(12 + 3) * 45")               # a tool is a plain function with a docstring
    spec = tool_spec(calculator)                        # the JSON schema a chat template shows the model
    calls, malformed = parse_tool_calls(text)           # Hermes/Qwen: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    reply, status = call_tool(TOOLS, calls[0])          # never raises: "ok", "error" or "timeout"

Your own tool: a function with type hints and a Google-style docstring (a summary line, then
`Args:` with one line per argument), returning text. Add it to the dict you pass to the rollout:
its name, description and argument schema are read from the function (transformers'
`get_json_schema`, the same that `apply_chat_template(tools=...)` uses). A tool runs in a thread of
the trainer, trusted as the trainer's own code; one that runs what the model wrote must hand it to a
sandbox, as `python` does (sandbox.run_program: a jail, or a SandboxFusion server).
"""

import ast
import asyncio
import concurrent.futures
import json
import math
import operator
import re
import time
from dataclasses import dataclass

from common import InputError, all_reduce, print0
from data import ADDITION_PROMPT, BUILTIN_TASKS, GSM8K_PROMPT, Sample, ask, plain_ids, seed_for
from rollout import Sampling, adapter_named, read_output
from sandbox import memory_bound, run_program, sandbox_problem, sweep_leftovers

# ----------------------------------------------------------------------------------------------
# The tools


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % **, and parentheses.

    Args:
        expression: the expression, for example "(12 + 3) * 45" or "2 ** 10 / 7"
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float):
        return format(value, ".12g")
    return str(value)


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_DIGITS = 1000  # a result (or a power's operands) beyond this is refused: '9 ** 9 ** 9' must not hang the tool


def _evaluate(node):
    """Walk the parsed expression: numbers and the operators above only, nothing is ever eval'd."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) * math.log10(max(abs(left), 2)) > MAX_DIGITS:
            raise ValueError(f"{left} ** {right} has more than {MAX_DIGITS} digits")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        if isinstance(value, complex) or (isinstance(value, int) and value.bit_length() > MAX_DIGITS * 3.33):
            raise ValueError("the result is not a real number of at most 1000 digits")
        return value
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {ast.unparse(node)!r}")


def python(code: str) -> str:
    """Run Python code in a sandbox and return what it prints (stdout, then stderr).

    Args:
        code: a Python program; print() the results you need
    """
    return run_program(code, sandbox=PYTHON_SANDBOX["sandbox"], limits=PYTHON_SANDBOX["limits"])


TOOLS = {"calculator": calculator, "python": python}


def tool_names(tools: str) -> list[str]:
    """--tools' names: 'calculator,python' and 'calculator, python' alike."""
    return [name.strip() for name in tools.split(",") if name.strip()]


def tool_rules(
    *, tools: str, system_prompt: str | None, max_turns: int, max_reply_tokens: int, workers: int, timeout_s: float
) -> list[tuple[str, object, bool, str]]:
    """preflight.check_flags' rules for the tools' flags: --tools names some of TOOLS, --system-prompt,
    --max-turns, --max-tool-reply-tokens, --tool-workers, --tool-timeout-s."""
    unknown = [t for t in tool_names(tools) if t not in TOOLS]
    return [
        (
            "--tools",
            repr(tools),
            not unknown,
            f"a comma-separated list of {', '.join(TOOLS)} ({', '.join(map(repr, unknown))} is not one of them)",
        ),
        (
            "--system-prompt",
            system_prompt,
            not (system_prompt and tools),
            "without --tools (the tools bring their own system "
            "prompt and worked calls; put your instructions in --prompt-template)",
        ),
        ("--max-turns", max_turns, max_turns >= 1, ">= 1"),
        ("--max-tool-reply-tokens", max_reply_tokens, max_reply_tokens >= 1, ">= 1"),
        ("--tool-workers", workers, workers >= 1, ">= 1"),
        ("--tool-timeout-s", timeout_s, timeout_s > 0, "> 0"),
    ]


# Where `python` runs programs (sandbox.py): 'bwrap' (a jail), 'process' (a plain subprocess) or a SandboxFusion
# URL, and the limits over sandbox.LIMITS. select_tools sets them from the script's flags.
PYTHON_SANDBOX = {"sandbox": "bwrap", "limits": {}}


def select_tools(names: str, *, python_sandbox: str = "bwrap", seconds: float = 10.0, workers: int = 1) -> dict:
    """The tools named in `names` ('calculator,python'), by name. With python, its programs run in
    `python_sandbox` for at most `seconds`; a sandbox that can't run stops here (InputError: the cause,
    the fix), before anything loads, 'process' is said as a warning, and the memory `workers` calls at once
    can hold at most, said in one line."""
    tools = {name: TOOLS[name] for name in tool_names(names)}
    if "python" in tools:
        sweep_leftovers()  # the work folders and cgroups of trainers killed mid-call (sandbox.py)
        problem = sandbox_problem(python_sandbox)
        if problem:
            raise InputError(problem)
        if python_sandbox == "process":
            print0(
                "warning: --python-sandbox process: model-written programs run as plain subprocesses of the trainer, "
                "which they can read, signal or exhaust (docs/tools.md: the python tool)"
            )
        PYTHON_SANDBOX.update(sandbox=python_sandbox, limits={"seconds": seconds})
        if not python_sandbox.startswith(("http://", "https://")):  # a service's memory is its own
            print0(memory_bound(workers))
    return tools


# ----------------------------------------------------------------------------------------------
# Calls: parse what the model wrote, run it, never raise


TOOLS_SYSTEM_PROMPT = """You can call tools. To call one, write
<tool_call>{{"name": "<tool name>", "arguments": {{<the arguments as JSON>}}}}</tool_call>
and end your turn: its result comes back in the next message, then go on with your answer.
The tools:
{tools}"""

# Worked examples, shown as earlier turns before the question. Measured on SmolLM2-135M-Instruct
# (multiplication, T=1, bench/tool_probe.py): with the system prompt alone 0 of 32 samples called
# the calculator, with a one-line system prompt 0 of 24, after one worked example 5 of 24, after two
# 13 of 24. RL needs samples that call a tool to have something to reinforce.
EXAMPLES = [("What is 123 * 45?", "123 * 45", "5535"), ("What is 802 * 17?", "802 * 17", "13634")]
EXAMPLE_CALLS = {"calculator": ("expression", "{}"), "python": ("code", "print({})")}


def tools_prompt(tokenizer, tools: dict, template: str = "{question}") -> tuple[list[dict], list[dict] | None]:
    """How the model learns of the tools: (the messages before each question, the tools' schemas
    for the chat template). A template that renders tools itself (Qwen2.5 and 3, Llama 3.1, ...)
    gets the schemas; any other a system prompt describing them. Then EXAMPLES as worked turns,
    asked through the task's `template`, calling the first of `tools` that EXAMPLE_CALLS knows."""
    specs = [tool_spec(fn) for fn in tools.values()]
    messages = []
    if "tools" not in (tokenizer.chat_template or ""):
        described = [{k: v for k, v in s["function"].items() if k != "return"} for s in specs]
        messages.append(
            {"role": "system", "content": TOOLS_SYSTEM_PROMPT.format(tools="\n".join(map(json.dumps, described)))}
        )
    name = next((n for n in tools if n in EXAMPLE_CALLS), None)
    for question, expression, result in EXAMPLES if name else []:
        argument, fmt = EXAMPLE_CALLS[name]
        call = json.dumps({"name": name, "arguments": {argument: fmt.format(expression)}})
        messages += [
            {"role": "user", "content": ask(question, template)},
            {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": f"{expression} = {result}\n#### {result}"},
        ]
    return messages, (specs if "tools" in (tokenizer.chat_template or "") else None)


def tool_call_stop_ids(tokenizer) -> list[int]:
    """'</tool_call>' as a stop token where the vocabulary has it as one token (Qwen's): a turn then
    ends at the complete call. Elsewhere a turn ends at the end-of-turn token."""
    ids = tokenizer.encode("</tool_call>", add_special_tokens=False)
    return ids if len(ids) == 1 else []


TOOLS_LINE = [  # a step's console line with --tools: (name, metric, format, meaning), tool_stats' keys
    ("turns", "tools/turns_mean", ".2f", "model turns a sample"),
    ("calls", "tools/calls_per_sample", ".2f", "tool calls a sample"),
    ("tool errors", "tools/errors", ".0f", "calls that failed (bad arguments, an error, an unknown tool)"),
]


def tool_stats(samples) -> dict:
    """Turns and tool calls of a step's samples, over all ranks."""
    import torch  # lazy: the sandbox's own process never imports this module's metrics

    calls = [c for s in samples for c in s.tool_calls]
    tot = all_reduce(
        torch.tensor(
            [
                len(samples),
                sum(s.turns for s in samples),
                len(calls),
                sum(status == "error" for _, status, _ in calls),
                sum(status == "timeout" for _, status, _ in calls),
                sum(seconds for _, _, seconds in calls),
                sum(bool(s.tool_calls) for s in samples),
            ],
            dtype=torch.float64,
        )
    )
    n = tot[0].clamp(min=1)
    return {
        "tools/turns_mean": tot[1] / n,
        "tools/calls_per_sample": tot[2] / n,
        "tools/errors": tot[3],
        "tools/timeouts": tot[4],
        "tools/seconds": tot[5],
        "tools/used_frac": tot[6] / n,
    }


def tool_spec(fn) -> dict:
    """The JSON schema of a tool, as chat templates take it ({"type": "function", "function": ...})."""
    from transformers.utils import get_json_schema  # lazy: only with tools

    return get_json_schema(fn)


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[list[dict], list[str]]:
    """Hermes/Qwen tool calls in a turn's text: ([{"name": ..., "arguments": {...}}, ...], [what was
    malformed, ...]). An opened call that is never closed counts as malformed."""
    calls, malformed = [], []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            malformed.append(f"the tool call is not valid JSON ({e.msg}): {body.strip()[:200]}")
            continue
        if not (
            isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments", {}), dict)
        ):
            malformed.append(f'a tool call needs {{"name": "...", "arguments": {{...}}}}, got: {body.strip()[:200]}')
            continue
        calls.append({"name": call["name"], "arguments": call.get("arguments", {})})
    if text.count("<tool_call>") > text.count("</tool_call>"):
        malformed.append("a <tool_call> was opened and never closed with </tool_call>")
    return calls, malformed


def call_tool(tools: dict, call: dict) -> tuple[str, str]:
    """Run one parsed call: (the reply for the model, "ok" | "error" | "timeout"). Never raises: an
    unknown tool, bad arguments or a tool that fails becomes an error message the model reads."""
    fn = tools.get(call["name"])
    if fn is None:
        return f"error: there is no tool {call['name']!r}; the tools are {', '.join(tools)}", "error"
    try:
        return str(fn(**call["arguments"])), "ok"
    except TimeoutError as e:
        return f"error: {e}", "timeout"
    except TypeError as e:  # missing, unknown or mistyped arguments
        return f"error: bad arguments for {call['name']}: {e}", "error"
    except Exception as e:  # noqa: BLE001 -- any failure of the tool is the model's to read, not the trainer's
        return f"error: {type(e).__name__}: {e}", "error"


def timed_call(tools: dict, call: dict) -> tuple[str, str, float]:
    """call_tool, and the seconds it took."""
    t0 = time.perf_counter()
    reply, status = call_tool(tools, call)
    return reply, status, time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------
# Multi-turn: a sample that calls tools (rollout.generate runs ToolUse.episode for each request)


@dataclass
class ToolUse:
    """How samples call tools (grpo.py --tools calculator,python): the tools by name (TOOLS),
    at most `max_turns` model turns, each tool reply cut to `max_reply_tokens` tokens, the calls
    run in `pool`'s threads so that a slow tool holds up its own sample only."""

    tools: dict
    tokenizer: object
    pool: concurrent.futures.Executor
    max_turns: int = 4
    max_reply_tokens: int = 256

    def episode(self, engine, prompt: list[int], seed: int, *, sampling):
        """The seam rollout.run_requests calls for each request, without importing this module: one sample's
        `episode` of turns and tool replies (a coroutine, run on the engine's event loop)."""
        return episode(engine, prompt, seed, sampling=sampling, tool_use=self)


def tools_for(
    tokenizer,
    tools: dict,
    *,
    template: str | None,
    datasets: tuple[str, ...],
    workers: int,
    max_turns: int,
    max_reply_tokens: int,
) -> tuple[list[dict] | None, list[dict] | None, ToolUse | None]:
    """With `tools` (select_tools' choice): the messages before every question and the tools' schemas
    (tools_prompt: a system prompt, two worked calls asked through `template`, else through the datasets' kind's:
    addition's for the built-in tasks, GSM8K's for any other), and how samples call them (ToolUse, the calls in
    `workers` threads). Without tools: (None, None, None)."""
    if not tools:
        return None, None, None
    template = template or (ADDITION_PROMPT if set(datasets) <= set(BUILTIN_TASKS) else GSM8K_PROMPT)
    context, specs = tools_prompt(tokenizer, tools, template)
    pool = concurrent.futures.ThreadPoolExecutor(workers)
    return context, specs, ToolUse(tools, tokenizer, pool, max_turns=max_turns, max_reply_tokens=max_reply_tokens)


async def episode(engine, prompt: list[int], seed: int, *, sampling: Sampling, tool_use: ToolUse) -> Sample:
    """One sample that may call tools: the model's turns and the tools' replies as one growing
    token sequence. Token in, token out: earlier turns are never rendered again, so what is
    trained is exactly what was sampled. `model_mask` marks the model's tokens 1 and the tools' 0
    (their log-probs are 0); `text` is the model's own text, so a tool can never write the answer.

    A turn ends at a stop token; the episode ends at a turn without a tool call, after `max_turns`
    turns, or when the response budget (`sampling.max_new_tokens`, tool replies included) runs
    out: a turn cut by it, or a tool reply that does not fit, leaves the sample truncated.
    """
    tok, loop = tool_use.tokenizer, asyncio.get_running_loop()
    sample = Sample(
        prompt_ids=prompt, response_ids=[], rollout_logprobs=[], truncated=False, model_mask=[], messages=[]
    )
    texts = []
    for turn in range(tool_use.max_turns):
        params = {
            **sampling.params(seed_for(seed, "turn", turn) if turn else seed),
            "max_new_tokens": sampling.max_new_tokens - len(sample.response_ids),
        }
        out = await engine.async_generate(
            input_ids=prompt + sample.response_ids,
            sampling_params=params,
            return_logprob=True,
            **adapter_named(engine, None),
        )
        turn_out = read_output(prompt, out, sampling, tok)
        sample.response_ids += turn_out.response_ids
        sample.rollout_logprobs += turn_out.rollout_logprobs
        sample.model_mask += [1] * len(turn_out.response_ids)
        texts.append(turn_out.text)
        sample.messages.append({"role": "assistant", "content": turn_out.text})
        calls, malformed = parse_tool_calls(turn_out.text)
        if turn_out.truncated or not (calls or malformed) or turn == tool_use.max_turns - 1:
            sample.truncated = turn_out.truncated
            break
        results = await asyncio.gather(
            *(loop.run_in_executor(tool_use.pool, timed_call, tool_use.tools, c) for c in calls)
        )
        results += [(f"error: {problem}", "error", 0.0) for problem in malformed]  # said to the model, never raised
        sample.tool_calls += [(c["name"], status, seconds) for c, (_, status, seconds) in zip(calls, results)]
        sample.tool_calls += [("?", "error", 0.0)] * len(malformed)
        replies = [tok.decode(plain_ids(tok, r)[: tool_use.max_reply_tokens]) for r, _, _ in results]
        reply_ids = tool_reply_ids(
            tok, replies, last_token=turn_out.response_ids[-1] if turn_out.response_ids else None
        )
        if len(sample.response_ids) + len(reply_ids) >= sampling.max_new_tokens:  # no room for it and a next turn
            sample.truncated = True
            break
        sample.response_ids += reply_ids
        sample.messages += [{"role": "tool", "content": r} for r in replies]
        sample.rollout_logprobs += [0.0] * len(reply_ids)
        sample.model_mask += [0] * len(reply_ids)
    sample.turns, sample.text = len(texts), "\n".join(texts)
    return sample


_CONTENT = "\x00the assistant's content\x00"  # a string no chat template writes itself
_REPLY = re.compile("\x00tool reply ([0-9]+)\x00")


def tool_reply_ids(tokenizer, replies: list[str], last_token: int | None) -> list[int]:
    """The tokens that follow a model turn with tool calls, as the chat template renders them:
    whatever ends the assistant turn (less the stop token the model sampled itself), one tool
    message per reply, and the next assistant turn's header. Taken as the token delta of a whole
    rendered conversation: a tool message rendered alone loses what the template writes between
    turns (verl#6501: the newline after Qwen's <|im_end|>). The template's own markers are special
    tokens; the replies are plain text (`plain_ids`): a program that prints '<|im_end|><|im_start|>user'
    can't forge a turn."""
    base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _CONTENT}]
    slots = [{"role": "tool", "content": f"\x00tool reply {i}\x00"} for i in range(len(replies))]
    full = tokenizer.apply_chat_template(base + slots, tokenize=False, add_generation_prompt=True)
    if _CONTENT not in full:
        raise ValueError(
            "the chat template rewrites an earlier assistant turn when tool messages follow it; "
            "a multi-turn rollout needs a template that keeps earlier turns as they were"
        )
    pieces = _REPLY.split(
        full[full.index(_CONTENT) + len(_CONTENT) :]
    )  # template text, reply number, template text, ...
    if pieces[1::2] != [str(i) for i in range(len(replies))]:
        raise ValueError("the chat template does not show each tool message's content once, in order")
    ids = [
        i
        for k, piece in enumerate(pieces)
        for i in (
            plain_ids(tokenizer, replies[int(piece)]) if k % 2 else tokenizer.encode(piece, add_special_tokens=False)
        )
    ]
    return ids[1:] if ids and ids[0] == last_token else ids
