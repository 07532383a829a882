"""GRPO: group-relative policy optimization, FSDP2 training + colocated SGLang rollout.

    python grpo.py --model HuggingFaceTB/SmolLM2-135M-Instruct                # 1 GPU, built-in addition task
    torchrun --nproc_per_node=8 grpo.py --model Qwen/Qwen2.5-7B-Instruct --dataset openai/gsm8k --offload
    python grpo.py --model ./tiny-model --rollout-engine hf                   # CPU, no SGLang
    python grpo.py --rollout-mode server --rollout-url http://HOST:30000 [--async-rollout]   # SGLang on GPUs of its own

Each step (main's loop, its phases called by name): wake SGLang up and sync the weights (memory.wake_up), evaluate
when due (rollout.held_out_eval), sample G completions per prompt and score them (rollout.send_prompts, the reward bound
in main: reward.reward_fn or --reward), sleep SGLang (memory.sleep), recompute old (and reference) log-probs, turn each
group's rewards into advantages, then `update`: epochs x mini-batches x micro-batches of `grpo_loss`, an optimizer
step per mini-batch; the step's line and row, a checkpoint when due, the signal check. The file reads in that order:
Args, the flags' checks, the variants' pieces, then the default step in one stretch: its GRPO pieces (pure functions of
tensors), update, main (its set-up, each a named call; then the loop). grpo_minimal.py is the default step alone.

Variants, all flags (docs/variants.md): the advantage (--advantage grpo, rloo, reinforce++; --no-scale-rewards
+ --loss-agg seq-mean-token-sum-norm: Dr.GRPO), the policy loss (--policy-loss ppo-clip, gspo, cispo, sapo;
--clip-high 0.28: DAPO's clip-higher), the sampler-trainer mismatch (--rollout-correction tis, mis, icepop, seq-mask;
logged every step whatever the choice), --dynamic-sampling, --overlong-filter, --beta > 0 with --kl-estimator k2/k3 in
the loss or (--kl-in-reward) in the reward.

What the default leaves out (each a flag away):
- One update a batch (--epochs 1 --num-minibatches 1): the old log-probs come from the weights the loss sees, so every
  ratio is 1 and nothing clips; ppo-clip, gspo, cispo and sapo take the same step (--num-minibatches 4: they differ).
- No reference model (--beta 0): no KL term anywhere, and no reference model is loaded.
- Token-mean (--loss-agg token-mean): every loss token of a mini-batch weighs the same, so a long response counts
  more than a short one (seq-mean-token-mean: the GRPO paper's; seq-mean-token-sum-norm: Dr.GRPO's).
- No rollout correction colocated (--rollout-correction auto: tis with --async-rollout only): SGLang's bf16 kernels
  sample from slightly other probabilities than the trainer computes; that is logged every step, not corrected.
- As every script here: each rank reads the whole checkpoint on CPU before sharding; sequences are right-padded per
  micro-batch unless --max-tokens-per-micro-batch packs them; one AdamW over all parameters.

Shapes, in comments ([B, T-1]) and in the names of lists whose shape is not obvious (samples_G, rewards_P_G):
P prompts on this rank, G samples of each (--group-size), B = P x G sequences, T tokens a sequence (prompt, response,
padding; per-token tensors are [B, T-1]: token t is predicted at position t-1); b, t: a micro-batch's.
"""

import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Literal

from common import exit_on_interrupt  # first (stdlib only): a Ctrl-C while torch loads (~1.5 s) is one line

