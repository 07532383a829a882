"""Baseline: Hugging Face TRL's GRPOTrainer on our built-in addition task, matched to bench/run_grpo_arith.sh.

    source bench/gpu_env.sh && python3 bench/trl_grpo.py --model $SMOLLM2 --max-steps 100 --max-seconds 480 --out-dir $OUT/trl
    python bench/trl_grpo.py --model /tmp/tiny --max-steps 2 --prompts-per-step 4 --group-size 4 \
        --max-new-tokens 16 --micro-batch-size 8 --no-bf16 --out-dir /tmp/trl-run      # CPU check

Needs trl 1.16.0, datasets, multiprocess (in .whl/; gpu_env.sh installs them). As in grpo.py: the same
prompts, chat template and reward (reward.py); 32 prompts x 16 samples = 512 completions and ONE
optimizer step per generation round; 256 new tokens, T 1, top-p 1; AdamW at a constant 1e-5, no
warm-up, grad-norm clip 1.0; beta 0 (no reference model); clip 0.2; group-std-scaled advantages; the
loss averaged over all completion tokens of the 512; bf16 autocast over fp32 weights.
What differs: TRL's own seeded prompt order; advantages / (std + 1e-4) (ours 1e-6); with one update
per generation TRL skips the old-log-prob pass and uses the current log-probs detached (ratio exactly
1; ours recomputes them: ratio 1 up to numerics, the same gradient); no greedy evaluation.
CAVEAT, --generation-path paged with --bf16: TRL casts the policy itself to bf16 before generating and
never back, so from step 1 on it trains in pure bf16 (no fp32 master weights; an AdamW step of ~1e-5
is below bf16's resolution for most weights). --generation-path generate keeps fp32 weights.
Writes out_dir/trl_metrics.jsonl (one row per optimizer step) and out_dir/trl_summary.json.
"""

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import transformers
import trl
import tyro
from datasets import Dataset
from transformers import PrinterCallback, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from data import load_task  # noqa: E402
from reward import int_match_reward, score  # noqa: E402


