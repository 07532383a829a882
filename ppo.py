"""PPO with a critic: FSDP2 actor + critic, GAE, KL penalty in the reward, colocated SGLang rollout.

    python ppo.py --model HuggingFaceTB/SmolLM2-135M-Instruct                 # 1 GPU, built-in addition task
    torchrun --nproc_per_node=8 ppo.py --model Qwen/Qwen2.5-7B-Instruct --critic-model Qwen/Qwen2.5-7B-Instruct \
        --dataset openai/gsm8k --offload
    python ppo.py --model ./tiny-model --rollout-engine hf                    # CPU, no SGLang
    python ppo.py --rollout-mode server --rollout-url http://HOST:30000 [--async-rollout]    # SGLang on GPUs of its own

Each step (main's loop, its phases called by name): wake SGLang up and sync the actor's weights (memory.wake_up),
evaluate when due, sample completions and score them (the reward bound in main: reward.reward_fn or --reward), sleep
SGLang (memory.sleep), recompute old log-probs, reference log-probs and values, turn the score on the last token plus a
per-token KL penalty into per-token rewards, estimate advantages by GAE, whiten them, then `update`: clipped-value steps
on the critic and PPO-clip steps on the actor. The file reads as grpo.py: Args, the flags' checks, the PPO pieces,
update, main (its set-up, each a named call, and the critic; then the loop).

The recipe of Ziegler et al. (2019) / InstructGPT as verl and OpenRLHF run it. Options: a fixed KL
coefficient or an adaptive controller toward --target-kl, critic warm-up steps, an entropy bonus.
What it simplifies: as grpo.py, plus token-mean loss aggregation only, and truncated responses
are treated as ending (no bootstrap from the value of the cut-off state; see --overlong-filter).
"""

import math
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Literal

from common import exit_on_interrupt  # first (stdlib only): a Ctrl-C while torch loads (~1.5 s) is one line

exit_on_interrupt("ppo.py")
import torch
import torch.distributed as dist

from checkpoint import Checkpoints, checkpoint_to_resume, model_fingerprint
from common import agreed_signal, all_reduce, all_reduce_dict, allow_interrupt, handle_signals, print0
from data import PromptSampler, collate, label, seed_for, source_name, task_prompts, template_rule
from fsdp import (
    balance,
    clip_and_step,
    compute_dtype,
    deterministic_training,
    init_distributed,
    load_model,
    matmul_params,
    micro_batches,
    shard_model,
    skip_schedule,
    throughput,
)
from logprobs import batch_forward, forward_tokens, old_and_ref_logprobs, token_logprobs
from lora import LORA_LR_FACTOR, GapCheck, apply_lora, check_lora, default_lr, lora_rules
from memory import MemoryLog, sleep, wake_up
from preflight import check_engine, check_flags, check_model, engine_count, friendly_errors, given_flags, parse_args
from preflight import package_rules, rollout_rules, sampling_rules
from reward import EVAL_LINE, EVAL_TOOLS_LINE, REWARD_LINE, reward_fn, sampled_line, score_samples
from reward_jail import load_user_reward
from reward_model import RM_LINE, check_reward_model, load_reward_model, rm_flag_rules, rm_rewards
from rollout import Sampling, SGLangOptions, held_out_eval, mismatch_stats, send_prompts, step_rollout_stats
from rollout import stop_engine, stop_token_ids
from runlog import CLIP, SAMPLES_LINE, TIMES_LINE, TRUNC, RunLog, StepClock, claim_run_dir, default_run_name, eval_due
from runlog import legend, log_line, progress, run_info
from server import ServerOptions, start_rollout
from start import adamw, check_training_state, compile_choice, load_policy, micro_batching, seed_ranks
from stop import NonFinite, stop_run
from tools import TOOLS_LINE, select_tools, tool_call_stop_ids, tool_rules, tool_stats, tools_for


