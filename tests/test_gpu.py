"""GPU tests: SGLang rollout + FSDP2 training on a real model. Skipped without CUDA.

    GRPO_TEST_MODEL=$SMOLLM2 python -m pytest tests/test_gpu.py -v -s

Each test runs a script in a subprocess: SGLang spawns its scheduler processes, which is best
done from a plain `__main__`, not from inside pytest.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.environ.get("GRPO_TEST_MODEL") or os.environ.get("SMOLLM2")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(MODEL is None, reason="set GRPO_TEST_MODEL (or SMOLLM2) to a local model folder"),
]
# Mean |SGLang log-prob - FSDP log-prob| over sampled tokens: bf16 numerics stay well under this;
# a stale or garbage weight lands far above it.
LOGPROB_TOLERANCE = 0.1


def run(cmd, timeout=900, output=False):
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    print(proc.stdout[-6000:], proc.stderr[-6000:], sep="\n")
    assert proc.returncode == 0, f"exit code {proc.returncode}"
    return proc if output else proc.stdout


def test_sglang_logprobs_match_fsdp_after_sync(tmp_path):
    out = tmp_path / "logprob_check.json"
    run([sys.executable, "tests/gpu_logprob_check.py", "--model", MODEL, "--out", str(out)])
    result = json.loads(out.read_text())
    print("mean |logprob diff|:", {k: result[k] for k in ("synced", "stale", "synced_twice", "garbage")})
    assert result["synced"] < LOGPROB_TOLERANCE
    assert result["synced_twice"] < LOGPROB_TOLERANCE  # step 2: after release, resume and a second sync
    assert result["stale"] > 2 * LOGPROB_TOLERANCE  # the check must catch a missed sync ...
    assert result["garbage"] > 2 * LOGPROB_TOLERANCE  # ... and a corrupted tensor


def test_a_launched_server_takes_the_weights(tmp_path):
    """server.launch_servers (what --rollout-gpus runs): SGLang's launcher on GPU 1 with NCCL, or on a
    one-GPU machine beside the trainer with gloo; the same four measurements as the in-process engine."""
    out = tmp_path / "logprob_check.json"
    run(
        [
            sys.executable,
            "tests/gpu_logprob_check.py",
            "--model",
            MODEL,
            "--out",
            str(out),
            "--rollout-engine",
            "launched",
            "--sglang-mem-fraction",
            "0.3",
        ]
    )
    result = json.loads(out.read_text())
    print(
        "launched server, mean |logprob diff|:",
        {k: result[k] for k in ("synced", "stale", "synced_twice", "garbage", "sync_s")},
    )
    assert result["synced"] < LOGPROB_TOLERANCE and result["synced_twice"] < LOGPROB_TOLERANCE
    assert result["stale"] > 2 * LOGPROB_TOLERANCE and result["garbage"] > 2 * LOGPROB_TOLERANCE
    assert (tmp_path / f"rollout_server_{1 if torch.cuda.device_count() >= 2 else 0}.log").exists()


def test_the_weight_sync_group_has_a_communicator_of_its_own():
    """A split from the trainer's default NCCL communicator would leave the servers out (tests/nccl_split_check.py)."""
    assert "join_group's was not" in run([sys.executable, "tests/nccl_split_check.py"], timeout=300)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="--rollout-gpus 1 needs a GPU beside the trainer's")
def test_grpo_rollout_gpus_async(tmp_path):
    """torchrun --nproc_per_node 1 on a two-GPU machine: the job starts its server on GPU 1, trains on
    GPU 0, one step off-policy; the server ends with the run."""
    run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=1",
            "grpo.py",
            "--model",
            MODEL,
            "--rollout-mode",
            "server",
            "--rollout-gpus",
            "1",
            "--async-rollout",
            "--steps",
            "3",
            "--prompts-per-step",
            "16",
            "--group-size",
            "4",
            "--max-new-tokens",
            "64",
            "--eval-every",
            "3",
            "--num-eval-prompts",
            "32",
            "--save-every",
            "0",
            "--lr",
            "1e-5",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "t",
        ]
    )
    steps = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    train_steps = [m for m in steps if "train/loss" in m]
    assert [m["rollout/staleness"] for m in train_steps] == [0, 1, 1]
    assert train_steps[0]["rollout/logprob_abs_diff"] < LOGPROB_TOLERANCE
    log = tmp_path / "t" / "rollout_server_1.log"
    assert log.exists()
    assert not writers_of(str(log)), "the run's server outlived it"  # this run's server (others may share the machine)