exit_on_interrupt("grpo.py")
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
    matmul_params,
    micro_batches,
    skip_schedule,
    throughput,
)
from logprobs import old_and_ref_logprobs, token_logprobs
from lora import LORA_LR_FACTOR, GapCheck, check_lora, default_lr, lora_rules
from memory import MemoryLog, sleep, wake_up
from producer import Producer
from preflight import check_engine, check_flags, check_model, engine_count, friendly_errors, given_flags, parse_args
from preflight import package_rules
from preflight import rollout_rules, sampling_rules
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
    """policy to train: a hub id or a local folder (also the reference model and SGLang's config)"""
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
    group_size: int = 16
    """completions per prompt; advantages are normalized within each group"""
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
    """peak learning rate (AdamW); 0: 1e-6 for full fine-tuning, 1e-5 with --lora-rank (10x: docs/lora.md)"""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """decay after warm-up, reaching min_lr_ratio * lr after steps * epochs * num_minibatches optimizer steps"""
    warmup_steps: int = 0
    """optimizer steps of linear warm-up from 0"""
    min_lr_ratio: float = 0.0
    """final lr / peak lr for cosine and linear schedules"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's betas (decay of the gradient's running mean and of its square)"""
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
    """> 0: train a LoRA adapter of this rank (fp32, AdamW) on the base frozen in bf16 (lora.py); 0: full fine-tuning.
    For RL even rank 1 learns as full fine-tuning does, at ~10x its --lr ('LoRA Without Regret')"""
    lora_alpha: float = 32.0
    """the adapter's scale is lora_alpha / lora_rank"""
    lora_targets: tuple[str, ...] = ("all-linear",)
    """linear layers that get an adapter: all-linear (every one of the decoder layers, MLP too), or names (q_proj v_proj)"""
    lora_sync: Literal["merge", "adapter"] = "adapter"
    """how the engine gets the adapter: adapter (SGLang with LoRA on: the base once, then the adapter alone each step,
    every request names it); merge (W + alpha/r B A as bf16 weights: any engine or server, --rollout-tp > 1 too, but an
    update finer than bf16's step at W is lost in the rounding: docs/lora.md)"""
    lora_gap_ratio: float = 3.0
    """the run fails when the sampler-trainer log-prob gap exceeds this x its first step's + 0.01: the engine does not
    hold the trained weights (lora.GapCheck); 0: no check (nor with --async-rollout, one update stale by design)"""
    # --- GRPO (docs/variants.md)
    advantage: Literal["grpo", "rloo", "reinforce++"] = "grpo"
    """grpo: reward minus its group's mean, over the group's std (--scale-rewards); rloo: minus the mean of the other
    G-1 samples of its group (leave-one-out); reinforce++: minus the group's mean, then whitened over the whole batch"""
    scale_rewards: bool = True
    """with --advantage grpo: divide group-centred rewards by the group's std (--no-scale-rewards: Dr.GRPO). Its 1e-6
    epsilon is no floor: rewards 0, 0, 0 and 1e-4 (a reward model's near-ties) get advantages -0.49 and +1.47, as
    large as a right answer among wrong ones"""
    policy_loss: Literal["ppo-clip", "gspo", "cispo", "sapo"] = "ppo-clip"
    """ppo-clip: a ratio per token, clipped (GRPO, DAPO); gspo: one ratio per sequence (the geometric mean of its
    tokens'), clipped per sequence; cispo: the clipped ratio as a constant weight on -A log p: clipped tokens keep a
    gradient; sapo: no clip, a sigmoid gate of the ratio (--sapo-tau). Each brings its paper's clip range
    (--clip-low/--clip-high not given): gspo 3e-4/4e-4, cispo 1/4"""
    sapo_tau: tuple[float, float] | None = None
    """--policy-loss sapo's gate temperatures for positive and negative advantages (None: 1 1.05, the paper's; larger:
    a ratio's gradient fades sooner as it leaves 1)"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """token-mean: over all tokens of the mini-batch; seq-mean-token-mean: mean per sequence, then over
    sequences (original GRPO, and GSPO's: gspo's default unless given); seq-mean-token-sum-norm: token sum /
    (sequences * max_new_tokens) (Dr.GRPO)"""
    clip_low: float = 0.2
    """ratio clipped below at 1 - clip_low (1: no lower bound); not given: 3e-4 with gspo, 1 with cispo"""
    clip_high: float = 0.2
    """ratio clipped above at 1 + clip_high (0.28: clip-higher from DAPO); not given: 4e-4 with gspo, 4 with cispo"""
    rollout_correction: Literal["auto", "none", "tis", "mis", "icepop", "seq-mask", "decoupled"] = "auto"
    """for the sampler not being the trained policy (SGLang's bf16 kernels; one update older with --async-rollout),
    by r = p_old / p_sampler per token: tis weights each token's loss by min(r, --tis-cap); mis masks the tokens whose
    r leaves --correction-bounds out of the loss; icepop masks them too and weights the others by r; seq-mask drops a
    sequence whose geometric-mean r leaves them; decoupled (AReaL's decoupled PPO) weights each token by r and masks it
    where r > HI: p_old is the proximal policy the trainer recomputes, the ratio clipped against it. auto: tis with
    --async-rollout, decoupled with --max-staleness >= 2, else none"""
    tis_cap: float | None = None
    """the cap of --rollout-correction tis (None: 2.0); 0 with --async-rollout: no correction"""
    correction_bounds: tuple[float, float] | None = None
    """[lo, hi] of r that mis, icepop, seq-mask and decoupled keep (inclusive); None: mis 0.5 2 (verl's token
    rejection), icepop 0.5 5 (IcePop's), seq-mask 0.999 1.001 (verl's geometric rejection: a mean over tokens moves
    little), decoupled 0 5 (AReaL's behaviour-weight cap)"""
    beta: float = 0.0
    """KL coefficient to the reference model; 0 loads no reference model at all"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """per-token estimate of KL(policy || ref) in the loss, r = ref/policy probability of the sampled token: k2 =
    (log r)^2 / 2, k3 = r - 1 - log r (Schulman's; its value unbiased and >= 0). As a loss on the policy's own samples
    their gradients follow two KLs: k2's that of KL(policy || ref), k3's that of KL(ref || policy) (tests/test_grpo_math.py
    works both out); k1 = -log r has zero expected gradient there and is refused (k1 belongs in the reward: --kl-in-reward)"""
    kl_in_reward: bool = False
    """subtract beta * sum of k1 over the response from the reward instead of adding KL to the loss"""
    dynamic_sampling: bool = False
    """drop groups whose rewards are all equal (no signal) and sample more prompts to refill (DAPO)"""
    max_sampling_rounds: int = 4
    """with --dynamic-sampling, rollout rounds per step at most"""
    overlong_filter: bool = False
    """mask truncated responses out of the loss (DAPO)"""
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
    sampled by the weights from before the last update (one step off-policy; see --rollout-correction); the same as
    --max-staleness 1"""
    max_staleness: int = 0
    """with --rollout-mode server, k: how many weight updates a sample's oldest token may lag the trained weights. 0:
    each step samples with the weights it trains; 1: --async-rollout; k >= 2: fully asynchronous (producer.py): the
    servers never wait for the trainer, a weight update aborts their requests and resumes them from their tokens so far
    (partial rollouts), a group older than k is dropped, and the loss is decoupled PPO (--rollout-correction auto)"""
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
    """default: grpo-<model>-<dataset>-s<seed>"""
    resume: bool = False
    """continue from the latest checkpoint of this run"""
    track: bool = False
    """log to Weights & Biases"""
    wandb_project: str = "grpo"
    """wandb project"""
    log_samples_every: int = 10
    """print a few sample completions (and append them to samples.jsonl) every this many steps (0: never)"""


FULL_LR = 1e-6  # --lr 0's value for full fine-tuning (sized for 1.5B-7B models); with LoRA 10x (lora.default_lr)
# PLUMBING: without a GPU, these replace the defaults of the flags not given (SmolLM2-135M shapes: ~20 s a step on 2 cores).
CPU_SIZES = {
    "prompts_per_step": 4,
    "group_size": 4,
    "max_new_tokens": 64,
    "num_eval_prompts": 16,
    "micro_batch_size": 16,
}
# PLUMBING: a step's console line: (name, metric, format, what it is: the legend printed before step 1)
CONSOLE = SAMPLES_LINE + [("gnorm", "train/grad_norm", ".2f", "gradient norm before clipping")] + TIMES_LINE
# shown after the others, on a step where they are not 0
IF_NOT_0 = [TRUNC, ("kl", "train/kl", ".2g", "KL to the reference per token (where not 0: --beta > 0)"), CLIP]
FULLY_ASYNC_CONSOLE = [  # --max-staleness >= 2 (producer.py)
    ("stale", "rollout/staleness", ".2f", "updates between a sample's oldest token and the trained weights, mean"),
    ("partial", "rollout/partial_frac", ".2f", "share of samples a weight update interrupted and resumed"),
    ("dropped", "rollout/dropped_groups", ".0f", "groups dropped so far as older than --max-staleness"),
]
CORRECTION_CONSOLE = [
    ("mismatch kl", "rollout/mismatch_kl", ".1e", "KL(sampler || trainer) over the model's tokens"),
    ("corrected", "rollout/correction_frac", ".3f", "share of tokens --rollout-correction capped or masked"),
]

# ----------------------------------------------------------------------------------------------
# Flags: each checked before anything loads, and the defaults that depend on other flags


def check_args(args: Args, world_size: int):
    """Bad input fails here, before anything is loaded or written, all at once: GRPO's own flags, the sizes and the
    optimizer's, then each module's rules for its flags (the rollout's, evaluation's, the tools', the reward model's,
    LoRA's, packages)."""
    a, server, given = args, args.rollout_mode == "server", given_flags(sys.argv[1:])
    per_rank = a.prompts_per_step // world_size * a.group_size
    engines = engine_count(world_size, a.rollout_tp, (len(a.rollout_url) or a.rollout_gpus // a.rollout_tp) * server)
    check_flags(
        [  # (flag, value, holds, what it must be)
            ("--group-size", a.group_size, a.group_size >= 2, ">= 2: GRPO compares completions of one prompt"),
            ("--beta", a.beta, a.beta >= 0, ">= 0"),
            (
                "--kl-estimator",
                a.kl_estimator,
                a.kl_estimator != "k1" or a.beta == 0 or a.kl_in_reward,
                "k2 or k3 in the "
                "loss (--beta > 0): k1's gradient there is that of log p, zero in expectation; k1 belongs in the reward (--kl-in-reward)",
            ),
            (
                "--scale-rewards",
                a.scale_rewards,
                a.scale_rewards or a.advantage == "grpo",
                "with --advantage grpo (rloo and reinforce++ divide by no group's std)",
            ),
            ("--clip-low", a.clip_low, 0 <= a.clip_low <= 1, "in [0, 1] (1: no lower bound)"),
            (
                "--sapo-tau",
                a.sapo_tau,
                a.sapo_tau is None or (0 < min(a.sapo_tau) <= max(a.sapo_tau) < math.inf and a.policy_loss == "sapo"),
                "POS NEG, finite and > 0, with --policy-loss sapo",
            ),
            (
                "--tis-cap",
                a.tis_cap,
                a.tis_cap is None or a.tis_cap > 0 or (a.tis_cap == 0 and a.rollout_correction != "tis"),
                "> 0 (0: no tis with --async-rollout, which turns it on)",
            ),
            (
                "--tis-cap",
                a.tis_cap,
                a.tis_cap is None
                or a.tis_cap == 0
                or a.rollout_correction == "tis"
                or (a.rollout_correction == "auto" and (a.async_rollout or a.max_staleness == 1)),
                "given with --rollout-correction tis or --async-rollout only",
            ),
            (
                "--correction-bounds",
                a.correction_bounds,
                a.correction_bounds is None
                or (
                    0 <= a.correction_bounds[0] <= 1 <= a.correction_bounds[1] < math.inf
                    and a.rollout_correction in ("mis", "icepop", "seq-mask", "decoupled")
                ),
                "LO HI with 0 <= LO <= 1 <= HI < inf, with --rollout-correction mis, icepop, seq-mask or decoupled",
            ),
            ("--max-sampling-rounds", a.max_sampling_rounds, a.max_sampling_rounds >= 1, ">= 1"),
            (
                "--async-rollout",
                a.async_rollout,
                not a.async_rollout or (server and not a.dynamic_sampling),
                "with --rollout-mode server, without --dynamic-sampling (its refills wait on this step's rewards)",
            ),
            ("--max-staleness", a.max_staleness, a.max_staleness >= 0, ">= 0 (0: synchronous)"),
            (
                "--max-staleness",
                a.max_staleness,
                a.max_staleness == 0 or (server and not a.dynamic_sampling),
                "0 without --rollout-mode server (a colocated engine takes turns with training on its GPUs), and "
                "without --dynamic-sampling (its refills wait on this step's rewards)",
            ),
            (
                "--async-rollout",
                a.async_rollout,
                not a.async_rollout or a.max_staleness <= 1,
                f"not given with --max-staleness {a.max_staleness}: it is --max-staleness 1",
            ),
            (
                "--deterministic-rollout",
                a.deterministic_rollout,
                not (a.deterministic_rollout and a.max_staleness >= 2),
                "without --max-staleness >= 2: fully asynchronous samples depend on when a weight update interrupts "
                "them, so no run repeats bit for bit",
            ),
            (
                "--dynamic-sampling",
                a.dynamic_sampling,
                not (a.dynamic_sampling and a.reward_model),
                "without --reward-model (the "
                "reward model scores once per step, after generation: it can't refill groups)",
            ),
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


def variant_defaults(args: Args) -> Args:
    """The defaults that depend on other flags, for the flags not given on the command line: each policy loss's clip
    range and each correction's bounds (VARIANT_DEFAULTS), tis with --async-rollout, as before --rollout-correction, and
    --lr 0's (LoRA's is 10x full fine-tuning's)."""
    correction, staleness = args.rollout_correction, max(args.max_staleness, int(args.async_rollout))
    if correction == "auto":  # the objective follows the staleness
        correction = "decoupled" if staleness >= 2 else "tis" if staleness == 1 and args.tis_cap != 0 else "none"
    defaults = {"tis_cap": 2.0, **VARIANT_DEFAULTS.get(args.policy_loss, {}), **VARIANT_DEFAULTS.get(correction, {})}
    given = given_flags(sys.argv[1:])
    defaults = {k: v for k, v in defaults.items() if k not in given}
    lr = default_lr(args.lr, full=FULL_LR, rank=args.lora_rank)  # LoRA learns at ~10x full fine-tuning's rate
    # one flag set, one meaning: --async-rollout is --max-staleness 1
    return replace(
        args, rollout_correction=correction, max_staleness=staleness, async_rollout=staleness == 1, lr=lr, **defaults
    )


def variant_line(args: Args) -> str:
    """The variant in force after variant_defaults, for the console. With one update a batch the old log-probs come
    from the weights the loss sees: every ratio is 1, nothing clips, and ppo-clip, gspo, cispo and sapo take one step."""
    correction = args.rollout_correction
    if correction == "tis":
        correction += f" (cap {args.tis_cap:g})"
    elif correction != "none":  # mis, icepop, seq-mask, decoupled
        correction += " (bounds {:g} {:g})".format(*args.correction_bounds)
    gate = (
        "tau {:g} / {:g}".format(*args.sapo_tau)
        if args.policy_loss == "sapo"
        else f"clip {args.clip_low:g} / {args.clip_high:g}"
    )
    line = f"algorithm: advantage {args.advantage} | policy loss {args.policy_loss} ({gate}, {args.loss_agg}) | rollout correction {correction}"
    line += f" | lr {args.lr:g}" + f" (LoRA's default: {LORA_LR_FACTOR:g}x full fine-tuning's)" * (args.lora_rank > 0)
    if args.max_staleness:
        line += f" | staleness at most {args.max_staleness}" + " (fully async: producer.py)" * (args.max_staleness >= 2)
    if args.epochs * args.num_minibatches == 1:
        line += " | one update a batch: every ratio 1, nothing clips (--num-minibatches N: the policy losses differ)"
    return line


# ----------------------------------------------------------------------------------------------
# ALGO: the GRPO pieces, pure functions of tensors (tests/test_grpo_math.py checks them by hand)

ADVANTAGE_EPS = 1e-6  # added to a group's reward std: a group of near-equal rewards stays finite
# each variant's own defaults, from its paper, for --clip-low/--clip-high/--correction-bounds not given (variant_defaults)
VARIANT_DEFAULTS = {
    "gspo": {
        "clip_low": 3e-4,
        "clip_high": 4e-4,  # Zheng et al. 2025: the sequence ratio's range
        "loss_agg": "seq-mean-token-mean",
    },  # and its objective: a mean per sequence
    "cispo": {"clip_low": 1.0, "clip_high": 4.0},  # MiniMax-M1: no lower bound; upper 5 (SkyRL's)
    "sapo": {"sapo_tau": (1.0, 1.05)},  # SAPO's tau_pos, tau_neg
    "mis": {"correction_bounds": (0.5, 2.0)},  # verl's token rejection: 2 and its reciprocal
    "icepop": {"correction_bounds": (0.5, 5.0)},  # IcePop's alpha, beta (OpenRLHF's default)
    "seq-mask": {"correction_bounds": (0.999, 1.001)},  # verl's geometric rejection (geo_rs)
    "decoupled": {"correction_bounds": (0.0, 5.0)},  # AReaL's behav_imp_weight_cap, as its examples set it
}


# The variants --advantage and --loss choose, each beside its siblings (VARIANT_DEFAULTS: their papers' settings);
# then the default step's own pieces, update and the loop, in one stretch


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): each sample's baseline is the mean reward of the G-1 other
    samples of its group, so it is independent of the sample itself. [num_groups, G] -> [num_groups, G]"""
    others = (rewards.sum(dim=1, keepdim=True) - rewards) / (rewards.shape[1] - 1)
    return rewards - others


def reinforce_pp_advantages(rewards: torch.Tensor, world_sum=all_reduce) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al. 2025, arXiv 2501.03262): the group's mean subtracted, then whitened over the
    global batch, all ranks' samples (world_sum adds over them), instead of by each group's std. Per sample, as the
    paper writes it (verl and OpenRLHF whiten over tokens: a long response weighs more). [num_groups, G]"""
    adv = rewards - rewards.mean(dim=1, keepdim=True)
    n, total, squares = world_sum(torch.stack([torch.tensor(float(adv.numel())), adv.sum(), (adv**2).sum()]).double())
    mean = total / n  # 0 up to rounding: every group is centred already
    std = ((squares - n * mean**2) / (n - 1).clamp(min=1)).clamp(min=0).sqrt()  # unbiased, as group_advantages
    return ((adv - mean) / (std + ADVANTAGE_EPS)).to(rewards.dtype)


def gspo_policy_loss(logp, old_logp, advantages, mask, clip_low: float, clip_high: float):
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): one ratio per sequence, the geometric mean of its tokens' ratios,
    s = exp(mean over its loss tokens of (logp - old_logp)), PPO-clipped per sequence; its paper clips at 3e-4 / 4e-4
    (a mean over tokens moves far less than one token). The GSPO-token form: each token's ratio is
    sg(s) * exp(logp - sg(logp)), worth s and with the gradient through its own log-prob: averaged over a sequence's
    tokens (seq-mean-token-mean, as the paper) it is GSPO's gradient; clipped as PPO-clip clips. Returns (loss, clipped),
    [B, T]; whole sequences are clipped or not (s is the same number on each of its tokens, bit for bit)."""
    log_s = ((logp - old_logp) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
    ratio = torch.exp(log_s.detach()) * torch.exp(logp - logp.detach())  # [B, T]: s times exactly 1
    return ppo_clip(ratio, advantages, clip_low, clip_high)


def cispo_policy_loss(logp, old_logp, advantages, clip_low: float, clip_high: float):
    """CISPO (MiniMax-M1, arXiv 2506.13585): loss = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log p, r the
    token's ratio. The clip bounds a constant weight instead of cutting the gradient: a token past the band still
    gets -A * weight * d log p (PPO-clip gives it none). The paper sets no lower bound (clip_low 1). Returns (loss,
    clipped), [B, T]: clipped marks the tokens whose weight the band cut."""
    ratio = torch.exp(logp - old_logp).detach()
    weight = ratio.clamp(1 - clip_low, 1 + clip_high)
    return -weight * advantages * logp, weight != ratio


def sapo_policy_loss(logp, old_logp, advantages, tau_pos: float, tau_neg: float):
    """SAPO (Qwen team 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347): no clip; loss = -A * 4 s / tau
    with s = sigmoid(tau (r - 1)), r the token's ratio, tau = tau_pos where A > 0, else tau_neg. d loss / d log p =
    -A * 4 s (1 - s) r: -A at r = 1 (PPO's), fading smoothly as r leaves 1 instead of dropping to 0 at a band's edge
    (an infinite r: s = 1, a finite loss). Returns (loss, clipped), [B, T]; nothing is clipped."""
    tau = torch.where(advantages > 0, tau_pos, tau_neg)  # [B, T] or [B, 1]
    gate = torch.sigmoid(tau * (torch.exp(logp - old_logp) - 1)) * 4 / tau
    return -advantages * gate, torch.zeros_like(logp, dtype=torch.bool)


def group_advantages(rewards: torch.Tensor, scale: bool) -> torch.Tensor:
    """rewards [num_groups, group_size] -> advantages, centred (and scaled) within each group."""
    adv = rewards - rewards.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (rewards.std(dim=1, keepdim=True) + ADVANTAGE_EPS)  # unbiased std, as in the GRPO paper
    return adv


def advantages(rewards: torch.Tensor, kind: str, scale: bool) -> torch.Tensor:
    """--advantage: rewards [num_groups, G] -> advantages [num_groups, G]."""
    if kind == "grpo":
        return group_advantages(rewards, scale)
    if kind == "rloo":
        return rloo_advantages(rewards)
    if kind == "reinforce++":
        return reinforce_pp_advantages(rewards)
    raise ValueError(f"--advantage {kind!r} is unknown; use grpo, rloo or reinforce++")


KL_EXP_CLAMP = 20.0  # k3's exponent is clamped to +-this: one outlier token can't overflow the loss


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) from the policy's own samples, r = ref/policy probability of the sampled
    token: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r (Schulman's: unbiased, always >= 0). In GRPO's loss
    (--beta, --kl-estimator) k2's gradient is that of KL(policy || ref) and k3's that of KL(ref || policy); k1's is zero
    in expectation there, so k1 goes in the reward (--kl-in-reward); k3 of (now, old) is the update's approx_kl.
    [B, T] -> [B, T]"""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        neg = (-log_ratio).clamp(-KL_EXP_CLAMP, KL_EXP_CLAMP)
        return torch.exp(neg) - 1 - neg
    raise ValueError(f"KL estimator {estimator!r} is unknown; use k1, k2 or k3")


def clipped_policy_loss(logp, old_logp, advantages, clip_low: float, clip_high: float):
    """PPO-clip per token: max(-A r, -A clip(r, 1-clip_low, 1+clip_high)), r = exp(logp - old_logp). Returns (loss,
    clipped), [B, T]."""
    return ppo_clip(torch.exp(logp - old_logp), advantages, clip_low, clip_high)


def ppo_clip(ratio, advantages, clip_low: float, clip_high: float):
    """max(-A r, -A clip(r, 1-clip_low, 1+clip_high)) of any ratio r (a token's, GSPO's). Returns (loss, clipped), [B, T]."""
    unclipped, clipped = -advantages * ratio, -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def rollout_correction(old_logp, sampler_logp, mask, kind: str, *, tis_cap: float, bounds: tuple[float, float] | None):
    """The sampler is not the policy that computed old_logp: SGLang's bf16 kernels differ from the trainer's even with
    the same weights, and with --async-rollout its weights are one update older (--max-staleness k: up to k). With
    r = p_old / p_sampler per token of `mask` (the model's tokens), bounds = (lo, hi), inclusive:
      tis       weight min(r, tis_cap)  (truncated IS: Yao et al. 2025, "Your efficient RL framework secretly brings
                you off-policy RL training")
      mis       tokens with r outside [lo, hi] out of the loss, no weight  (verl's token rejection, from Liu, Li et
                al. 2025, "When speed kills stability", whose masked IS also weights the others by r: icepop's way)
      icepop    those out, the others weighted by r  (IcePop: Ling team 2025, Ring-1T, arXiv 2510.18855)
      seq-mask  a sequence out when its geometric-mean r leaves [lo, hi]  (verl's geometric rejection, Liu, Li et al.)
      decoupled icepop's arithmetic where the sampler lags by up to k updates: old_logp is the proximal policy the
                trainer recomputes before the update, the loss clips its ratio against it, and r weighs each token
                from the behaviour (sampler) policy to it, masked above hi  (AReaL's decoupled PPO: Fu et al. 2025,
                arXiv 2505.24298, its behaviour-weight cap)
    Returns (weight or None, keep, touched), [B, T]: weight multiplies each token's loss, keep the loss mask (a
    masked token leaves the normalizer too), touched marks the tokens capped or masked. No gradient: both are constants."""
    log_r = (old_logp - sampler_logp) * mask
    r = torch.exp(log_r)  # [B, T]
    if kind == "none":
        return None, mask, torch.zeros_like(mask, dtype=torch.bool)
    if kind == "tis":  # a NaN ratio (a NaN log-prob) weighs 0, and is counted as corrected
        return torch.where(r.isnan(), 0.0, r.clamp(max=tis_cap)), mask, ((r > tis_cap) | r.isnan()) & (mask > 0)
    if kind == "seq-mask":  # one ratio per sequence, on each of its tokens
        r = torch.exp(log_r.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(mask)
    if kind not in ("mis", "icepop", "seq-mask", "decoupled"):
        raise ValueError(f"--rollout-correction {kind!r} is unknown; use none, tis, mis, icepop, seq-mask or decoupled")
    keep = mask * ((r >= bounds[0]) & (r <= bounds[1]))
    weighted = kind in ("icepop", "decoupled")
    weight = torch.where(keep > 0, r, 0.0) if weighted else None  # a masked token's r may be inf
    return weight, keep, (mask - keep) > 0


def aggregate(values, mask, mode: str, num_seqs: float, num_tokens: float, max_len: int) -> torch.Tensor:
    """Reduce per-token values [B, T] to this rank's share of the mini-batch loss.

    The whole normalization story: num_seqs (sequences with at least one loss token) and num_tokens
    count the whole mini-batch on all ranks, computed once before its micro-batches. So the losses
    of all micro-batches on all ranks add up to the mini-batch mean, and FSDP sums their gradients
    over ranks (fsdp.shard_model sets no divide factor): the gradient is the mean's, and nothing
    else scales it.
    """
    if mode == "token-mean":
        return (values * mask).sum() / max(num_tokens, 1.0)
    if mode == "seq-mean-token-mean":
        return ((values * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / max(num_seqs, 1.0)
    if mode == "seq-mean-token-sum-norm":  # Dr.GRPO: a constant normalizer, no length bias
        return (values * mask).sum() / (max(num_seqs, 1.0) * max_len)
    raise ValueError(f"--loss-agg {mode!r} is unknown")


def grpo_loss(
    logp,
    entropy,
    mb,
    *,
    clip_low: float,
    clip_high: float,
    kl_coef: float,
    kl_estimator: str,
    loss_agg: str,
    num_seqs: float,
    num_tokens: float,
    max_len: int,
    policy_loss: str = "ppo-clip",
    sapo_tau: tuple[float, float] = VARIANT_DEFAULTS["sapo"]["sapo_tau"],
):
    """One micro-batch's loss: the policy loss (--policy-loss) on the advantages, each token weighted by the rollout
    correction's weight where it has one (mb.is_weight: tis, icepop; its masks are in mb.loss_mask already), plus
    kl_coef * KL to the reference model (0: no KL in the loss), reduced by `aggregate`. logp, entropy [b, t]: the
    policy now. Returns (this rank's share of the mini-batch loss, sums over loss tokens for the metrics)."""
    m = mb.loss_mask  # [b, t]
    if policy_loss == "ppo-clip":
        token_loss, clipped = clipped_policy_loss(logp, mb.old_logprobs, mb.advantages, clip_low, clip_high)  # [b, t]
    elif policy_loss == "gspo":
        token_loss, clipped = gspo_policy_loss(logp, mb.old_logprobs, mb.advantages, m, clip_low, clip_high)
    elif policy_loss == "cispo":
        token_loss, clipped = cispo_policy_loss(logp, mb.old_logprobs, mb.advantages, clip_low, clip_high)
    elif policy_loss == "sapo":
        token_loss, clipped = sapo_policy_loss(logp, mb.old_logprobs, mb.advantages, *sapo_tau)
    else:
        raise ValueError(f"--policy-loss {policy_loss!r} is unknown; use ppo-clip, gspo, cispo or sapo")
    stats = {
        "clip_frac": (clipped.float() * m).sum(),
        "entropy": (entropy * m).sum(),
        "tokens": m.sum(),
        "approx_kl": (kl_penalty(mb.old_logprobs, logp.detach(), "k3") * m).sum(),
    }  # KL(old || now)
    if mb.is_weight is not None:
        token_loss = token_loss * mb.is_weight  # a constant [b, t]: no gradient through it
    if kl_coef > 0:
        kl = kl_penalty(logp, mb.ref_logprobs, kl_estimator)  # [b, t]
        token_loss = token_loss + kl_coef * kl
        stats["kl"] = (kl.detach() * m).sum()
    loss = aggregate(token_loss, m, loss_agg, num_seqs, num_tokens, max_len)
    stats["loss"] = loss.detach()
    return loss, stats


def update(policy, optimizer, scheduler, batch, args: Args, *, step: int, device, rank: int = 0) -> dict:
    """The update on one rollout batch: --epochs passes, each shuffled and cut into --num-minibatches mini-batches
    (one optimizer step each), each mini-batch in micro-batches whose gradients add up (--micro-batch-size rows, or
    packed to --max-tokens-per-micro-batch tokens); the loss is grpo_loss's (--policy-loss: ppo-clip, gspo, cispo,
    sapo). batch: this rank's [B, T-1] fields, advantages and loss mask set. Returns the train/ metrics, all ranks'."""
    policy.train()
    totals = {
        k: torch.zeros((), dtype=torch.float64, device=device)  # metric sums, on the device
        for k in ("loss", "clip_frac", "kl", "entropy", "approx_kl", "tokens")
    }
    grad_norms, lengths, empty = [], batch.attention_mask.sum(-1), 0  # lengths: [B] real tokens
    max_tokens = args.max_tokens_per_micro_batch  # > 0: packed micro-batches of at most this many tokens
    for epoch in range(args.epochs):
        shuffle = torch.Generator().manual_seed(seed_for(args.seed, "update", step, epoch))
        order = torch.randperm(len(batch), generator=shuffle)
        for mini in order.tensor_split(args.num_minibatches):  # the rows of one optimizer step: as many
            # as the LR schedule counts, also when dynamic sampling shrank the batch (6 rows: 2, 2, 1, 1)
            # global counts, once per mini-batch: every rank normalizes by the whole mini-batch
            num_tokens = float(all_reduce(batch.loss_mask[mini].sum()))
            num_seqs = float(all_reduce((batch.loss_mask[mini].sum(-1) > 0).sum()))  # filtered rows don't count
            # no loss token on any rank (every row masked by --overlong-filter, MIS or IcePop, or fewer rows than
            # mini-batches): no optimizer step, since AdamW's momentum alone would move every weight by most of a
            # step; the schedule moves on, as for a step skipped whole
            if num_tokens == 0:
                skip_schedule(scheduler, 1)
                empty += 1
                continue
            mbs = micro_batches(mini, lengths, args.micro_batch_size, max_tokens)  # as many on every rank
            for rows in progress(mbs, f"update {epoch + 1}/{args.epochs}", rank):
                part = batch.select(rows)  # [b, t] fields, on the CPU
                mb = part.to(device)  # queued, no wait for the GPU; part's mask plans a packed row on the CPU
                logp, entropy = token_logprobs(
                    policy,
                    mb.input_ids,
                    part.attention_mask,
                    args.temperature,
                    with_entropy=True,
                    packed=max_tokens > 0,
                )  # [b, t-1] each
                loss, stats = grpo_loss(
                    logp,
                    entropy,
                    mb,
                    policy_loss=args.policy_loss,
                    clip_low=args.clip_low,
                    clip_high=args.clip_high,
                    kl_coef=0.0 if args.kl_in_reward else args.beta,
                    kl_estimator=args.kl_estimator,
                    loss_agg=args.loss_agg,
                    sapo_tau=args.sapo_tau,
                    num_seqs=num_seqs,
                    num_tokens=num_tokens,
                    max_len=args.max_new_tokens,
                )
                loss.backward()
                for k, v in stats.items():
                    totals[k] += v
            grad_norms.append(clip_and_step(policy, optimizer, scheduler, args.max_grad_norm))
    totals = all_reduce_dict(totals)  # a CPU-GPU sync point, once per step
    tokens = totals["tokens"].clamp(min=1)
    return {
        "train/loss": totals["loss"] / (args.epochs * args.num_minibatches),
        "train/clip_frac": totals["clip_frac"] / tokens,
        "train/kl": totals["kl"] / tokens,
        "train/entropy": totals["entropy"] / tokens,
        "train/approx_kl": totals["approx_kl"] / tokens,
        "train/grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
        "train/lr": scheduler.get_last_lr()[0],
        "train/nonfinite_skips": sum(not math.isfinite(g) for g in grad_norms),
        "train/empty_minibatches": empty,  # no loss token on any rank: no optimizer step
    }


# ----------------------------------------------------------------------------------------------
# main: its set-up, each a named call, then the loop, which names each phase


def main(args: Args):
    handle_signals()  # Ctrl-C and SIGTERM stop the run between phases (common.py)
    rank, world_size, device = init_distributed(args.dist_timeout_minutes)
    dtype = compute_dtype(device)  # bf16; fp32 on a CPU without bf16 instructions (fsdp.py says why)
    check_args(args, world_size)
    args = variant_defaults(args)  # gspo's and cispo's clip ranges, a correction's bounds, tis with --async-rollout

    # ---- bad input fails here, before anything loads or is written, each in one line ---------------
    if args.deterministic_rollout:  # the update too: step 2 samples the same only from the same weights
        deterministic_training()
    tools = select_tools(  # its sandbox checked, its memory said
        args.tools, python_sandbox=args.python_sandbox, seconds=args.tool_timeout_s, workers=args.tool_workers
    )
    run_name = args.run_name or default_run_name("grpo", args.model, list(map(source_name, args.dataset)), args.seed)
    run_dir = claim_run_dir(args.output_dir, run_name, resume=args.resume)  # this script's, locked while it runs
    resume_from = checkpoint_to_resume(run_dir, args.resume, asdict(args))  # resumed: the flags it started with
    engine_kind = "server" if args.rollout_mode == "server" else check_engine(args.rollout_engine)
    tokenizer, context_len = check_model(args.model, rollout_tp=args.rollout_tp, generates=True)
    base_weights = model_fingerprint(args.model)  # in trainer.pt: --resume checks --model holds these weights
    adapter = args.lora_rank > 0 and args.lora_sync == "adapter"  # SGLang serves the adapter, the base kept
    lora_targets = check_lora(args.model, args.lora_rank, args.lora_targets, sglang=adapter and engine_kind != "hf")
    check_training_state(args.model, device, lora=args.lora_rank > 0, reference=args.beta > 0)  # fits the GPUs
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
    print0(f"data: {data_line} | {world_size} ranks, engine {engine_kind}\n{variant_line(args)}")
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
        reference=args.beta > 0,
        gradient_checkpointing=args.gradient_checkpointing,
        colocated=engine_kind != "server",
        longest=max(map(len, train_prompts.ids)) + args.max_new_tokens,  # tool replies count in the response budget
        reward_model=args.reward_model,
        engine_keeps_weights=adapter,  # --lora-sync adapter: the engine keeps the base while it sleeps
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

    # ---- the models: the policy, its reference with --beta > 0, a reward model -------------------
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
        reference=args.beta > 0,  # LoRA: the policy with its adapter off, no second copy
    )
    rm = load_reward_model(args.reward_model, device, dtype, args.attn_implementation) if args.reward_model else None
    optimizer, scheduler = adamw(
        policy,
        lr=args.lr,
        weight_decay=args.weight_decay,
        betas=args.adam_betas,
        warmup_steps=args.warmup_steps,
        schedule=args.lr_schedule,
        min_lr_ratio=args.min_lr_ratio,
        total_steps=args.steps * args.epochs * args.num_minibatches,  # optimizer steps
    )
    # what the memory phases move around the engine (memory.wake_up and sleep), and how the weights reach it
    models = [m for m in (policy, ref, rm) if m is not None]
    phases = dict(models=models, optimizers=[optimizer], offload=args.offload, mem=mem)
    sync = dict(
        bucket_bytes=args.sync_bucket_mb * 2**20,
        tp_group=rollout.tp.process_group if engine_kind == "sglang" else None,
        dtype=dtype if engine_kind == "hf" else torch.bfloat16,  # SGLang computes in bf16
        adapter=adapter,
    )
    n_params = matmul_params(policy)  # the policy's size, for MFU (fsdp.throughput)
    clock.lap("model_s")

    # ---- the run's record: checkpoints, metrics, the console line ---------------------------------
    checkpoints = Checkpoints(
        run_dir,
        stateful={"policy": (policy, optimizer)},
        hf_models={"model": policy},
        tokenizer=tokenizer,
        state=lambda: {  # in trainer.pt, with step and data; --resume checks --model holds the same weights
            "scheduler": scheduler.state_dict(),
            "args": asdict(args),
            "model_fingerprint": base_weights,
        },
        every=args.save_every,
        keep=args.keep_checkpoints,
    )
    if state := checkpoints.resume(resume_from, sampler):  # weights, optimizer, RNG, data; the LR schedule:
        scheduler.load_state_dict(state["scheduler"])
    start_step = clock.begin(checkpoints.last)  # 0: a new run
    # a step's line: these columns, then the rare ones where not 0; the legend says what each name means
    console = CONSOLE + CORRECTION_CONSOLE * (args.rollout_correction != "none") + TOOLS_LINE * bool(tools)
    console += FULLY_ASYNC_CONSOLE * (args.max_staleness >= 2)
    console += RM_LINE * bool(args.reward_model)
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
    # the engine holds the trained weights (not checked with --max-staleness >= 1: samples lag the updates by design)
    gap_check = GapCheck(args.lora_gap_ratio if args.lora_rank and not args.max_staleness else 0)
    data_position = sampler.state_dict()  # every rank's the same, before anything is drawn
    producer = None  # --max-staleness >= 2: groups come from a producer that keeps the servers full (producer.py)
    if args.max_staleness >= 2:
        producer = Producer(
            rollout.engine,  # rank 0's; None elsewhere: those ranks only take their share
            sampler,
            train_prompts,
            sampling=sampling,
            group_size=args.group_size,
            groups_per_step=args.prompts_per_step,
            max_staleness=args.max_staleness,
            seed=args.seed,
            tokenizer=tokenizer,
            tool_use=tool_use,  # with --tools: each sample an episode, resumed mid-turn after a weight update
            timeout_s=args.rollout_timeout,
        )
        producer.start()  # paused until the first weight sync

    # ---- the loop ----------------------------------------------------------------------------------
    local_prompts = args.prompts_per_step // world_size
    updates = args.epochs * args.num_minibatches  # optimizer steps a step
    ahead = None  # --async-rollout: the next step's rollout, generating while this step trains
    stopped = None  # (signal, steps done, data position): a signal every rank agreed on stops the run after the loop
    for step in range(start_step + 1, args.steps + 1):
        t_step, metrics = time.time(), {"step": step}
        mem.reset()  # the memory log's phases: this step's

        # -- 1. wake SGLang up with the current weights (memory.wake_up: the first half of the diagram), with
        # --async-rollout after it finishes this step's batch (generating since the last step); evaluate when due
        data_before = ahead.before if ahead else data_position if producer else sampler.state_dict()  # a stop's
        if ahead is not None:
            with mem.phase("generate"):
                ahead.result()
        if producer is not None:  # a weight update interrupts, never drains: running requests abort, kept so far
            with mem.phase("pause"):
                producer.pause()
        wake_up(rollout.engine, policy=policy, **sync, **phases)
        if producer is not None:  # the servers hold the weights of step - 1 updates: the aborted requests go on
            with mem.phase("continue"):
                producer.resume(version=step - 1)
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

        # -- 2. rollout: group_size samples per prompt, scored; dynamic sampling refills dropped groups
        with mem.phase("generate"):
            kept_P_G, seen, rounds = [], [], 0
            while True:
                pending, ahead = ahead, None
                if producer is not None:  # B finished groups, none older than --max-staleness (producer.py)
                    pending = producer.take(version=step - 1)
                if pending is None:  # rollout.py: draw this rank's prompts, --group-size samples each, send them
                    pending = send_prompts(
                        rollout,
                        sampler,
                        train_prompts,
                        n=args.prompts_per_step,
                        group_size=args.group_size,
                        seeds=(args.seed, "sample", step, rounds),
                    )
                samples = label(pending.result(), [train_prompts.examples[i] for i in pending.sample_idx])
                for k, s in enumerate(samples):
                    s.group_id = (len(seen) + k) // args.group_size  # the same for the G samples of a prompt
                # in threads, each call within --reward-timeout-s; one that raised, NaN/inf or timed out: 0.0, and why
                score_samples(reward, samples, workers=args.reward_workers, timeout_s=args.reward_timeout_s)
                groups_P_G = [
                    samples[g * args.group_size : (g + 1) * args.group_size]
                    for g in range(len(samples) // args.group_size)
                ]
                seen += samples
                rounds += 1
                if args.dynamic_sampling:  # ALGO: a group of equal rewards has zero advantage: no signal
                    groups_P_G = [samples_G for samples_G in groups_P_G if len({s.reward for s in samples_G}) > 1]
                kept_P_G += groups_P_G
                kept_total = int(all_reduce(len(kept_P_G)))  # pooled below: one rank's surplus fills another's gap
                if (
                    not args.dynamic_sampling
                    or kept_total >= args.prompts_per_step
                    or rounds == args.max_sampling_rounds
                ):
                    break
            # every rank trains on as many groups (FSDP's collectives must match), dealt from all ranks' kept_P_G
            n_groups = min(kept_total // world_size, local_prompts)
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
                seeds=(args.seed, "sample", step + 1, 0),
                ahead=True,
            )

        # -- 3. SGLang sleeps (memory.sleep: the second half of the diagram), training state comes back
        sleep(rollout.engine, device=device, **phases)
        if rm is not None:  # ALGO: each reward becomes w_rule * rule + w_rm * the RM's score (reward_model.py)
            with mem.phase("reward_model"):
                metrics.update(
                    rm_rewards(
                        rm,
                        seen,
                        weights=args.reward_weights,
                        whiten=args.reward_model_norm,
                        tokenizer=rm_tokenizer,
                        template=rm_template,
                        max_len=rm_max_len,
                        micro_batch_size=args.reward_model_micro_batch_size,
                        device=device,
                    )
                )
        metrics.update(step_rollout_stats(seen, pending, generate_s=mem.seconds["generate"]))  # rewards, lengths
        metrics.update(tool_stats(seen) if tools else {})  # turns and tool calls (tools.py)
        metrics.update({"rollout/kept_groups": n_groups * world_size, "rollout/sampling_rounds": rounds})
        if not n_groups:  # dynamic sampling found too few groups with differing rewards: nothing to learn from
            print0(
                f"step {step}/{args.steps} | {kept_total or 'no'} groups with differing rewards in {rounds} rounds"
                + f" (every one of the {world_size} ranks needs one)" * bool(kept_total)
                + ": update skipped"
            )
            metrics["train/skipped"] = 1.0
            skip_schedule(scheduler, updates)  # the LR follows the steps, not the updates
        else:
            # -- 4. the batch: old log-probs from the training model, reference log-probs if beta > 0
            # PLUMBING: whole groups change ranks, n_groups to each, evening out the ranks' tokens (fsdp.balance)
            tokens_P = [sum(len(s.prompt_ids) + len(s.response_ids) for s in samples_G) for samples_G in kept_P_G]
            kept_P_G = balance(kept_P_G, tokens_P, world_size, share=n_groups)
            samples_B = [s for samples_G in kept_P_G for s in samples_G]
            batch = collate(samples_B, pad_id)
            lengths = batch.attention_mask.sum(-1)  # [B] real tokens
            batch.loss_mask = batch.response_mask.clone()
            if args.overlong_filter:  # ALGO: a truncated response has no final answer to be judged on
                batch.loss_mask[torch.tensor([s.truncated for s in samples_B])] = 0.0
            with mem.phase("logprob"):  # no gradient; a LoRA policy's reference: its base, the adapter off
                batch.old_logprobs, batch.ref_logprobs = old_and_ref_logprobs(
                    policy,
                    ref,
                    batch,
                    micro_batch_size=args.micro_batch_size,
                    temperature=args.temperature,
                    device=device,
                    max_tokens=args.max_tokens_per_micro_batch,
                    progress=lambda x: progress(x, "log-probs", rank),
                )
            # ALGO: the sampler's log-probs vs the trainer's (old_logprobs), on the model's tokens: logged, and corrected
            weight, keep, touched = rollout_correction(
                batch.old_logprobs,
                batch.rollout_logprobs,
                batch.response_mask,
                args.rollout_correction,
                tis_cap=args.tis_cap,
                bounds=args.correction_bounds,
            )
            batch.is_weight, batch.loss_mask = weight, batch.loss_mask * keep
            metrics.update(mismatch_stats(batch, touched))  # the log-prob gap (the sync check), KL, largest ratio
            gap_check(metrics["rollout/logprob_abs_diff"], step)  # --lora-rank: a stale engine ends the run

            # -- 5. advantages
            group_ids_P_G = torch.tensor([s.group_id for s in samples_B]).view(-1, args.group_size)
            assert (group_ids_P_G == group_ids_P_G[:, :1]).all(), "a row of the reshape mixes samples of two prompts"
            rewards_P_G = torch.tensor([s.reward for s in samples_B]).view(-1, args.group_size)
            if ref is not None and args.kl_in_reward:  # ALGO: KL as a reward penalty, per sequence
                seq_kl_B = (kl_penalty(batch.old_logprobs, batch.ref_logprobs, "k1") * batch.response_mask).sum(-1)
                rewards_P_G = rewards_P_G - args.beta * seq_kl_B.view(-1, args.group_size)
            adv_B = advantages(rewards_P_G, args.advantage, args.scale_rewards).view(-1)
            batch.advantages = adv_B[:, None] * batch.response_mask  # [B, T-1]

            # -- 6. update: epochs x mini-batches x micro-batches of grpo_loss, an optimizer step per mini-batch
            with mem.phase("update"):
                metrics.update(update(policy, optimizer, scheduler, batch, args, step=step, device=device, rank=rank))
            metrics.update(  # PLUMBING: tokens a second, the ranks' balance, MFU on a GPU of known peak (fsdp.py)
                throughput(
                    lengths,
                    seconds=time.time() - t_step,
                    phase_seconds=mem.seconds,
                    device=device,
                    forward_params=n_params * (1 + (ref is not None)),  # log-probs: policy, reference
                    update_params=n_params,
                    weight_grads=not args.lora_rank,  # LoRA: the frozen base has no weight gradients
                    epochs=args.epochs,
                )
            )

        # -- 7. the step's line and metrics row, a few samples, a checkpoint when due, a signal's stop
        after = ahead.before if ahead else pending.before if producer else sampler.state_dict()  # the data position
        data_position = after
        metrics |= clock.times(step, time.time() - t_step, mem.metrics())  # seconds and memory by phase
        metrics = {k: float(v) for k, v in metrics.items()}
        print0(log_line(clock.label(step), metrics, console, rare=IF_NOT_0 + REWARD_LINE))
        log.log(metrics)
        if warning := nonfinite.after_step(step, int(metrics.get("train/nonfinite_skips", 0)), updates):
            print0(warning)
        if args.log_samples_every and step % args.log_samples_every == 0:
            log.samples(step, seen)
        if checkpoints.due(step, args.steps):
            checkpoints.save(step, after)
        if signum := agreed_signal():
            stopped = (signum, step, after)
            break

    # ---- the last evaluation, then the closing lines ---------------------------------------------
    if producer is not None:  # no more groups; the running ones abort, and the servers take the evaluation
        producer.close()
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
    with friendly_errors("grpo.py"):
        main(
            parse_args(Args, CPU_SIZES, shown={"lr": "1e-6; LoRA: 1e-5"})
        )  # no GPU: CPU_SIZES for the flags not given (preflight.parse_args)
