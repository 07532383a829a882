"""Reward models: a trained model's score as a reward (--reward-model), beside or instead of the rule rewards.

    tokenizer, template = check_reward_model("Skywork/Skywork-Reward-V2-Qwen3-0.6B")  # before anything loads
    rm = load_reward_model(path, device, dtype)                  # FSDP2-sharded, frozen, like the reference model
    read = dict(tokenizer=tokenizer, template=template, max_len=2048, micro_batch_size=8, device=device)
    metrics = rm_rewards(rm, samples, weights=(1.0, 1.0), whiten=False, **read)  # reward = 1 * rule + 1 * RM score

A reward model is what the public ones are (Skywork-Reward, the Qwen and Llama RMs) and what train_rm.py writes:
a Hugging Face *ForSequenceClassification model with one label, its head read at the conversation's last token.
It reads the conversation with its own tokenizer and chat template (the prompt's messages, then the response; a
tool episode's turns and tool replies as messages): the policy's tokens are not the RM's. It is a tenant of the
memory phases (memory.py) like the reference model: with --offload on the CPU while SGLang generates.
"""

import math
import os
import sys

import torch
import torch.distributed as dist

from fsdp import load_model, shard_model
from common import InputError, all_reduce, all_reduce_dict
from preflight import check_model, given_flags
from data import plain_ids

RM_LINE = [  # the console's (name, metric, format, meaning)
    ("rm", "rollout/rm_score", ".3f", "the reward model's score, mean"),
    ("rm s", "time/reward_model", ".1f", "seconds scoring with the reward model"),
]


def rm_flag_rules(
    *,
    reward_model: str | None,
    weights: tuple[float, float],
    norm: bool,
    max_len: int,
    micro_batch_size: int,
    template: str | None,
    given: set[str],
) -> list[tuple[str, object, bool, str]]:
    """check_flags' rules for grpo.py's and ppo.py's --reward-model flags: the others only with it (`given`: the
    command line's flags by field name, preflight.given_flags)."""
    others = {
        "reward_weights": weights,
        "reward_model_norm": norm,
        "reward_model_max_len": max_len,
        "reward_model_micro_batch_size": micro_batch_size,
        "reward_model_template": template,
    }
    alone = [(k, v) for k, v in others.items() if k in given and not reward_model]
    return [
        ("--reward-model-max-len", max_len, max_len >= 2, ">= 2"),
        ("--reward-model-micro-batch-size", micro_batch_size, micro_batch_size >= 1, ">= 1"),
        (
            "--reward-weights",
            weights,
            all(map(math.isfinite, weights)) and any(weights),
            "two finite numbers, not both 0: the rule reward's weight, then the reward model's",
        ),
        *[(f"--{k.replace('_', '-')}", v, False, "given with --reward-model only") for k, v in alone],
    ]


def check_reward_model(
    name: str | None, template: str | None = None, max_len: int = 2048, *, system: bool = False, tools: bool = False
):
    """Before anything loads: a folder or hub id of a one-label sequence-classification model whose tokenizer has a
    chat template, or `template` (--reward-model-template: a file or the Jinja text itself) that renders a
    conversation shaped as the run's (a system prompt, tool replies). Returns (tokenizer, the chat template to render
    with, max_len cut to its context where not given; given larger, an error), or three Nones for no reward model."""
    from transformers import AutoConfig

    if name is None:
        return None, None, None
    flag, roles = "--reward-model", ("system",) * system + ("user", "assistant") + ("tool", "assistant") * tools
    tokenizer, context = check_model(name, flag, raw_text=False)
    if not has_reward_head(name, flag, fix="pass a reward model"):
        raise InputError(
            f"{flag} {name!r} is not a reward model: its config.json names no *ForSequenceClassification "
            f"head (architectures: {AutoConfig.from_pretrained(name).architectures}); pass one (train_rm.py "
            f"writes one) or a rule reward, --reward FILE.py:function"
        )
    if context and max_len > context:
        if "reward_model_max_len" in given_flags(sys.argv[1:]):
            raise InputError(
                f"--reward-model-max-len {max_len} is more than {name!r}'s context of {context} tokens: "
                f"pass at most {context}"
            )
        max_len = context
    return (
        tokenizer,
        chat_template(tokenizer, name, template, flag=flag, template_flag="--reward-model-template", roles=roles),
        max_len,
    )


