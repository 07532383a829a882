"""The dtype training and the HF engine compute in (fsdp.compute_dtype): bf16 on GPUs and on CPUs with bf16
instructions, fp32 on other CPUs; and the engine's log-probs match the trainer's in either."""

import pytest
import torch

from data import collate, prompt_tokens
from fsdp import compute_dtype, cpu_flags, load_model, shard_model
from logprobs import batch_logprobs
from memory import ALL_TAGS, MemoryLog, release, sleep, wake_up
from rollout import Sampling, generate, mismatch_stats, start_engine, stop_token_ids

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "flags, max_isa, want",
    [
        ({"avx", "avx2", "fma"}, "", torch.float32),  # AVX2 only: bf16 matmuls 6.6x slower
        ({"avx2", "avx512f", "avx512bw", "avx512_vnni"}, "", torch.float32),  # AVX-512 without bf16 (Cascade Lake)
        ({"avx2", "avx512f", "avx512_bf16"}, "", torch.bfloat16),  # Zen 4, Cooper Lake
        ({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, "", torch.bfloat16),  # Sapphire Rapids
        ({"avx512f", "avx512_bf16"}, "AVX2", torch.float32),  # oneDNN capped below bf16
        ({"avx512f", "avx512_bf16"}, "avx512_core", torch.float32),  # lower case: oneDNN reads it too
        ({"avx512f", "avx512_bf16"}, "AVX512_CORE_BF16", torch.bfloat16),  # capped at bf16: still has it
        ({"avx512f", "avx512_bf16"}, "ALL", torch.bfloat16),
        ({"fp", "asimd", "bf16"}, "", torch.float32),  # Arm's bf16: not measured, fp32
        (set(), "", torch.float32),  # no /proc/cpuinfo (macOS)
    ],
)
def test_cpu_compute_dtype_from_flags(flags, max_isa, want):
    assert compute_dtype(CPU, flags=flags, max_isa=max_isa) == want


def test_gpus_compute_in_bf16_whatever_the_host_cpu():
    assert compute_dtype(torch.device("cuda", 0), flags=set(), max_isa="AVX2") == torch.bfloat16


def test_cpu_flags_read_from_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512_bf16\nbugs\t\t: sysret_ss_attrs\n"
        "processor\t: 1\nflags\t\t: fpu avx2 avx512_bf16\n"
    )
    arm = tmp_path / "arm"  # Arm lists "Features", which names other things: no x86 flags
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert cpu_flags(str(x86)) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(str(arm)) == set()
    assert cpu_flags(str(tmp_path / "missing")) == set()


@pytest.mark.usefixtures("gloo")
@pytest.mark.parametrize("dtype, most", [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
def test_engine_and_trainer_log_probs_match_in_one_dtype(tiny_model_dir, dtype, most):
    """As grpo.py's CPU run: the HF engine and the FSDP2 policy compute in `dtype`, the sync sends it. In fp32 the
    two differ only by summation order (KV cache vs one forward: 1e-7 here; a bf16 sync into this fp32 pair gave
    8e-4); bf16 rounds each layer's output (4e-4 here; the smoke runs' bound is 0.05)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = start_engine("hf", tiny_model_dir, seed=0, dtype=dtype)
    release(engine, ALL_TAGS)
    torch.manual_seed(0)
    policy = shard_model(load_model(tiny_model_dir, CPU, torch.float32), param_dtype=dtype)
    with torch.no_grad():  # weights the engine has not loaded: only the sync can bring them
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    phases = dict(models=[policy], optimizers=[], offload=False, mem=MemoryLog())
    wake_up(engine, policy=policy, dtype=dtype, **phases)
    prompt = prompt_tokens(tokenizer, "What is 12 + 34?")
    sampling = Sampling(max_new_tokens=16, stop_ids=stop_token_ids(tokenizer, tiny_model_dir))
    samples = generate(engine, [prompt] * 4, [1, 2, 3, 4], sampling=sampling, tokenizer=tokenizer)
    sleep(engine, device=CPU, **phases)
    batch = collate(samples, tokenizer.pad_token_id)
    batch.old_logprobs = batch_logprobs(policy, batch, micro_batch_size=4, temperature=1.0, device=CPU)
    assert mismatch_stats(batch)["rollout/logprob_abs_diff"] < most
