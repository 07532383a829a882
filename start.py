"""PLUMBING: what grpo.py and ppo.py start a run with, in the order their `main`s call it, and the few calls their
loops make on what it started (no algorithm here: each script's own is written out in it).

    checked = checked_run("grpo", args, device, reference=args.beta > 0)  # bad input fails here, before anything loads
    tool_use, reward, train_prompts, eval_prompts, data_line = the_task(args, checked)   # the task: prompts, reward
    seed_ranks(args.seed, rank)
    rollout, watch = start_engines(args, checked, tool_use=tool_use, dtype=dtype, mem=mem)  # before any model
    policy, ref = load_policy(args, device, dtype, checked.lora_targets, reference=checked.reference)
    optimizer, scheduler = adamw(policy, args.lr, args)
    phases, sync = memory_plan(args, checked, rollout, dtype=dtype, models=[...], optimizers=[...], mem=mem)
    log, stop_now, begin_step, end_step, finish = run_record(args, checked, rollout, watch, sampler=sampler, ...)
    ... the loop: begin_step(step, ahead) (start_of_step: the engine woken, the held-out evaluation when due),
        end_step(step, metrics, samples, ...) (end_of_step: the step's line, row, checkpoint) ...
    finish()                                            # finish_run: the last evaluation, the closing lines

Each takes the script's `args` where it reads many of the flags both scripts' Args share by name (STYLE: common fields
carry identical names): the fields it reads are the flags its docstring names. A flag only one script has is passed
by keyword."""

import random
from dataclasses import asdict, dataclass
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from checkpoint import checkpoint_to_resume
from data import seed_for, source_name, task_prompts
from fsdp import deterministic_training, load_model, lr_lambda, shard_model
from lora import apply_lora, check_lora, lora_line, trainable
from memory import wake_up
from preflight import InputError, check_engine, check_model, parameter_count, state_problem
from reward import EVAL_LINE, REWARD_LINE, load_reward, reward_fn
from reward_model import RM_LINE, check_reward_model
from rollout import SGLangOptions, Sampling, held_out_eval, stop_token_ids, tools_for
from runlog import RunLog, StepClock, claim_run_dir, default_run_name, eval_due, legend, log_line, print0, run_info
from server import start_rollout
from stop import NonFinite, agreed_signal, allow_interrupt, stop_engine, stop_run
from tools import TOOLS_LINE, select_tools, tool_call_stop_ids


@dataclass
class Checked:
    """What the checks before anything loads found (checked_run)."""

    tools: dict  # tools.select_tools': name -> tool ({}: one turn)
    run_name: str
    run_dir: str  # claimed: this script's, locked while the run lives (runlog.claim_run_dir)
    resume_from: str | None  # the checkpoint --resume continues from (checkpoint.checkpoint_to_resume)
    engine_kind: str  # "sglang", "hf" or "server"
    tokenizer: object
    context_len: int
    adapter: bool  # --lora-sync adapter with a rank: the engine serves the adapter, the base kept
    lora_targets: list[str]  # the adapted layers' names' last parts ([]: no LoRA)
    reference: bool  # the script loads a reference model (its KL flags): counted in the training state, load_policy's
    sampling: Sampling  # the rollout's token limit, stop tokens, temperature and top-p
    pad_id: int
    rm_read: dict  # how the reward model reads a conversation (reward_model.rm_rewards' keywords)


