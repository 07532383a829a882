"""PLUMBING: pieces grpo.py's and ppo.py's `main`s start a run with, each a call with explicit parameters (no algorithm
here: each script's own is written out in it).

    seed_ranks(args.seed, rank)                                    # Python's and numpy's per rank, torch's shared
    check_training_state(args.model, device, lora=False, reference=True)   # a 7B full fine-tuning on one GPU: stop
    policy, ref = load_policy(args.model, device, dtype, lora_rank=0, ..., reference=True)   # FSDP2-sharded
    optimizer, scheduler = adamw(policy, lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999), ..., total_steps=200)
"""

import random

import numpy as np
import torch
import torch.distributed as dist

from common import InputError, print0
from data import seed_for
from fsdp import load_model, lr_lambda, shard_model
from logprobs import compile_head
from lora import apply_lora, lora_line, trainable
from preflight import parameter_count, state_problem


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
