"""Packed micro-batches (--max-tokens-per-micro-batch): the same numbers as padded ones, the planner's
promises, MFU by hand, and grpo.py / ppo.py with packing on under torchrun."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import torchrun_check
from data import Sample, collate
from fsdp import load_model, matmul_params, mfu, micro_batches, pack_rows, peak_flops
from logprobs import forward_tokens, token_logprobs
from test_smoke import ROOT, metrics, run_grpo

# (prompt, response) tokens: 3 to 262 in all, as collate right-pads them; a 2-token row has a single target
SHAPES = [(5, 3), (9, 120), (30, 1), (4, 60), (12, 250), (1, 1)]


def tiny_batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    samples = [
        Sample(
            torch.randint(3, 300, (p,), generator=gen).tolist(),
            torch.randint(3, 300, (r,), generator=gen).tolist(),
            [0.0] * r,
            False,
        )
        for p, r in SHAPES
    ]
    batch = collate(samples, pad_id=0)
    real = torch.zeros_like(batch.response_mask)  # [B, T-1]: positions whose target is a real token
    for i, (p, r) in enumerate(SHAPES):
        real[i, : p + r - 1] = 1.0
    return batch, real


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_model(tiny_model_dir, torch.device("cpu"), torch.float32)


def test_packed_logprobs_and_entropy_equal_padded(policy):
    batch, real = tiny_batch()
    with torch.no_grad():
        logp, entropy = token_logprobs(policy, batch.input_ids, batch.attention_mask, 0.7, with_entropy=True)
        p_logp, p_entropy = token_logprobs(
            policy, batch.input_ids, batch.attention_mask, 0.7, with_entropy=True, packed=True
        )
    assert p_logp.shape == logp.shape == real.shape
    torch.testing.assert_close(p_logp * real, logp * real, rtol=0, atol=2e-5)  # fp32: |logp| ~ 6, rounding ~1e-6
    torch.testing.assert_close(p_entropy * real, entropy * real, rtol=0, atol=2e-5)
    assert p_logp[real == 0].abs().max() == 0 and p_entropy[real == 0].abs().max() == 0  # zero past each end
    # the mechanism: one row [1, n], positions restarting per sequence, no attention mask
    logits, ids, _ = forward_tokens(policy, batch.input_ids, batch.attention_mask, packed=True)
    assert ids.shape == (1, sum(p + r for p, r in SHAPES)) and logits.shape[:2] == ids.shape
    with torch.no_grad():  # the same row with positions running on: attention crosses sequences, numbers change
        crossed = policy(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False).logits
    assert (crossed[0, 10:] - logits[0, 10:]).abs().max() > 1e-2


def test_packed_gradients_equal_padded(policy):
    """Gradients flow back through the scatter into [B, T-1]: the loss code sees padded tensors."""
    batch, real = tiny_batch(seed=1)
    weights = torch.rand(real.shape, generator=torch.Generator().manual_seed(2)) * batch.response_mask

    def grads(packed):
        policy.zero_grad(set_to_none=True)
        logp, entropy = token_logprobs(
            policy, batch.input_ids, batch.attention_mask, 1.0, with_entropy=True, entropy_grad=True, packed=packed
        )
        ((logp + 0.01 * entropy) * weights).sum().backward()  # an entropy bonus too: its graph goes through the scatter
        return {n: p.grad.clone() for n, p in policy.named_parameters()}

    padded, packed = grads(False), grads(True)
    for n in padded:
        torch.testing.assert_close(packed[n], padded[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


def causal_per_sequence(q, k, v, cu: torch.Tensor, scale) -> torch.Tensor:
    """What the varlen kernel computes, by sdpa: each [cu[i], cu[i+1]) attends causally to itself; grouped key/value
    heads shared as the kernel shares them. q [n, h, d], k and v [n, kv, d] -> [n, h, d]."""
    import torch.nn.functional as F

    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
    bounds = cu.tolist()
    return torch.cat(
        [
            F.scaled_dot_product_attention(
                *(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=scale
            ).transpose(0, 1)
            for a, b in zip(bounds[:-1], bounds[1:])
        ]
    )


def test_varlen_attention_tells_torch_2_13s_kernel_of_grouped_heads(policy, tiny_model_dir, monkeypatch):
    """torch 2.13's varlen_attn refuses grouped-query attention (fewer key/value heads than query heads) unless given
    enable_gqa=True (issue 54, item 5): a stand-in with that signature and that refusal, on the tiny model (4 query
    heads, 2 key/value heads), gets the flag and gives sdpa's log-probs; a kernel without the parameter (torch 2.11's)
    is called as before (the test above)."""
    import torch.nn.attention.varlen as kernel

    given = []

    def torch_2_13(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        if k.shape[1] != q.shape[1] and not enable_gqa:
            raise RuntimeError("varlen_attn: number of heads in key/value must equal query's unless enable_gqa")
        given.append(enable_gqa)
        return causal_per_sequence(q, k, v, cu_q, scale)

    monkeypatch.setattr(kernel, "varlen_attn", torch_2_13)
    varlen = load_model(tiny_model_dir, torch.device("cpu"), torch.float32, attn_implementation="varlen")
    assert varlen.config.num_key_value_heads < varlen.config.num_attention_heads
    batch, real = tiny_batch(seed=6)
    with torch.no_grad():
        want, _ = token_logprobs(policy, batch.input_ids, batch.attention_mask, 0.7, packed=False)
        got, _ = token_logprobs(varlen, batch.input_ids, batch.attention_mask, 0.7, packed=True)
    assert given and all(given)
    torch.testing.assert_close(got * real, want * real, rtol=0, atol=2e-5)


def test_varlen_attention_gives_sdpa_numbers_sequence_by_sequence(policy, tiny_model_dir, monkeypatch):
    """--attn-implementation varlen (fsdp.varlen_attention) with torch's CUDA-only kernel replaced by a stand-in that
    runs sdpa over each [start, end) it is given: packed rows hand the kernel each sequence (forward_tokens' cu, no
    [n, n] mask built), unpadded rows each row (found from the positions), padded rows go to sdpa; log-probs and
    gradients as sdpa's padded ones. transformers never looks for a packed row's sequences itself (a wait for the GPU
    each forward, masking_utils.find_packed_sequence_indices). The kernel itself is compared on a GPU (test_gpu.py)."""
    import torch.nn.attention.varlen as kernel
    import transformers.masking_utils as masking

    calls, searched = [], []
    find = masking.find_packed_sequence_indices
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda p: searched.append(p.shape) or find(p))

    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window_size=(-1, -1)):  # [n, h, d], [n, kv, d]
        calls.append((cu_q.tolist(), max_q))
        assert cu_q is cu_k and max_q == max_k and window_size == (-1, 0) and cu_q.dtype == torch.int32
        assert max_q >= int((cu_q[1:] - cu_q[:-1]).max())
        return causal_per_sequence(q, k, v, cu_q, scale)

    monkeypatch.setattr(kernel, "varlen_attn", stand_in)
    varlen = load_model(tiny_model_dir, torch.device("cpu"), torch.float32, attn_implementation="varlen")
    batch, real = tiny_batch(seed=6)
    weights = torch.rand(real.shape, generator=torch.Generator().manual_seed(7)) * batch.response_mask

    def run(model, packed):
        model.zero_grad(set_to_none=True)
        logp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, 0.7, packed=packed)
        (logp * weights).sum().backward()
        return logp.detach() * real, {n: p.grad.clone() for n, p in model.named_parameters()}

    want_logp, want_grads = run(policy, False)
    got_logp, got_grads = run(varlen, True)
    lengths = [p + r for p, r in SHAPES]
    assert calls and all(c == ([sum(lengths[:i]) for i in range(len(lengths) + 1)], max(lengths)) for c in calls)
    assert searched == []
    torch.testing.assert_close(got_logp, want_logp, rtol=0, atol=2e-5)
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
    calls.clear()  # padded rows: sdpa, the kernel never called
    torch.testing.assert_close(run(varlen, False)[0], want_logp, rtol=0, atol=2e-5)
    assert calls == []
    ids = batch.input_ids[:, :40]  # rows without padding, positions 0..39 each: one sequence a row
    with torch.no_grad():
        want, got = (m(input_ids=ids, use_cache=False).logits for m in (policy, varlen))
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    assert calls[0] == ([0, 40, 80, 120, 160, 200, 240], 40)


@pytest.mark.slow
@pytest.mark.usefixtures("gloo")
def test_logit_chunks_and_compiled_layers_keep_the_numbers(tiny_model_dir, monkeypatch):
    """token_logprobs' head LOGIT_CHUNK tokens at a time (recomputed in backward), and --compile's layers and head math, under
    FSDP2 as the scripts run them: the log-probs, entropies and gradients of the whole-logits, plain model."""
    import fsdp
    import logprobs

    batch, real = tiny_batch(seed=4)
    weights = torch.rand(real.shape, generator=torch.Generator().manual_seed(5)) * batch.response_mask

    def run(model, chunk):
        monkeypatch.setattr(logprobs, "LOGIT_CHUNK", chunk)
        model.zero_grad(set_to_none=True)
        device = next(model.parameters()).device  # FSDP2 takes the GPU where there is one
        logp, entropy = token_logprobs(
            model,
            batch.input_ids.to(device),
            batch.attention_mask.to(device),
            0.7,
            with_entropy=True,
            entropy_grad=True,
            packed=True,
        )
        ((logp + 0.01 * entropy) * weights.to(device)).sum().backward()
        return {
            "logp": logp.detach(),
            "entropy": entropy.detach(),
            **{n: p.grad.full_tensor() for n, p in model.named_parameters()},
        }

    torch.manual_seed(0)
    plain = fsdp.shard_model(load_model(tiny_model_dir, torch.device("cpu"), torch.float32), param_dtype=None)
    whole = run(plain, 10_000)  # one chunk: the logits of all 496 tokens at once, as a plain head
    compiled = fsdp.shard_model(
        load_model(tiny_model_dir, torch.device("cpu"), torch.float32), param_dtype=None, compile=True
    )
    logprobs.compile_head(compiled)
    for name, got in (("chunks of 64", run(plain, 64)), ("compiled, chunks of 64", run(compiled, 64))):
        for k in whole:
            torch.testing.assert_close(got[k], whole[k], rtol=1e-4, atol=2e-5, msg=lambda m: f"{name}, {k}: {m}")
    # entropy as a metric (entropy_grad False) carries no graph: the scripts sum it into their step metrics
    logp, entropy = token_logprobs(plain, batch.input_ids, batch.attention_mask, 1.0, with_entropy=True, packed=True)
    assert logp.requires_grad and not entropy.requires_grad


def test_packed_values_equal_padded(tiny_model_dir):
    """ppo.py's critic: a token-classification head, packed through the same forward_tokens."""
    from transformers import AutoModelForTokenClassification

    from ppo import token_values

    critic = load_model(
        tiny_model_dir, torch.device("cpu"), torch.float32, model_class=AutoModelForTokenClassification, num_labels=1
    )
    batch, real = tiny_batch(seed=3)
    with torch.no_grad():
        padded = token_values(critic, batch.input_ids, batch.attention_mask)
        packed = token_values(critic, batch.input_ids, batch.attention_mask, packed=True)
    torch.testing.assert_close(packed * real, padded * real, rtol=0, atol=1e-5)