def checked_run(script: str, args, device, *, reference: bool) -> Checked:
    """Bad input fails here, before anything loads or is written, each in one line: the tools (--tools, their sandbox),
    the run folder claimed (--output-dir, --run-name, --resume: `script`'s), the engine (--rollout-engine,
    --rollout-mode), the model and its context (--model, --rollout-tp), LoRA's layers (--lora-*), on a GPU the training
    state (preflight.state_problem: the model's, and its `reference`'s where the script loads one), the reward model
    (--reward-model*); the stop tokens and sampling (--max-new-tokens, --temperature, --top-p). With
    --deterministic-rollout the update is made deterministic too (step 2 samples the same only from the same weights)."""
    if args.deterministic_rollout:
        deterministic_training()
    tools = select_tools(
        args.tools, python_sandbox=args.python_sandbox, seconds=args.tool_timeout_s, workers=args.tool_workers
    )  # its sandbox checked, its memory said
    run_name = args.run_name or default_run_name(script, args.model, list(map(source_name, args.dataset)), args.seed)
    run_dir = claim_run_dir(args.output_dir, run_name, resume=args.resume)  # runlog.py: this script's, locked
    resume_from = checkpoint_to_resume(run_dir, args.resume, args)  # resumed: the flags it started with
    engine_kind = "server" if args.rollout_mode == "server" else check_engine(args.rollout_engine)
    tokenizer, context_len = check_model(args.model, rollout_tp=args.rollout_tp, generates=True)  # bad input: one line
    adapter = args.lora_rank > 0 and args.lora_sync == "adapter"  # --lora-sync adapter: SGLang serves the adapter
    lora_targets = check_lora(args.model, args.lora_rank, args.lora_targets, sglang=adapter and engine_kind != "hf")
    if device.type == "cuda" and (params := parameter_count(args.model)):  # a 7B full fine-tuning on one GPU, say
        gpu_bytes = torch.cuda.get_device_properties(device).total_memory
        lora, world_size = args.lora_rank > 0, dist.get_world_size()
        if problem := state_problem(params, lora=lora, reference=reference, world_size=world_size, gpu_bytes=gpu_bytes):
            raise InputError(problem)
    rm_tokenizer, rm_template, rm_max_len = check_reward_model(
        args.reward_model,
        args.reward_model_template,  # None: none
        args.reward_model_max_len,
        system=bool(args.system_prompt),
        tools=bool(tools),
    )
    stop_ids = stop_token_ids(tokenizer, args.model) + (tool_call_stop_ids(tokenizer) if tools else [])
    return Checked(
        tools=tools,
        run_name=run_name,
        run_dir=run_dir,
        resume_from=resume_from,
        engine_kind=engine_kind,
        tokenizer=tokenizer,
        context_len=context_len,
        adapter=adapter,
        lora_targets=lora_targets,
        reference=reference,
        sampling=Sampling(
            max_new_tokens=args.max_new_tokens, stop_ids=stop_ids, temperature=args.temperature, top_p=args.top_p
        ),
        pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0],
        rm_read=dict(
            tokenizer=rm_tokenizer,
            template=rm_template,
            max_len=rm_max_len,
            micro_batch_size=args.reward_model_micro_batch_size,
            device=device,
        ),
    )


