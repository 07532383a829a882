"""GRPO, the reading edition: grpo.py's default step over the reading core alone, top to bottom in one file.

    python grpo_minimal.py --model HuggingFaceTB/SmolLM2-135M-Instruct                # 1 GPU, built-in addition
    torchrun --nproc_per_node=8 grpo_minimal.py --model Qwen/Qwen2.5-7B-Instruct --dataset openai/gsm8k
    python grpo_minimal.py --model ./tiny-model --prompts-per-step 4 --group-size 4 --max-new-tokens 64   # CPU

Each step, as the GPU memory sees it (memory.py draws it): wake the in-process SGLang engine up with the policy's
weights, sample G completions of each prompt and score them (reward.py), put the engine to sleep, recompute the
old log-probs, turn each group's rewards into advantages, and take one PPO-clip step on the token mean.
At the same seed it computes what `python grpo.py` computes by default (tests/test_golden.py checks it on a CPU).

What it leaves out, each there in grpo.py: the variants (RLOO, REINFORCE++, GSPO, CISPO, SAPO, Dr.GRPO, clip-higher,
dynamic sampling, the overlong filter, rollout corrections), a reference model and KL, several mini-batches or epochs,
packing, LoRA, tools, reward models, server mode and async rollout, rollout TP, checkpoints and --resume, the
checks that fail bad input in one line before anything loads, Ctrl-C handling, wandb. Its record: a console line a step
and output_dir/run_name/metrics.jsonl.

Shapes: P prompts on this rank, G samples of each (--group-size), B = P x G sequences, T tokens a sequence; per-token
tensors are [B, T-1] (token t is predicted at position t-1).
"""

import json
import os
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Literal

import torch
import torch.distributed as dist
import tyro
from transformers import AutoTokenizer

from common import all_reduce, all_reduce_dict, print0
from data import PromptSampler, collate, label, seed_for, task_prompts
from fsdp import balance, clip_and_step, compute_dtype, init_distributed, load_model, micro_batches, shard_model
from logprobs import batch_logprobs, token_logprobs
from lora import trainable
from memory import ALL_TAGS, MemoryLog, release, sleep, wake_up
from reward import reward_fn, score_samples
from rollout import Rollout, Sampling, SGLangOptions, held_out_eval, mismatch_stats, send_prompts
from rollout import graph_batch, start_engine, step_rollout_stats, stop_engine, stop_token_ids, tp_group


@dataclass
class Args:
    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    """policy to train: a hub id or a local folder"""
    dataset: tuple[str, ...] = ("addition",)
    """'addition' (built in), a hub id ('openai/gsm8k') or a .jsonl file of {"prompt", "answer"} rows (data.py)"""
    prompts_per_step: int = 32
    """prompts per step over all ranks"""
    group_size: int = 16
    """completions per prompt; advantages are normalized within each group"""
    max_prompt_len: int = 256
    """prompts longer than this (in tokens) are dropped"""
    max_new_tokens: int = 256
    """response length limit"""
    temperature: float = 1.0
    """sampling temperature (the log-probs are taken at the same temperature)"""
    steps: int = 200
    """training steps, one rollout batch each"""
    lr: float = 1e-6
    """AdamW's learning rate"""
    clip: float = 0.2
    """the ratio is clipped to [1 - clip, 1 + clip]"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    micro_batch_size: int = 8
    """sequences per forward and backward on each rank"""
    unformatted_credit: float = 0.25
    """reward for a right answer not in the asked format ('#### N'); one in it earns 1.0"""
    format_weight: float = 0.0
    """reward += this for an answer in the asked format, right or wrong"""
    num_eval_prompts: int = 256
    """held-out prompts per evaluation (greedy)"""
    eval_every: int = 20
    """evaluate every this many steps and after the last (0: never)"""
    rollout_engine: Literal["auto", "sglang", "hf"] = "auto"
    """sglang on a GPU, hf (plain transformers) on a CPU"""
    sglang_mem_fraction: float = 0.6
    """share of the GPU for SGLang's weights and KV cache while it is awake"""
    seed: int = 0
    """seeds the prompt order, the sampling and the update's shuffle"""
    log_samples_every: int = 10
    """print a completion every this many steps (0: never)"""
    output_dir: str = "runs"
    """metrics.jsonl goes to output_dir/run_name"""
    run_name: str = "grpo_minimal"


# ----------------------------------------------------------------------------------------------
# ALGO: GRPO's advantages and loss (grpo.py has these and the variants beside them)

ADVANTAGE_EPS = 1e-6  # added to a group's reward std: a group of near-equal rewards stays finite


def group_advantages(rewards_P_G: torch.Tensor) -> torch.Tensor:
    """Each reward minus its group's mean, over the group's (unbiased) std: [P, G] -> [P, G]."""
    centred = rewards_P_G - rewards_P_G.mean(dim=1, keepdim=True)
    return centred / (rewards_P_G.std(dim=1, keepdim=True) + ADVANTAGE_EPS)