def test_pack_rows_budget_each_row_once_balanced():
    lengths = [700, 20, 300, 300, 1500, 64, 90, 410, 256, 33, 512, 128]
    bins = pack_rows(lengths, max_tokens=1024)
    # FFD needs 4 bins (the 1500-token sequence alone); then longest first into the emptiest bin (LPT):
    # 700, 512, 410 open bins 1-3; 300 -> 410's, 300 -> 512's, 256 -> 700's, 128 -> 710, 90 -> 812, 64 -> 838,
    # 33 -> 902 (the first of two), 20 -> 902
    assert bins == [[4], [0, 8], [3, 6, 9, 10], [1, 2, 5, 7, 11]]
    assert [sum(lengths[i] for i in b) for b in bins] == [1500, 956, 935, 922]  # heaviest first, 1024 at most but one
    more = pack_rows(lengths, max_tokens=1024, count=8)  # another rank needs 8
    assert len(more) == 8 and sorted(i for b in more for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 1024 for b in more if b != [4])
    assert pack_rows([5, 5], max_tokens=100, count=4) == [[0], [1], [], []]  # empty bins: stand-ins
    # 200 tokens in two bins of 100: LPT makes 60+30 and 50+40, then 20 fits neither; FFD's 60+40 and 50+30+20 stand
    assert pack_rows([60, 50, 40, 30, 20], max_tokens=100) == [[0, 2], [1, 3, 4]]