@dataclass
class Args:
    # --- model and data
    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    """actor to train: a hub id or a local folder (also the reference model and SGLang's config)"""
    critic_model: str | None = None
    """critic's starting point: a causal LM whose body gets a fresh scalar head; default: --model"""
    dataset: tuple[str, ...] = ("addition",)
    """'addition' or 'multiplication' (built in, no download), a hub id ('openai/gsm8k'), or a .jsonl/.parquet file or
    folder of rows {"prompt": text or chat messages, "answer": ...}, GSM8K's {"question", "answer"} or MATH's {"problem",
    "solution" or "answer"}; several: trained on together, each held out and judged on its own"""
    eval_dataset: str | None = None
    """held-out prompts in the same format; default: the 'test' split of --dataset (of a single file: 1 in 10 of its rows)"""
    prompt_field: str | None = None
    """the column holding the prompt (default: prompt, question or problem)"""
    answer_field: str | None = None
    """the column holding the answer (default: answer or solution)"""
    answer_kind: Literal["gsm8k", "math", "text"] | None = None
    """how an answer is judged (reward.correct): gsm8k (the number after '####'), math (the last \\boxed{}, compared
    by math-verify), text (the line after '####'); default: from the columns (MATH's: math) and the answers"""
    prompt_template: str | None = None
    """how a prompt is asked, {prompt} the row's; default: its kind's (data.py: GSM8K_PROMPT, MATH_PROMPT, ...)"""
    system_prompt: str | None = None
    """a system message before each prompt"""
    num_eval_prompts: int = 256
    """held-out prompts per evaluation (greedy)"""
    max_prompt_len: int = 256
    """prompts longer than this (in tokens, after the chat template) are dropped and counted; with --tools
    the tools' prompt before each (system prompt, worked calls) comes on top"""
    max_new_tokens: int = 256
    """response length limit; longer responses are truncated (see --overlong-filter)"""
    # --- sampling
    prompts_per_step: int = 32
    """prompts per step over all ranks (must divide by the number of ranks)"""
    group_size: int = 1
    """completions per prompt (each one is its own episode: the critic is the baseline)"""
    temperature: float = 1.0
    """sampling temperature (log-probs are computed at the same temperature)"""
    top_p: float = 1.0
    """nucleus sampling; < 1 makes the sampler's distribution differ from the trained one. Both engines report the
    whole vocabulary's log-probs at the temperature, as the trainer computes them (SGLang 0.5.16 and the HF engine
    alike), so the mismatch metrics and corrections compare one quantity; none corrects for the truncation itself"""
    # --- optimization
    steps: int = 200
    """training steps (one rollout batch each)"""
    lr: float = 0.0
    """actor's peak learning rate (AdamW); 0: 1e-6 for full fine-tuning, 1e-5 with --lora-rank (10x: docs/lora.md)"""
    critic_lr: float = 0.0
    """critic's peak learning rate (its own AdamW and schedule); 0: 1e-5, 1e-4 with --lora-rank"""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """decay after warm-up, reaching min_lr_ratio * lr after steps * epochs * num_minibatches optimizer steps"""
    warmup_steps: int = 0
    """optimizer steps of linear warm-up from 0"""
    min_lr_ratio: float = 0.0
    """final lr / peak lr for cosine and linear schedules"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's betas, actor and critic (decay of the gradient's running mean and of its square)"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    micro_batch_size: int = 8
    """sequences per forward/backward per rank, padded to the longest (gradient accumulation over micro-batches). On a
    GPU, given neither this nor --max-tokens-per-micro-batch, micro-batches are packed to a token budget worked out
    at start from the model's shapes and the GPU's memory (start.micro_batching; the start-up line says it)"""
    max_tokens_per_micro_batch: int = 0
    """> 0: micro-batches by tokens instead, at most this many per rank (one longer sequence alone), the sequences
    packed into one row without padding (fsdp.forward_tokens; see --attn-implementation); 0: --micro-batch-size, or
    on a GPU the token budget above"""
    num_minibatches: int = 1
    """optimizer steps per epoch over the rollout batch"""
    epochs: int = 1
    """passes over each rollout batch"""
    seed: int = 0
    """seeds data order, sampling and initialization"""
    # --- LoRA (docs/lora.md)
    lora_rank: int = 0
    """> 0: train LoRA adapters of this rank (fp32, AdamW) on bases frozen in bf16 (lora.py): the actor's, and the
    critic's body its own (its value head trained whole, in fp32); 0: full fine-tuning"""
    lora_alpha: float = 32.0
    """the adapters' scale is lora_alpha / lora_rank"""
    lora_targets: tuple[str, ...] = ("all-linear",)
    """linear layers that get an adapter: all-linear (every one of the decoder layers, MLP too), or names (q_proj v_proj)"""
    lora_sync: Literal["merge", "adapter"] = "adapter"
    """how the engine gets the adapter: adapter (SGLang with LoRA on: the base once, then the adapter alone each step,
    every request names it); merge (W + alpha/r B A as bf16 weights: any engine or server, --rollout-tp > 1 too, but an
    update finer than bf16's step at W is lost in the rounding: docs/lora.md)"""
    lora_gap_ratio: float = 3.0
    """the run fails when the sampler-trainer log-prob gap exceeds this x its first step's + 0.01: the engine does not
    hold the trained weights (lora.GapCheck); 0: no check (nor with --async-rollout, one update stale by design)"""
    # --- PPO
    gamma: float = 1.0
    """discount per token in GAE"""
    lam: float = 0.95
    """GAE lambda (1.0: Monte-Carlo returns minus values)"""
    clip_low: float = 0.2
    """actor ratio clipped below at 1 - clip_low"""
    clip_high: float = 0.2
    """actor ratio clipped above at 1 + clip_high"""
    value_clip: float = 0.2
    """new values stay within old value +- value_clip in the clipped value loss"""
    kl_coef: float = 0.001
    """per-token KL penalty in the reward (initial value with --adaptive-kl); 0 without --adaptive-kl: no reference model"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """per-token KL(actor || ref) estimate in the reward penalty (see grpo.py). As a reward the policy gradient
    E[grad log p * (-kl)] is exact with k1, the default (the gradient of KL(actor || ref)); k2 and k3 bias it (a penalty
    that grows with the log-ratio, not the KL's gradient: tests/test_ppo_math.py)"""
    adaptive_kl: bool = False
    """adjust kl_coef each step toward --target-kl (Ziegler et al. 2019)"""
    target_kl: float = 1.0
    """target KL per response (nats, summed over tokens) for --adaptive-kl"""
    kl_horizon: int = 10000
    """samples over which the adaptive controller closes the gap"""
    whiten_advantages: bool = True
    """normalize advantages to mean 0, std 1 over the batch's response tokens (all ranks)"""
    entropy_coef: float = 0.0
    """entropy bonus in the actor loss (keeps a [B, T, vocab] graph: memory)"""
    critic_warmup_steps: int = 0
    """first steps train only the critic (the actor and its LR schedule wait)"""
    overlong_filter: bool = False
    """mask truncated responses out of the actor and critic losses"""
    # --- reward
    reward: str | None = None
    """FILE.py:function, your own (completion, answer) -> float instead of the built-in reward below (the accuracy
    metrics still judge by --answer-kind)"""
    reward_sandbox: Literal["bwrap", "none"] = "bwrap"
    """where --reward's function runs: bwrap, jails of its own (no network, read-only files, 4 GiB, reward_jail.py);
    none, the trainer's threads (trusted code: one that calls an API, or reads the run's state)"""
    unformatted_credit: float = 0.25
    """reward for a right answer not given in the asked format ('#### N', \\boxed{}); one in it earns 1.0"""
    format_weight: float = 0.0
    """reward += format_weight when the response gives its answer in the asked format, right or wrong. Beware:
    unconditional format reward is easy to hack (a small model learns to guess '#### 57')"""
    reward_workers: int = 8
    """reward calls that run at once, each in a thread (1: one at a time, for a reward that is not thread-safe)"""
    reward_timeout_s: float = 30.0
    """a reward call still running after this scores 0 (rollout/reward_timeouts) and runs on, abandoned (reward.score_all)"""
    reward_model: str | None = None
    """a reward model (hub id or folder: a *ForSequenceClassification with one label, e.g. train_rm.py's) scoring each
    conversation with its own tokenizer and chat template; its score joins the rule reward (--reward-weights)"""
    reward_weights: tuple[float, float] = (1.0, 1.0)
    """with --reward-model: the rule reward's weight (answer correctness or --reward) and the reward model's; '0 1': the
    reward model alone (accuracy is still judged by the rule)"""
    reward_model_norm: bool = False
    """with --reward-model: whiten its scores over the batch (mean 0, std 1) before they are weighted"""
    reward_model_max_len: int = 2048
    """with --reward-model: conversations cut to this many of its tokens (counted: rollout/rm_truncated)"""
    reward_model_micro_batch_size: int = 64
    """with --reward-model: conversations per forward (no vocabulary-sized logits, so more fit than the policy's)"""
    reward_model_template: str | None = None
    """with --reward-model: its chat template (a FILE.jinja or the text), for a tokenizer without one"""
    # --- tools (multi-turn rollouts)
    tools: str = ""
    """comma-separated tools a sample may call mid-answer: calculator, python (tools.py); '' for one turn"""
    max_turns: int = 4
    """with --tools: model turns per sample at most (a call in the last one is not run)"""
    max_tool_reply_tokens: int = 256
    """with --tools: a tool's reply is cut to this many tokens; the whole response (model turns and tool
    replies) stays within --max-new-tokens"""
    tool_workers: int = 16
    """with --tools: tool calls that run at once on each engine (threads; python runs in its own process)"""
    tool_timeout_s: float = 10.0
    """with --tools: wall-clock limit of one python tool run (it also gets 1 GiB of memory, 32 processes; sandbox.py)"""
    python_sandbox: str = "bwrap"
    """with --tools python: where model-written programs run: 'bwrap' (a bubblewrap jail on this machine), a
    SandboxFusion server's URL (http://HOST:PORT), or 'process' (a plain subprocess: it can reach the trainer)"""
    # --- memory and systems
    gradient_checkpointing: bool = False
    """recompute activations in backward (less memory, ~30% more compute)"""
    compile: bool = False
    """torch.compile each decoder layer and the log-prob head: fused kernels, the update 1.1-1.5x faster (H200); the first
    step compiles. Not given, on a GPU: on for packed micro-batches through varlen attention, full fine-tuning or
    LoRA, where measured faster (start.compile_choice)"""
    offload: bool = False
    """move parameters and optimizer state to CPU while SGLang generates"""
    attn_implementation: str = "sdpa"
    """transformers attention for training; packed, sdpa computes all n^2 token pairs of a micro-batch, varlen (GPU:
    torch's FlashAttention-2, fsdp.varlen_attention) and flex_attention (GPU) only each sequence's own (docs/packing.md).
    Not given: varlen for packed micro-batches where the GPU and torch run it (preflight.varlen_runs)"""
    rollout_engine: Literal["auto", "sglang", "hf"] = "auto"
    """'sglang' (GPU), 'hf' (plain transformers, CPU tests), 'auto': sglang when CUDA is available"""
    rollout_tp: int = 1
    """tensor parallel size of each SGLang engine; the first rank of each group of k owns it"""
    rollout_mode: Literal["colocate", "server"] = "colocate"
    """'colocate': an engine on the training GPUs, taking turns with training (memory.py); 'server': SGLang
    servers you start on other GPUs or nodes (--rollout-url), weights sent over NCCL (server.py)"""
    rollout_url: tuple[str, ...] = ()
    """with --rollout-mode server: each server's http://HOST:PORT (python -m sglang.launch_server ...)"""
    rollout_gpus: int = 0
    """with --rollout-mode server, instead of --rollout-url: rank 0 starts servers (SGLang's launcher, one per
    --rollout-tp GPUs) on the last k GPUs of its node; training takes the others (torchrun --nproc_per_node N-k)"""
    rollout_timeout: float = 600.0
    """with --rollout-mode server: seconds a server may take to start, answer a request or take the weights"""
    rollout_sync_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """with --rollout-mode server: how weights travel; auto: NCCL on GPUs, gloo on CPUs. gloo also serves a server on
    the trainer's own GPU (NCCL refuses two members of one group on one GPU), through host memory"""
    rollout_sync_address: str | None = None
    """with --rollout-mode server: this machine's address the servers reach for the weight sync (default: found
    from the route to the first server)"""
    async_rollout: bool = False
    """with --rollout-mode server: generate the next step's batch while this one trains; each batch is then
    sampled by the weights from before the last update (one step off-policy; see --tis-cap)"""
    tis_cap: float | None = None
    """truncated importance sampling: each token's actor loss x min(exp(old_logprob - sampler_logprob), cap), for a
    sampler that is not the trained actor; None: 2.0 with --async-rollout, else off; 0: off"""
    sglang_mem_fraction: float = 0.6
    """share of GPU memory for SGLang's weights + KV cache while it is awake"""
    sglang_attention_backend: str = "triton"
    """SGLang attention kernels ('fa3' or 'flashinfer' where installed are faster)"""
    sglang_sampling_backend: str = "pytorch"
    """SGLang sampling kernels ('flashinfer' where installed)"""
    sglang_cuda_graph_max_bs: int | None = None
    """largest decode batch captured as a CUDA graph (fewer graphs start faster); None: SGLang's default"""
    sglang_disable_cuda_graph: bool = False
    """no CUDA graphs: fastest start, slower decode"""
    sglang_prefill_cuda_graph: bool = False
    """also capture prefill graphs (SGLang's default; torch.compile adds 15-45 s to start-up)"""
    deterministic_rollout: bool = False
    """the same --seed samples the same completions: SGLang's deterministic inference (batch-invariant kernels, each
    sample its own seed; --sglang-attention-backend fa3, fa4, flashinfer or triton; a --rollout-url server started with
    --enable-deterministic-inference), a deterministic update; slower (docs/determinism.md)"""
    sync_bucket_mb: int = 512
    """weight sync gathers and sends this many MB at a time"""
    # --- evaluation, checkpoints, logging
    eval_every: int = 20
    """greedy evaluation every this many steps (0: never), and after the last step"""
    eval_before_train: bool = False
    """also evaluate before the first update"""
    eval_samples: int = 0
    """beside the greedy answer, this many samples a held-out prompt at --eval-temperature: avg@K, pass@1,2,4..K
    (Chen et al.'s unbiased estimator) and maj@K (majority vote) of strict answers (0: greedy only)"""
    eval_temperature: float = 1.0
    """temperature of those samples"""
    eval_top_p: float = 1.0
    """top-p of those samples"""
    save_every: int = 100
    """checkpoint every this many steps (0: only at the end; -1: never, for benchmarks)"""
    keep_checkpoints: int = 2
    """newest checkpoints kept (0: all)"""
    save_on_signal: bool = True
    """on Ctrl-C or SIGTERM (preemption: Slurm, Kubernetes, torchrun), save the finished steps before exiting"""
    max_nonfinite_steps: int = 3
    """stop after this many steps in a row that skipped updates for a NaN/inf loss or gradient (a NaN reward scores 0)"""
    dist_timeout_minutes: float = 30.0
    """how long a rank waits at a collective for the others (a slow generation, or a dead rank) before failing"""
    output_dir: str = "runs"
    """runs are written to output_dir/run_name"""
    run_name: str | None = None
    """default: ppo-<model>-<dataset>-s<seed>"""
    resume: bool = False
    """continue from the latest checkpoint of this run"""
    track: bool = False
    """log to Weights & Biases"""
    wandb_project: str = "ppo"
    """wandb project"""
    log_samples_every: int = 10
    """print a few sample completions (and append them to samples.jsonl) every this many steps (0: never)"""


FULL_LR, FULL_CRITIC_LR = 1e-6, 1e-5  # --lr 0's and --critic-lr 0's for full fine-tuning; with LoRA 10x
# PLUMBING: without a GPU, these replace the defaults of the flags not given: 16 samples of up to 64 tokens a step, as grpo.py.
CPU_SIZES = {
    "prompts_per_step": 8,
    "group_size": 2,
    "max_new_tokens": 64,
    "num_eval_prompts": 16,
    "micro_batch_size": 16,
}
# PLUMBING: a step's console line: (name, metric, format, what it is: the legend printed before step 1)
CONSOLE = (
    SAMPLES_LINE
    + [
        ("vloss", "critic/value_loss", ".2g", "the critic's value loss"),
        (
            "ev",
            "critic/explained_var",
            ".2f",
            "explained variance: the share of the returns' variance the values explain",
        ),
        ("gnorm", "train/grad_norm", ".2f", "the actor's gradient norm before clipping"),
    ]
    + TIMES_LINE
)
# shown after the others, on a step where they are not 0
IF_NOT_0 = [TRUNC, ("kl", "train/kl_per_response", ".2g", "KL(actor || reference) per response (where not 0)"), CLIP]

# ----------------------------------------------------------------------------------------------
# Flags: each checked before anything loads


def check_args(args: Args, world_size: int):
    """Bad input fails here, before anything is loaded or written, all at once: PPO's own flags, the sizes and the
    optimizer's, then each module's rules for its flags (the rollout's, evaluation's, the tools', the reward model's,
    LoRA's, packages)."""
    a, server, given = args, args.rollout_mode == "server", given_flags(sys.argv[1:])
    per_rank = a.prompts_per_step // world_size * a.group_size
    engines = engine_count(world_size, a.rollout_tp, (len(a.rollout_url) or a.rollout_gpus // a.rollout_tp) * server)
    check_flags(
        [  # (flag, value, holds, what it must be)
            ("--group-size", a.group_size, a.group_size >= 1, ">= 1"),
            ("--critic-lr", a.critic_lr, a.critic_lr >= 0, ">= 0 (0: the default: 1e-5, 1e-4 with --lora-rank)"),
            ("--gamma", a.gamma, 0 <= a.gamma <= 1, "in [0, 1]"),
            ("--lam", a.lam, 0 <= a.lam <= 1, "in [0, 1]"),
            ("--kl-coef", a.kl_coef, a.kl_coef >= 0, ">= 0"),
            ("--target-kl", a.target_kl, a.target_kl > 0, "> 0"),
            ("--kl-horizon", a.kl_horizon, a.kl_horizon >= 1, ">= 1"),
            ("--clip-low", a.clip_low, 0 <= a.clip_low < 1, "in [0, 1)"),
            ("--value-clip", a.value_clip, a.value_clip > 0, "> 0"),
            ("--entropy-coef", a.entropy_coef, a.entropy_coef >= 0, ">= 0"),
            ("--critic-warmup-steps", a.critic_warmup_steps, a.critic_warmup_steps >= 0, ">= 0"),
            ("--async-rollout", a.async_rollout, not a.async_rollout or server, "with --rollout-mode server"),
            ("--tis-cap", a.tis_cap, a.tis_cap is None or a.tis_cap >= 0, ">= 0"),
            ("--steps", a.steps, a.steps >= 1, ">= 1 (to only evaluate a model: python evaluate.py)"),
            (
                "--prompts-per-step",
                a.prompts_per_step,
                a.prompts_per_step >= 1 and a.prompts_per_step % world_size == 0,
                f">= 1 and divide by the {world_size} ranks",
            ),
            ("--max-new-tokens", a.max_new_tokens, a.max_new_tokens >= 1, ">= 1"),
            ("--max-prompt-len", a.max_prompt_len, a.max_prompt_len >= 1, ">= 1"),
            ("--lr", a.lr, a.lr >= 0, ">= 0 (0: the default: 1e-6, 1e-5 with --lora-rank)"),
            ("--weight-decay", a.weight_decay, a.weight_decay >= 0, ">= 0"),
            ("--adam-betas", a.adam_betas, all(0 <= b < 1 for b in a.adam_betas), "two numbers in [0, 1)"),
            ("--max-grad-norm", a.max_grad_norm, a.max_grad_norm > 0, "> 0"),
            ("--warmup-steps", a.warmup_steps, a.warmup_steps >= 0, ">= 0"),
            ("--min-lr-ratio", a.min_lr_ratio, 0 <= a.min_lr_ratio <= 1, "in [0, 1]"),
            ("--micro-batch-size", a.micro_batch_size, a.micro_batch_size >= 1, ">= 1"),
            ("--max-tokens-per-micro-batch", a.max_tokens_per_micro_batch, a.max_tokens_per_micro_batch >= 0, ">= 0"),
            (  # fsdp.varlen_attention hands a packed row's sequences to the kernel; padded rows would go to sdpa
                "--attn-implementation",
                a.attn_implementation,
                a.attn_implementation != "varlen"
                or a.max_tokens_per_micro_batch > 0
                or not {"micro_batch_size", "max_tokens_per_micro_batch"} & given,
                "given with --max-tokens-per-micro-batch N (e.g. 8192) for varlen, or with neither micro-batch flag "
                "(a GPU packs by a token budget): it attends within packed rows",
            ),
            ("--epochs", a.epochs, a.epochs >= 1, ">= 1"),
            (
                "--num-minibatches",
                a.num_minibatches,
                a.num_minibatches >= 1 and per_rank % a.num_minibatches == 0,
                f">= 1 and divide the {per_rank} samples per rank",
            ),
            ("--temperature", a.temperature, a.temperature > 0, "> 0"),
            ("--top-p", a.top_p, 0 < a.top_p <= 1, "in (0, 1]"),
            ("--clip-high", a.clip_high, a.clip_high >= 0, ">= 0"),
            ("--num-eval-prompts", a.num_eval_prompts, a.num_eval_prompts >= 1, ">= 1 (--eval-every 0: no evaluation)"),
            ("--eval-every", a.eval_every, a.eval_every >= 0, ">= 0"),
            ("--eval-top-p", a.eval_top_p, 0 < a.eval_top_p <= 1, "in (0, 1]"),
            ("--save-every", a.save_every, a.save_every >= -1, ">= -1"),
            ("--keep-checkpoints", a.keep_checkpoints, a.keep_checkpoints >= 0, ">= 0"),
            ("--log-samples-every", a.log_samples_every, a.log_samples_every >= 0, ">= 0"),
            ("--max-nonfinite-steps", a.max_nonfinite_steps, a.max_nonfinite_steps >= 1, ">= 1"),
            ("--reward-workers", a.reward_workers, a.reward_workers >= 1, ">= 1 (1: one call at a time)"),
            ("--reward-timeout-s", a.reward_timeout_s, a.reward_timeout_s > 0, "> 0"),
            ("--dist-timeout-minutes", a.dist_timeout_minutes, a.dist_timeout_minutes > 0, "> 0"),
            *rollout_rules(  # SGLang's memory, TP, the servers (preflight.py)
                mode=a.rollout_mode,
                tp=a.rollout_tp,
                urls=a.rollout_url,
                gpus=a.rollout_gpus,
                timeout=a.rollout_timeout,
                mem_fraction=a.sglang_mem_fraction,
                sync_bucket_mb=a.sync_bucket_mb,
                world_size=world_size,
            ),
            *sampling_rules(  # --eval-samples K and --eval-temperature; --deterministic-rollout's attention
                num_eval_prompts=a.num_eval_prompts,
                eval_samples=a.eval_samples,
                eval_temperature=a.eval_temperature,
                engines=engines,
                deterministic=a.deterministic_rollout,
                attention_backend=a.sglang_attention_backend,
                rollout_tp=a.rollout_tp,
            ),
            *tool_rules(  # --tools names known tools, not with --system-prompt (tools.py)
                tools=a.tools,
                system_prompt=a.system_prompt,
                max_turns=a.max_turns,
                max_reply_tokens=a.max_tool_reply_tokens,
                workers=a.tool_workers,
                timeout_s=a.tool_timeout_s,
            ),
            *package_rules(track=a.track, attn_implementation=a.attn_implementation),  # wandb; attention that trains
            template_rule(a.prompt_template),  # {prompt}, and no other placeholder (data.py)
            *rm_flag_rules(  # --reward-weights finite, not both 0; the --reward-model-* flags only with it
                reward_model=a.reward_model,
                weights=a.reward_weights,
                norm=a.reward_model_norm,
                max_len=a.reward_model_max_len,
                micro_batch_size=a.reward_model_micro_batch_size,
                template=a.reward_model_template,
                given=given,
            ),
            *lora_rules(  # rank >= 0, alpha > 0 and finite, the other --lora-* with a rank only
                rank=a.lora_rank,
                alpha=a.lora_alpha,
                targets=a.lora_targets,
                sync=a.lora_sync,
                gap_ratio=a.lora_gap_ratio,
                rollout_tp=a.rollout_tp,
                given=given,
            ),
        ]
    )


# ----------------------------------------------------------------------------------------------
# ALGO: the PPO pieces, pure functions of tensors (tests/test_ppo_math.py checks them by hand)


KL_EXP_CLAMP = 20.0  # k3's exponent is clamped to +-this: one outlier token can't overflow the penalty


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(actor || ref) from the actor's own samples, r = ref/actor probability of the sampled
    token: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r (Schulman's: unbiased, always >= 0). PPO puts it in the
    reward (token_rewards, --kl-estimator), where only k1's policy gradient is that of KL(actor || ref); k3 of (now,
    old) is the update's approx_kl. [B, T] -> [B, T]"""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        neg = (-log_ratio).clamp(-KL_EXP_CLAMP, KL_EXP_CLAMP)
        return torch.exp(neg) - 1 - neg
    raise ValueError(f"KL estimator {estimator!r} is unknown; use k1, k2 or k3")


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """The episode's score lands on its last response token; every response token pays kl_coef * KL.
    scores [B], kl and mask [B, T] -> rewards [B, T]."""
    rewards = -kl_coef * kl * mask
    last = (mask * torch.arange(mask.shape[1])).argmax(-1)  # position of each row's last response token
    rewards[torch.arange(len(scores)), last] += scores * (mask.sum(-1) > 0)
    return rewards


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Generalized advantage estimation over the response tokens of each row. [B, T] -> advantages, returns.

    A reverse scan over positions; outside the response (prompt, padding) nothing changes, so each
    row's last response token sees next value 0: the episode ends there.
    """
    advantages = torch.zeros_like(rewards)
    last_gae = torch.zeros(rewards.shape[0])
    next_value = torch.zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = torch.where(m, delta + gamma * lam * last_gae, last_gae)
        next_value = torch.where(m, values[:, t], next_value)
        advantages[:, t] = last_gae * m
    return advantages, (advantages + values) * mask


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, reduce=lambda t: t, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the entries where mask is 1; `reduce` sums over ranks. Zero elsewhere."""
    n = float(reduce(mask.sum()))
    mean = float(reduce((x * mask).sum())) / n
    var = float(reduce(((x - mean) ** 2 * mask).sum())) / n
    return (x - mean) / math.sqrt(var + eps) * mask


def clipped_policy_loss(logp, old_logp, advantages, clip_low: float, clip_high: float):
    """PPO-clip per token: max(-A r, -A clip(r, 1-clip_low, 1+clip_high)). Returns (loss, clipped), [B, T]."""
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def clipped_value_loss(values, old_values, returns, clip: float):
    """0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = old V + clip(V - old V, +-clip). Returns (loss, clipped), [B, T]."""
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_loss, clipped_loss = (values - returns) ** 2, (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped_loss, clipped_loss), clipped_loss > unclipped_loss


def token_values(critic, input_ids: torch.Tensor, attention_mask: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """The critic's value of each state: values[:, t] is read at token t, before input_ids[:, t+1]
    is chosen, so it lines up with token_logprobs. [B, T-1], fp32. `packed`: as token_logprobs'."""
    with warnings.catch_warnings():  # FSDP2 warns that the head's output is a view: harmless, nothing here is in-place
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        out, _, unpack = forward_tokens(critic, input_ids, attention_mask, packed)  # [B, T, 1] or [1, N, 1]
    return unpack(out[:, :-1, 0].float())


def adaptive_kl_coef(coef: float, kl: float, target: float, horizon: int, n: int) -> float:
    """Ziegler et al.: proportional control of the KL coefficient, error clipped to +-20%."""
    error = min(max(kl / target - 1, -0.2), 0.2)
    return coef * (1 + error * n / horizon)


def actor_loss(
    logp,
    entropy,
    mb,
    *,
    clip_low: float,
    clip_high: float,
    entropy_coef: float,
    num_tokens: float,
    tis_cap: float = 0.0,
):
    """One micro-batch's actor loss: PPO-clip on the GAE advantages minus entropy_coef * entropy,
    token-mean over the whole mini-batch (num_tokens counts all ranks: see grpo.py's `aggregate`).
    tis_cap > 0: the clipped term weighted by min(p_old / p_sampler, tis_cap) (grpo.py's grpo_loss).
    logp, entropy [b, t]: the actor now. Returns (loss, sums over loss tokens for the metrics)."""
    m = mb.loss_mask  # [b, t]
    token_loss, clipped = clipped_policy_loss(logp, mb.old_logprobs, mb.advantages, clip_low, clip_high)  # [b, t]
    stats = {
        "clip_frac": (clipped.float() * m).sum(),
        "entropy": (entropy.detach() * m).sum(),
        "approx_kl": (kl_penalty(mb.old_logprobs, logp.detach(), "k3") * m).sum(),
    }
    if tis_cap > 0:
        weight = torch.exp(mb.old_logprobs - mb.rollout_logprobs).nan_to_num(nan=0.0)  # [b, t]; a NaN log-prob weighs 0
        token_loss = token_loss * weight.clamp(max=tis_cap)  # both log-probs are constants: no gradient through it
        stats.update(
            tis_weight=(weight.clamp(max=tis_cap) * m).sum(), tis_capped=((weight > tis_cap).float() * m).sum()
        )
    loss = ((token_loss - entropy_coef * entropy) * m).sum() / num_tokens
    return loss, {"loss": loss.detach(), **stats}


def critic_loss(values, mb, *, value_clip: float, num_tokens: float):
    """One micro-batch's critic loss: clipped value loss against the GAE returns, token-mean over
    the whole mini-batch. values [b, t]: the critic now. Returns (loss, sums for the metrics)."""
    m = mb.loss_mask  # [b, t]
    value_loss, clipped = clipped_value_loss(values, mb.values, mb.returns, value_clip)  # [b, t]
    loss = (value_loss * m).sum() / num_tokens
    return loss, {"value_loss": loss.detach(), "value_clip_frac": (clipped.float() * m).sum(), "tokens": m.sum()}


def update(actor, critic, batch, args: Args, *, step: int, device, rank: int = 0, update_actor: bool) -> dict:
    """The update on one rollout batch: --epochs passes, each shuffled and cut into --num-minibatches mini-batches
    (one optimizer step each for the critic, and for the actor after --critic-warmup-steps: `update_actor`), each
    mini-batch in micro-batches whose gradients add up; critic_loss, then actor_loss, on each. batch: this rank's
    [B, T-1] fields, advantages, returns and values set. actor, critic: (model, optimizer, LR schedule) each. Returns
    the critic/ and train/ metrics, all ranks'."""
    (policy, optimizer, scheduler), (critic, critic_optimizer, critic_scheduler) = actor, critic
    tis_cap = args.tis_cap if args.tis_cap is not None else 2.0 * args.async_rollout  # 0: off
    policy.train()
    critic.train()
    totals = {
        k: torch.zeros((), dtype=torch.float64, device=device)  # metric sums, on the device
        for k in (
            "loss",
            "clip_frac",
            "entropy",
            "approx_kl",
            "value_loss",
            "value_clip_frac",
            "tokens",
            "tis_weight",
            "tis_capped",
        )
    }
    grad_norms, critic_grad_norms, lengths, empty = [], [], batch.attention_mask.sum(-1), 0  # lengths: [B] tokens
    max_tokens = args.max_tokens_per_micro_batch  # > 0: packed micro-batches of at most this many tokens
    for epoch in range(args.epochs):
        shuffle = torch.Generator().manual_seed(seed_for(args.seed, "update", step, epoch))
        order = torch.randperm(len(batch), generator=shuffle)
        for mini in order.tensor_split(args.num_minibatches):  # the rows of one optimizer step: as many as the
            # LR schedule counts (4 rows: 2, 1, 1; chunk gave 2, 2: two steps of the three planned)
            # global count, once per mini-batch: every rank normalizes by the whole mini-batch (token-mean)
            num_tokens = float(all_reduce(batch.loss_mask[mini].sum()))
            # no loss token on any rank (every row masked, or no row): no optimizer step, since AdamW's momentum alone
            # would move every weight by most of a step; the schedules move on, as for a step skipped whole
            if num_tokens == 0:
                skip_schedule(critic_scheduler, 1)
                if update_actor:
                    skip_schedule(scheduler, 1)
                empty += 1
                continue
            mbs = micro_batches(mini, lengths, args.micro_batch_size, max_tokens)  # as many on every rank
            for rows in progress(mbs, f"update {epoch + 1}/{args.epochs}", rank):
                part = batch.select(rows)  # [b, t] fields, on the CPU
                mb = part.to(device)  # the forwards take part's mask: a packed row planned on the CPU, no wait
                values = token_values(critic, mb.input_ids, part.attention_mask, max_tokens > 0)  # [b, t-1]
                loss, stats = critic_loss(values, mb, value_clip=args.value_clip, num_tokens=num_tokens)
                loss.backward()
                for k, v in stats.items():
                    totals[k] += v
                if not update_actor:  # the critic's warm-up (--critic-warmup-steps): the actor waits
                    continue
                logp, entropy = token_logprobs(
                    policy,
                    mb.input_ids,
                    part.attention_mask,
                    args.temperature,
                    with_entropy=True,
                    entropy_grad=args.entropy_coef > 0,
                    packed=max_tokens > 0,
                )  # [b, t-1] each
                loss, stats = actor_loss(
                    logp,
                    entropy,
                    mb,
                    clip_low=args.clip_low,
                    clip_high=args.clip_high,
                    entropy_coef=args.entropy_coef,
                    num_tokens=num_tokens,
                    tis_cap=tis_cap,
                )
                loss.backward()
                for k, v in stats.items():
                    totals[k] += v
            critic_grad_norms.append(clip_and_step(critic, critic_optimizer, critic_scheduler, args.max_grad_norm))
            if update_actor:
                grad_norms.append(clip_and_step(policy, optimizer, scheduler, args.max_grad_norm))
    totals = all_reduce_dict(totals)  # a CPU-GPU sync point, once per step
    n_opt, tokens = args.epochs * args.num_minibatches, totals["tokens"].clamp(min=1)
    metrics = {
        "critic/value_loss": totals["value_loss"] / n_opt,
        "critic/value_clip_frac": totals["value_clip_frac"] / tokens,
        "critic/grad_norm": sum(critic_grad_norms) / max(len(critic_grad_norms), 1),
        "critic/lr": critic_scheduler.get_last_lr()[0],
        "train/nonfinite_skips": sum(not math.isfinite(g) for g in grad_norms + critic_grad_norms),
        "train/empty_minibatches": empty,  # no loss token on any rank: no optimizer step
    }
    if not update_actor:
        return metrics | {"train/critic_warmup": 1.0}
    metrics |= {
        "train/loss": totals["loss"] / n_opt,
        "train/clip_frac": totals["clip_frac"] / tokens,
        "train/entropy": totals["entropy"] / tokens,
        "train/approx_kl": totals["approx_kl"] / tokens,
        "train/grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
        "train/lr": scheduler.get_last_lr()[0],
    }
    if tis_cap:
        metrics |= {
            "train/tis_weight": totals["tis_weight"] / tokens,
            "train/tis_capped_frac": totals["tis_capped"] / tokens,
        }
    return metrics


# ----------------------------------------------------------------------------------------------
# main: its set-up, each a named call, then the loop, which names each phase


def main(args: Args):
    handle_signals()  # Ctrl-C and SIGTERM stop the run between phases (common.py)
    rank, world_size, device = init_distributed(args.dist_timeout_minutes)
    dtype = compute_dtype(device)  # bf16; fp32 on a CPU without bf16 instructions (fsdp.py says why)
    check_args(args, world_size)
    reference = args.kl_coef > 0 or args.adaptive_kl  # a reference model only where the KL is on
    args = replace(  # --lr 0 and --critic-lr 0, the defaults: LoRA learns at ~10x full fine-tuning's rate (lora.py)
        args,
        lr=default_lr(args.lr, full=FULL_LR, rank=args.lora_rank),
        critic_lr=default_lr(args.critic_lr, full=FULL_CRITIC_LR, rank=args.lora_rank),
    )

    # ---- bad input fails here, before anything loads or is written, each in one line ---------------
    if args.deterministic_rollout:  # the update too: step 2 samples the same only from the same weights
        deterministic_training()
    tools = select_tools(  # its sandbox checked, its memory said
        args.tools, python_sandbox=args.python_sandbox, seconds=args.tool_timeout_s, workers=args.tool_workers
    )
    run_name = args.run_name or default_run_name("ppo", args.model, list(map(source_name, args.dataset)), args.seed)
    run_dir = claim_run_dir(args.output_dir, run_name, resume=args.resume)  # this script's, locked while it runs
    resume_from = checkpoint_to_resume(run_dir, args.resume, asdict(args))  # resumed: the flags it started with
    engine_kind = "server" if args.rollout_mode == "server" else check_engine(args.rollout_engine)
    tokenizer, context_len = check_model(args.model, rollout_tp=args.rollout_tp, generates=True)
    base_weights = model_fingerprint(args.model)  # in trainer.pt: --resume checks --model holds these weights
    adapter = args.lora_rank > 0 and args.lora_sync == "adapter"  # SGLang serves the adapter, the base kept
    lora_targets = check_lora(args.model, args.lora_rank, args.lora_targets, sglang=adapter and engine_kind != "hf")
    check_training_state(args.model, device, lora=args.lora_rank > 0, reference=reference)  # fits the GPUs
    rm_tokenizer, rm_template, rm_max_len = check_reward_model(
        args.reward_model,
        args.reward_model_template,
        args.reward_model_max_len,
        system=bool(args.system_prompt),
        tools=bool(tools),
    )
    stop_ids = stop_token_ids(tokenizer, args.model) + (tool_call_stop_ids(tokenizer) if tools else [])
    sampling = Sampling(args.max_new_tokens, stop_ids, temperature=args.temperature, top_p=args.top_p)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    from transformers import AutoModelForTokenClassification  # lazy: keeps `import ppo` fast

    critic_path = args.critic_model or args.model
    critic_targets = check_lora(
        critic_path, args.lora_rank, args.lora_targets, "--critic-model", AutoModelForTokenClassification
    )
    if args.critic_model:
        check_model(args.critic_model, "--critic-model", with_tokenizer=False)

    # ---- the task: how a prompt is asked (data.py) and what a completion earns (reward.py) --------
    context, tool_specs, tool_use = tools_for(  # the tools' prompt (system prompt, worked calls), their runner
        tokenizer,
        tools,
        template=args.prompt_template,
        datasets=args.dataset,
        workers=args.tool_workers,
        max_turns=args.max_turns,
        max_reply_tokens=args.max_tool_reply_tokens,
    )
    reward = partial(  # ALGO: 1 for an answer right in the asked format (reward.reward_fn), or yours (--reward)
        reward_fn,
        user_reward=load_user_reward(args.reward, sandbox=args.reward_sandbox, timeout_s=args.reward_timeout_s)
        if args.reward
        else None,
        unformatted_credit=args.unformatted_credit,
        format_weight=args.format_weight,
    )
    train_prompts, eval_prompts, data_line = task_prompts(
        tokenizer,
        list(args.dataset),
        args.eval_dataset,
        context_len=context_len,  # a prompt, the tools' and the response must fit: checked first
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        num_eval=args.num_eval_prompts,
        max_prompt_len=args.max_prompt_len,
        template=args.prompt_template,
        system_prompt=args.system_prompt,
        prompt_field=args.prompt_field,
        answer_field=args.answer_field,
        kind=args.answer_kind,
        context=context,
        tools=tool_specs,
    )
    sampler = PromptSampler(len(train_prompts.ids), args.seed)
    lora_lr = f" (LoRA's default: {LORA_LR_FACTOR:g}x full fine-tuning's)" * (args.lora_rank > 0)
    print0(
        f"data: {data_line} | {world_size} ranks, engine {engine_kind} | lr {args.lr:g}, critic {args.critic_lr:g}{lora_lr}"
    )
    # ---- micro-batches and attention: on a GPU, for the flags not given, packed rows of a token budget ----------
    given = given_flags(sys.argv[1:])  # the flags on the command line: the defaults below are for the others
    mbs, max_tokens, attn, line = micro_batching(
        args.model,
        device,
        given=given,
        micro_batch_size=args.micro_batch_size,
        max_tokens=args.max_tokens_per_micro_batch,
        attn_implementation=args.attn_implementation,
        lora=args.lora_rank > 0,
        reference=reference,
        gradient_checkpointing=args.gradient_checkpointing,
        colocated=engine_kind != "server",
        longest=max(map(len, train_prompts.ids)) + args.max_new_tokens,  # tool replies count in the response budget
        reward_model=args.reward_model,
        engine_keeps_weights=adapter,  # --lora-sync adapter: the engine keeps the base while it sleeps
        critic=critic_path,
    )
    args = replace(args, micro_batch_size=mbs, max_tokens_per_micro_batch=max_tokens, attn_implementation=attn)
    if line:
        print0(line)
    compile, line = compile_choice(  # on a GPU, not given: on where it measured faster
        device,
        given=given,
        compile=args.compile,
        attn_implementation=args.attn_implementation,
        gradient_checkpointing=args.gradient_checkpointing,
        offload=args.offload,
        deterministic=args.deterministic_rollout,
    )
    args = replace(args, compile=compile)
    if line:
        print0(line)
    seed_ranks(args.seed, rank)  # numpy's and Python's per rank, torch's the same on every rank
    clock = StepClock(total=args.steps)  # 'step 3/200 | eta 1:02', the start-up's seconds by part since launch
    clock.lap("setup_s")  # imports, process group, tokenizer, data

    # ---- the rollout engines first: SGLang sizes its KV cache from the free memory it finds -------
    mem = MemoryLog()
    allow_interrupt(True)  # from here until the run's record exists, a signal ends the run at once: nothing to save
    rollout, watch = start_rollout(  # colocated engines (rollout.py) or SGLang servers (server.py); watched
        engine_kind,
        args.model,
        samples=args.prompts_per_step * args.group_size,
        eval_samples=args.num_eval_prompts * args.eval_samples,
        options=SGLangOptions(
            mem_fraction=args.sglang_mem_fraction,
            tp_size=args.rollout_tp,
            attention_backend=args.sglang_attention_backend,
            sampling_backend=args.sglang_sampling_backend,
            cuda_graph_max_bs=args.sglang_cuda_graph_max_bs,  # None: sized to each engine's share of `samples`
            disable_cuda_graph=args.sglang_disable_cuda_graph,
            prefill_cuda_graph=args.sglang_prefill_cuda_graph,
            deterministic=args.deterministic_rollout,
            lora_rank=args.lora_rank if adapter else 0,
            lora_targets=tuple(lora_targets),
        ),
        servers=ServerOptions(
            urls=args.rollout_url,
            gpus=args.rollout_gpus,
            timeout_s=args.rollout_timeout,
            sync_backend=args.rollout_sync_backend,
            sync_address=args.rollout_sync_address,
        ),
        seed=args.seed,
        dtype=dtype,
        sampling=sampling,
        tokenizer=tokenizer,
        tool_use=tool_use,
        log_dir=run_dir,
        phase=lambda: mem.current,  # a dead engine's line names the phase
    )
    clock.lap("engine_s")

    # ---- the models: the actor, its reference where the KL is on, the critic, a reward model -----
    policy, ref = load_policy(
        args.model,
        device,
        dtype,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_sync=args.lora_sync,
        lora_targets=lora_targets,
        gradient_checkpointing=args.gradient_checkpointing,
        attn_implementation=args.attn_implementation,
        compile=args.compile,
        reference=reference,  # LoRA: the actor with its adapter off, no second copy
    )
    rm = load_reward_model(args.reward_model, device, dtype, args.attn_implementation) if args.reward_model else None
    # The critic: the LM's body with a one-output token-classification head, value per position.
    masters = torch.bfloat16 if args.lora_rank else torch.float32  # LoRA: the bases frozen in bf16, adapters fp32
    critic = load_model(
        critic_path,
        device,
        masters,
        args.gradient_checkpointing,
        args.attn_implementation,
        AutoModelForTokenClassification,
        new_head=True,
        num_labels=1,
    )
    for p in critic.score.parameters():  # ALGO: values start at 0 rather than at noise
        torch.nn.init.zeros_(p)
    apply_lora(critic, args.lora_rank, args.lora_alpha, critic_targets)  # LoRA: the critic's body an adapter of its own
    critic.score.float().requires_grad_(True)  # its head is new: trained whole, in fp32 (full fine-tuning: as it was)
    shard_model(critic, param_dtype=dtype, compile=args.compile)
    schedule = dict(
        weight_decay=args.weight_decay,
        betas=args.adam_betas,
        warmup_steps=args.warmup_steps,
        schedule=args.lr_schedule,
        min_lr_ratio=args.min_lr_ratio,
        total_steps=args.steps * args.epochs * args.num_minibatches,  # optimizer steps
    )
    optimizer, scheduler = adamw(policy, lr=args.lr, **schedule)
    critic_optimizer, critic_scheduler = adamw(critic, lr=args.critic_lr, **schedule)
    actor, value = (policy, optimizer, scheduler), (critic, critic_optimizer, critic_scheduler)  # what update() trains
    # what the memory phases move around the engine (memory.wake_up and sleep), and how the weights reach it
    models = [m for m in (policy, ref, critic, rm) if m is not None]
    phases = dict(models=models, optimizers=[optimizer, critic_optimizer], offload=args.offload, mem=mem)
    sync = dict(
        bucket_bytes=args.sync_bucket_mb * 2**20,
        tp_group=rollout.tp.process_group if engine_kind == "sglang" else None,
        dtype=dtype if engine_kind == "hf" else torch.bfloat16,  # SGLang computes in bf16
        adapter=adapter,
    )
    kl_coef = args.kl_coef
    n_policy, n_critic = matmul_params(policy), matmul_params(critic)  # the models' sizes, for MFU (fsdp.throughput)
    clock.lap("model_s")

    # ---- the run's record: checkpoints, metrics, the console line ---------------------------------
    checkpoints = Checkpoints(
        run_dir,
        stateful={"policy": (policy, optimizer), "critic": (critic, critic_optimizer)},
        hf_models={"model": policy, "critic": critic},
        tokenizer=tokenizer,
        state=lambda: {  # in trainer.pt, with the step and the data position
            "scheduler": scheduler.state_dict(),
            "critic_scheduler": critic_scheduler.state_dict(),
            "kl_coef": kl_coef,
            "args": asdict(args),
            "model_fingerprint": base_weights,  # --resume checks --model holds the same weights
        },
        every=args.save_every,
        keep=args.keep_checkpoints,
    )
    if state := checkpoints.resume(resume_from, sampler):  # weights, optimizers, RNG, data position; the rest:
        scheduler.load_state_dict(state["scheduler"])
        critic_scheduler.load_state_dict(state["critic_scheduler"])
        kl_coef = state["kl_coef"]
    start_step = clock.begin(checkpoints.last)  # 0: a new run
    # a step's line: these columns, then the rare ones where not 0; the legend says what each name means
    console = CONSOLE + TOOLS_LINE * bool(tools) + RM_LINE * bool(args.reward_model)
    print0(legend(console + IF_NOT_0))
    eval_columns = EVAL_LINE + sampled_line(args.eval_samples) + EVAL_TOOLS_LINE * bool(tools)
    allow_interrupt(False)  # from here on a signal stops the run at the next check, between phases (stop.stop_run)
    log = RunLog(  # args.json, run_info.json, metrics.jsonl, samples.jsonl, curves.png; wandb with --track
        run_dir,
        config=asdict(args),
        start_step=start_step,
        info=run_info(
            world_size,
            engine_kind,
            python_sandbox=args.python_sandbox if "python" in tools else None,
            tool_workers=args.tool_workers,
        ),
        track=args.track,
        project=args.wandb_project,
        run_name=run_name,
        eval_redone=start_step < args.steps
        and eval_due(start_step, every=args.eval_every, before_train=args.eval_before_train),
    )
    nonfinite = NonFinite(args.max_nonfinite_steps)  # steps whose updates all skipped for NaN/inf: a line, then stop
    # the engine holds the trained weights (not checked with --async-rollout: its samples are one update old by design)
    gap_check = GapCheck(args.lora_gap_ratio if args.lora_rank and not args.async_rollout else 0)

    # ---- the loop ----------------------------------------------------------------------------------
    max_tokens = args.max_tokens_per_micro_batch  # > 0: packed micro-batches of at most this many tokens
    ahead = None  # --async-rollout: the next step's rollout, generating while this step trains
    stopped = None  # (signal, steps done, data position): a signal every rank agreed on stops the run after the loop
    for step in range(start_step + 1, args.steps + 1):
        t_step, metrics = time.time(), {"step": step}
        mem.reset()  # the memory log's phases: this step's

        # -- 1. wake SGLang up with the actor's weights (memory.wake_up: the first half of the diagram), with
        # --async-rollout after it finishes this step's batch (generating since the last step); evaluate when due
        data_before = ahead.before if ahead else sampler.state_dict()  # where a stop before this update leaves it
        if ahead is not None:
            with mem.phase("generate"):
                ahead.result()
        wake_up(rollout.engine, policy=policy, **sync, **phases)
        if eval_due(step - 1, every=args.eval_every, before_train=args.eval_before_train):  # after step - 1 updates
            with mem.phase("eval"):
                evaluation = held_out_eval(  # greedy, and --eval-samples K sampled: pass@k, maj@k
                    rollout,
                    eval_prompts,
                    step=step - 1,
                    k=args.eval_samples,
                    temperature=args.eval_temperature,
                    top_p=args.eval_top_p,
                    seed=args.seed,
                )
            if evaluation is None:  # a signal cut it short: nothing logged
                stopped = (agreed_signal(), step - 1, data_before)
                break
            log.evaluation(step - 1, evaluation, eval_columns)

        # -- 2. rollout: group_size episodes per prompt, scored
        with mem.phase("generate"):
            pending, ahead = ahead, None
            if pending is None:  # rollout.py: draw this rank's prompts, --group-size samples each, send them
                pending = send_prompts(
                    rollout,
                    sampler,
                    train_prompts,
                    n=args.prompts_per_step,
                    group_size=args.group_size,
                    seeds=(args.seed, "sample", step),
                )
            samples = label(pending.result(), [train_prompts.examples[i] for i in pending.sample_idx])
            # in threads, each call within --reward-timeout-s; one that raised, NaN/inf or timed out: 0.0, and why
            score_samples(reward, samples, workers=args.reward_workers, timeout_s=args.reward_timeout_s)
        if signum := agreed_signal():  # a signal during generation: stop before anything is trained on
            stopped = (signum, step - 1, data_before)
            break
        if args.async_rollout and step < args.steps:  # ALGO: one step off-policy: the next batch is sampled by the
            ahead = send_prompts(  # weights this step updates
                rollout,
                sampler,
                train_prompts,
                n=args.prompts_per_step,
                group_size=args.group_size,
                seeds=(args.seed, "sample", step + 1),
                ahead=True,
            )

        # -- 3. SGLang sleeps (memory.sleep: the second half of the diagram), training state comes back
        sleep(rollout.engine, device=device, **phases)
        if rm is not None:  # ALGO: each reward becomes w_rule * rule + w_rm * the RM's score (reward_model.py)
            with mem.phase("reward_model"):
                metrics.update(
                    rm_rewards(
                        rm,
                        samples,
                        weights=args.reward_weights,
                        whiten=args.reward_model_norm,
                        tokenizer=rm_tokenizer,
                        template=rm_template,
                        max_len=rm_max_len,
                        micro_batch_size=args.reward_model_micro_batch_size,
                        device=device,
                    )
                )
        metrics.update(step_rollout_stats(samples, pending, generate_s=mem.seconds["generate"]))  # rewards, lengths
        metrics.update(tool_stats(samples) if tools else {})  # turns and tool calls (tools.py)

        # -- 4. the batch: old log-probs, reference log-probs and values, all from the training side
        # PLUMBING: samples change ranks, as many on each, evening out the ranks' tokens (fsdp.balance)
        samples = balance(samples, [len(s.prompt_ids) + len(s.response_ids) for s in samples], world_size)
        batch = collate(samples, pad_id)
        lengths = batch.attention_mask.sum(-1)  # [B] real tokens
        batch.loss_mask = batch.response_mask.clone()
        if args.overlong_filter:  # ALGO: a truncated response has no final answer to be judged on
            batch.loss_mask[torch.tensor([s.truncated for s in samples])] = 0.0
        with mem.phase("logprob"):  # no gradient; a LoRA actor's reference: its base, the adapter off
            batch.old_logprobs, batch.ref_logprobs = old_and_ref_logprobs(
                policy,
                ref,
                batch,
                micro_batch_size=args.micro_batch_size,
                temperature=args.temperature,
                device=device,
                max_tokens=max_tokens,
                progress=lambda x: progress(x, "log-probs", rank),
            )
            batch.values = batch_forward(
                lambda ids, mask: token_values(critic, ids, mask, max_tokens > 0),
                batch,
                args.micro_batch_size,
                device,
                max_tokens=max_tokens,
            )  # [B, T-1], a field of ppo.py's own
        metrics.update(mismatch_stats(batch))  # sampler vs trainer: the sync check, KL, largest ratio (rollout.py)
        gap_check(metrics["rollout/logprob_abs_diff"], step)  # --lora-rank: a stale engine ends the run

        # -- 5. rewards per token (score on the last token, KL penalty on each), GAE, whitening
        mask = batch.response_mask
        kl = (
            kl_penalty(batch.old_logprobs, batch.ref_logprobs, args.kl_estimator) * mask
            if ref is not None
            else torch.zeros_like(mask)
        )
        scores = torch.tensor([s.reward for s in samples])  # [B]
        rewards = token_rewards(scores, kl, mask, kl_coef)  # [B, T-1]
        advantages, batch.returns = gae(rewards, batch.values, mask, args.gamma, args.lam)  # [B, T-1] each
        if args.whiten_advantages:
            advantages = masked_whiten(advantages, batch.loss_mask, all_reduce)
        batch.advantages = advantages
        lm, residual = batch.loss_mask, (batch.returns - batch.values) * batch.loss_mask  # [B, T-1]
        sums = all_reduce_dict(
            {
                "tokens": lm.sum(),
                "returns": (batch.returns * lm).sum(),
                "returns_sq": (batch.returns**2 * lm).sum(),
                "residual": residual.sum(),
                "residual_sq": (residual**2).sum(),
                "values": (batch.values * lm).sum(),
                "kl": kl.sum(),
                "responses": torch.tensor(float(len(samples))),
            }
        )
        n_tok = sums["tokens"].clamp(min=1)
        var_returns = sums["returns_sq"] / n_tok - (sums["returns"] / n_tok) ** 2
        var_residual = sums["residual_sq"] / n_tok - (sums["residual"] / n_tok) ** 2
        kl_per_response = float(sums["kl"] / sums["responses"])
        metrics.update(
            {
                "critic/returns_mean": sums["returns"] / n_tok,
                "critic/values_mean": sums["values"] / n_tok,
                "critic/explained_var": 1 - var_residual / var_returns.clamp(min=1e-8),
                "train/kl_per_response": kl_per_response,
                "train/kl_coef": kl_coef,
            }
        )

        # -- 6. update: epochs x mini-batches x micro-batches; the critic every step, the actor after the warm-up
        update_actor = step > args.critic_warmup_steps
        with mem.phase("update"):
            train = update(actor, value, batch, args, step=step, device=device, rank=rank, update_actor=update_actor)
        if args.adaptive_kl and math.isfinite(kl_per_response):  # ALGO: steer the KL coefficient toward the target
            kl_coef = adaptive_kl_coef(
                kl_coef, kl_per_response, args.target_kl, args.kl_horizon, int(sums["responses"])
            )
        metrics.update(train)
        metrics.update(  # PLUMBING: tokens a second, the ranks' balance, MFU on a GPU of known peak (fsdp.py)
            throughput(
                lengths,
                seconds=time.time() - t_step,
                phase_seconds=mem.seconds,
                device=device,
                forward_params=n_policy * (1 + (ref is not None)) + n_critic,  # log-probs: actor, reference, critic
                update_params=n_policy * update_actor + n_critic,
                weight_grads=not args.lora_rank,  # LoRA: the frozen bases have no weight gradients
                epochs=args.epochs,
            )
        )

        # -- 7. the step's line and metrics row, a few samples, a checkpoint when due, a signal's stop
        after = ahead.before if ahead else sampler.state_dict()  # the data position after this step
        updates = args.epochs * args.num_minibatches * (2 if update_actor else 1)  # optimizer steps: actor, critic
        metrics |= clock.times(step, time.time() - t_step, mem.metrics())  # seconds and memory by phase
        metrics = {k: float(v) for k, v in metrics.items()}
        print0(log_line(clock.label(step), metrics, console, rare=IF_NOT_0 + REWARD_LINE))
        log.log(metrics)
        if warning := nonfinite.after_step(step, int(metrics.get("train/nonfinite_skips", 0)), updates):
            print0(warning)
        if args.log_samples_every and step % args.log_samples_every == 0:
            log.samples(step, samples)
        if checkpoints.due(step, args.steps):
            checkpoints.save(step, after)
        if signum := agreed_signal():
            stopped = (signum, step, after)
            break

    # ---- the last evaluation, then the closing lines ---------------------------------------------
    if not stopped and args.eval_every and start_step < args.steps:
        wake_up(rollout.engine, policy=policy, **sync, **phases)
        evaluation = held_out_eval(
            rollout,
            eval_prompts,
            step=args.steps,
            k=args.eval_samples,
            temperature=args.eval_temperature,
            top_p=args.eval_top_p,
            seed=args.seed,
        )
        if evaluation is None:  # a signal cut it short
            stopped = (agreed_signal(), args.steps, sampler.state_dict())
        else:
            log.evaluation(args.steps, evaluation, eval_columns)
    if stopped:  # the engine down, the finished steps saved (--save-on-signal), how to go on; exit 128 + signal
        signum, done, data_position = stopped
        stop_run(
            signum,
            done,
            data_position,
            engine=rollout.engine,
            watch=watch,
            phases=phases,
            device=device,
            checkpoints=checkpoints,
            save=args.save_on_signal,
            mem=mem,
            log=log,
            clock=clock,
            eval_line=EVAL_LINE,
            resume=args.resume,
        )
    mem.close()
    stop_engine(rollout.engine, watch)
    log.finish()  # curves.png
    clock.summary(run_dir, EVAL_LINE)  # steps, time, held-out accuracy, where the checkpoint and curves are
    dist.destroy_process_group()


if __name__ == "__main__":  # SGLang starts its scheduler with multiprocessing spawn: keep this guard
    with friendly_errors("ppo.py"):
        main(
            parse_args(Args, CPU_SIZES, shown={"lr": "1e-6; LoRA: 1e-5", "critic_lr": "1e-5; LoRA: 1e-4"})
        )  # no GPU: CPU_SIZES for the flags not given (preflight.parse_args)
