"""Reward model: a Bradley-Terry model trained on preference pairs, FSDP2; the RLHF step between SFT and PPO/GRPO.

    python train_rm.py --model HuggingFaceTB/SmolLM2-135M-Instruct --dataset pairs.jsonl           # 1 GPU
    torchrun --nproc_per_node=8 train_rm.py --model runs/<sft run>/checkpoints/step_N/model --dataset pairs.jsonl
    python train_rm.py --model ./tiny-model --dataset pairs.jsonl                                   # CPU
    python grpo.py --model M --reward-model runs/<rm run>/checkpoints/step_N/model --reward-weights 0 1  # then use it

Rows {"prompt": text or chat messages, "chosen": text, "rejected": text, "group": optional text}. The model (a base or
instruct model, or a policy checkpoint's model/ folder) gets a fresh one-output head, read at each conversation's last
token (reward_model.last_token_scores). Each step scores both sides of --pairs-per-step pairs and lowers
-log sigmoid(r_chosen - r_rejected); each evaluation reports held-out pairwise accuracy, margin and loss, per "group"
too. A checkpoint's model/ is a one-label *ForSequenceClassification folder: grpo.py and ppo.py --reward-model read it.
What it simplifies: the pairs in a seeded shuffle, epoch after epoch (no length bucketing); right-padded micro-batches;
a conversation longer than --max-len loses its end; no margin term or score-centring regularizer in the loss.
"""

import math
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass
from typing import Literal

from common import exit_on_interrupt  # first (stdlib only): a Ctrl-C while torch loads (~1.5 s) is one line

exit_on_interrupt("train_rm.py")
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from checkpoint import checkpoint_to_resume, load_checkpoint, save_checkpoint
from data import PromptSampler, load_pairs, shard, source_name, split_pairs
from fsdp import clip_and_step, compute_dtype, init_distributed, load_model, lr_lambda, shard_model
from lora import trainable
from preflight import check_flags, check_model, friendly_errors, package_rules, parse_args
from reward_model import chat_template, conversation, has_reward_head, last_token_scores, pad, rm_tokens, score
from runlog import RunLog, StepClock, claim_run_dir, legend, log_line, run_info
from stop import NonFinite
from common import InputError, agreed_signal, all_reduce_dict, allow_interrupt, handle_signals, print0