def test_micro_batches_padded_unchanged_packed_order_free():
    rows, lengths = torch.tensor([5, 0, 3, 1, 4, 2]), torch.tensor([40, 10, 90, 30, 20, 60])
    assert [r.tolist() for r in micro_batches(rows, lengths, 4)] == [[5, 0, 3, 1], [4, 2]]  # today's split
    packed = [r.tolist() for r in micro_batches(rows, lengths, 4, max_tokens=100)]
    assert packed == [r.tolist() for r in micro_batches(torch.arange(6), lengths, 4, max_tokens=100)]
    assert all(sum(lengths[i] for i in b) <= 100 for b in packed)  # [0..5]: 250 tokens in 3 bins


def test_select_of_no_rows_is_a_stand_in():
    batch, _ = tiny_batch()
    batch.loss_mask = batch.response_mask.clone()
    stand_in = batch.select(torch.tensor([], dtype=torch.long))
    assert len(stand_in) == 1 and stand_in.input_ids.shape[1] == sum(SHAPES[0])  # row 0, cut to its length
    assert stand_in.response_mask.sum() == 0 and stand_in.loss_mask.sum() == 0  # no loss token, no metric


def test_mfu_by_hand(tiny_model_dir):
    # 6 FLOPs x 1e9 params x 10,000 tokens = 6e13 FLOPs in 2 s on 2 GPUs of 989e12: 6e13 / 2 / 1.978e15 = 0.015166...
    assert mfu(6 * 1e9, 10_000, 2.0, 989e12, 2) == pytest.approx(0.0151668, rel=1e-5)
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12 and peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("") is None and peak_flops("Tesla T4") is None  # CPU, unknown GPU: no MFU at all
    # the tiny Llama: 2 layers x (q 64x64 + k, v 64x32 + o 64x64 + gate, up, down 64x128 + 2 norms) + final norm = 74,048,
    # and the embedding 455 x 64 = 29,120 shared with the head (tied): it counts once
    policy = load_model(tiny_model_dir, torch.device("cpu"), torch.float32)
    assert matmul_params(policy) == 2 * (4096 + 2 * 2048 + 4096 + 3 * 8192 + 128) + 64 + 455 * 64