def the_task(args, checked: Checked):
    """The task's pieces bound to their flags: how a prompt is asked (data.task_prompts: a template with {prompt}, then
    the chat template) and what a completion earns (reward.reward_fn, the ALGO to change: 1 for an answer right in the
    asked format; any (completion, answer) -> float can be the reward, --reward FILE.py:function). Returns the tools' runner (None: one turn), the reward, the
    training and held-out prompts (data.Prompts) and the line that says what was loaded: before any model loads, so a
    bad file fails fast. Flags: --dataset, --eval-dataset, --prompt-template, --system-prompt, --prompt-field,
    --answer-field, --answer-kind, --num-eval-prompts, --max-prompt-len, --max-new-tokens, --seed, the tools'
    (--tool-workers, --max-turns, --max-tool-reply-tokens) and the reward's (--reward, --unformatted-credit,
    --format-weight)."""
    context, tool_specs, tool_use = tools_for(
        checked.tokenizer,
        checked.tools,
        template=args.prompt_template,  # None: each kind's own (data.py)
        datasets=args.dataset,
        workers=args.tool_workers,
        max_turns=args.max_turns,
        max_reply_tokens=args.max_tool_reply_tokens,
    )  # the tools' prompt (system prompt, worked calls) and their runner (rollout.py)
    reward = partial(
        reward_fn,
        user_reward=load_reward(args.reward) if args.reward else None,
        unformatted_credit=args.unformatted_credit,
        format_weight=args.format_weight,
    )
    train_prompts, eval_prompts, data_line = task_prompts(
        checked.tokenizer,
        list(args.dataset),
        args.eval_dataset,
        context_len=checked.context_len,  # a prompt, the tools' and the response must fit: checked first
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
    return tool_use, reward, train_prompts, eval_prompts, data_line


def seed_ranks(seed: int, rank: int):
    """Python's and numpy's RNG seeded per rank, torch's the same on every rank (the same initialization)."""
    random.seed(seed_for(seed, "rank", rank))
    np.random.seed(seed_for(seed, "rank", rank))
    torch.manual_seed(seed)


def start_engines(args, checked: Checked, *, tool_use, dtype: torch.dtype, mem):
    """The rollout engines first, before any model loads: SGLang sizes its KV cache from the free memory it finds
    (server.start_rollout: the engines on the training GPUs, or SGLang servers; watched, naming `mem`'s phase). A
    signal from here on ends the run at once: nothing to save yet. Flags: --rollout-*, --sglang-*, --model, --seed,
    --prompts-per-step x --group-size (a step's samples), --num-eval-prompts x --eval-samples,
    --deterministic-rollout, --lora-rank with --lora-sync adapter. Returns (rollout.Rollout: how a rank samples, the
    engine's watch)."""
    allow_interrupt(True)
    return start_rollout(
        checked.engine_kind,
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
            lora_rank=args.lora_rank if checked.adapter else 0,
            lora_targets=tuple(checked.lora_targets),
        ),
        seed=args.seed,
        dtype=dtype,
        sampling=checked.sampling,
        tokenizer=checked.tokenizer,
        tool_use=tool_use,
        urls=args.rollout_url,
        gpus=args.rollout_gpus,
        timeout_s=args.rollout_timeout,
        sync_backend=args.rollout_sync_backend,
        sync_address=args.rollout_sync_address,
        log_dir=checked.run_dir,
        phase=lambda: mem.current,
    )


def load_policy(args, device, dtype: torch.dtype, lora_targets: list[str], *, reference: bool):
    """The policy (fp32 masters, `dtype` compute; with --lora-rank the base frozen in bf16 and an fp32 adapter on
    `lora_targets`, lora.py), FSDP2-sharded; with `reference` (the KL is on) its reference: the policy itself with
    LoRA (its adapter off, lora.adapter_off: no second copy), else a second copy of --model, frozen. Flags: --model,
    --lora-rank, --lora-alpha, --lora-sync, --gradient-checkpointing, --attn-implementation, --compile. Returns
    (policy, reference or None)."""
    masters = torch.bfloat16 if args.lora_rank else torch.float32  # LoRA: the base frozen in bf16, the adapter fp32
    policy = load_model(args.model, device, masters, args.gradient_checkpointing, args.attn_implementation)
    if apply_lora(policy, args.lora_rank, args.lora_alpha, lora_targets):  # rank 0: nothing (lora.py)
        print0(lora_line(policy, args.lora_sync))
    shard_model(policy, param_dtype=dtype, compile=args.compile)
    if not reference or args.lora_rank:
        return policy, policy if reference else None
    ref = load_model(args.model, device, dtype, attn_implementation=args.attn_implementation).eval()
    shard_model(ref, param_dtype=None, compile=args.compile)
    return policy, ref


