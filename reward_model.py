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

import os

import torch
import torch.distributed as dist

from fsdp import all_reduce, all_reduce_dict, load_model, shard_model
from preflight import InputError, check_model

RM_LINE = [("rm", "rollout/rm_score", ".3f"), ("rm s", "time/reward_model", ".1f")]  # the console's (name, metric, format)


def check_reward_model(name: str, template: str | None = None, flag: str = "--reward-model"):
    """Before anything loads: a folder or hub id of a one-label sequence-classification model whose tokenizer has a
    chat template, or `template` (--reward-model-template: a file or the Jinja text itself). Returns (tokenizer,
    the chat template to render with)."""
    from transformers import AutoConfig

    tokenizer, _ = check_model(name, flag)
    config = AutoConfig.from_pretrained(name)
    heads = [a for a in config.architectures or [] if a.endswith("ForSequenceClassification")]
    if not heads:
        raise InputError(f"{flag} {name!r} is not a reward model: its config.json names no *ForSequenceClassification "
                         f"head (architectures: {config.architectures}); pass one (train_rm.py writes one) or a rule "
                         f"reward, --reward FILE.py:function")
    if config.num_labels != 1:
        raise InputError(f"{flag} {name!r} has {config.num_labels} labels ({heads[0]}); a reward model scores with "
                         f"one (num_labels 1): pass a reward model, not a classifier")
    return tokenizer, chat_template(tokenizer, name, template, flag=flag, template_flag="--reward-model-template")


def chat_template(tokenizer, name: str, template: str | None, *, flag: str, template_flag: str) -> str:
    """The chat template conversations are read with: `template` (template_flag's: a FILE.jinja or the Jinja text
    itself), else the tokenizer's own; neither is an error naming both flags. The tokenizer gets a pad id if it has
    none (its eos): right padding needs one, and the head is read at the last real token anyway."""
    if template is not None and os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            template = f.read()
    elif template is not None and "{{" not in template and "{%" not in template:
        raise InputError(f"{template_flag} {template!r} is neither a file nor a Jinja template: pass a "
                         f"FILE.jinja or the template's text")
    if (template or tokenizer.chat_template) is None:
        raise InputError(f"{flag} {name!r}: its tokenizer has no chat template to read a conversation with: pass "
                         f"{template_flag} FILE.jinja (for a trained reward model, the one it was trained with)")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return template or tokenizer.chat_template


def load_reward_model(name: str, device: torch.device, dtype: torch.dtype, attn_implementation: str = "sdpa"):
    """The reward model in `dtype`, sharded with FSDP2 like the reference model, frozen (eval mode, no gradients)."""
    from transformers import AutoModelForSequenceClassification

    model = load_model(name, device, dtype, attn_implementation=attn_implementation,
                       model_class=AutoModelForSequenceClassification).eval()
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


def rm_tokens(tokenizer, conversations: list[list[dict]], *, template: str, max_len: int) -> tuple[list[list[int]], int]:
    """Each conversation through the reward model's chat template, cut to its first `max_len` tokens (the end is
    lost: a long response is judged on its start). Returns (token ids, how many were cut)."""
    ids = [list(tokenizer.apply_chat_template(c, chat_template=template, tokenize=True, return_dict=False))
           for c in conversations]
    return [x[:max_len] for x in ids], sum(len(x) > max_len for x in ids)


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
    last = attention_mask.sum(-1) - 1                                               # [B]
    return caught[0][torch.arange(len(last), device=last.device), last, 0].float()   # [B, T, 1] -> [B]


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
    chunks = [order[k:k + micro_batch_size] for k in range(0, len(order), micro_batch_size)]
    count = int(all_reduce(len(chunks), dist.ReduceOp.MAX))
    out = torch.zeros(len(rows))
    for k in range(count):
        chunk = chunks[k] if k < len(chunks) else []
        ids, mask = pad([rows[i] for i in chunk] or [[pad_id]], pad_id)
        scores = last_token_scores(model, ids.to(device), mask.to(device)).cpu()
        out[chunk] = scores[:len(chunk)]
    return out


def score_conversations(model, conversations: list[list[dict]], *, tokenizer, template: str, max_len: int,
                        micro_batch_size: int, device) -> tuple[torch.Tensor, int]:
    """rm_tokens, then score: ([B] scores on the CPU, how many conversations were cut to max_len)."""
    rows, cut = rm_tokens(tokenizer, conversations, template=template, max_len=max_len)
    return score(model, rows, pad_id=tokenizer.pad_token_id, micro_batch_size=micro_batch_size, device=device), cut


# ----------------------------------------------------------------------------------------------
# ALGO: the rewards in use, weighted into one

def combine_rewards(rule: torch.Tensor, rm: torch.Tensor, *, weights: tuple[float, float], whiten: bool) -> torch.Tensor:
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
    scores, cut = score_conversations(model, [conversation(s.prompt, s.messages or s.text) for s in samples], **read)     # [n]
    rule = torch.tensor([s.reward for s in samples])                                                  # [n]
    for s, reward in zip(samples, combine_rewards(rule, scores, weights=weights, whiten=whiten).tolist()):
        s.reward = reward
    return rm_stats(rule, scores, cut)


def rm_stats(rule: torch.Tensor, rm: torch.Tensor, cut: int) -> dict[str, float]:
    """A step's metrics over all ranks: the RM's mean and std, the rule reward's mean, their Pearson correlation
    (both on: does the RM agree with the rule?), conversations cut to --reward-model-max-len. [B] each."""
    rm, rule = rm.double(), rule.double()
    sums = {k: float(v) for k, v in all_reduce_dict({  # one collective for all of them
        "n": torch.tensor(float(len(rm))), "rm": rm.sum(), "rule": rule.sum(), "rm2": (rm**2).sum(),
        "rule2": (rule**2).sum(), "cross": (rm * rule).sum(), "cut": torch.tensor(float(cut))}).items()}
    n, m, r = sums["n"], sums["rm"] / sums["n"], sums["rule"] / sums["n"]
    var_m, var_r = max(sums["rm2"] / n - m * m, 0.0), max(sums["rule2"] / n - r * r, 0.0)
    corr = (sums["cross"] / n - m * r) / (var_m * var_r) ** 0.5 if var_m > 0 and var_r > 0 else float("nan")
    return {"rollout/rm_score": m, "rollout/rm_score_std": var_m**0.5, "rollout/rule_reward": r,
            "rollout/rm_rule_corr": corr, "rollout/rm_truncated": sums["cut"]}