def smoke_pair(model, tmp_path, script, *extra, steps: int = 2):
    """The same seeded run, padded and packed, two gloo ranks; the steps' metrics of each."""
    runs = {}
    for name, flags in (("padded", []), ("packed", ["--max-tokens-per-micro-batch", "80"])):
        run_grpo(
            model,
            tmp_path / name,
            "--steps",
            str(steps),
            "--eval-every",
            "0",
            "--save-every",
            "-1",
            *extra,
            *flags,
            nproc=2,
            script=script,
        )
        runs[name] = metrics(tmp_path / name)[0]
    return runs["padded"], runs["packed"]


def assert_close_runs(padded, packed, keys):
    """Step 1 (the same weights, the same samples) of a padded and a packed run, in fp32 (conftest.py's pins: oneDNN at
    AVX2, so fsdp.compute_dtype is fp32 on every CPU). Packing changes only the order in which the kernels sum: measured
    on an AMD EPYC under the pins and with ATen's AVX-512 kernels, MKL's own branch or two threads instead, the two runs'
    losses, entropies and norms were at most 1.1e-7 relative apart and their log-prob gaps 1.2e-8; the bounds are ~100x
    that (bf16, where a CPU has it and nothing pins it, rounds each layer's output: ~1e-4)."""
    a, b = padded[0], packed[0]
    for k in ("rollout/reward_mean", "rollout/response_len_mean"):
        assert a[k] == b[k], k  # the engine's samples: the same rollouts
    for k in keys:
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), k
    # the trainer's log-probs vs the sampler's: padded and packed trainer log-probs agree to fp32's summation order
    assert abs(b["rollout/logprob_abs_diff"] - a["rollout/logprob_abs_diff"]) < 1e-6
    assert b["train/approx_kl"] == 0 and b["train/clip_frac"] == 0
    assert not any("mfu" in k for k in b)  # a CPU has no peak FLOP/s: no MFU key rather than a made-up one


