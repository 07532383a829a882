"""memory.py on the CPU: the order of SGLang's memory calls, the weight sync, optimizer moves, MemoryLog.

A fake engine records the calls SGLang would get; a one-process gloo group stands in for torchrun.
"""

import time

import pytest
import torch

from conftest import torchrun_check
from fsdp import load_model, shard_model
from memory import ALL_TAGS, MemoryLog, move_optimizer, release, resume, sleep, wake_up


class FakeEngine:
    """Records SGLang's memory and weight calls, in order. Like sglang.Engine it has no `released` of its own."""

    def __init__(self):
        self.calls = []
        self.sent = []  # (name, tensor) of every weight sync, in order

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", list(tags)))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", list(tags)))

    def update_weights_from_tensor(self, named_tensors, flush_cache=True):
        self.calls.append(("update", flush_cache))
        self.sent += list(named_tensors)

    def flush_cache(self):
        self.calls.append(("flush",))


pytestmark = pytest.mark.usefixtures("gloo")  # resume() barriers, FSDP2 needs a process group (conftest)


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    """The tiny Llama as grpo.py builds it: fp32 masters, FSDP2 with bf16 compute."""
    torch.manual_seed(0)
    return shard_model(load_model(tiny_model_dir, torch.device("cpu"), torch.float32), param_dtype=torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# release / resume


def test_release_then_resume_records_the_order():
    engine = FakeEngine()
    release(engine, ALL_TAGS)
    assert engine.released == set(ALL_TAGS)
    resume(engine, ["weights"])
    resume(engine, ["kv_cache", "cuda_graph"])
    assert engine.calls == [
        ("release", ["weights", "kv_cache", "cuda_graph"]),
        ("resume", ["weights"]),
        ("resume", ["kv_cache", "cuda_graph"]),
    ]
    assert engine.released == set()


def test_resume_without_release_raises():
    """Resuming a region that was never released is an out-of-order phase, caught before SGLang sees it."""
    engine = FakeEngine()
    with pytest.raises(RuntimeError, match=r"\['weights'\], which was never released"):
        resume(engine, ["weights"])
    release(engine, ["weights"])
    with pytest.raises(RuntimeError, match=r"\['kv_cache'\]"):
        resume(engine, ["weights", "kv_cache"])
    assert engine.calls == [("release", ["weights"])]  # neither resume reached the engine


def test_non_owner_rank_has_no_engine():
    """engine=None (a non-owner rank of a TP group): release/resume only empty the cache and barrier."""
    release(None, ALL_TAGS)
    resume(None, ["weights"])


# ----------------------------------------------------------------------------------------------
# wake_up / sleep on an FSDP2 model


def test_wake_up_then_sleep_call_order(policy):
    """resume weights -> update(s) -> flush -> resume kv_cache + cuda_graph -> release all; grads freed first."""
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    policy(input_ids=torch.tensor([[1, 5, 7, 9]])).logits.float().sum().backward()
    assert all(p.grad is not None for p in policy.parameters())

    engine, log = FakeEngine(), MemoryLog()
    release(engine, ALL_TAGS)  # as grpo.py does after starting the engine
    engine.calls.clear()
    wake_up(
        engine, policy=policy, models=[policy], optimizers=[optimizer], offload=False, mem=log, bucket_bytes=16 << 10
    )
    assert all(p.grad is None for p in policy.parameters())  # free_grads
    sleep(engine, models=[policy], optimizers=[optimizer], offload=False, mem=log, device=torch.device("cpu"))

    kinds = [c[0] for c in engine.calls]
    n_updates = kinds.count("update")
    assert n_updates > 1  # 16 KiB buckets split the ~100 KiB of bf16 weights
    assert engine.calls == (
        [("resume", ["weights"])]
        + [("update", False)] * n_updates
        + [("flush",), ("resume", ["kv_cache", "cuda_graph"]), ("release", list(ALL_TAGS))]
    )
    assert engine.released == set(ALL_TAGS)
    assert list(log.seconds) == [
        "free_grads",
        "resume_weights",
        "sync_weights",
        "offload_model",
        "resume_kv_cache",
        "release",
        "reload",
    ]


def test_sync_sends_every_parameter_full_and_bf16(policy, tiny_model_dir):
    """Every parameter name once, as a plain bf16 tensor of the unsharded shape holding the model's values."""
    engine = FakeEngine()
    release(engine, ["weights", "kv_cache", "cuda_graph"])
    wake_up(
        engine, policy=policy, models=[policy], optimizers=[], offload=False, mem=MemoryLog(), bucket_bytes=16 << 10
    )
    full = dict(load_model(tiny_model_dir, torch.device("cpu"), torch.float32).named_parameters())
    sharded = dict(policy.named_parameters())
    sent_names = [name for name, _ in engine.sent]
    assert sorted(sent_names) == sorted(full) and len(set(sent_names)) == len(sent_names)
    assert "model.embed_tokens.weight" in sent_names and "lm_head.weight" not in sent_names  # tied: sent once
    for name, tensor in engine.sent:
        assert type(tensor) is torch.Tensor  # a gathered tensor, not a DTensor shard
        assert tensor.dtype == torch.bfloat16 and tensor.shape == full[name].shape
        assert torch.equal(tensor, sharded[name].detach().full_tensor().to(torch.bfloat16))


@pytest.mark.slow
def test_sync_with_a_tp_group_hands_each_rank_its_own_copy(tiny_model_dir):
    """--rollout-tp 2: for every parameter SGLang gets one handle per TP rank, each made by that rank
    (TP worker i opens rank i's copy on its own GPU), bucket by bucket (tests/sync_tp_check.py)."""
    proc = torchrun_check("tests/sync_tp_check.py", tiny_model_dir)
    assert proc.returncode == 0 and "tp sync ok" in proc.stdout, proc.stderr[-3000:]


def test_offload_moves_every_model_and_optimizer_while_generating():
    """With offload, every training-side model (policy, reference, critic) and every optimizer leaves
    the device before the KV cache is resumed, and comes back after the release."""
    events = []

    class Model:  # records .to(); stands in for an FSDP2 module
        def __init__(self, name):
            self.name = name

        def to(self, device, non_blocking=False):
            events.append((self.name, str(device)))

    class Optimizer:
        def __init__(self, name):
            self.name = name

        def zero_grad(self, set_to_none=True):
            pass

    class Engine(FakeEngine):
        def resume_memory_occupation(self, tags=None):
            events.append(("engine", "resume " + "+".join(tags)))

        def release_memory_occupation(self, tags=None):
            events.append(("engine", "release"))

    engine, policy = Engine(), Model("policy")
    models = [policy, Model("ref"), Model("critic")]
    optimizers = [Optimizer("actor_adam"), Optimizer("critic_adam")]
    release(engine, ALL_TAGS)
    events.clear()
    import memory  # record what sync_weights and move_optimizer (tested on their own) are asked to do

    real = memory.sync_weights, memory.move_optimizer
    memory.sync_weights = lambda model, engine, bucket_bytes, tp_group, dtype, adapter: events.append(("sync", ""))
    memory.move_optimizer = lambda opt, device: events.append((opt.name, str(device)))
    try:
        wake_up(engine, policy=policy, models=models, optimizers=optimizers, offload=True, mem=MemoryLog())
        sleep(engine, models=models, optimizers=optimizers, offload=True, mem=MemoryLog(), device="cuda:0")
    finally:
        memory.sync_weights, memory.move_optimizer = real
    kv = events.index(("engine", "resume kv_cache+cuda_graph"))
    off = {name for name, dev in events[:kv] if dev == "cpu"}
    assert off == {"policy", "ref", "critic", "actor_adam", "critic_adam"}
    assert events.index(("actor_adam", "cpu")) < events.index(("engine", "resume weights"))  # before SGLang's weights
    assert events.index(("sync", "")) < events.index(("policy", "cpu"))  # the sync reads the params first
    back = {name for name, dev in events[events.index(("engine", "release")) :] if dev == "cuda:0"}
    assert back == {"policy", "ref", "critic", "actor_adam", "critic_adam"}


# ----------------------------------------------------------------------------------------------
# move_optimizer


def test_move_optimizer_moves_adam_state_but_not_step():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()  # creates step, exp_avg, exp_avg_sq per parameter
    state = optimizer.state[model.weight]
    step, exp_avg = state["step"], state["exp_avg"].clone()

    move_optimizer(optimizer, "cpu")
    assert state["exp_avg"].device.type == "cpu" and torch.equal(state["exp_avg"], exp_avg)
    assert state["step"] is step

    # "meta" makes the move visible on a CPU-only machine: Adam's moments go, the step counter stays
    move_optimizer(optimizer, "meta")
    for s in optimizer.state.values():
        assert s["exp_avg"].device.type == "meta" and s["exp_avg_sq"].device.type == "meta"
        assert s["step"].device.type == "cpu" and float(s["step"]) == 1.0
    assert state["step"] is step


# ----------------------------------------------------------------------------------------------
# MemoryLog


def test_memory_log_on_cpu_records_seconds_only():
    log = MemoryLog()
    with log.phase("a"):
        time.sleep(0.02)
    with log.phase("b"):
        pass
    with log.phase("a"):  # the same phase twice in a step: seconds add up
        time.sleep(0.02)
    assert log.seconds["a"] >= 0.04 and log.seconds["b"] < log.seconds["a"]
    assert log.gib == {}
    assert set(log.metrics()) == {"time/a", "time/b"}
    log.reset()
    assert log.metrics() == {}
    log.close()


# ----------------------------------------------------------------------------------------------
# Sizing a micro-batch: memory.token_budget and start.micro_batching (issue 55)

H100_BYTES = 85_017_755_648  # torch's total_memory of an 80 GB H100 (79.18 GiB)
QWEN_1P5B = dict(  # Qwen2.5-1.5B's config.json, the fields the budget reads
    model_type="qwen2",
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
)


def test_token_budget_by_hand_at_qwen_1p5b_on_an_h100():
    """1.5B shapes, full fine-tuning, one H100, no engine: bench/packing_bench.py's setting, where 16384 packed tokens
    through varlen peaked at 75.5 GiB of 79.2 (bench/results/packing_varlen_1p5b_h100.json) and flex_attention's
    12288 ran out: the budget comes out just under the one that fit."""
    from memory import activation_bytes, token_budget

    per_token = activation_bytes(layers=28, hidden=1536, intermediate=8960, checkpointing=False)
    assert per_token == 28 * 2 * (10 * 1536 + 4 * 8960) + 4 * 1536 == 2_873_344  # 2.74 MiB
    checkpointed = activation_bytes(layers=28, hidden=1536, intermediate=8960, checkpointing=True)
    assert checkpointed == 2 * 1536 * 28 + 2 * (10 * 1536 + 4 * 8960) + 4 * 1536 == 194_560
    state = 1_543_569_408 * 16  # fp32 weights and gradients, AdamW's two moments
    head = 14 * 2048 * 151936  # one chunk of fp32 logits and their kin
    # 0.9 x 85.02e9 - 2 GiB - 24.70e9 - 4.36e9 = 45.32e9 bytes: 15770 tokens, down to a multiple of 1024
    assert (H100_BYTES * 0.9 - 2 * 2**30 - state - head) // per_token == 15770
    kw = dict(gpu_bytes=H100_BYTES, state_bytes=state, token_bytes=per_token, vocab=151936, chunk=2048)
    assert token_budget(**kw, engine_bytes=0) == 15360
    assert token_budget(**kw, engine_bytes=4 * 2**30) == 13312  # a colocated engine asleep: 14276 tokens
    assert token_budget(**{**kw, "token_bytes": checkpointed}, engine_bytes=0) == 232448  # 232915 checkpointed
    assert token_budget(**{**kw, "state_bytes": 80e9}, engine_bytes=0) == 0  # the state alone overflows: none


@pytest.fixture
def qwen_1p5b_config(tmp_path):
    """A folder holding only Qwen2.5-1.5B's config.json: no weights to read, so its parameters come from the config."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(QWEN_1P5B))
    return str(tmp_path)


@pytest.fixture
def an_h100(monkeypatch):
    """torch.cuda's answers of a machine with one H100, on this CPU (nothing is allocated on it)."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": H100_BYTES})())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    return torch.device("cuda", 0)


def micro_batching(model, device, given=(), **kw):
    import start

    defaults = dict(
        micro_batch_size=8,
        max_tokens=0,
        attn_implementation="sdpa",
        lora=False,
        reference=False,
        gradient_checkpointing=False,
        colocated=False,
        longest=1124,
    )
    return start.micro_batching(model, device, given=set(given), **{**defaults, **kw})


def test_micro_batching_packs_a_gpu_run_to_its_token_budget_through_varlen(qwen_1p5b_config, an_h100, monkeypatch):
    """What the README's command gets on a GPU, the flags not given: packed rows of the token budget, varlen; the
    line says what and why. A GPU or torch without the kernel: padded rows, as many of the longest as the budget
    holds. Flags given win; the CPU keeps its own defaults."""
    import preflight
    import start
    from start import config_parameters

    from transformers import AutoConfig

    assert config_parameters(AutoConfig.from_pretrained(qwen_1p5b_config)) == 1_543_569_408  # 1,543,714,304 with biases
    monkeypatch.setattr(start, "varlen_runs", lambda device, config: True)
    mbs, tokens, attn, line = micro_batching(qwen_1p5b_config, an_h100)
    assert (mbs, tokens, attn) == (8, 15360, "varlen")
    assert line == (
        "micro-batches: packed rows of up to 15360 tokens, varlen attention (2.7 MiB of activations a token (28 "
        "layers x 1536), 23 GiB of training state on this GPU's 79 GiB; --max-tokens-per-micro-batch N or "
        "--micro-batch-size N to choose)"
    )
    assert micro_batching(qwen_1p5b_config, an_h100, colocated=True)[1] == 13312  # the engine asleep keeps 4 GiB
    assert micro_batching(qwen_1p5b_config, an_h100, lora=True)[1] == 22528  # a bf16 base, 2 bytes a parameter: 23291
    # --lora-sync adapter: the engine asleep keeps the base's bf16 weights too (3.09e9 bytes): 20722 tokens
    lora_adapter = micro_batching(qwen_1p5b_config, an_h100, lora=True, colocated=True, engine_keeps_weights=True)
    assert lora_adapter[1] == 20480 and "3 GiB of training state, 3 GiB of weights held beside it" in lora_adapter[3]
    # a reward model of the same size, held whole in bf16 on the GPU: 45.32e9 - 3.09e9 bytes, 14696 tokens
    assert micro_batching(qwen_1p5b_config, an_h100, reward_model=qwen_1p5b_config)[1] == 14336
    # the user's micro-batches stand; packed ones get the fastest attention
    assert micro_batching(qwen_1p5b_config, an_h100, {"micro_batch_size"}, micro_batch_size=32) == (32, 0, "sdpa", None)
    mbs, tokens, attn, line = micro_batching(qwen_1p5b_config, an_h100, {"max_tokens_per_micro_batch"}, max_tokens=8192)
    assert (mbs, tokens, attn) == (8, 8192, "varlen") and line.startswith("attention: varlen")
    assert micro_batching(  # and so does the attention given with them
        qwen_1p5b_config, an_h100, {"max_tokens_per_micro_batch", "attn_implementation"}, max_tokens=8192
    ) == (8, 8192, "sdpa", None)
    # sdpa asked for, or no varlen kernel here: padded rows of the longest sequence, 15360 // 1124 of them
    for given, varlen in (({"attn_implementation"}, True), ((), False)):
        monkeypatch.setattr(start, "varlen_runs", lambda device, config, varlen=varlen: varlen)
        mbs, tokens, attn, line = micro_batching(qwen_1p5b_config, an_h100, given)
        assert (mbs, tokens, attn) == (13, 0, "sdpa") and line.startswith(
            "micro-batches: 13 rows padded to the longest"
        )
    # a budget short of the longest sequence: said, and the longest gets its micro-batch
    monkeypatch.setattr(start, "varlen_runs", lambda device, config: True)
    mbs, tokens, attn, line = micro_batching(qwen_1p5b_config, an_h100, longest=20000)
    assert tokens == 20480 and line.endswith("a sequence of up to 20000 tokens may not fit: --gradient-checkpointing")
    assert micro_batching(qwen_1p5b_config, torch.device("cpu")) == (8, 0, "sdpa", None)  # CPU_SIZES' rows stand
    assert not preflight.varlen_runs(torch.device("cpu"), None)


def test_compile_is_on_by_default_where_it_measured_faster(an_h100):
    """--compile, given neither --compile nor --no-compile: on for a GPU run's packed micro-batches through varlen
    attention (measured faster at four shapes, LoRA among them, on H200s: bench/results/fast_defaults_h200x2.json),
    off where not measured, each said; the flag given wins; the CPU keeps its own (off)."""
    from start import compile_choice

    def choose(device=an_h100, given=(), **kw):
        options = dict(
            compile=False,
            attn_implementation="varlen",
            gradient_checkpointing=False,
            offload=False,
            deterministic=False,
        )
        return compile_choice(device, given=set(given), **{**options, **kw})

    on, line = choose()
    assert on and line.startswith("compile: on (") and line.endswith("--no-compile to skip it)")
    assert choose(given={"no_compile"}) == (False, None)  # --no-compile
    assert choose(given={"compile"}, compile=True) == (True, None)  # --compile
    assert choose(torch.device("cpu")) == (False, None)
    off, line = choose(attn_implementation="sdpa", gradient_checkpointing=True, offload=True, deterministic=True)
    assert not off and line == (
        "compile: off (not measured faster with --gradient-checkpointing, --offload, --deterministic-rollout, sdpa "
        "attention; --compile to try it)"
    )
    assert choose(given={"no_compile"}, offload=True) == (False, None)  # --no-compile, said by nothing


def test_compile_without_a_compiler_is_off_or_one_line(an_h100, monkeypatch):
    """torch.compile builds Triton's launchers with a C compiler ($CC, gcc or clang; Inductor's C++ on a CPU): a
    machine without one keeps the default off, said with the fix; --compile given stops at start in one line, before
    anything loads, where it would otherwise fail in step 1's first forward."""
    import shutil

    import start
    from common import InputError
    from preflight import compiler_problem

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    options = dict(attn_implementation="varlen", gradient_checkpointing=False, offload=False)
    on, line = start.compile_choice(an_h100, given=set(), compile=False, deterministic=False, **options)
    assert not on and line == (
        "compile: off (no C compiler for Triton's kernels ($CC, gcc or clang): install gcc (apt-get install gcc) or "
        "set CC, to have it)"
    )
    with pytest.raises(InputError, match=r"^--compile: no C\+\+ compiler for Inductor's kernels .*g\+\+.*or leave"):
        start.compile_choice(torch.device("cpu"), given={"compile"}, compile=True, deterministic=False, **options)
    assert start.compile_choice(an_h100, given={"no_compile"}, compile=False, deterministic=False, **options) == (
        False,
        None,
    )
    monkeypatch.setenv("CC", "/opt/cc")  # Triton takes $CC first
    assert compiler_problem("cuda") is None and compiler_problem("cpu") is not None