def grpo_loss(logp, mb, *, clip: float, num_tokens: float):
    """PPO-clip per token, max(-A r, -A clip(r, 1 - clip, 1 + clip)) with r = exp(logp - old_logp), summed over this
    micro-batch's loss tokens and divided by the whole mini-batch's on all ranks (`num_tokens`): the micro-batches' losses
    on all ranks add up to the token mean, and FSDP sums their gradients (fsdp.shard_model sets no divide factor).
    logp [b, t]. Returns (loss, tokens clipped)."""
    ratio = torch.exp(logp - mb.old_logprobs)  # [b, t]
    unclipped, clipped = -mb.advantages * ratio, -mb.advantages * ratio.clamp(1 - clip, 1 + clip)
    token_loss = torch.maximum(unclipped, clipped)  # [b, t]
    loss = (token_loss * mb.loss_mask).sum() / max(num_tokens, 1.0)
    return loss, ((clipped > unclipped).float() * mb.loss_mask).sum()


def update(policy, optimizer, scheduler, batch, args: Args, *, step: int, device) -> dict:
    """One optimizer step on the rollout batch (this rank's [B, T-1] fields, advantages set), its rows shuffled and cut
    into micro-batches whose gradients add up. Returns the train/ metrics, all ranks'."""
    policy.train()
    totals = {
        k: torch.zeros((), dtype=torch.float64, device=device) for k in ("loss", "clip_frac", "entropy", "tokens")
    }
    lengths = batch.attention_mask.sum(-1)  # [B] real tokens
    order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(seed_for(args.seed, "update", step, 0)))
    num_tokens = float(all_reduce(batch.loss_mask.sum()))  # the token mean's denominator: every rank's tokens
    for rows in micro_batches(order, lengths, args.micro_batch_size):  # PLUMBING: as many on every rank (FSDP)
        mb = batch.select(rows).to(device)  # [b, t] fields
        logp, entropy = token_logprobs(policy, mb.input_ids, mb.attention_mask, args.temperature, with_entropy=True)
        loss, clipped = grpo_loss(logp, mb, clip=args.clip, num_tokens=num_tokens)
        loss.backward()
        totals["loss"] += loss.detach()
        totals["clip_frac"] += clipped
        totals["entropy"] += (entropy * mb.loss_mask).sum()
        totals["tokens"] += mb.loss_mask.sum()
    grad_norm = clip_and_step(policy, optimizer, scheduler, args.max_grad_norm)  # a NaN/inf norm skips the step
    totals = all_reduce_dict(totals)  # a CPU-GPU sync point, once per step
    tokens = totals["tokens"].clamp(min=1)
    return {
        "train/loss": totals["loss"],
        "train/clip_frac": totals["clip_frac"] / tokens,
        "train/entropy": totals["entropy"] / tokens,
        "train/grad_norm": grad_norm,
    }


# ----------------------------------------------------------------------------------------------
# main: the set-up, then the loop


