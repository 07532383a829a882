"""Forward passes and token log-probs: what the loss compares, computed the way the sampler computed them.

    logp, entropy = token_logprobs(model, ids, mask, temperature=1.0, with_entropy=True)   # [B, T-1]
    logp, _ = token_logprobs(model, ids, mask, temperature=1.0, packed=True)  # the same: real tokens in one row
    old_logp = batch_logprobs(model, batch, micro_batch_size=8, temperature=1.0, device=device)   # no gradient
    old_logp, ref_logp = old_and_ref_logprobs(policy, ref, batch, micro_batch_size=8, temperature=1.0, device=device)
    compile_head(model)                                   # --compile: the log-prob head's passes compiled too

Token t of a row is predicted at position t-1: per-token tensors are [B, T-1], logp[:, t] scoring input_ids[:, t+1].
Log-probs are of the distribution the sampler drew from, softmax(logits / temperature), in fp32.
"""

import torch

from common import to_device
from fsdp import VARLEN, micro_batches
from lora import adapter_off


LOGIT_CHUNK = 2048  # tokens whose [chunk, V] logits exist at once in token_logprobs (~3 GB fp32 at V = 152k)


def logits_to_logprobs(logits, targets, temperature: float, with_entropy: bool, entropy_grad: bool) -> torch.Tensor:
    """[c, V] logits, [c] target ids -> [c, 2]: each target's log-prob at `temperature` and the entropy (zeros unless
    with_entropy; no gradient unless entropy_grad). compile_head compiles it: model.logits_to_logprobs."""
    logits = logits if temperature == 1.0 else logits.float() / temperature
    # fp32 (bf16 log-probs are off by ~1e-2, enough to skew the PPO ratio), in one fused pass over the logits
    logp_all = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # [c, V]
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else logp_all[:, 0] * 0
    return torch.stack([logp_all.gather(-1, targets[:, None]).squeeze(-1), entropy], -1)


def forward_tokens(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, packed: bool = False, head=None):
    """model(...).logits of a right-padded micro-batch [b, t], the ids they score, and `unpack`: per-token
    values of the next-token positions -> [b, t-1] (padded: the identity). head(hidden [b, t, H], ids [b, t]): what
    the output head returns instead of the logits (token_logprobs'), run in the forward, where FSDP2 gathered its weight.

    packed: the rows' real tokens in one row [1, n], no padding, positions restarting at 0 in each
    sequence. With attention_mask None, transformers reads the restarts as sequence boundaries
    (masking_utils.find_packed_sequence_indices) and keeps attention within each: sdpa and eager by a
    block-diagonal causal mask [1, 1, n, n] (n^2 memory; all n^2 pairs computed), flex_attention by a
    block mask that skips the other sequences' blocks, flash_attention_2 by per-sequence lengths.

    attention_mask may stay on the CPU (the micro-batch loops keep it there): the packed row is planned from it there
    and its indices go to the GPU without waiting, where a GPU mask makes the CPU wait for the GPU to catch up
    (nonzero's size and the longest sequence are data the CPU must read) before it queues the forward.
    """
    unpack, positions = (lambda x: x), None
    device = input_ids.device
    if packed:
        real = attention_mask.bool()  # [b, t]
        rows, cols = real.nonzero(as_tuple=True)  # [n] each, row by row (n: data-dependent, read where the mask is)
        positions = to_device((real.cumsum(-1) - 1)[rows, cols][None], device)  # [1, n]: 0, 1, ... in each sequence
        rows, cols = to_device(rows, device), to_device(cols, device)
        input_ids, attention_mask = input_ids[rows, cols][None], None  # [1, n]
        # packed position j predicts token j+1 of its own sequence, unless j ends it: that value is zeroed onto the
        # column past the sequence's end (boolean indexing would stop the CPU until the GPU caught up)
        own, shape = rows[1:] == rows[:-1], real.shape  # [n-1]

        def unpack(x):  # [1, n-1] -> [b, t-1], zero past each sequence's end; gradients flow back through it
            out = x.new_zeros(shape)  # [b, t]
            return out.index_put((rows[:-1], cols[:-1]), x[0] * own)[:, :-1]

    elif attention_mask is not None:
        attention_mask = to_device(attention_mask, device)
    sequences = {}  # varlen_attention's sequences in the packed row (else it finds them: one sync a layer)
    if packed and getattr(model.config, "_attn_implementation", None) == VARLEN:
        lengths = real.sum(-1)  # [b]: the row's sequences, in order
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int()  # [b+1]: where each starts, and the end
        sequences = dict(cu_seq_lens_q=to_device(cu, device), max_length_q=int(lengths.max()))
        # a mask of no size, which transformers hands to the attention unread (a 4-d mask) and varlen_attention ignores
        # when given the sequences: with None, transformers would find the sequences in the positions itself, reading a
        # GPU value each forward (masking_utils.find_packed_sequence_indices), a wait for the GPU
        attention_mask = torch.ones(1, 1, 0, 0, dtype=torch.bool, device=device)  # [1, 1, 0, 0]
    if head is not None:  # on this module object, for this call only
        model.get_output_embeddings().forward = lambda hidden: head(hidden, input_ids)
    try:
        logits = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False, **sequences
        ).logits  # [b, t, V] or [1, n, V]
    finally:
        if head is not None:
            del model.get_output_embeddings().forward  # the class's forward again
    return logits, input_ids, unpack


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    packed: bool = False,
):
    """Log-prob of each next token under `model` at sampling temperature `temperature`.

    Returns logp [B, T-1] (logp[:, t] scores input_ids[:, t+1]) and, if asked, the entropy of the
    next-token distribution [B, T-1]: a metric without gradient, unless `entropy_grad` (an entropy
    bonus). Dividing by the temperature matters: SGLang reports log-probs of the distribution it
    sampled from, softmax(logits / T). `packed`: one forward over the rows without padding
    (forward_tokens), the same numbers on the real tokens, zero past them.

    The output head runs LOGIT_CHUNK tokens at a time: the [N, V] logits (fp32: 5 GB for 8192 tokens of a 152k
    vocabulary) never exist whole; under autograd each chunk's are recomputed in backward (one more head matmul).
    """
    output, to_logprobs = model.get_output_embeddings(), getattr(model, "logits_to_logprobs", logits_to_logprobs)
    logprobs = lambda logits, y: to_logprobs(logits, y, temperature, with_entropy, entropy_grad)  # noqa: E731  [c, 2]

    def head(hidden, ids):  # [b, t, H], [b, t] -> [b*t, 2] (not a view: FSDP2 hooks the forward's output)
        targets = torch.cat([ids[:, 1:], ids[:, :1]], 1).flatten()  # [b*t]: the last column's is a stand-in
        chunks = zip(hidden.flatten(0, 1).split(LOGIT_CHUNK), targets.split(LOGIT_CHUNK))
        chunk = lambda h, y: logprobs(torch.nn.functional.linear(h, output.weight, output.bias), y)  # noqa: E731
        recompute = torch.is_grad_enabled() and hidden.shape[0] * hidden.shape[1] > LOGIT_CHUNK  # one chunk: kept
        out = [
            torch.utils.checkpoint.checkpoint(chunk, h, y, use_reentrant=False) if recompute else chunk(h, y)
            for h, y in chunks
        ]
        return torch.cat(out)

    if getattr(model.config, "final_logit_softcapping", None):  # Gemma 2 caps the logits after the head: whole ones
        logits, ids, unpack = forward_tokens(model, input_ids, attention_mask, packed)  # [B, T, V] or [1, N, V]
        out = logprobs(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).view(*ids[:, 1:].shape, 2)
    else:
        out, ids, unpack = forward_tokens(model, input_ids, attention_mask, packed, head)  # [B*T, 2] or [N, 2]
        out = out.view(*ids.shape, 2)[:, :-1]  # [B, T-1, 2]
    logp, entropy = out.unbind(-1)  # the stack of the two carries logp's graph: a metric entropy leaves it
    return unpack(logp), unpack(entropy if entropy_grad else entropy.detach()) if with_entropy else None