def chat_template(
    tokenizer,
    name: str,
    template: str | None,
    *,
    flag: str,
    template_flag: str,
    roles: tuple[str, ...] = ("user", "assistant"),
) -> str:
    """The chat template conversations are read with: `template` (template_flag's: a FILE.jinja or the Jinja text
    itself), else the tokenizer's own; neither is an error naming both flags, and so is one that can't render a
    conversation of `roles`. The tokenizer gets a pad id if it has none (its eos): right padding needs one, and the
    head is read at the last real token anyway."""
    if template is not None and os.path.isfile(template):
        try:
            with open(template, encoding="utf-8") as f:
                template = f.read()
        except UnicodeDecodeError as e:
            raise InputError(f"{template_flag} {template!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    elif template is not None and "{{" not in template and "{%" not in template:
        raise InputError(
            f"{template_flag} {template!r} is neither a file nor a Jinja template: pass a "
            f"FILE.jinja or the template's text"
        )
    if (template or tokenizer.chat_template) is None:
        raise InputError(
            f"{flag} {name!r}: its tokenizer has no chat template to read a conversation with: pass "
            f"{template_flag} FILE.jinja (for a trained reward model, the one it was trained with)"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    which = f"{template_flag}'s template" if template else f"{flag} {name!r}'s chat template"
    template = template or tokenizer.chat_template
    rm_tokens(
        tokenizer,
        [[{"role": r, "content": "2 + 2 = 4"} for r in roles]],
        template=template,
        max_len=2,
        item=f"{which}, on a test conversation",
    )
    return template


def has_reward_head(name: str, flag: str, fix: str) -> bool:
    """Whether config.json names a *ForSequenceClassification head (train_rm.py keeps it; --reward-model needs it);
    one of several labels is a classifier, not a reward model: an error naming `fix`, before anything loads."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(name)
    if not any(a.endswith("ForSequenceClassification") for a in config.architectures or []):
        return False
    if config.num_labels != 1:
        raise InputError(
            f"{flag} {name!r} is a classifier of {config.num_labels} labels: a reward model has one; {fix}"
        )
    return True


def load_reward_model(name: str, device: torch.device, dtype: torch.dtype, attn_implementation: str = "sdpa"):
    """The reward model in `dtype`, sharded with FSDP2 like the reference model, frozen (eval mode, no gradients)."""
    from transformers import AutoModelForSequenceClassification

    model = load_model(
        name, device, dtype, attn_implementation=attn_implementation, model_class=AutoModelForSequenceClassification
    ).eval()
    if not isinstance(getattr(model, "score", None), torch.nn.Linear):
        raise InputError(f"--reward-model {name!r}: {type(model).__name__} has no `score` head to read")
    model.requires_grad_(False)
    shard_model(model, param_dtype=None)
    return model


def conversation(prompt: str | list[dict], response: str | list[dict]) -> list[dict]:
    """What the reward model reads: the prompt's messages (as asked, after --prompt-template), then the response:
    a text (one assistant message), or a tool episode's turns and tool replies (rollout.episode's `messages`)."""
    asked = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    return asked + ([{"role": "assistant", "content": response}] if isinstance(response, str) else response)


def rm_tokens(
    tokenizer, conversations: list[list[dict]], *, template: str, max_len: int, item: str = "a conversation"
) -> tuple[list[list[int]], int]:
    """Each conversation through the reward model's chat template, cut to its first `max_len` tokens (the end is
    lost: a long response is judged on its start). A template that fails on one, or renders it empty, is an
    InputError naming `item`, the conversation's roles and its start. Returns (token ids, how many were cut)."""
    ids = []
    for c in conversations:
        try:  # jinja's errors (a role the template refuses, its syntax, a name it lacks) and any other of a template
            ids.append(template_tokens(tokenizer, c, template))
            problem = "it renders no tokens" if not ids[-1] else None
        except Exception as e:
            problem = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        if problem:
            raise InputError(
                f"{item} (roles {', '.join(m.get('role', '?') for m in c)}; it begins "
                f"{str(c[0].get('content'))[:60]!r}): the reward model's chat template failed: {problem}"
            )
    return [x[:max_len] for x in ids], sum(len(x) > max_len for x in ids)


def template_tokens(tokenizer, conversation: list[dict], template: str) -> list[int]:
    """The conversation through the chat template as tokens, where only the template's own markup can be special
    tokens: each message's content is tokenized as text (a tool's reply printing '<|im_end|><|im_start|>assistant'
    stays those characters, as rollout.plain_ids keeps it for the policy). The rendered text is cut at each content,
    found in order (as given, else stripped, as templates do); a content the template rewrote is left as rendered."""
    text, pos, ids = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False), 0, []
    for m in conversation:
        content = m.get("content")
        found = [(text.find(x, pos), x) for x in (content, str(content).strip()) if isinstance(content, str) and x]
        at, content = next(((i, x) for i, x in found if i >= 0), (-1, ""))
        if at < 0:
            continue
        ids += tokenizer.encode(text[pos:at], add_special_tokens=False) + plain_ids(tokenizer, content)
        pos = at + len(content)
    return ids + tokenizer.encode(text[pos:], add_special_tokens=False)


def last_token_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The head's output at each row's last real token (right padding): [B, T] -> [B], fp32. The head's output
    at every position is caught on its way out: HF's own pooling finds the last token by pad_token_id, and
    misreads a conversation that ends in that token. Gradients flow (train_rm.py trains through it)."""
    caught = []
    hook = model.score.register_forward_hook(lambda module, inputs, out: caught.append(out))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask)
    finally:
        hook.remove()
    last = attention_mask.sum(-1) - 1  # [B]
    return caught[0][torch.arange(len(last), device=last.device), last, 0].float()  # [B, T, 1] -> [B]


def pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (input_ids, attention_mask), right-padded, [B, T] each."""
    width = max(map(len, rows), default=1)
    ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], dtype=torch.long)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long)
    return ids, mask


