"""PLUMBING: pieces grpo.py's and ppo.py's `main`s start a run with, each a call with explicit parameters (no algorithm
here: each script's own is written out in it).

    seed_ranks(args.seed, rank)                                    # Python's and numpy's per rank, torch's shared
    check_training_state(args.model, device, lora=False, reference=True)   # a 7B full fine-tuning on one GPU: stop
    mbs, max_tokens, attn, line = micro_batching(args.model, device, given=..., ...)   # packed by a token budget
    compile, line = compile_choice(device, given=..., compile=False, attn_implementation=attn, ...)   # on, measured
    policy, ref = load_policy(args.model, device, dtype, lora_rank=0, ..., reference=True)   # FSDP2-sharded
    optimizer, scheduler = adamw(policy, lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999), ..., total_steps=200)
"""

import random

import numpy as np
import torch
import torch.distributed as dist

from common import InputError, print0
from data import seed_for
from fsdp import VARLEN, load_model, lr_lambda, shard_model
from logprobs import LOGIT_CHUNK, compile_head
from lora import apply_lora, lora_line, trainable
from memory import GiB, activation_bytes, token_budget
from preflight import FROZEN_BYTES, compiler_problem, parameter_count, state_bytes, state_problem, varlen_runs


def seed_ranks(seed: int, rank: int):
    """Python's and numpy's RNG seeded per rank, torch's the same on every rank (the same initialization)."""
    random.seed(seed_for(seed, "rank", rank))
    np.random.seed(seed_for(seed, "rank", rank))
    torch.manual_seed(seed)


def check_training_state(model: str, device: torch.device, *, lora: bool, reference: bool):
    """On a GPU, before anything loads: the training state of `model` (its parameters from the safetensors headers:
    16 bytes a trained one, 2 a frozen one; its `reference`'s where the script loads one) must fit this GPU over the
    ranks, else one line naming the fixes that fit (preflight.state_problem). A CPU, or a model whose size can't be
    read: nothing to check."""
    if device.type != "cuda" or not (params := parameter_count(model)):
        return
    gpu_bytes = torch.cuda.get_device_properties(device).total_memory
    world_size = dist.get_world_size()
    if problem := state_problem(params, lora=lora, reference=reference, world_size=world_size, gpu_bytes=gpu_bytes):
        raise InputError(problem)


MAX_TOKENS_PER_MICRO_BATCH = 65536  # a token budget's ceiling: past ~16k tokens a micro-batch gains little more