@dataclass
class Args:
    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    """policy to train: a hub id or a local folder"""
    out_dir: str = "runs/trl_grpo"
    """trl_metrics.jsonl and trl_summary.json go here (also TRL's output_dir; nothing is checkpointed)"""
    max_steps: int = 100
    """optimizer steps, each one generation round of prompts_per_step x group_size completions"""
    max_seconds: float | None = None
    """stop after the first step that ends this many seconds after start (fits a time-limited GPU call; the
    summary is still written); None: no limit"""
    prompts_per_step: int = 32
    """distinct prompts per step"""
    group_size: int = 16
    """completions per prompt (TRL's num_generations); advantages are normalized within each group"""
    max_new_tokens: int = 256
    """response length limit (TRL's max_completion_length)"""
    temperature: float = 1.0
    """sampling temperature"""
    top_p: float = 1.0
    """nucleus sampling"""
    lr: float = 1e-5
    """constant learning rate (AdamW), no warm-up"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    micro_batch_size: int = 128
    """sequences per forward/backward (TRL's per_device_train_batch_size); gradient accumulation makes up
    the rest of prompts_per_step x group_size, so exactly one optimizer step follows each generation"""
    clip_low: float = 0.2
    """ratio clipped below at 1 - clip_low (TRL's epsilon)"""
    clip_high: float = 0.2
    """ratio clipped above at 1 + clip_high (TRL's epsilon_high)"""
    beta: float = 0.0
    """KL coefficient; 0 loads no reference model"""
    scale_rewards: bool = True
    """divide group-centred rewards by the group's std (TRL's scale_rewards='group')"""
    loss_type: Literal["dapo", "bnpo"] = "dapo"
    """'dapo': token sum over the whole 512-completion batch / its token count = our --loss-agg token-mean;
    'bnpo' divides by each micro-batch's token count instead, which differs when lengths vary"""
    unformatted_credit: float = 0.25
    """reward for a right final number not given as '#### N' (a right '#### N' earns 1.0), as in grpo.py"""
    generation_path: Literal["paged", "generate"] = "paged"
    """'paged' (default, the fastest TRL path without vLLM): transformers continuous batching
    (TRL's use_transformers_continuous_batching; generate_batch with a paged KV cache: no padding, each
    request frees its slot when it ends; TRL reports ~1.25x over 'generate' at 32-64 samples per prompt).
    'generate': model.generate on a left-padded batch of all 512, each row decoded until the longest ends"""
    paged_mem_fraction: float = 0.5
    """'paged': share of free GPU memory for its KV cache (TRL's default 0.5 leaves room for training)"""
    bf16: bool = True
    """bf16 autocast over fp32 weights (TRL's bf16=True; see the module docstring for 'paged');
    --no-bf16: fp32 throughout (CPU)"""
    gradient_checkpointing: bool = False
    """recompute activations in backward (TRL's default is on; grpo.py's and this script's is off)"""
    attn_implementation: str = "sdpa"
    """transformers attention for training, as in grpo.py"""
    seed: int = 0
    """seeds the task's train/test split, TRL's prompt order, sampling and initialization"""


class StepLog(TrainerCallback):
    """Wall seconds per optimizer step and TRL's logged metrics, one JSONL row per step."""

    def __init__(self, path: str, t_launch: float, max_seconds: float | None):
        self.path, self.t_launch, self.max_seconds, self.trainer = path, t_launch, max_seconds, None
        self.rows, self.t_last, self.step_s, self.startup_s = [], None, 0.0, None
        open(path, "w").close()

    def on_train_begin(self, args, state, control, **kwargs):
        self.t_last = time.time()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.time()
        self.step_s, self.t_last = now - self.t_last, now  # everything since the last step ended
        if state.global_step == 1:
            self.startup_s = now - self.t_launch  # main() to the end of step 1, as grpo.py measures it
        if self.max_seconds is not None and now - self.t_launch > self.max_seconds:
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "train_runtime" in logs:  # the summary log after the last step
            return
        trainer = self.trainer  # set once the trainer exists: it holds the generation timer
        row = {
            "step": state.global_step,
            "perf/step_s": self.step_s,
            "time/generate": trainer.gen_s,
            "generate_calls": trainer.gen_calls,
            **logs,
        }
        trainer.gen_s, trainer.gen_calls = 0.0, 0
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(
            f"step {row['step']} | {row['perf/step_s']:.2f} s (generate {row['time/generate']:.2f} s) | "
            f"reward {logs.get('reward', float('nan')):.3f} | len {logs.get('completions/mean_length', 0):.1f} | "
            f"loss {logs.get('loss', float('nan')):.4f} | grad_norm {logs.get('grad_norm', float('nan')):.3f}",
            flush=True,
        )


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that also times its generation (TRL's own profiling only reports to wandb/mlflow/trackio)."""

    gen_s, gen_calls = 0.0, 0

    def _generate_single_turn(self, *a, **kw):
        t = time.time()
        out = super()._generate_single_turn(*a, **kw)  # returns token lists: the GPU work is done
        self.gen_s += time.time() - t
        self.gen_calls += 1
        return out


def main(args: Args):
    t_launch = time.time()
    completions_per_step = args.prompts_per_step * args.group_size
    if completions_per_step % args.micro_batch_size:
        raise SystemExit(
            f"--micro-batch-size {args.micro_batch_size} must divide the {completions_per_step} completions per step"
        )
    os.makedirs(args.out_dir, exist_ok=True)

    # ---- data: our addition split, one user turn; TRL applies the chat template as data.tokenize_prompts does
    train_examples, _, _ = load_task("addition", None, seed=args.seed, num_eval=0)
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": e.prompt}], "answer": e.answer} for e in train_examples]
    )

    # ALGO: grpo.py's reward (reward.reward_fn, format_weight 0), through reward.score (a raising reward is a 0)
    def reward_one(completion: str, answer: str) -> float:
        if int_match_reward(completion, answer, "strict"):
            return 1.0
        return args.unformatted_credit * int_match_reward(completion, answer, "flexible")

    def reward_fn(completions, answer, **kwargs) -> list[float]:
        # conversational prompts -> each completion is [{"role": "assistant", "content": text}]
        return [score(reward_one, c[0]["content"], a)[0] for c, a in zip(completions, answer)]

    config = GRPOConfig(
        output_dir=args.out_dir,
        max_steps=args.max_steps,
        seed=args.seed,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        bf16=args.bf16,
        use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=args.gradient_checkpointing,
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": args.attn_implementation},
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=args.max_grad_norm,
        # one generation of 512 per optimizer step: per_device_train_batch_size x accumulation = 512
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=completions_per_step // args.micro_batch_size,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=0,
        beta=args.beta,
        epsilon=args.clip_low,
        epsilon_high=args.clip_high,
        num_iterations=1,
        scale_rewards="group" if args.scale_rewards else "none",
        loss_type=args.loss_type,
        use_transformers_continuous_batching=args.generation_path == "paged",
        # CUDA graphs off, as TRL's authors advise for training (they are off anyway with sdpa's attention mask)
        transformers_continuous_batching_config={
            "max_memory_percent": args.paged_mem_fraction,
            "use_cuda_graph": False,
        },
    )
    if (config.generation_batch_size, config.steps_per_generation) != (
        completions_per_step,
        config.gradient_accumulation_steps,
    ):
        raise SystemExit(
            f"TRL would generate {config.generation_batch_size} completions every {config.steps_per_generation} "
            f"micro-steps, not {completions_per_step} per optimizer step: check this TRL version's GRPOConfig"
        )
    log = StepLog(os.path.join(args.out_dir, "trl_metrics.jsonl"), t_launch, args.max_seconds)
    trainer = TimedGRPOTrainer(
        model=args.model, reward_funcs=reward_fn, args=config, train_dataset=dataset, callbacks=[log]
    )
    log.trainer = trainer
    trainer.remove_callback(PrinterCallback)  # our one line per step replaces its dict dump

    # ---- train ----------------------------------------------------------------------------------
    t0 = time.time()
    trainer.train()
    rows = log.rows
    timed = rows[1:] or rows  # step 1 also pays for warm-up: left out of the means
    summary = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "generation_path": args.generation_path,
        "bf16": args.bf16,
        "loss_type": args.loss_type,
        "steps": len(rows),
        "prompts_per_step": args.prompts_per_step,
        "group_size": args.group_size,
        "seconds_per_step": statistics.mean(r["perf/step_s"] for r in timed),
        "seconds_per_step_excludes_step_1": len(rows) > 1,
        "generate_s_per_step": statistics.mean(r["time/generate"] for r in timed),
        "generate_calls_per_step": sorted({r["generate_calls"] for r in rows}),
        "startup_to_first_step_s": log.startup_s,
        "train_s": time.time() - t0,
        "wall_clock_s": time.time() - t_launch,
        "new_tokens_per_s": statistics.mean(
            r["completions/mean_length"] * completions_per_step / r["perf/step_s"] for r in timed
        ),
        "reward_curve": [[r["step"], r.get("reward")] for r in rows],
        "final_reward": rows[-1].get("reward"),
        "param_dtype_after_training": str(next(trainer.model.parameters()).dtype),
        "args": asdict(args),
        "command": "python " + " ".join(sys.argv),
    }
    with open(os.path.join(args.out_dir, "trl_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("reward_curve", "args")}, indent=1))


if __name__ == "__main__":
    main(tyro.cli(Args))