def adamw(model, lr: float, args):
    """AdamW over what trains of `model` (lora.trainable), fused: no temporaries (foreach allocates sqrt(v) for every
    parameter at once: +4 B/param, 28 GiB at 7B); its LR schedule (fsdp.lr_lambda) over --steps x --epochs x
    --num-minibatches optimizer steps. Flags: --weight-decay, --adam-betas, --warmup-steps, --lr-schedule,
    --min-lr-ratio. Returns (optimizer, scheduler)."""
    optimizer = torch.optim.AdamW(
        trainable(model), lr=lr, weight_decay=args.weight_decay, betas=args.adam_betas, fused=True
    )
    total_steps = args.steps * args.epochs * args.num_minibatches
    schedule = lr_lambda(args.warmup_steps, args.lr_schedule, args.min_lr_ratio, total_steps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def memory_plan(args, checked: Checked, rollout, *, dtype: torch.dtype, models: list, optimizers: list, mem):
    """What the memory phases move around the engine (memory.wake_up and sleep: `models` and `optimizers`, all of it
    off the GPU with --offload), and the weight sync's buckets (--sync-bucket-mb), TP group and dtype (SGLang computes
    in bf16). Returns (phases, sync): keywords of wake_up and sleep, and of wake_up alone."""
    phases = dict(models=[m for m in models if m is not None], optimizers=optimizers, offload=args.offload, mem=mem)
    sync = dict(
        bucket_bytes=args.sync_bucket_mb * 2**20,
        tp_group=rollout.tp.process_group if checked.engine_kind == "sglang" else None,
        dtype=dtype if checked.engine_kind == "hf" else torch.bfloat16,
        adapter=checked.adapter,
    )
    return phases, sync


def run_record(
    args,
    checked: Checked,
    rollout,
    watch,
    *,
    phases: dict,
    device,
    checkpoints,
    clock: StepClock,
    sampler,
    eval_prompts,
    console: list,
    rare: list,
    policy,
    sync: dict,
):
    """The run's record from the clock's start on (runlog.RunLog: args.json, run_info.json, metrics, samples, wandb with
    --track); from here on a signal stops the run at the next check, between phases (stop.stop_run: the engine down, the
    training state back, the finished steps saved in `checkpoints`, exit 128 + signal). Flags: --track, --wandb-project,
    --eval-*, --steps, --save-on-signal, --resume, --log-samples-every, --max-nonfinite-steps, --reward-model. A step's
    line: the script's `console` columns, then the task's (tools.TOOLS_LINE with --tools, reward_model.RM_LINE with a
    reward model), their legend printed here once. Returns (log, stop_now, begin_step, end_step, finish), the calls the
    loop makes on them: stop_now(signum, done, sampler_state); begin_step(step, ahead): a step's start (start_of_step:
    the engine woken with `policy`'s weights, memory.wake_up with `sync` and `phases`, then the held-out evaluation,
    rollout.held_out_eval, after step - 1 updates where due; the data position from `sampler`); end_step(step, metrics,
    samples, ...): the step's line (those columns, then `rare` and the reward's failures: names shown where not 0), row,
    samples and checkpoint; finish(): the last evaluation (the engine awake; a stop at `sampler`'s data position) and
    the closing lines."""
    start_step, mem = clock.start, phases["mem"]
    wake = partial(wake_up, rollout.engine, policy=policy, **sync, **phases)  # the engine awake with `policy`'s weights
    console = console + TOOLS_LINE * bool(checked.tools) + RM_LINE * bool(args.reward_model)  # the task's columns
    print0(legend(console + rare))  # once: what each name of a step's line means
    allow_interrupt(False)
    log = RunLog(
        checked.run_dir,
        config=asdict(args),
        start_step=start_step,
        info=run_info(
            dist.get_world_size(),
            checked.engine_kind,
            python_sandbox=args.python_sandbox if "python" in checked.tools else None,
            tool_workers=args.tool_workers,
        ),
        track=args.track,
        project=args.wandb_project,
        run_name=checked.run_name,
        eval_redone=start_step < args.steps
        and eval_due(start_step, every=args.eval_every, before_train=args.eval_before_train),
    )
    stop_now = partial(
        stop_run,
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
    held_out = partial(
        held_out_eval,
        rollout,
        eval_prompts,
        log,
        k=args.eval_samples,
        temperature=args.eval_temperature,
        top_p=args.eval_top_p,
        seed=args.seed,
    )
    evaluate = partial(
        evaluate_due,
        held_out=held_out,
        stop_now=stop_now,
        mem=mem,
        every=args.eval_every,
        before=args.eval_before_train,
    )
    begin_step = partial(start_of_step, sampler=sampler, mem=mem, wake=wake, evaluate=evaluate)
    record = dict(log=log, clock=clock, mem=mem)
    end_step = partial(
        end_of_step,
        **record,
        checkpoints=checkpoints,
        stop_now=stop_now,
        steps=args.steps,
        console=console,
        rare=rare + REWARD_LINE,  # REWARD_LINE: samples the reward scored 0 (it raised, NaN/inf, timed out)
        nonfinite=NonFinite(args.max_nonfinite_steps),
        samples_every=args.log_samples_every,
    )
    last = bool(args.eval_every) and start_step < args.steps  # a last evaluation: --eval-every, steps run
    finish = partial(
        finish_run, sampler, engine=rollout.engine, watch=watch, evaluate=evaluate, last=last, wake=wake, **record
    )
    return log, stop_now, begin_step, end_step, finish


def start_of_step(step: int, ahead, *, sampler, mem, wake, evaluate) -> dict:
    """A step's start: the memory log's phases reset; with --async-rollout this step's batch (`ahead`: a
    rollout.Pending, generating since the last step) finished first, in the generate phase; the engine woken with the
    current weights (`wake`: memory.wake_up, the first half of its diagram); the held-out evaluation after step - 1
    updates where due (`evaluate`: evaluate_due). Returns the data position after step - 1 (`ahead`'s from before its
    draw, else `sampler`'s): where a stop before this step's update leaves the data."""
    mem.reset()
    sampler_state = ahead.before if ahead else sampler.state_dict()
    if ahead is not None:
        with mem.phase("generate"):
            ahead.result()
    wake()
    evaluate(step - 1, sampler_state)  # after wake: the evaluation generates with the current weights
    return sampler_state


def evaluate_due(
    done: int, sampler_state: dict, *, final: bool = False, held_out, stop_now, mem, every: int, before: bool
):
    """The held-out evaluation after `done` updates, where due (runlog.eval_due: every `every` steps, step 0 with
    `before`; `final`: after the last step, outside the steps' phases); a signal that cut it short stops the run at
    data position `sampler_state` (nothing logged)."""
    if final:
        if signum := held_out(step=done):
            stop_now(signum, done, sampler_state)
    elif eval_due(done, every=every, before_train=before):
        with mem.phase("eval"):
            if signum := held_out(step=done):
                stop_now(signum, done, sampler_state)


def end_of_step(
    step: int,
    metrics: dict,
    samples: list,
    *,
    after: dict,
    seconds: float,
    updates: int,
    log,
    clock,
    mem,
    checkpoints,
    stop_now,
    steps: int,
    console: list,
    rare: list,
    nonfinite,
    samples_every: int,
):
    """A step's end: its seconds and memory by phase (runlog.StepClock.times), its console line and metrics row, a
    warning after steps whose `updates` optimizer steps were all skipped for NaN/inf (stop.NonFinite), a few samples
    every `samples_every` steps, a checkpoint when due (data position `after`), and a signal's stop."""
    times = clock.times(step, seconds, mem.metrics())  # step and phase seconds, memory (runlog.py)
    metrics = {k: float(v) for k, v in (metrics | times).items()}
    print0(log_line(clock.label(step), metrics, console, rare=rare))
    log.log(metrics)
    if warning := nonfinite.after_step(step, int(metrics.get("train/nonfinite_skips", 0)), updates):
        print0(warning)
    if samples_every and step % samples_every == 0:
        log.samples(step, samples)
    if checkpoints.due(step, steps):
        checkpoints.save(step, after)
    if signum := agreed_signal():
        stop_now(signum, step, after)


def finish_run(sampler, *, engine, watch, evaluate, last: bool, wake, log, clock, mem):
    """After the loop: a last evaluation (`last`; a signal that cuts it short stops the run at `sampler`'s data
    position), the engine awake first (`wake`), then the memory log, the engine,
    the record and the process group closed, and the closing lines (steps, time, held-out accuracy, where the
    checkpoint and curves are)."""
    if last:
        wake()
        evaluate(clock.total, sampler.state_dict(), final=True)
    mem.close()
    stop_engine(engine, watch)
    log.finish()
    clock.summary(log.run_dir, EVAL_LINE)  # steps, time, held-out accuracy, where the checkpoint and curves are
    dist.destroy_process_group()