@dataclass
class Args:
    # --- model and data
    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    """the starting point: a hub id or folder of a base or instruct model, or a policy checkpoint's
    runs/<run>/checkpoints/step_N/model; its body gets a fresh one-output head (a reward model keeps its own)"""
    dataset: str = "pairs.jsonl"
    """preference pairs: a .jsonl (or .parquet) file of rows {"prompt": text or chat messages, "chosen": text,
    "rejected": text, "group": optional text}; rows with an empty side or identical sides are skipped and counted"""
    eval_dataset: str | None = None
    """held-out pairs in the same format; default: a seeded 1 in 10 of --dataset's pairs, whole prompts, never trained on"""
    num_eval_pairs: int = 512
    """held-out pairs per evaluation, at most"""
    chat_template: str | None = None
    """a chat template (a FILE.jinja or the text) for a tokenizer without one; the exported model's tokenizer keeps it"""
    max_len: int = 1024
    """conversations (the prompt, then the response, through the chat template) cut to this many tokens (counted)"""
    # --- optimization
    steps: int = 200
    """training steps (one optimizer step each)"""
    pairs_per_step: int = 64
    """pairs per step over all ranks (must divide by the number of ranks)"""
    micro_batch_size: int = 8
    """pairs per forward/backward per rank, both sides in one forward (gradient accumulation over micro-batches)"""
    lr: float = 1e-5
    """peak learning rate (AdamW); SmolLM2-135M as an RM needed 5e-5 to learn the sum-only pairs (bench/results/README.md)"""
    lr_schedule: Literal["constant", "cosine", "linear"] = "cosine"
    """decay after warm-up, reaching min_lr_ratio * lr at the last step"""
    warmup_steps: int = 0
    """steps of linear warm-up from 0"""
    min_lr_ratio: float = 0.1
    """final lr / peak lr for cosine and linear schedules"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's betas (decay of the gradient's running mean and of its square)"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    seed: int = 0
    """seeds the data order and the held-out split"""
    # --- memory and systems
    gradient_checkpointing: bool = False
    """recompute activations in backward (less memory, ~30% more compute)"""
    attn_implementation: str = "sdpa"
    """transformers attention ('flash_attention_2' if flash-attn is installed)"""
    # --- evaluation, checkpoints and logging
    eval_every: int = 20
    """held-out evaluation every this many steps (0: never), and after the last step"""
    eval_before_train: bool = False
    """also evaluate before the first update"""
    save_every: int = 100
    """checkpoint every this many steps (0: only at the end; -1: never)"""
    keep_checkpoints: int = 2
    """newest checkpoints kept (0: all)"""
    save_on_signal: bool = True
    """on Ctrl-C or SIGTERM (preemption), save the finished steps before exiting"""
    max_nonfinite_steps: int = 3
    """stop after this many steps in a row that skipped their update for a NaN/inf loss or gradient"""
    output_dir: str = "runs"
    """runs are written to output_dir/run_name"""
    run_name: str | None = None
    """default: rm-<model>-<dataset>-s<seed>"""
    resume: bool = False
    """continue from the latest checkpoint of this run"""
    track: bool = False
    """log to Weights & Biases"""
    wandb_project: str = "reward-model"
    """wandb project"""


# PLUMBING: without a GPU, these replace the defaults of the flags not given; the console lines: (name, metric, format,
# what it is: the legend printed before step 1)
CPU_SIZES = {"pairs_per_step": 8, "max_len": 256, "num_eval_pairs": 64}
CONSOLE = [
    ("loss", "train/loss", ".4f", "-log sigmoid(r_chosen - r_rejected), the step's mean"),
    ("acc", "train/pair_acc", ".3f", "share of the step's pairs scored chosen over rejected"),
    ("margin", "train/margin", ".3f", "r_chosen - r_rejected, mean"),
    ("gnorm", "train/grad_norm", ".3f", "gradient norm before clipping"),
    ("lr", "train/lr", ".1e", "learning rate"),
    ("step s", "perf/step_s", ".2f", "seconds of the step"),
]
EVAL_LINE = [("acc", "eval/pair_acc", ".3f"), ("margin", "eval/margin", ".3f"), ("loss", "eval/loss", ".4f")]

# ----------------------------------------------------------------------------------------------
# ALGO: the Bradley-Terry loss (tests/test_train_rm.py checks it by hand)


def pairwise_loss(chosen: torch.Tensor, rejected: torch.Tensor, *, num_pairs: float):
    """Bradley-Terry: P(chosen preferred) = sigmoid(r_chosen - r_rejected); the loss is its negative log-likelihood,
    -log sigmoid(r_c - r_r) = log(1 + exp(-(r_c - r_r))). Scores [P] each. A worked example: margins 2 and -1 cost
    log(1 + e^-2) = 0.1269 and log(1 + e^1) = 1.3133. Only differences are fitted: the scores' offset is arbitrary.

    Returns (this rank's share of the step's mean loss: the sum over these pairs / num_pairs, every rank's pairs of
    the step; FSDP sums the gradients over ranks, so they are the mean's), and sums for the metrics: loss, correct
    (r_c > r_r; a tie counts half: an untrained zero head scores 0.5), margin."""
    margin = chosen - rejected  # [P]
    per_pair = -F.logsigmoid(margin)  # [P], stable for any margin
    correct = (margin > 0).float() + 0.5 * (margin == 0).float()  # [P]
    stats = {"loss": per_pair.detach().sum(), "correct": correct.sum(), "margin": margin.detach().sum()}
    return per_pair.sum() / num_pairs, stats


def check_args(a: Args, world_size: int):
    """Bad input fails here, before anything is loaded or written."""
    check_flags(
        [  # (flag, value, holds, what it must be)
            ("--steps", a.steps, a.steps >= 1, ">= 1"),
            (
                "--pairs-per-step",
                a.pairs_per_step,
                a.pairs_per_step >= 1 and a.pairs_per_step % world_size == 0,
                f">= 1 and divide by the {world_size} ranks",
            ),
            ("--micro-batch-size", a.micro_batch_size, a.micro_batch_size >= 1, ">= 1"),
            ("--max-len", a.max_len, a.max_len >= 2, ">= 2"),
            ("--num-eval-pairs", a.num_eval_pairs, a.num_eval_pairs >= 1, ">= 1 (--eval-every 0: no evaluation)"),
            ("--lr", a.lr, a.lr > 0, "> 0"),
            ("--warmup-steps", a.warmup_steps, a.warmup_steps >= 0, ">= 0"),
            ("--min-lr-ratio", a.min_lr_ratio, 0 <= a.min_lr_ratio <= 1, "in [0, 1]"),
            ("--weight-decay", a.weight_decay, a.weight_decay >= 0, ">= 0"),
            ("--adam-betas", a.adam_betas, all(0 <= b < 1 for b in a.adam_betas), "two numbers in [0, 1)"),
            ("--max-grad-norm", a.max_grad_norm, a.max_grad_norm > 0, "> 0"),
            ("--eval-every", a.eval_every, a.eval_every >= 0, ">= 0"),
            ("--save-every", a.save_every, a.save_every >= -1, ">= -1"),
            ("--keep-checkpoints", a.keep_checkpoints, a.keep_checkpoints >= 0, ">= 0"),
            ("--max-nonfinite-steps", a.max_nonfinite_steps, a.max_nonfinite_steps >= 1, ">= 1"),
            *package_rules(track=a.track, attn_implementation=a.attn_implementation),  # wandb; attention that trains
        ]
    )


# ----------------------------------------------------------------------------------------------


def main(args: Args):
    handle_signals()  # Ctrl-C and SIGTERM stop the run after the step in progress (stop.py)
    allow_interrupt(True)  # until the loop: a signal ends the run at once, nothing to save yet
    rank, world_size, device = init_distributed()
    dtype = compute_dtype(device)  # bf16; fp32 on a CPU without bf16 instructions (fsdp.py says why)
    check_args(args, world_size)
    run_name = (
        args.run_name or f"rm-{os.path.basename(args.model.rstrip('/'))}-{source_name(args.dataset)}-s{args.seed}"
    )
    run_dir = claim_run_dir(args.output_dir, run_name, resume=args.resume)  # runlog.py: this script's, locked
    resume_from = checkpoint_to_resume(run_dir, args.resume, asdict(args))  # resumed: the flags it started with
    tokenizer, context = check_model(args.model, raw_text=False)  # the template: chat_template below
    if context is not None and args.max_len > context:
        raise InputError(
            f"--max-len {args.max_len} is more than {args.model!r}'s context of {context} tokens: lower it"
        )
    own_head = has_reward_head(
        args.model, "--model", fix="pass a language model (it gets a one-output head) or a reward model"
    )
    # PLUMBING: the template conversations are read with, kept by the exported tokenizer, so grpo.py reads them alike
    tokenizer.chat_template = chat_template(
        tokenizer, args.model, args.chat_template, flag="--model", template_flag="--chat-template"
    )

    # ---- data: before the model loads, so a bad file fails fast ------------------------------------
    pairs, skipped = load_pairs(args.dataset)
    if args.eval_dataset:
        held, skipped_eval = load_pairs(args.eval_dataset, "--eval-dataset")
        seen = {
            (str(p.prompt), p.chosen, p.rejected) for p in pairs
        }  # a pair also trained on measures no generalization
        held, note = held[: args.num_eval_pairs], f"eval pairs from {args.eval_dataset}"
        note += f", {sum((str(p.prompt), p.chosen, p.rejected) in seen for p in held)} of them also in --dataset"
        skipped = {k: v + skipped_eval[k] for k, v in skipped.items()}
    else:
        pairs, held, note = split_pairs(pairs, seed=args.seed, num_eval=args.num_eval_pairs, where=args.dataset)

    def tokenize(
        part, source
    ):  # [(chosen ids, rejected ids, group)], conversations cut to --max-len, pairs it made equal
        rows, cut = rm_tokens(
            tokenizer,
            [conversation(p.prompt, side) for p in part for side in (p.chosen, p.rejected)],
            template=tokenizer.chat_template,
            max_len=args.max_len,
            item=f"{source}: a pair",
        )
        kept = [(c, r, p.group) for c, r, p in zip(rows[0::2], rows[1::2], part) if c != r]  # a tie teaches nothing
        if part and not kept:
            raise InputError(
                f"every pair of {source} is the same on both sides after the cut to --max-len {args.max_len}: "
                f"raise --max-len (the responses differ only after it)"
            )
        return kept, cut, len(part) - len(kept)

    conversations = 2 * (len(pairs) + len(held))  # before the cut: a pair's chosen and rejected
    (train, cut, same), (held, held_cut, held_same) = (
        tokenize(pairs, args.dataset),
        tokenize(held, args.eval_dataset or args.dataset),
    )
    groups = sorted({g for _, _, g in held if g})  # held-out accuracy is also reported per group
    sampler = PromptSampler(len(train), args.seed)  # a seeded shuffle of the pairs, epoch after epoch, resumable
    shown = groups[:8]  # the console's (metrics.jsonl has every group's accuracy): a group per prompt would fill lines
    note += "".join(f", {g} {sum(x == g for _, _, x in held)}" for g in shown) + f", +{len(groups) - 8} groups" * (
        len(groups) > 8
    )
    print0(
        f"data: {len(train)} train pairs, {len(held)} eval pairs ({note}) | skipped{' (both files)' * bool(args.eval_dataset)} "
        f"{skipped['empty']} with an empty side, {skipped['identical']} with identical sides | cut to --max-len "
        f"{args.max_len}: {cut + held_cut} of {conversations} conversations, {same + held_same} pairs the same after it, "
        f"skipped | {world_size} ranks"
    )
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    # ---- the model: --model's body and a one-output head (fp32 masters, `dtype` compute) ---------
    from transformers import AutoModelForSequenceClassification  # lazy: keeps `import train_rm` fast

    model = load_model(
        args.model,
        device,
        torch.float32,
        args.gradient_checkpointing,
        args.attn_implementation,
        AutoModelForSequenceClassification,
        new_head=not own_head,
        num_labels=1,
    )
    model.config.pad_token_id = pad_id = tokenizer.pad_token_id  # HF's own pooling finds the last token by it
    if not own_head:  # ALGO: every score starts at 0: loss log 2 = 0.693, accuracy 0.5 (ties) before the first step
        for p in model.score.parameters():
            torch.nn.init.zeros_(p)
    shard_model(model, param_dtype=dtype)
    optimizer = torch.optim.AdamW(
        trainable(model), lr=args.lr, weight_decay=args.weight_decay, betas=args.adam_betas, fused=True
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(args.warmup_steps, args.lr_schedule, args.min_lr_ratio, args.steps)
    )

    start_step = 0
    if resume_from:
        state = load_checkpoint(resume_from, {"model": (model, optimizer)})
        sampler.load_state_dict(state["sampler"])
        scheduler.load_state_dict(state["scheduler"])
        start_step = state["step"]
        print0(f"resumed from {resume_from}: step {start_step}, data epoch {sampler.epoch} index {sampler.index}")
    allow_interrupt(False)  # from here on a signal stops the run after the step in progress
    log = RunLog(
        run_dir,
        config=asdict(args),
        start_step=start_step,
        info=run_info(world_size, "none"),
        track=args.track,
        project=args.wandb_project,
        run_name=run_name,
        eval_redone=start_step == 0 and args.eval_before_train,
    )
    last_saved, nonfinite = start_step, NonFinite(args.max_nonfinite_steps)

    def save(step: int):
        nonlocal last_saved
        t0 = time.time()
        path = save_checkpoint(
            run_dir,
            step,
            {"model": (model, optimizer)},
            {"model": model},
            tokenizer,
            {"step": step, "sampler": sampler.state_dict(), "scheduler": scheduler.state_dict(), "args": asdict(args)},
            args.keep_checkpoints,
        )
        last_saved = step
        print0(f"saved {path} ({time.time() - t0:.1f}s)")

    def evaluate(step: int):
        """Pairwise accuracy, margin and loss on the held-out pairs (per group too), each rank a strided share."""
        share = held[rank::world_size]
        scores = score(
            model,
            [c for c, _, _ in share] + [r for _, r, _ in share],
            pad_id=pad_id,
            micro_batch_size=2 * args.micro_batch_size,
            device=device,
        )  # [2n]: chosen, then rejected
        chosen, rejected = scores[: len(share)], scores[len(share) :]  # [n] each
        sums = {"pairs": len(share), **pairwise_loss(chosen, rejected, num_pairs=1.0)[1]}
        for g in groups:
            mask = torch.tensor([x == g for _, _, x in share], dtype=torch.bool)  # [n]
            sums[f"{g}/pairs"] = mask.sum()
            sums[f"{g}/correct"] = pairwise_loss(chosen[mask], rejected[mask], num_pairs=1.0)[1]["correct"]
        sums = all_reduce_dict({k: torch.as_tensor(v, dtype=torch.float64) for k, v in sums.items()})
        n = sums["pairs"]
        out = {
            "step": step,
            "eval/pair_acc": sums["correct"] / n,
            "eval/margin": sums["margin"] / n,
            "eval/loss": sums["loss"] / n,
            **{f"eval/pair_acc/{g}": sums[f"{g}/correct"] / sums[f"{g}/pairs"] for g in groups},
        }
        out = {k: float(v) for k, v in out.items()}
        print0(log_line(f"eval after step {step}", out, EVAL_LINE + [(g, f"eval/pair_acc/{g}", ".3f") for g in shown]))
        log.log(out)

    # ---- the loop ----------------------------------------------------------------------------------
    model.train()  # HF's gradient checkpointing runs in training mode only (no dropout either way: fsdp.load_model)
    if args.eval_every and args.eval_before_train and start_step == 0:
        evaluate(0)
    print0(legend(CONSOLE))
    clock = StepClock(total=args.steps, start=start_step)  # 'step 3/200 | eta 1:02', the last lines
    for step in range(start_step + 1, args.steps + 1):
        t_step = time.time()
        mine = shard(sampler.draw(args.pairs_per_step), rank, world_size)  # this rank's pairs: as many on every rank
        totals = {k: torch.zeros((), dtype=torch.float64, device=device) for k in ("loss", "correct", "margin")}
        for k in range(0, len(mine), args.micro_batch_size):
            rows = [train[i] for i in mine[k : k + args.micro_batch_size]]
            ids, mask = pad([c for c, _, _ in rows] + [r for _, r, _ in rows], pad_id)  # [2b, T]: chosen, then rejected
            scores = last_token_scores(model, ids.to(device), mask.to(device))  # [2b], gradients flow
            # ALGO: -log sigmoid(r_chosen - r_rejected), summed over these pairs / the step's pairs on all ranks
            loss, stats = pairwise_loss(scores[: len(rows)], scores[len(rows) :], num_pairs=args.pairs_per_step)
            loss.backward()
            for key, v in stats.items():
                totals[key] += v
        grad_norm = clip_and_step(model, optimizer, scheduler, args.max_grad_norm)  # NaN/inf: the update is skipped
        totals = all_reduce_dict(totals)  # a CPU-GPU sync point, once per step
        metrics = {
            "step": step,
            "train/loss": totals["loss"] / args.pairs_per_step,
            "train/pair_acc": totals["correct"] / args.pairs_per_step,
            "train/margin": totals["margin"] / args.pairs_per_step,
            "train/grad_norm": grad_norm,
            "train/lr": scheduler.get_last_lr()[0],
            "train/nonfinite_skips": float(not math.isfinite(grad_norm)),
            "perf/step_s": time.time() - t_step,
        }
        if device.type == "cuda":  # the trainer's peak, and what torch's caching allocator holds (nvidia-smi sees that)
            metrics |= {
                "perf/peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30,
                "perf/reserved_gib": torch.cuda.memory_reserved() / 2**30,
            }
        metrics = {k: float(v) for k, v in metrics.items()}
        print0(log_line(clock.label(step), metrics, CONSOLE))
        log.log(metrics)
        if warning := nonfinite.after_step(step, int(metrics["train/nonfinite_skips"]), 1):
            print0(warning)
        if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
            evaluate(step)
        if args.save_every >= 0 and ((args.save_every and step % args.save_every == 0) or step == args.steps):
            save(step)
        if signum := agreed_signal():  # every rank stops here, after the same step: save what is not saved yet
            if args.save_on_signal and args.save_every >= 0 and step > last_saved:
                save(step)
            log.finish()
            clock.summary(run_dir, EVAL_LINE, stopped=True)
            again = " ".join(sys.argv) + " --resume" * (not args.resume)
            print0(
                f"stopped by {signal.Signals(signum).name} after step {step}; continue from step {last_saved} with: "
                f"{'torchrun --nproc_per_node=' + str(world_size) if 'RANK' in os.environ else 'python'} {again}"
            )
            dist.destroy_process_group()
            raise SystemExit(128 + signum)
    log.finish()  # curves.png too
    clock.summary(run_dir, EVAL_LINE)  # steps, time, held-out accuracy, where the checkpoint and curves are
    dist.destroy_process_group()


if __name__ == "__main__":
    with friendly_errors("train_rm.py"):
        main(parse_args(Args, CPU_SIZES))  # no GPU: CPU_SIZES for the flags not given (preflight.parse_args)
