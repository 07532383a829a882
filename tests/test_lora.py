"""lora.py on the CPU (issue 42): a LoRA update against the same update by hand, the adapter-off reference against the
base model, exact resume from a checkpoint, the merged and the PEFT exports against the trained model, both ways of
syncing reaching an HF engine (and a stand-in server) with the same weights, a skipped sync ending the run in one line,
bad input; then grpo.py and ppo.py with --lora-rank end to end (test_smoke.py runs ppo.py's on two ranks).

Models compute in fp32 here (FSDP2's param_dtype), the base stored in bf16 as in a run: the numbers can be compared to
rounding. One gloo process stands in for torchrun.
"""

import json
import os
import sys

import pytest
import torch

from checkpoint import load_checkpoint, save_checkpoint
from data import collate
from fsdp import load_model, shard_model
from logprobs import batch_logprobs, compile_head, token_logprobs
from lora import (
    GapCheck,
    adapter_config,
    adapter_off,
    apply_lora,
    check_lora,
    engine_weights,
    load_adapter,
    lora_modules,
    lora_rules,
    sync_adapter,
    trainable,
)
from memory import sync_weights
from preflight import check_flags
from common import InputError, RunFailed
from rollout import HFEngine, Sampling, SGLangOptions, generate

pytestmark = pytest.mark.usefixtures("gloo")
CPU = torch.device("cpu")


def lora_policy(model_dir, rank=4, alpha=32.0, targets=("all-linear",), seed=0, random_b=True, compile=False):
    """grpo.py's LoRA policy (base in bf16, adapter fp32, FSDP2), computing in fp32. random_b: B is not zero, so that
    A gets a gradient and the adapter changes the model from the start (apply_lora starts B at zero). compile: its
    layers and log-prob head through torch.compile (--compile)."""
    torch.manual_seed(seed)
    model = load_model(model_dir, CPU, torch.bfloat16)
    apply_lora(model, rank, alpha, targets)
    if random_b:
        with torch.no_grad():
            for _, m in lora_modules(model):
                m.lora_B.normal_(0, 0.02)
    model = shard_model(model, param_dtype=torch.float32, compile=compile)
    if compile:
        compile_head(model)
    return model