@pytest.mark.slow
def test_grpo_packed_matches_padded_two_ranks(trained_tiny_model_dir, tmp_path):
    padded, packed = smoke_pair(
        trained_tiny_model_dir, tmp_path, "grpo.py", "--beta", "0.05", "--gradient-checkpointing", "--seed", "2"
    )
    assert_close_runs(padded, packed, ["train/loss", "train/entropy", "train/grad_norm"])
    # step 2: the reference model's packed log-probs are in use (seed 2: at seeds 0 and 1 every group of step 1 is all
    # right or all wrong on this model since the samples' seeds follow their place in the draw: no update, KL 0)
    assert packed[1]["train/kl"] > 0
    # the busiest rank's tokens over the mean (the deal itself: tests/packing_check.py); here ~1.002 and ~1.007
    spread = [r["perf/rank_tokens_max_over_mean"] for r in padded + packed]
    assert all(1 <= x < 1.2 for x in spread) and spread[0] == spread[2], spread  # padded or packed: the same deal


@pytest.mark.slow
def test_ppo_packed_matches_padded_two_ranks(trained_tiny_model_dir, tmp_path):
    padded, packed = smoke_pair(trained_tiny_model_dir, tmp_path, "ppo.py", "--kl-coef", "0.05", steps=1)
    assert_close_runs(padded, packed, ["train/entropy", "train/grad_norm", "critic/value_loss", "critic/grad_norm"])
    assert abs(packed[0]["train/loss"] - padded[0]["train/loss"]) < 1e-5  # whitened advantages: a loss near 0


@pytest.mark.slow
def test_fsdp_packed_equals_padded_two_ranks(tiny_model_dir):
    """FSDP2, fp32, ranks needing different numbers of micro-batches: the same log-probs and gradient."""
    proc = torchrun_check("tests/packing_check.py", tiny_model_dir)
    assert proc.returncode == 0 and "packed matches padded" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.slow
def test_packing_bench_runs_on_cpu(tiny_model_dir, tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "bench/packing_bench.py",
            "--model",
            tiny_model_dir,
            "--device",
            "cpu",
            "--steps",
            "1",
            "--samples",
            "8",
            "--min-len",
            "20",
            "--max-len",
            "200",
            "--prompt-len",
            "10",
            "--micro-batch-size",
            "4",
            "--max-tokens",
            "512",
            "--runs",
            "padded/sdpa",
            "packed/sdpa",
            "packed/sdpa/waits",
            "packed/sdpa/direct",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["run"] for r in result["runs"]] == [
        "padded/sdpa",
        "packed/sdpa",
        "packed/sdpa/waits",
        "packed/sdpa/direct",
    ]
    assert result["real_tokens"] < result["padded_tokens"] and all(r["update_s"] > 0 for r in result["runs"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("attn", ["sdpa", "flex_attention"])
def test_packed_equals_padded_on_gpu(attn):
    """On a GPU, fp32, a random 2-layer Qwen2: each attention's packed path (sdpa: the block-diagonal mask,
    flex_attention: a block mask, compiled on first use) gives padded sdpa's log-probs and gradient."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    torch.manual_seed(0)
    padded_model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").cuda()
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).cuda()
    model.load_state_dict(padded_model.state_dict())
    batch, real = tiny_batch()
    ids, mask, real = batch.input_ids.cuda(), batch.attention_mask.cuda(), real.cuda()
    grads = []
    for m, packed in ((padded_model, False), (model, True)):
        logp, _ = token_logprobs(m, ids, mask, 1.0, packed=packed)
        (logp * real).sum().backward()
        grads.append([p.grad for p in m.parameters()])
        if not packed:
            reference = logp.detach()
    torch.testing.assert_close(logp.detach() * real, reference * real, rtol=0, atol=1e-4)
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-5)