def main(args: Args):
    rank, world_size, device = init_distributed()  # torchrun's ranks, or a world of one
    dtype = compute_dtype(device)  # bf16 on a GPU (fp32 on a CPU without bf16 instructions)
    torch.manual_seed(args.seed)
    run_dir = os.path.join(args.output_dir, args.run_name)
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)

    # the task: prompts (data.py), and what a completion earns (reward.py: 1 for a right '#### N' answer)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_prompts, eval_prompts, data_line = task_prompts(
        tokenizer,
        list(args.dataset),
        None,
        seed=args.seed,
        num_eval=args.num_eval_prompts,
        max_prompt_len=args.max_prompt_len,
    )
    reward = partial(reward_fn, unformatted_credit=args.unformatted_credit, format_weight=args.format_weight)
    sampler = PromptSampler(len(train_prompts.ids), args.seed)  # epochs of shuffled prompts
    stop_ids = stop_token_ids(tokenizer, args.model)
    sampling = Sampling(args.max_new_tokens, stop_ids, temperature=args.temperature)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    print0(f"data: {data_line} | {world_size} ranks")

    # the engine first, on each rank's GPU: SGLang sizes its KV cache from the memory it finds free
    kind = args.rollout_engine if args.rollout_engine != "auto" else ("sglang" if device.type == "cuda" else "hf")
    requests = args.prompts_per_step * args.group_size // world_size  # decoded at once: CUDA graphs up to that many
    options = SGLangOptions(mem_fraction=args.sglang_mem_fraction, cuda_graph_max_bs=graph_batch(requests, None))
    engine = start_engine(kind, args.model, seed=args.seed, sglang=options, dtype=dtype)
    release(engine, ALL_TAGS)  # asleep until the first weight sync
    dist.barrier()  # no rank loads its model before every engine has measured free memory
    rollout = Rollout(engine, tp_group(1), sampling, tokenizer)

    # the policy: fp32 masters, FSDP2 (each decoder layer, then the root), computing in `dtype`
    policy = load_model(args.model, device, torch.float32)
    shard_model(policy, param_dtype=dtype)
    optimizer = torch.optim.AdamW(trainable(policy), lr=args.lr, weight_decay=0.0, fused=True)  # its shards
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)  # a constant learning rate
    mem = MemoryLog()  # seconds and GPU memory per phase
    tenants = dict(models=[policy], optimizers=[optimizer], offload=False, mem=mem)  # what shares the GPU with SGLang
    sync_dtype = dtype if kind == "hf" else torch.bfloat16  # SGLang computes in bf16

    local_prompts = args.prompts_per_step // world_size
    for step in range(1, args.steps + 1):
        t_step = time.time()
        mem.reset()

        # -- 1. wake SGLang up with the policy's weights (memory.py: free grads, resume weights, sync, resume KV)
        wake_up(engine, policy=policy, dtype=sync_dtype, **tenants)
        if args.eval_every and step > 1 and (step - 1) % args.eval_every == 0:
            with mem.phase("eval"):
                print0(f"eval after step {step - 1} | {held_out_line(rollout, eval_prompts, step - 1, args.seed)}")

        # -- 2. rollout: G samples of each of this rank's prompts, scored
        with mem.phase("generate"):
            pending = send_prompts(
                rollout,
                sampler,
                train_prompts,
                n=args.prompts_per_step,
                group_size=args.group_size,
                seeds=(args.seed, "sample", step, 0),  # each sample's own, from its place in the step's draw
            )
            samples = label(pending.result(), [train_prompts.examples[i] for i in pending.sample_idx])
            score_samples(reward, samples, workers=8, timeout_s=30.0)  # in threads; one that fails scores 0

        # -- 3. SGLang sleeps: it frees its KV cache and weights (memory.sleep)
        sleep(engine, device=device, **tenants)
        metrics = {"step": step, **step_rollout_stats(samples, pending, generate_s=mem.seconds["generate"])}

        # -- 4. the batch, and the old log-probs from the training model (no gradient)
        groups_P_G = [samples[g : g + args.group_size] for g in range(0, len(samples), args.group_size)]
        tokens_P = [sum(len(s.prompt_ids) + len(s.response_ids) for s in samples_G) for samples_G in groups_P_G]
        groups_P_G = balance(groups_P_G, tokens_P, world_size, share=local_prompts)  # PLUMBING: even tokens a rank
        samples_B = [s for samples_G in groups_P_G for s in samples_G]
        batch = collate(samples_B, pad_id)
        batch.loss_mask = batch.response_mask.clone()  # [B, T-1]: the response's tokens
        with mem.phase("logprob"):
            batch.old_logprobs = batch_logprobs(policy, batch, args.micro_batch_size, args.temperature, device)
        batch.is_weight = None
        metrics.update(mismatch_stats(batch))  # the sampler's log-probs vs the trainer's: did the sync work?

        # -- 5. advantages: each group's rewards, centred and scaled
        rewards_P_G = torch.tensor([s.reward for s in samples_B]).view(-1, args.group_size)
        batch.advantages = group_advantages(rewards_P_G).view(-1)[:, None] * batch.response_mask  # [B, T-1]

        # -- 6. update: one optimizer step over micro-batches
        with mem.phase("update"):
            metrics.update(update(policy, optimizer, scheduler, batch, args, step=step, device=device))

        # -- 7. the step's line and metrics row
        metrics = {k: float(v) for k, v in metrics.items()} | {"time/step": time.time() - t_step}
        print0(
            f"step {step}/{args.steps} | reward {metrics['rollout/reward_mean']:.3f} | "
            f"acc {metrics['rollout/strict_acc']:.3f} | len {metrics['rollout/response_len_mean']:.0f} | "
            f"loss {metrics['train/loss']:.4f} | gnorm {metrics['train/grad_norm']:.2f} | "
            f"{metrics['time/step']:.1f}s"
        )
        if args.log_samples_every and step % args.log_samples_every == 0:
            print0(f"  sample (reward {samples[0].reward:.2f}, answer {samples[0].answer}): {samples[0].text[:300]!r}")
        if rank == 0:
            with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(metrics) + "\n")

    if args.eval_every:  # the last evaluation
        wake_up(engine, policy=policy, dtype=sync_dtype, **tenants)
        print0(f"eval after step {args.steps} | {held_out_line(rollout, eval_prompts, args.steps, args.seed)}")
    stop_engine(engine)
    dist.destroy_process_group()


def held_out_line(rollout, eval_prompts, step: int, seed: int) -> str:
    """Greedy accuracy on the held-out prompts (rollout.held_out_eval), as a console line."""
    evaluation = held_out_eval(rollout, eval_prompts, step=step, k=0, temperature=1.0, top_p=1.0, seed=seed)
    return " | ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in evaluation.items() if "acc" in k)


if __name__ == "__main__":  # SGLang starts its scheduler with multiprocessing spawn: keep this guard
    args = tyro.cli(Args)
    main(replace(args, output_dir=os.path.expanduser(args.output_dir)))