def fixed_batch(seed=0, rows=3, length=14):
    ids = torch.randint(5, 400, (rows, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, -4:] = 0  # a padded row
    return ids, mask


def mean_logp(model, ids, mask):
    logp, _ = token_logprobs(model, ids, mask, 1.0)  # [B, T-1]
    m = mask[:, 1:].float()
    return (logp * m).sum() / m.sum(), logp


def step(model, optimizer, seed):
    ids, mask = fixed_batch(seed)
    loss = -mean_logp(model, ids, mask)[0]
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def adapter(model) -> dict:
    return {k: v.clone() for k, v in engine_adapter(model).items()}


def engine_adapter(model) -> dict:
    from lora import adapter_tensors

    return adapter_tensors(model, torch.float32)


# ----------------------------------------------------------------------------------------------
# The update, the reference


def test_a_lora_layer_is_its_merged_linear():
    torch.manual_seed(0)
    linear = torch.nn.Linear(6, 5)
    from lora import LoRALinear

    m = LoRALinear(linear, rank=2, alpha=4.0)
    torch.nn.init.normal_(m.lora_B)
    x = torch.randn(3, 6)
    merged = linear.weight + 2.0 * m.lora_B @ m.lora_A  # alpha / r = 2
    assert torch.allclose(m(x), x @ merged.T + linear.bias, atol=1e-6)
    with adapter_off(torch.nn.Sequential(m)):
        assert torch.equal(m(x), linear(x))
    assert m.weight is linear.weight  # the base's own Parameter: its name and state dict entry stay


def test_an_update_equals_the_one_computed_by_hand(tiny_model_dir):
    """One AdamW step of the FSDP2 LoRA policy on a token-mean log-prob loss against the same step written out: the
    merged weights W + (alpha / r) B A in a plain fp32 copy of the model (torch.func.functional_call), autograd for
    A and B, AdamW's first step (m = (1 - b1) g, v = (1 - b2) g^2, bias-corrected: lr g / (|g| + eps), after the decay).
    The base gets no gradient and no optimizer state; only the adapter moves."""
    targets, rank, alpha, lr, wd, eps = ("q_proj", "down_proj"), 2, 8.0, 1e-2, 0.1, 1e-6
    policy = lora_policy(tiny_model_dir, rank, alpha, targets)
    names = [n for n, _ in lora_modules(policy)]
    assert len(names) == 4  # 2 layers x (q_proj, down_proj)
    start = {n: p.detach().full_tensor().clone() for n, p in policy.named_parameters()}  # [the bf16 base, A, B]
    optimizer = torch.optim.AdamW(trainable(policy), lr=lr, weight_decay=wd, eps=eps, fused=True)
    assert len(optimizer.param_groups[0]["params"]) == 2 * len(names)  # the adapter, nothing else
    ids, mask = fixed_batch()
    loss = -mean_logp(policy, ids, mask)[0]
    loss.backward()
    assert all(p.grad is None for n, p in policy.named_parameters() if "lora_" not in n)  # the base: no gradient
    optimizer.step()

    # by hand: the merged model, in fp32, from the same numbers
    plain = load_model(tiny_model_dir, CPU, torch.float32)
    leaves = {n: v.float().requires_grad_("lora_" in n) for n, v in start.items()}
    weights = {n: v for n, v in leaves.items() if "lora_" not in n}
    for name in names:
        weights[f"{name}.weight"] = (
            leaves[f"{name}.weight"] + alpha / rank * leaves[f"{name}.lora_B"] @ leaves[f"{name}.lora_A"]
        )
    logits = torch.func.functional_call(plain, weights, (ids,), {"attention_mask": mask}).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
    m = mask[:, 1:].float()
    hand_loss = -(logp * m).sum() / m.sum()
    assert loss.item() == pytest.approx(hand_loss.item(), rel=1e-6)
    hand_loss.backward()
    moved = 0
    for n, p in policy.named_parameters():
        after = p.detach().full_tensor()
        if "lora_" not in n:
            assert torch.equal(after, start[n]) and after.dtype == torch.bfloat16 and not p.requires_grad
            continue
        g = leaves[n].grad
        expected = start[n] * (1 - lr * wd) - lr * g / (g.abs() + eps)  # AdamW's first step
        assert p.dtype == torch.float32 and torch.allclose(after, expected, atol=2e-6), n
        moved += (after != start[n]).any().item()
    assert moved == 2 * len(names)  # A and B of every layer moved (B was not zero: A had a gradient)
    states = list(optimizer.state.values())
    assert len(states) == 2 * len(names) and all(s["exp_avg"].dtype == torch.float32 for s in states)


def test_the_adapter_off_reference_is_the_base_model(tiny_model_dir):
    """--beta > 0 with --lora-rank: the reference log-probs are the policy's with its adapter off, which are the base
    model's, after the adapter has trained; with it on they differ."""
    policy = lora_policy(tiny_model_dir)
    optimizer = torch.optim.AdamW(trainable(policy), lr=1e-2)
    step(policy, optimizer, seed=1)
    ids, mask = fixed_batch(seed=2)
    base = shard_model(load_model(tiny_model_dir, CPU, torch.bfloat16), param_dtype=torch.float32)
    with torch.no_grad():
        with adapter_off(policy):
            off = mean_logp(policy, ids, mask)[1]
        on, base_logp = mean_logp(policy, ids, mask)[1], mean_logp(base, ids, mask)[1]
    assert torch.allclose(off, base_logp, atol=1e-6)
    assert (on - base_logp).abs().max() > 1e-2
    assert all(m.active for _, m in lora_modules(policy))  # switched back on


# ----------------------------------------------------------------------------------------------
# Checkpoints and exports


def test_resume_continues_exactly_and_the_exports_give_the_trained_model(tiny_model_dir, tmp_path):
    """save_checkpoint after 2 steps, 2 more steps; a policy of another seed (other A) loads the checkpoint and takes
    the same 2 steps: the same adapter, bit for bit. The checkpoint's state holds the adapter and its optimizer only;
    model/ is the merged model (transformers loads it: the trained log-probs to bf16's rounding of the merged weights);
    adapter/ is PEFT's folder (on the base: the trained log-probs to fp32 rounding)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    policy = lora_policy(tiny_model_dir, random_b=False)
    optimizer = torch.optim.AdamW(trainable(policy), lr=1e-2, fused=True)
    for s in range(2):
        step(policy, optimizer, seed=s)
    path = save_checkpoint(str(tmp_path), 2, {"policy": (policy, optimizer)}, {"model": policy}, None, {"step": 2})
    ids, mask = fixed_batch(seed=9)
    with torch.no_grad():
        trained = mean_logp(policy, ids, mask)[1]
    for s in range(2, 4):
        step(policy, optimizer, seed=s)
    straight = adapter(policy)

    resumed = lora_policy(tiny_model_dir, seed=1, random_b=False)
    assert not torch.equal(adapter(resumed)[next(iter(straight))], adapter(policy)[next(iter(straight))])
    opt2 = torch.optim.AdamW(trainable(resumed), lr=1e-2, fused=True)
    assert load_checkpoint(path, {"policy": (resumed, opt2)})["step"] == 2
    for s in range(2, 4):
        step(resumed, opt2, seed=s)
    assert all(torch.equal(v, adapter(resumed)[k]) for k, v in straight.items())

    saved = dcp.FileSystemReader(os.path.join(path, "state")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("policy_model")]
    assert model_keys and all(".lora_A" in k or ".lora_B" in k for k in model_keys)  # no base weight

    merged = AutoModelForCausalLM.from_pretrained(os.path.join(path, "model"), dtype=torch.float32)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        logits = merged(ids, attention_mask=mask).logits
    merged_logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    real = mask[:, 1:].bool()
    assert (merged_logp - trained)[real].abs().max() < 2e-2  # bf16 weights: W + (alpha/r) B A rounded once

    config = json.load(open(os.path.join(path, "adapter", "adapter_config.json")))
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 32.0
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    tensors = load_file(os.path.join(path, "adapter", "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).float()  # the trained-on base
    apply_lora(base, config["r"], config["lora_alpha"], config["target_modules"])
    load_adapter(base, tensors)
    with torch.no_grad():
        peft_logp = torch.log_softmax(base(ids, attention_mask=mask).logits[:, :-1], -1)
    peft_logp = peft_logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert (peft_logp - trained)[real].abs().max() < 1e-4
    from peft import PeftModel  # PEFT itself reads the folder as the README says: the same log-probs

    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).float(),
        os.path.join(path, "adapter"),
    )
    with torch.no_grad():
        logits = peft_model(input_ids=ids, attention_mask=mask).logits
    by_peft = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert (by_peft - trained)[real].abs().max() < 1e-4 and (by_peft - peft_logp)[real].abs().max() < 1e-5
    with pytest.raises(KeyError, match="1 unknown"):  # a name the model does not have is never skipped silently
        load_adapter(
            base, {**tensors, "base_model.model.model.layers.9.mlp.up_proj.lora_A.weight": tensors[next(iter(tensors))]}
        )


# ----------------------------------------------------------------------------------------------
# The sync: merge and adapter, to the HF engine and to a (stand-in) server


def greedy(engine, tokenizer, n=4):
    prompts = [tokenizer.encode(f"What is {a} + {a + 3}?") for a in range(10, 10 + n)]
    sampling = Sampling(max_new_tokens=6, stop_ids=[tokenizer.eos_token_id], temperature=0.0)
    return generate(engine, prompts, [0] * n, sampling=sampling)


def test_both_sync_ways_deliver_the_same_weights_to_the_hf_engine(tiny_model_dir):
    """merge: the adapted weights arrive as W + (alpha/r) B A; adapter: the base once, then the adapter alone, named by
    every request. The engines then hold the same weights and generate the same tokens with the same log-probs; the
    adapter engine asked without the adapter's name generates with the base (what every request must avoid)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    policy = lora_policy(tiny_model_dir)
    merged, served = HFEngine(tiny_model_dir, dtype=torch.float32), HFEngine(tiny_model_dir, dtype=torch.float32)
    weight_calls = []
    update = served.update_weights_from_tensor
    served.update_weights_from_tensor = lambda tensors, **kw: weight_calls.append(len(tensors)) or update(tensors, **kw)
    optimizer = torch.optim.AdamW(trainable(policy), lr=1e-2)
    for sync in range(2):
        sync_weights(policy, merged, dtype=torch.float32)
        sync_weights(policy, served, dtype=torch.float32, adapter=True)
        assert served.adapter == served.lora_name == "policy" and served.kept == {"weights"}
        sent = dict(engine_weights(served.model, torch.float32))  # the served engine's base + its adapter, merged
        assert sent.keys() == dict(merged.model.named_parameters()).keys()
        for name, p in merged.model.named_parameters():
            assert torch.allclose(sent[name], p, atol=1e-6), name
        a, b = greedy(merged, tokenizer), greedy(served, tokenizer)
        assert [s.response_ids for s in a] == [s.response_ids for s in b]
        assert all(
            torch.allclose(torch.tensor(x.rollout_logprobs), torch.tensor(y.rollout_logprobs), atol=1e-5)
            for x, y in zip(a, b)
        )
        step(policy, optimizer, seed=sync)
    assert len(weight_calls) >= 1 and all(weight_calls)  # the base: the first sync only, in its buckets
    first = len(weight_calls)
    sync_weights(policy, served, dtype=torch.float32, adapter=True)
    assert len(weight_calls) == first  # later syncs: the adapter alone
    served.adapter = None  # requests that do not name the adapter: the base model
    base = greedy(served, tokenizer)
    assert any(x.rollout_logprobs != y.rollout_logprobs for x, y in zip(base, greedy(merged, tokenizer)))


def test_a_skipped_sync_fails_the_run_in_one_line(tiny_model_dir):
    """The loop's pieces in order (sync, generate, the trainer's log-probs, the gap, an update): the gap stays at its
    first step's level while every sync arrives; step 3's sync skipped leaves the engine on step 2's weights and
    lora.GapCheck ends the run in one line, naming the gap and its level."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    policy = lora_policy(tiny_model_dir, random_b=False)
    optimizer = torch.optim.AdamW(trainable(policy), lr=5e-2)
    engine, check = HFEngine(tiny_model_dir, dtype=torch.float32), GapCheck(3.0)
    prompts = [tokenizer.encode(f"What is {a} + 7?") for a in range(10, 18)]
    sampling = Sampling(max_new_tokens=8, stop_ids=[tokenizer.eos_token_id], temperature=1.0)
    gaps = []
    for n in range(1, 5):
        if n != 3:
            sync_weights(policy, engine, dtype=torch.float32)
        batch = collate(generate(engine, prompts, list(range(8)), sampling=sampling), tokenizer.pad_token_id)
        batch.old_logprobs = batch_logprobs(policy, batch, 8, 1.0, CPU)
        from rollout import mismatch_stats

        gaps.append(mismatch_stats(batch)["rollout/logprob_abs_diff"])
        if n == 3:
            with pytest.raises(RunFailed) as failed:
                check(gaps[-1], n)
            break
        check(gaps[-1], n)
        policy.train()
        loss = -(token_logprobs(policy, batch.input_ids, batch.attention_mask, 1.0)[0] * batch.response_mask).sum()
        (loss / batch.response_mask.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert gaps[0] < 1e-4 and gaps[1] < 1e-4 and gaps[2] > 0.01, gaps  # fp32 on both sides: synced, ~1e-6
    message = str(failed.value)
    assert "\n" not in message and message.startswith("step 3: the sampler-trainer log-prob gap")
    assert "the engine is not generating with the trained weights" in message


def test_the_adapter_reaches_a_server_through_its_loading_endpoint(tiny_model_dir, tmp_path):
    """--lora-sync adapter with --rollout-mode server: the adapter is written as PEFT's folder and each server loads it
    (/load_lora_adapter; the old one unloaded first); every /generate names it; the server's answers are the
    merged engine's. A server without LoRA is refused at start, naming the flags it needs."""
    from stand_in_server import StandInServer
    from transformers import AutoTokenizer

    from server import ServerEngine, ServerInputError

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    policy = lora_policy(tiny_model_dir)
    plain = StandInServer(tiny_model_dir).start()
    try:
        with pytest.raises(ServerInputError, match="--enable-lora --max-lora-rank 4 --lora-target-modules"):
            ServerEngine([plain.url], timeout_s=30, lora_rank=4, adapter_dir=str(tmp_path))
    finally:
        plain.stop()
    stand_in = StandInServer(tiny_model_dir, lora_rank=8).start()
    try:
        engine = ServerEngine([stand_in.url], timeout_s=30, lora_rank=4, adapter_dir=str(tmp_path))
        stand_in.engine.update_weights_from_tensor(list(engine_weights(policy, torch.float32, merge=False)))  # the base
        merged = HFEngine(tiny_model_dir, dtype=torch.float32)
        for _ in range(2):
            sync_adapter(policy, engine, torch.float32)
            sync_weights(policy, merged, dtype=torch.float32)
            a, b = greedy(engine, tokenizer), greedy(merged, tokenizer)
            assert [s.response_ids for s in a] == [s.response_ids for s in b]
            assert all(
                torch.allclose(torch.tensor(x.rollout_logprobs), torch.tensor(y.rollout_logprobs), atol=1e-5)
                for x, y in zip(a, b)
            )
        assert stand_in.requests[-1]["lora_path"] == ["policy"] * 4
        lora_events = [e[1] for e in stand_in.events if e[0] == "lora"]
        assert lora_events == [
            "/unload_lora_adapter",  # one of this name that a trainer before this one left, if any
            "/load_lora_adapter",
            "/unload_lora_adapter",
            "/load_lora_adapter",
        ]
        assert json.load(open(tmp_path / "policy" / "adapter_config.json")) == adapter_config(policy)
    finally:
        stand_in.stop()


def test_sglang_is_started_with_lora_for_the_adapter_way(tmp_path):
    """--lora-sync adapter: the in-process engine's and the launched servers' LoRA settings (SGLang 0.5.16's names)."""
    from server import launch_servers

    options = SGLangOptions(lora_rank=8, lora_targets=("q_proj", "v_proj"))
    assert options.lora_flags() == dict(
        enable_lora=True,
        max_lora_rank=8,
        lora_target_modules=["q_proj", "v_proj"],
        max_loras_per_batch=2,
        lora_strict_loading=True,
    )
    assert SGLangOptions().lora_flags() == {}
    _, [process] = launch_servers(
        "m",
        gpus=[0],
        tp_size=1,
        seed=0,
        options=options,
        log_dir=str(tmp_path),
        command=(sys.executable, "-c", "import sys; print(' '.join(sys.argv[1:]))"),
    )
    process.wait(30)
    line = open(process.log).read()
    assert (
        "--enable-lora --max-lora-rank 8 --lora-target-modules q_proj v_proj --max-loras-per-batch 2 --lora-strict-loading"
        in line
    )


# ----------------------------------------------------------------------------------------------
# Bad input


def test_bad_lora_input_is_one_line(tiny_model_dir):
    from grpo import Args

    def rules(a, given):
        return lora_rules(
            rank=a.lora_rank,
            alpha=a.lora_alpha,
            targets=a.lora_targets,
            sync=a.lora_sync,
            gap_ratio=a.lora_gap_ratio,
            rollout_tp=a.rollout_tp,
            given=set(given),
        )

    def problem(args, given=()):
        with pytest.raises(InputError) as e:
            check_flags(rules(args, given))
        return str(e.value)

    assert problem(Args(lora_rank=-1)) == "--lora-rank -1 must be >= 0 (0: full fine-tuning; 1-64 for LoRA)"
    assert problem(Args(lora_rank=4, lora_alpha=0.0)).startswith("--lora-alpha 0.0 must be > 0")
    assert problem(Args(lora_alpha=16.0), ["lora_alpha"]).startswith("--lora-alpha 16.0 must be given with --lora-rank")
    assert problem(Args(lora_rank=4, lora_alpha=float("inf"))).startswith("--lora-alpha inf must be > 0 and finite")
    assert problem(Args(lora_rank=4, lora_sync="adapter", rollout_tp=2)).startswith("--lora-sync adapter must be merge")
    check_flags(rules(Args(lora_rank=4, lora_sync="adapter"), {"lora_sync"}))  # fine
    with pytest.raises(InputError) as e:
        check_lora(tiny_model_dir, 4, ("qproj",))
    assert str(e.value) == (
        f"--lora-targets qproj match no linear layer of --model {tiny_model_dir} (LlamaForCausalLM): name some of "
        "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj, or all-linear"
    )
    assert check_lora(tiny_model_dir, 4, ("all-linear",), sglang=True)[-1] == "v_proj"
    assert check_lora(tiny_model_dir, 0, ("nothing",)) == []  # full fine-tuning: nothing to check
    from transformers import AutoModelForTokenClassification

    assert check_lora(tiny_model_dir, 4, ("q_proj",), "--critic-model", AutoModelForTokenClassification) == ["q_proj"]


def test_lora_learning_rate_default_by_hand():
    """--lr 0 (the default): full fine-tuning's rate, 10x with an adapter (at 1e-6 a LoRA run learned next to nothing:
    issue 53); a rate given is kept, LoRA or not."""
    from lora import default_lr

    assert default_lr(0.0, full=1e-6, rank=0) == 1e-6
    assert default_lr(0.0, full=1e-6, rank=8) == pytest.approx(1e-5)
    assert default_lr(0.0, full=1e-5, rank=1) == pytest.approx(1e-4)  # ppo's critic
    assert default_lr(3e-4, full=1e-6, rank=8) == default_lr(3e-4, full=1e-6, rank=0) == 3e-4


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, said",
    [
        ("grpo.py", "| lr 1e-05 (LoRA's default: 10x full fine-tuning's)"),
        ("ppo.py", "| lr 1e-05, critic 0.0001 (LoRA's default: 10x full fine-tuning's)"),
    ],
)
def test_a_lora_run_without_lr_trains_at_loras_default(script, said, tiny_model_dir, tmp_path):
    """As a user types it, --lora-rank and no --lr: the start-up line says the rate and why, args.json records it, and
    the run trains at it (train/lr, the scheduler's)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, script, "--model", tiny_model_dir, "--output-dir", str(tmp_path), "--run-name", "r"]
    cmd += ["--lora-rank", "4", "--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8"]
    cmd += ["--num-eval-prompts", "2", "--eval-every", "0", "--rollout-engine", "hf"]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert said in proc.stdout, proc.stdout[:3000]
    recorded = json.load(open(tmp_path / "r" / "args.json"))
    assert recorded["lr"] == pytest.approx(1e-5)
    if script == "ppo.py":
        assert recorded["critic_lr"] == pytest.approx(1e-4)
    rows = [json.loads(line) for line in open(tmp_path / "r" / "metrics.jsonl")]
    assert [r["train/lr"] for r in rows if "train/lr" in r] == [pytest.approx(1e-5)]


# ----------------------------------------------------------------------------------------------
# grpo.py end to end (two short runs)


@pytest.mark.slow
def test_grpo_lora_adapter_way_resumes_exactly(trained_tiny_model_dir, tmp_path):
    """grpo.py --lora-rank 4 --lora-sync adapter --beta 0.02 (the reference: the adapter off): 2 steps with checkpoints
    at 1 and 2; step 2 removed, --resume from 1 takes step 2 again with the same numbers and the same adapter. The
    checkpoint has the merged model/ and the PEFT adapter/; the gap stays at the synced level (the engine got every
    adapter)."""
    from safetensors.torch import load_file

    from test_smoke import metrics, run_grpo

    flags = ["--lora-rank", "4", "--lora-sync", "adapter", "--beta", "0.02", "--lr", "2e-3", "--eval-every", "0"]
    run_grpo(trained_tiny_model_dir, tmp_path, "--steps", "2", "--save-every", "1", "--keep-checkpoints", "0", *flags)
    ckpts = tmp_path / "r" / "checkpoints"
    straight, rows = load_file(ckpts / "step_000002" / "adapter" / "adapter_model.safetensors"), metrics(tmp_path)[0]
    assert sorted(os.listdir(ckpts / "step_000002")) == [
        "adapter",
        "manifest.json",
        "model",
        "rng_rank0.pt",
        "state",
        "trainer.pt",
    ]
    assert rows[-1]["train/kl"] > 0 and all(r["rollout/logprob_abs_diff"] < 0.05 for r in rows)
    import shutil

    shutil.rmtree(ckpts / "step_000002")
    run_grpo(trained_tiny_model_dir, tmp_path, "--steps", "2", "--resume", *flags)
    resumed = load_file(ckpts / "step_000002" / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(v, resumed[k]) for k, v in straight.items())
    keep = ("rollout/", "train/")
    a, b = ({k: v for k, v in r.items() if k.startswith(keep)} for r in (rows[-1], metrics(tmp_path)[0][-1]))
    assert a == pytest.approx(b, rel=1e-6, abs=1e-9)


@pytest.mark.slow
def test_compiled_lora_layers_keep_the_numbers(tiny_model_dir):
    """--compile with --lora-rank (on by default on a GPU: 1.14x faster a step at 7B shapes, issue 55): the adapted
    layers and the log-prob head through torch.compile give the plain policy's packed log-probs and adapter gradients,
    the frozen base none; with the adapters off (the reference of --beta > 0) the base's log-probs, and the adapted
    ones again after."""
    ids, mask = fixed_batch(3)
    runs = {}
    for compiled in (False, True):
        model = lora_policy(tiny_model_dir, compile=compiled)
        logp, _ = token_logprobs(model, ids, mask, 1.0, packed=True)  # [B, T-1]
        (logp * mask[:, 1:]).sum().backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        with torch.no_grad(), adapter_off(model):
            base, _ = token_logprobs(model, ids, mask, 1.0, packed=True)
        with torch.no_grad():
            again, _ = token_logprobs(model, ids, mask, 1.0, packed=True)
        torch.testing.assert_close(again, logp.detach(), rtol=1e-4, atol=2e-5)
        assert (base - logp.detach()).abs().max() > 1e-3  # random B: the adapter moves the numbers
        runs[compiled] = logp.detach(), grads, base
    (want, want_grads, want_base), (got, got_grads, got_base) = runs[False], runs[True]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(got_base, want_base, rtol=1e-4, atol=2e-5)
    assert got_grads.keys() == want_grads.keys() and all("lora_" in n for n in want_grads)
    for name in want_grads:
        torch.testing.assert_close(
            got_grads[name], want_grads[name], rtol=1e-4, atol=2e-5, msg=lambda m: f"{name}: {m}"
        )