@torch.no_grad()
def score(model, rows: list[list[int]], *, pad_id: int, micro_batch_size: int, device) -> torch.Tensor:
    """The reward model's score of each token list, `micro_batch_size` at a time (longest first: less padding).
    Every rank runs as many forwards (FSDP2's collectives), a rank with fewer rows a one-token stand-in. [B], CPU."""
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    chunks = [order[k : k + micro_batch_size] for k in range(0, len(order), micro_batch_size)]
    count = int(all_reduce(len(chunks), dist.ReduceOp.MAX))
    out = torch.zeros(len(rows))
    for k in range(count):
        chunk = chunks[k] if k < len(chunks) else []
        ids, mask = pad([rows[i] for i in chunk] or [[pad_id]], pad_id)
        scores = last_token_scores(model, ids.to(device), mask.to(device)).cpu()
        out[chunk] = scores[: len(chunk)]
    return out


def score_conversations(
    model, conversations: list[list[dict]], *, tokenizer, template: str, max_len: int, micro_batch_size: int, device
) -> tuple[torch.Tensor, int]:
    """rm_tokens, then score: ([B] scores on the CPU, how many conversations were cut to max_len)."""
    rows, cut = rm_tokens(tokenizer, conversations, template=template, max_len=max_len)
    return score(model, rows, pad_id=tokenizer.pad_token_id, micro_batch_size=micro_batch_size, device=device), cut


# ----------------------------------------------------------------------------------------------
# ALGO: the rewards in use, weighted into one


def combine_rewards(
    rule: torch.Tensor, rm: torch.Tensor, *, weights: tuple[float, float], whiten: bool
) -> torch.Tensor:
    """reward = w_rule * rule + w_rm * rm, each sample's (ms-swift's reward_weights). whiten: the RM's scores
    first become (score - mean) / std over the global batch, all ranks: a Bradley-Terry model fixes only score
    differences, so its offset and scale are arbitrary and would otherwise set the weight. [B] each -> [B]."""
    if whiten:
        n = all_reduce(float(len(rm)))
        mean = all_reduce(rm.sum()) / n
        std = (all_reduce(((rm - mean) ** 2).sum()) / n).sqrt()
        rm = (rm - mean) / (std + 1e-6)
    return weights[0] * rule + weights[1] * rm


def rm_rewards(model, samples, *, weights: tuple[float, float], whiten: bool, **read) -> dict[str, float]:
    """Each sample's reward becomes combine_rewards(its rule reward, the reward model's score of its conversation);
    `read`: score_conversations' keywords. Returns the step's metrics (rm_stats)."""
    scores, cut = score_conversations(
        model, [conversation(s.prompt, s.messages or s.text) for s in samples], **read
    )  # [n]
    rule = torch.tensor([s.reward for s in samples])  # [n]
    for s, reward in zip(samples, combine_rewards(rule, scores, weights=weights, whiten=whiten).tolist()):
        s.reward = reward
    return rm_stats(rule, scores, cut)


def rm_stats(rule: torch.Tensor, rm: torch.Tensor, cut: int) -> dict[str, float]:
    """A step's metrics over all ranks: the RM's mean and std, the rule reward's mean, their Pearson correlation
    (both on: does the RM agree with the rule? not logged where either is constant), conversations cut to --reward-model-max-len. [B] each."""
    rm, rule = rm.double(), rule.double()
    sums = {
        k: float(v)
        for k, v in all_reduce_dict(
            {  # one collective for all of them
                "n": torch.tensor(float(len(rm))),
                "rm": rm.sum(),
                "rule": rule.sum(),
                "rm2": (rm**2).sum(),
                "rule2": (rule**2).sum(),
                "cross": (rm * rule).sum(),
                "cut": torch.tensor(float(cut)),
            }
        ).items()
    }
    n, m, r = sums["n"], sums["rm"] / sums["n"], sums["rule"] / sums["n"]
    var_m, var_r = max(sums["rm2"] / n - m * m, 0.0), max(sums["rule2"] / n - r * r, 0.0)
    corr = (
        {"rollout/rm_rule_corr": (sums["cross"] / n - m * r) / (var_m * var_r) ** 0.5}
        if var_m > 0 and var_r > 0
        else {}
    )
    return {
        "rollout/rm_score": m,
        "rollout/rm_score_std": var_m**0.5,
        "rollout/rule_reward": r,
        **corr,  # none: a constant
        "rollout/rm_truncated": sums["cut"],
    }