def writers_of(path: str) -> list[int]:
    """Processes whose standard output is `path` (a server launch_servers started writes its log there)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/fd/1") == path:
                found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.parametrize(
    "extra", [[], ["--offload", "--beta", "0.01", "--gradient-checkpointing"]], ids=["resident", "offload+ref"]
)
def test_grpo_three_full_steps(tmp_path, extra):
    run(
        [
            sys.executable,
            "grpo.py",
            "--model",
            MODEL,
            "--steps",
            "3",
            "--prompts-per-step",
            "16",
            "--group-size",
            "4",
            "--max-new-tokens",
            "64",
            "--eval-every",
            "2",
            "--num-eval-prompts",
            "32",
            "--save-every",
            "0",
            "--sglang-disable-cuda-graph",
            "--sglang-mem-fraction",
            "0.5",
            "--lr",
            "1e-5",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "t",
            *extra,
        ]
    )
    steps = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    train_steps = [m for m in steps if "train/loss" in m]
    assert [m["step"] for m in train_steps] == [1, 2, 3]
    for m in train_steps:  # every step's rollout came from the weights the trainer holds
        assert m["rollout/logprob_abs_diff"] < LOGPROB_TOLERANCE, m
    # a step whose 16 groups each earned one reward (SmolLM2 scores 0 on most samples) has no gradient: seen on an H200
    assert any(m["train/grad_norm"] > 0 for m in train_steps), train_steps
    assert (tmp_path / "t" / "checkpoints" / "step_000003" / "model" / "config.json").exists()
    # no micro-batch flag given: packed rows of a token budget through varlen (start.micro_batching; H100, H200)
    args = json.loads((tmp_path / "t" / "args.json").read_text())
    assert args["max_tokens_per_micro_batch"] >= 1024 and args["attn_implementation"] == "varlen", args
    assert args["compile"] == (not extra), args  # compiled, but not with checkpointing (start.compile_choice)


def test_ppo_three_steps_as_typed(tmp_path):
    """ppo.py with no micro-batch, attention or compile flag, as a user types it: the actor and the critic packed to
    the token budget through varlen and compiled (start.micro_batching, start.compile_choice); every step's rollout
    from the synced weights, the critic trained."""
    run(
        [
            sys.executable,
            "ppo.py",
            "--model",
            MODEL,
            "--steps",
            "3",
            "--prompts-per-step",
            "32",
            "--max-new-tokens",
            "64",
            "--eval-every",
            "0",
            "--save-every",
            "-1",
            "--sglang-mem-fraction",
            "0.5",
            "--lr",
            "1e-5",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "p",
        ]
    )
    rows = [json.loads(line) for line in (tmp_path / "p" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in rows if "critic/value_loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3], rows
    for m in steps:
        assert m["rollout/logprob_abs_diff"] < LOGPROB_TOLERANCE and math.isfinite(m["critic/value_loss"]), m
    args = json.loads((tmp_path / "p" / "args.json").read_text())
    assert args["max_tokens_per_micro_batch"] >= 1024 and args["attn_implementation"] == "varlen", args
    assert args["compile"], args


def test_grpo_with_the_calculator_three_steps(tmp_path):
    """Multi-turn episodes on SGLang's event loop: tool metrics logged, and the engine's per-turn
    log-probs of the model's tokens match the trainer's (the masks line up). As a user runs it: the
    default prompt length with tools, CUDA graphs, a clean end (no warning on stderr)."""
    proc = run(
        [
            sys.executable,
            "grpo.py",
            "--model",
            MODEL,
            "--dataset",
            "multiplication",
            "--tools",
            "calculator",
            "--steps",
            "3",
            "--prompts-per-step",
            "16",
            "--group-size",
            "4",
            "--max-new-tokens",
            "192",
            "--eval-every",
            "3",
            "--num-eval-prompts",
            "64",
            "--save-every",
            "0",
            "--sglang-mem-fraction",
            "0.5",
            "--lr",
            "1e-5",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "t",
        ],
        output=True,
    )
    assert "Warning" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "used a tool" in proc.stdout
    steps = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    train_steps = [m for m in steps if "train/loss" in m]
    assert [m["step"] for m in train_steps] == [1, 2, 3]
    assert any(m["tools/calls_per_sample"] > 0 for m in train_steps)  # the worked examples make SmolLM2 call it
    for m in train_steps:
        assert m["rollout/logprob_abs_diff"] < LOGPROB_TOLERANCE, m


@pytest.fixture
def sglang_server(tmp_path):
    """`python -m sglang.launch_server` as a user starts it: on GPU 1 (weights over NCCL) where there
    are two GPUs, else beside the trainer on GPU 0 (weights over gloo). Yields the trainer's flags."""
    two = torch.cuda.device_count() >= 2
    log = open(tmp_path / "server.log", "w")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1" if two else "0"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            MODEL,
            "--port",
            "30555",
            "--skip-tokenizer-init",
            "--mem-fraction-static",
            "0.6" if two else "0.3",
            "--attention-backend",
            "triton",
            "--sampling-backend",
            "pytorch",
            "--cuda-graph-backend-prefill",
            "disabled",
        ],
        stdout=log,
        stderr=log,
        env=env,
    )
    yield [
        "--rollout-mode",
        "server",
        "--rollout-url",
        "http://127.0.0.1:30555",
        "--rollout-timeout",
        "300",
        *([] if two else ["--rollout-sync-backend", "gloo"]),
    ]
    proc.kill()
    proc.wait()
    print((tmp_path / "server.log").read_text()[-3000:])