@torch.no_grad()
def batch_forward(fn, batch, micro_batch_size: int, device, progress=iter, max_tokens: int = 0) -> torch.Tensor:
    """fn(input_ids on `device`, attention_mask on the CPU) -> [b, t-1] over a whole Batch, micro-batch by
    micro-batch (micro_batches), without gradient. [B, T-1] on the CPU, zero past each micro-batch's longest
    sequence. Nothing in the loop waits for the GPU (forward_tokens plans a packed row from the CPU's mask); the
    results gather on `device` and come to the CPU once, at the end."""
    out = torch.zeros_like(batch.response_mask, device=device)  # [B, T-1]
    lengths = batch.attention_mask.sum(-1)  # [B]
    for rows in progress(micro_batches(torch.arange(len(batch)), lengths, micro_batch_size, max_tokens)):
        mb = batch.select(rows)  # no rows: a stand-in, run for FSDP's collectives only
        y = fn(to_device(mb.input_ids, device), mb.attention_mask)  # [b, t-1]
        out[to_device(rows, device), : y.shape[1]] = y[: len(rows)]
    return out.cpu()


def batch_logprobs(
    model, batch, micro_batch_size: int, temperature: float, device, progress=iter, max_tokens: int = 0
) -> torch.Tensor:
    """token_logprobs over a whole Batch, without gradient; max_tokens > 0: packed micro-batches of at most
    that many tokens. [B, T-1] on the CPU."""
    return batch_forward(
        lambda ids, mask: token_logprobs(model, ids, mask, temperature, packed=max_tokens > 0)[0],
        batch,
        micro_batch_size,
        device,
        progress,
        max_tokens,
    )


def old_and_ref_logprobs(
    policy, ref, batch, *, micro_batch_size: int, temperature: float, device, max_tokens: int = 0, progress=iter
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A batch's log-probs before the update (batch_logprobs), [B, T-1] on the CPU: the policy's (the old log-probs,
    the ratio's denominator; `progress` wraps its micro-batches) and the reference's (None without a `ref`). A LoRA
    policy is its own reference: its base, under lora.adapter_off (a no-op for a separate reference model)."""
    old = batch_logprobs(policy, batch, micro_batch_size, temperature, device, progress, max_tokens)
    if ref is None:
        return old, None
    with adapter_off(ref):
        return old, batch_logprobs(ref, batch, micro_batch_size, temperature, device, max_tokens=max_tokens)


def compile_head(model):
    """--compile: token_logprobs' passes over [chunk, V] logits compiled for `model` (fsdp.shard_model(compile=True)
    compiles its decoder layers); the first forwards and backwards compile."""
    model.logits_to_logprobs = torch.compile(logits_to_logprobs)