def micro_batching(
    model: str,
    device: torch.device,
    *,
    given: set[str],
    micro_batch_size: int,
    max_tokens: int,
    attn_implementation: str,
    lora: bool,
    reference: bool,
    gradient_checkpointing: bool,
    colocated: bool,
    longest: int,
    critic: str | None = None,
    reward_model: str | None = None,
    engine_keeps_weights: bool = False,
) -> tuple[int, int, str, str | None]:
    """The micro-batches and training attention of a run on `device`, for those of --micro-batch-size,
    --max-tokens-per-micro-batch and --attn-implementation (`given`: the flags on the command line) a user left out.
    On a GPU, neither micro-batch flag given: packed rows of up to a token budget (memory.token_budget: the GPU's
    memory less the training state, the engine asleep when `colocated`, the log-prob head's chunk, over the model's
    activations a token), through varlen attention where the GPU and torch offer it (preflight.varlen_runs), else
    padded rows, as many of the `longest` sequence as the budget holds, through sdpa. A packed micro-batch without
    --attn-implementation: varlen there too (sdpa computes every token pair of a packed row). The CPU keeps its
    defaults (the scripts' CPU_SIZES: 16 padded rows, its fastest, bench/results/cpu_micro_batches.json). `critic`:
    PPO's value model, trained beside the policy; `reward_model`: a scorer held in bf16 on every GPU;
    `engine_keeps_weights`: a colocated engine that keeps the base's bf16 weights while it sleeps (--lora-sync
    adapter). Returns (micro_batch_size, max_tokens, attn_implementation,
    the start-up line saying what was chosen and why, or None where nothing was)."""
    if device.type != "cuda" or "attn_implementation" in given and max_tokens > 0:
        return micro_batch_size, max_tokens, attn_implementation, None
    from transformers import AutoConfig  # lazy, as in preflight

    config = AutoConfig.from_pretrained(model)
    config = getattr(config, "text_config", None) or config  # a vision-language model's language half
    varlen = "attn_implementation" not in given and varlen_runs(device, config)
    if {"micro_batch_size", "max_tokens_per_micro_batch"} & given:  # the user's micro-batches, the fastest attention
        if max_tokens > 0 and varlen:
            return micro_batch_size, max_tokens, VARLEN, "attention: varlen for the packed rows (each sequence's own)"
        return micro_batch_size, max_tokens, attn_implementation, None
    layers, hidden, vocab = config.num_hidden_layers, config.hidden_size, config.vocab_size
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    params = parameter_count(model) or config_parameters(config)
    state = state_bytes(params, lora=lora, reference=reference)
    if critic:  # PPO's value model, trained beside the policy (a LoRA one: its base frozen)
        state += state_bytes(parameter_count(critic) or params, lora=lora, reference=False)
    held = 0  # on every GPU whole, not sharded: a reward model, an engine's kept weights
    if reward_model:
        held += FROZEN_BYTES * (parameter_count(reward_model) or params)
    if colocated and engine_keeps_weights:
        held += FROZEN_BYTES * params
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    per_token = activation_bytes(
        layers=layers, hidden=hidden, intermediate=intermediate, checkpointing=gradient_checkpointing
    )
    gpu = torch.cuda.get_device_properties(device).total_memory
    budget = token_budget(
        gpu_bytes=gpu,
        state_bytes=state / world_size + held,
        token_bytes=per_token,
        vocab=vocab,
        chunk=LOGIT_CHUNK,
        engine_bytes=4 * GiB if colocated else 0,
    )
    budget = min(budget, MAX_TOKENS_PER_MICRO_BATCH)
    why = (
        f"{per_token / 2**20:.1f} MiB of activations a token ({layers} layers x {hidden}"
        + ", checkpointed" * gradient_checkpointing
        + f"), {state / world_size / GiB:.0f} GiB of training state"
        + f", {held / GiB:.0f} GiB of weights held beside it" * (held > 0)
        + f" on this GPU's {gpu / GiB:.0f} GiB"
        + ", the engine asleep" * colocated
    )
    short = ""
    if budget < longest:  # the longest sequence alone may not fit: said, and given its micro-batch anyway
        short = f"; a sequence of up to {longest} tokens may not fit" + ": --gradient-checkpointing" * (
            not gradient_checkpointing
        )
        budget = -(-longest // 1024) * 1024
    choose = "--max-tokens-per-micro-batch N or --micro-batch-size N to choose"
    if varlen or attn_implementation not in ("sdpa", "eager"):  # an attention that keeps to each packed sequence
        attn = VARLEN if varlen else attn_implementation
        line = f"micro-batches: packed rows of up to {budget} tokens, {attn} attention ({why}; {choose}){short}"
        return micro_batch_size, budget, attn, line
    rows = max(1, budget // longest)
    line = (
        f"micro-batches: {rows} rows padded to the longest, {attn_implementation} attention ({why}; no varlen kernel "
        f"here: it needs a GPU of compute capability 8.0+ and torch.nn.attention.varlen; {choose}){short}"
    )
    return rows, 0, attn_implementation, line


def compile_choice(
    device: torch.device,
    *,
    given: set[str],
    compile: bool,
    attn_implementation: str,
    gradient_checkpointing: bool,
    offload: bool,
    deterministic: bool,
) -> tuple[bool, str | None]:
    """--compile for a run on `device` that gave neither --compile nor --no-compile (`given`: the flags on the command
    line): on a GPU, on where it measured faster, packed micro-batches through varlen attention, full fine-tuning or
    LoRA (two H200s, bench/results/fast_defaults_h200x2.json: the update 1.26x faster at SmolLM2 on addition, 1.12x
    with the calculator, 1.48x at Qwen2.5-1.5B shapes, 1.32x at 7B shapes with LoRA; its first step longer,
    compiling); off with gradient checkpointing, --offload or --deterministic-rollout (not measured), or another
    attention. The CPU keeps its default (off). Without the compiler torch.compile builds its kernels with
    (preflight.compiler_problem): off, said; --compile given, one line naming the fix. Returns (compile, the start-up
    line saying what was chosen and why, or None where nothing was)."""
    if {"compile", "no_compile"} & given:
        if compile and (problem := compiler_problem(device.type)):
            raise InputError(f"--compile: {problem}; or leave --compile out")
        return compile, None
    if device.type != "cuda":
        return compile, None
    unmeasured = [
        name
        for name, on in (
            ("--gradient-checkpointing", gradient_checkpointing),
            ("--offload", offload),
            ("--deterministic-rollout", deterministic),
            (f"{attn_implementation} attention", attn_implementation != VARLEN),
        )
        if on
    ]
    if unmeasured:
        return False, f"compile: off (not measured faster with {', '.join(unmeasured)}; --compile to try it)"
    if problem := compiler_problem(device.type):
        return False, f"compile: off ({problem}, to have it)"
    return True, (
        "compile: on (decoder layers and log-prob head through torch.compile: the update 1.1-1.5x faster, measured; "
        "the first step compiles, 10-40 s more; --no-compile to skip it)"
    )


def config_parameters(config) -> int:
    """A decoder's parameters from its config, for a model whose safetensors headers can't be read here: embeddings
    (and an untied head), and each layer's attention (q, o: hidden^2; k, v: hidden x the key/value heads' width) and
    MLP (3 x hidden x intermediate)."""
    h, i = config.hidden_size, getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    embed = config.vocab_size * h * (1 if getattr(config, "tie_word_embeddings", True) else 2)
    return embed + config.num_hidden_layers * (2 * h * h + 2 * h * (h // heads) * kv + 3 * h * i)


def load_policy(
    model: str,
    device,
    dtype: torch.dtype,
    *,
    lora_rank: int,
    lora_alpha: float,
    lora_sync: str,
    lora_targets: list[str],
    gradient_checkpointing: bool,
    attn_implementation: str,
    compile: bool,
    reference: bool,
):
    """The policy (fp32 masters, `dtype` compute; with `lora_rank` the base frozen in bf16 and an fp32 adapter on
    `lora_targets`, lora.py), FSDP2-sharded; with `reference` (the KL is on) its reference: the policy itself with
    LoRA (its adapter off, lora.adapter_off: no second copy), else a second copy of `model`, frozen. `compile`: its
    decoder layers and log-prob head compiled (fsdp.shard_model, logprobs.compile_head). Returns (policy, reference or
    None)."""
    masters = torch.bfloat16 if lora_rank else torch.float32  # LoRA: the base frozen in bf16, the adapter fp32
    policy = load_model(model, device, masters, gradient_checkpointing, attn_implementation)
    if apply_lora(policy, lora_rank, lora_alpha, lora_targets):  # rank 0: nothing (lora.py)
        print0(lora_line(policy, lora_sync))
    shard_model(policy, param_dtype=dtype, compile=compile)
    if compile:
        compile_head(policy)
    if not reference or lora_rank:
        return policy, policy if reference else None
    ref = load_model(model, device, dtype, attn_implementation=attn_implementation).eval()
    shard_model(ref, param_dtype=None, compile=compile)
    if compile:
        compile_head(ref)
    return policy, ref


def adamw(
    model,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    warmup_steps: int,
    schedule: str,
    min_lr_ratio: float,
    total_steps: int,
):
    """AdamW over what trains of `model` (lora.trainable), fused: no temporaries (foreach allocates sqrt(v) for every
    parameter at once: +4 B/param, 28 GiB at 7B); its LR schedule (fsdp.lr_lambda: `warmup_steps`, then `schedule`
    down to min_lr_ratio x lr) over `total_steps` optimizer steps. Returns (optimizer, scheduler)."""
    optimizer = torch.optim.AdamW(trainable(model), lr=lr, weight_decay=weight_decay, betas=betas, fused=True)
    factor = lr_lambda(warmup_steps, schedule, min_lr_ratio, total_steps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