def test_grpo_against_an_sglang_server_sync_then_async_with_tools(tmp_path, sglang_server):
    """The weights reach a real server (the log-prob gap of every synced step), then a run with
    --async-rollout and the calculator (multi-turn turns over HTTP, one step off-policy)."""
    common = [
        "--model",
        MODEL,
        "--steps",
        "3",
        "--prompts-per-step",
        "16",
        "--group-size",
        "4",
        "--eval-every",
        "0",
        "--save-every",
        "0",
        "--lr",
        "1e-5",
        "--output-dir",
        str(tmp_path),
        *sglang_server,
    ]
    run([sys.executable, "grpo.py", *common, "--max-new-tokens", "64", "--run-name", "sync"])
    sync = [json.loads(line) for line in (tmp_path / "sync" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in sync] == [1, 2, 3]
    for m in sync:
        assert m["rollout/logprob_abs_diff"] < LOGPROB_TOLERANCE and m["rollout/staleness"] == 0, m
    run(
        [
            sys.executable,
            "grpo.py",
            *common,
            "--dataset",
            "multiplication",
            "--tools",
            "calculator",
            "--max-new-tokens",
            "192",
            "--async-rollout",
            "--run-name",
            "async",
        ]
    )
    steps = [json.loads(line) for line in (tmp_path / "async" / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/staleness"] for m in steps] == [0, 1, 1]
    assert steps[0]["rollout/logprob_abs_diff"] < LOGPROB_TOLERANCE  # step 1 is sampled by the synced weights
    assert any(m["tools/calls_per_sample"] > 0 for m in steps) and all(
        0 <= m["rollout/correction_frac"] <= 1 for m in steps
    )


def test_varlen_attention_on_the_gpu_kernel():
    """--attn-implementation varlen with torch's FlashAttention-2 kernel (fsdp.varlen_attention; the CPU test runs a
    stand-in): packed log-probs and gradients of the real model in bf16 against sdpa's on padded rows, no further off
    than sdpa's own packed row (its block-diagonal mask) is: bf16 kernels differ in rounding (SmolLM2, random ids:
    ~4e-2 a token on 2026-11-26, as SGLang against transformers), a wrong boundary or scale by whole nats."""
    from fsdp import load_model
    from logprobs import token_logprobs
    from test_packing import tiny_batch

    batch, real = tiny_batch(seed=8)
    ids, mask, real = batch.input_ids.cuda(), batch.attention_mask.cuda(), real.cuda()
    weights = torch.rand(real.shape, generator=torch.Generator().manual_seed(9)).cuda() * real

    def run(attn, packed):
        model = load_model(MODEL, torch.device("cpu"), torch.bfloat16, attn_implementation=attn).cuda()
        logp, _ = token_logprobs(model, ids, mask, 1.0, packed=packed)
        (logp * weights).sum().backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        return logp.detach().float() * real, grads

    (want, want_grads), got = run("sdpa", False), {"varlen": run("varlen", True), "packed sdpa": run("sdpa", True)}
    off = {}
    for name, (logp, grads) in got.items():
        cosine = torch.nn.functional.cosine_similarity(grads, want_grads, dim=0)
        off[name] = float((logp - want).abs().sum() / real.sum())
        print(
            f"{name} vs padded sdpa: mean |dlogp| {off[name]:.2e}, max {(logp - want).abs().max():.2e}, cos {cosine:.5f}"
        )
        assert cosine > 0.999, name
    assert off["varlen"] < 2 * off["packed sdpa"] + 1e-2


def test_a_packed_micro_batch_never_waits_for_the_gpu():
    """The micro-batch loops' packed forward and backward, as grpo.py's update runs them (the batch's fields copied to
    the GPU, the mask kept on the CPU: logprobs.forward_tokens plans the packed row there): under CUDA's sync debug
    mode "error", any call that makes the CPU wait for the GPU (.item(), nonzero on the GPU, a blocking copy) raises.
    The same micro-batch with its mask on the GPU does wait (nonzero's size): the check catches what it should."""
    from fsdp import load_model
    from logprobs import token_logprobs
    from test_packing import tiny_batch

    batch, real = tiny_batch(seed=8)
    model = load_model(MODEL, torch.device("cpu"), torch.bfloat16, attn_implementation="varlen").cuda()
    device = torch.device("cuda")
    for watched in (False, True):  # the first pass loads kernels and may wait; the loop's later micro-batches must not
        torch.cuda.synchronize()
        mb = batch.to(device)
        torch.cuda.set_sync_debug_mode("error" if watched else "default")
        try:
            logp, _ = token_logprobs(model, mb.input_ids, batch.attention_mask, 1.0, packed=True)
            (logp * mb.response_mask).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            token_logprobs(model, mb.input_ids, mb.attention_mask, 1.0, packed=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_update_waits_for_the_gpu_only_to_step(monkeypatch):
    """grpo.update whole (two mini-batches, each in packed micro-batches through varlen) under CUDA's sync debug mode
    "error": the CPU may wait for the GPU only where the update means to, in clip_and_step (the gradient norm, once an
    optimizer step) and at the end (the metrics' sums, all_reduce_dict), each let through here; a wait anywhere in
    the micro-batch loop (the copies, the packed row's plan, the loss, its statistics, backward) raises."""
    from dataclasses import replace

    import grpo
    from fsdp import load_model
    from logprobs import batch_logprobs
    from test_packing import tiny_batch

    def let_wait(fn):  # fn run with the debug mode off: a wait the update means
        def run(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("default")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("error")

        return run

    monkeypatch.setattr(grpo, "clip_and_step", let_wait(grpo.clip_and_step))
    monkeypatch.setattr(grpo, "all_reduce_dict", let_wait(grpo.all_reduce_dict))
    device = torch.device("cuda")
    model = load_model(MODEL, torch.device("cpu"), torch.bfloat16, attn_implementation="varlen").cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    args = grpo.Args(model=MODEL, max_tokens_per_micro_batch=256, attn_implementation="varlen", num_minibatches=2)
    args = grpo.variant_defaults(args)
    batch, _ = tiny_batch(seed=9)
    old = batch_logprobs(model, batch, args.micro_batch_size, 1.0, device, max_tokens=256)  # [B, T-1]
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])[:, None]  # [B, 1]: an advantage a row
    batch = replace(batch, old_logprobs=old, loss_mask=batch.response_mask, advantages=signs * batch.response_mask)
    for watched in (False, True):  # the first update loads kernels and may wait; the next must not
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if watched else "default")
        try:
            metrics = grpo.update(model, optimizer, scheduler, batch, args, step=1, device=device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert math.isfinite(float(metrics["train/loss"])) and metrics["train/grad_norm"] > 0


def test_sglang_serves_the_exported_adapter(tmp_path):
    """The README's `sglang.launch_server ... --enable-lora --lora-paths policy=<checkpoint>/adapter` loads what
    lora.save_adapter writes: requests naming it score a text as transformers does the merged model/, requests
    without it as the base (tests/adapter_server_check.py)."""
    out = tmp_path / "adapter.json"
    run([sys.executable, "tests/adapter_server_check.py", "--model", MODEL, "--out", str(out)], timeout=600)
    r = json.loads(out.read_text())
    assert r["adapter_vs_merged"] < LOGPROB_TOLERANCE and r["base_vs_base"] < LOGPROB_TOLERANCE
    noise = max(r["adapter_vs_merged"], r["base_vs_base"])  # bf16 SGLang against transformers: ~0.03-0.05
    assert r["adapter_vs_base"] > 3 * noise and r["merged_vs_base_hf"] > 3 * noise  # the adapter moves it further
