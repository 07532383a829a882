"""Training on N GPUs: the process group, FSDP2 models, micro-batches, the optimizer's step, throughput.

    rank, world_size, device = init_distributed()         # torchrun, or plain `python` (world 1)
    dtype = compute_dtype(device)                         # bf16, or fp32 on a CPU without bf16 instructions
    model = load_model(path, device, dtype=torch.float32, gradient_checkpointing=True)
    shard_model(model, param_dtype=dtype)                 # FSDP2: each decoder layer, then the root
    for rows in micro_batches(rows, lengths, size=8, max_tokens=8192):  # packed: <= 8192 tokens, as many on all ranks
    groups = balance(groups, tokens, world_size)          # whole groups dealt over the ranks, their tokens even
    grad_norm = clip_and_step(model, optimizer, scheduler, max_grad_norm=1.0)   # a NaN/inf norm skips the step
    utilization = mfu(6 * matmul_params(model), tokens, seconds, peak_flops(gpu_name), world_size)
    metrics = throughput(lengths, seconds=..., phase_seconds=mem.seconds, peak=..., ...)  # tokens/s, balance, MFU

The forward passes and token log-probs of these models: logprobs.py.

PLUMBING: a reader of the algorithm can take these as given.
"""

import datetime
import inspect
import logging
import math
import os
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from common import all_reduce


# ----------------------------------------------------------------------------------------------
# Processes


def init_distributed(timeout_minutes: float = 30.0) -> tuple[int, int, torch.device]:
    """Join the torchrun job (or make a world of one for plain `python script.py`).

    NCCL on GPUs, gloo on CPU. The timeout is generous: a rank that finishes its rollout early
    waits at the next collective for the slowest rank's generation.
    """
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    timeout = datetime.timedelta(minutes=timeout_minutes)
    # SGLang runs NCCL with NCCL_CUMEM_ENABLE=0 unless it is exported; a rollout server and this process share the
    # weight sync's NCCL group, whose two ends must agree, and NCCL reads it once, at its first communicator: so
    # here, before any (a value the user exported is kept; server.check_nccl_memory checks it against the servers)
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group(backend, timeout=timeout, device_id=device if use_cuda else None)
    else:  # plain python: a one-process group, no port needed
        dist.init_process_group(
            backend,
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=timeout,
            device_id=device if use_cuda else None,
        )
    return dist.get_rank(), dist.get_world_size(), device


# ----------------------------------------------------------------------------------------------
# Models


def load_model(
    path: str,
    device: torch.device,
    dtype: torch.dtype,
    gradient_checkpointing: bool = False,
    attn_implementation: str = "sdpa",
    model_class=None,
    new_head: bool = False,
    **kwargs,
):
    """A Hugging Face model from a hub id or local folder, on the CPU in `dtype`. new_head: `model_class`'s head is
    new, not in the checkpoint (a critic's, a reward model's): transformers' table of it as MISSING is not shown.

    PLUMBING: every rank reads the whole checkpoint into CPU memory, then `shard_model` moves its
    shard to the GPU. Simple and fine to ~14B on one node; beyond that, build on the meta device
    and broadcast rank 0's weights instead.
    """
    from transformers import AutoModelForCausalLM  # lazy: keeps `import fsdp` light for notebooks

    model_class = model_class or AutoModelForCausalLM
    loader_log, new_by_design = (
        logging.getLogger("transformers.modeling_utils"),
        lambda r: "LOAD REPORT" not in r.getMessage(),
    )
    if new_head:
        loader_log.addFilter(new_by_design)
    if attn_implementation == VARLEN:
        register_varlen()
    try:
        model = model_class.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation, **kwargs)
    except OSError as e:
        raise OSError(
            f"could not load model {path!r}: {e}\nPass a hub id (e.g. Qwen/Qwen2.5-0.5B-Instruct) "
            f"or a local folder with config.json and weights."
        ) from None
    finally:
        loader_log.removeFilter(new_by_design)
    model.config.use_cache = False  # training forwards never use the KV cache
    dropout_off(model)
    if gradient_checkpointing:
        # Non-reentrant checkpointing composes with FSDP2: each layer's activations are recomputed
        # in backward, trading ~30% more compute for activations of one layer instead of all.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def dropout_off(model: torch.nn.Module):
    """Every dropout the model can apply, off: the old log-probs, the values and the update must see one function,
    in training mode too (policy.train() stays on). nn.Dropout modules (token-classification heads, used as critics,
    come with 0.1), and the rates modules copy from the config and apply functionally while training (Llama's, Qwen2's
    and Mistral's attention: config.attention_dropout; OPT's layerdrop, which skips whole layers at random), wherever a
    module or config holds a rate."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        zero_rates(module)  # attention_dropout, dropout, attn_pdrop, ...
    for config in [model.config] + [
        v for v in vars(model.config).values() if hasattr(v, "to_dict")
    ]:  # text_config, ...
        zero_rates(config)  # for code that reads the config as it runs (a checkpoint saves it so)


def zero_rates(obj):
    for name, value in list(vars(obj).items()):
        if ("dropout" in name or name.endswith(("pdrop", "layerdrop"))) and isinstance(value, float) and value > 0:
            setattr(obj, name, 0.0)


# A CPU multiplies bf16 fast only with instructions of its own, AVX512_BF16 (Zen 4, Cooper Lake on) or AMX; without them
# a bf16 matmul is slower than fp32 (6.6x on an AVX2 machine; with AVX512_BF16 3.7x faster). Read from /proc/cpuinfo's flags,
# as oneDNN's bf16 kernels key on them; not torch.backends.cpu.get_cpu_capability(), "AVX512" also on AVX-512 CPUs without
# bf16 (Skylake: ATen's vector kernels, not the matmul's); not timed at start, where other jobs on 2 cores swung one fp32
# matmul 5x between runs. Arm's bf16 is not measured: fp32. ONEDNN_MAX_CPU_ISA below AVX512_CORE_BF16 caps oneDNN too.
BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16"}
ISAS_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}


def compute_dtype(device: torch.device, flags: set[str] | None = None, max_isa: str | None = None) -> torch.dtype:
    """What forward and backward passes compute in, the HF engine's generation too (parameters and optimizer state stay
    fp32): bf16 on a GPU and on a CPU whose `flags` (/proc/cpuinfo's) name bf16 instructions that `max_isa`
    (ONEDNN_MAX_CPU_ISA) leaves to oneDNN; fp32 on other CPUs."""
    if device.type != "cpu":
        return torch.bfloat16
    flags = cpu_flags() if flags is None else flags
    max_isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "") if max_isa is None else max_isa
    return torch.bfloat16 if flags & BF16_CPU_FLAGS and max_isa.upper() not in ISAS_WITHOUT_BF16 else torch.float32


def deterministic_training():
    """The same batch gives the same update, run after run (--deterministic-rollout: the next step samples from these
    weights): torch's deterministic kernels (gather and embedding backward without atomic adds; SDPA's memory-efficient
    backward in one split over the keys, which torch only forces when strict: warn-only keeps the split and warns); an
    op that has none stops the run with torch's error naming it. cuBLAS with a fixed workspace (CUBLAS_WORKSPACE_CONFIG,
    read when its handle is made: call this before the first matmul)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags as Linux lists them; none without the file (macOS, Windows: fp32)."""
    try:
        with open(path) as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def shard_model(model, param_dtype: torch.dtype | None = torch.bfloat16, compile: bool = False):
    """FSDP2: shard each decoder layer, then the root (embeddings, final norm, head). compile: each layer
    through torch.compile first (as torchtitan does; names and state dicts unchanged), which fuses its
    elementwise ops into a few kernels (logprobs.compile_head: the log-prob head's too): the first passes compile.

    With param_dtype=bf16 the fp32 master shards are all-gathered as bf16 for compute and
    gradients are reduce-scattered in fp32 (reduce_dtype), as in torchtitan (param_dtype: compute_dtype's).
    param_dtype=None computes in the stored dtype (the frozen reference model). Parameters land on the GPU.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} names no decoder layer class in _no_split_modules; cannot shard it layer by layer"
        )
    for layer in layers:
        if compile:
            layer.compile()  # sizes that change (tokens, rows) turn symbolic after the first recompile
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    # Gradients are summed over ranks, not averaged: the loss already divides by the global token
    # (or sequence) count, computed once before the micro-batches (the scripts' `aggregate`), as in
    # torchtitan. Plain SUM reductions, which gloo supports too (PREMUL_SUM is NCCL's alone).
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


VARLEN = "varlen"  # --attn-implementation varlen: varlen_attention


def varlen_attention(
    module, query, key, value, attention_mask, scaling=None, cu_seq_lens_q=None, max_length_q=None, **kwargs
):
    """transformers' attention for --attn-implementation varlen: query [b, h, t, d], key and value [b, kv, t, d]
    -> [b, t, h, d], each sequence attending causally to its own tokens only, by the FlashAttention-2 kernel that
    torch itself ships (torch.nn.attention.varlen: CUDA, no flash-attn package). A packed row costs the sum of its
    sequences' squared lengths, not the square of the row's as sdpa's block-diagonal mask does. The sequences:
    forward_tokens' cu_seq_lens_q [s+1] in a packed row (its attention_mask, of no size, unread), else where
    position_ids restart at 0 (each row of an unpadded batch). A padded batch (sdpa's [b, 1, t, t] mask) and a KV cache
    go to sdpa."""
    from torch.nn.attention.varlen import varlen_attn
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None and (attention_mask is not None or query.shape[2] != key.shape[2]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if kwargs.get("softcap"):
        raise ValueError("--attn-implementation varlen has no logit soft-capping (Gemma 2): use sdpa or eager")
    b, h, t, d = query.shape
    if cu_seq_lens_q is None:
        positions = kwargs.get("position_ids")  # a model that does not pass them: each row one sequence
        positions = torch.arange(t, device=query.device)[None] if positions is None else positions
        starts = (positions.expand(b, t).flatten() == 0).nonzero().flatten()  # [s]
        cu_seq_lens_q, max_length_q = torch.cat([starts, starts.new_tensor([b * t])]).int(), t
    window = kwargs.get("sliding_window") or 0  # keys within the last `window` positions, this one included
    q, k, v = (x.transpose(1, 2).flatten(0, 1) for x in (query, key, value))  # [b*t, heads, d]: bf16 (FSDP2's)
    cu, n = cu_seq_lens_q, max_length_q
    # grouped-query attention (fewer key/value heads): torch 2.13's kernel refuses it unless told
    gqa = {"enable_gqa": True} if k.shape[1] != h and "enable_gqa" in inspect.signature(varlen_attn).parameters else {}
    out = varlen_attn(q, k, v, cu, cu, n, n, scale=scaling, window_size=(window - 1, 0), **gqa)  # [b*t, h, d]
    return out.view(b, t, h, d), None


def register_varlen():
    """--attn-implementation varlen in transformers' tables (load_model, before from_pretrained): the attention, and
    a mask only where rows are padded (no [n, n] mask for a packed row: its sequences go to the kernel instead)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(VARLEN, varlen_attention)
    AttentionMaskInterface.register(
        VARLEN,
        lambda attention_mask=None, **kw: (
            None if attention_mask is None else sdpa_mask(attention_mask=attention_mask, **kw)
        ),
    )


def pack_rows(lengths: list[int], max_tokens: int, count: int = 0) -> list[list[int]]:
    """Indices into `lengths` in bins of at most max_tokens tokens (a longer sequence alone in one), at least
    `count` bins (empty ones fill up), loads balanced, the heaviest bin first, each bin's indices in order.

    First-fit decreasing finds how many bins the budget needs; then, longest first, each sequence goes
    into the emptiest bin (LPT), which balances them. Where LPT would overflow a bin, FFD's bins stand.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    ffd = []  # [tokens, indices] per bin
    for i in order:
        fit = next((b for b in ffd if b[0] + lengths[i] <= max_tokens), None)
        if fit is None:
            fit = [0, []]
            ffd.append(fit)
        fit[0] += lengths[i]
        fit[1].append(i)
    k = max(count, len(ffd))
    bins = [[0, []] for _ in range(k)]
    for i in order:
        emptiest = min(bins, key=lambda b: b[0])
        if emptiest[1] and emptiest[0] + lengths[i] > max_tokens:
            bins = ffd + [[0, []] for _ in range(k - len(ffd))]
            break
        emptiest[0] += lengths[i]
        emptiest[1].append(i)
    return [sorted(b[1]) for b in sorted(bins, key=lambda b: -b[0])]


def micro_batches(rows: torch.Tensor, lengths: torch.Tensor, size: int, max_tokens: int = 0) -> list[torch.Tensor]:
    """`rows` of a batch cut into micro-batches: `size` rows each (the last may be smaller), or with
    max_tokens > 0 at most max_tokens tokens each (`lengths`: every row's tokens; pack_rows).

    PLUMBING: FSDP2 all-gathers each layer in every forward and reduce-scatters in every backward, so
    every rank must run as many micro-batches: the most any rank's rows need (one all_reduce); a rank
    with fewer gets empty ones, which Batch.select turns into stand-ins that add nothing to a loss.
    Rows stay on their rank (balance() evens the ranks' tokens out before). The same rows in any
    order pack the same way: a one-mini-batch update sees the log-prob pass's numbers, ratio 1 exactly.
    """
    if max_tokens <= 0:
        return list(rows.split(size))
    rows = rows.sort().values
    lens = lengths[rows].tolist()
    bins = pack_rows(lens, max_tokens)
    count = int(all_reduce(len(bins), dist.ReduceOp.MAX))
    if count > len(bins):  # another rank needs more: spread these rows over as many
        bins = pack_rows(lens, max_tokens, count)
    return [rows[torch.tensor(b, dtype=torch.long)] for b in bins]


def balance(items: list, weights: list[float], world_size: int, share: int | None = None) -> list:
    """Every rank's `items` dealt out again over the ranks, each rank keeping as many as it had (or `share` each: the
    pool cut to share x world_size first, in rank order, whatever the weights), so that their summed `weights`
    (tokens) are as even as LPT makes them: heaviest first, each to the lightest rank with room.

    PLUMBING: every rank runs as many micro-batches (micro_batches), so the rank whose rollouts ran longest
    sets every rank's pace. All ranks gather all items (all_gather_object: token ids, a few MB) and compute
    the same deal; each keeps its share, in the gathered order. Each item moves whole (grpo.py: a group).
    """
    if world_size == 1:
        return items if share is None else items[:share]
    gathered = [None] * world_size
    dist.all_gather_object(gathered, list(zip(weights, items)))
    pool = [x for part in gathered for x in part]  # rank by rank: the same list on every rank
    room = [len(part) if share is None else share for part in gathered]
    pool = pool[: sum(room)]
    loads, shares = [0.0] * world_size, [[] for _ in range(world_size)]
    for i in sorted(range(len(pool)), key=lambda i: -pool[i][0]):
        r = min((r for r in range(world_size) if len(shares[r]) < room[r]), key=lambda r: loads[r])
        loads[r] += pool[i][0]
        shares[r].append(i)
    return [pool[i][1] for i in sorted(shares[dist.get_rank()])]


def clip_and_step(model, optimizer, scheduler, max_grad_norm: float) -> float:
    """Clip the gradient to max_grad_norm, step the optimizer and its LR schedule, zero the
    gradient. A NaN/inf norm (a NaN loss or reward) skips the step: it never reaches the weights,
    and the schedule moves on as if it had (it counts the steps the run plans: steps x epochs x
    mini-batches). Returns the norm before clipping (a CPU-GPU sync point: once per optimizer step)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor under FSDP2
    if math.isfinite(norm):
        optimizer.step()
    skip_schedule(scheduler, 1)
    optimizer.zero_grad(set_to_none=True)
    return norm


def skip_schedule(scheduler, n: int):
    """Move the LR schedule on by n optimizer steps, taken or skipped (an update dynamic sampling skipped whole)."""
    with warnings.catch_warnings():  # torch warns of a schedule stepped before its optimizer: a first step skipped
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        for _ in range(n):
            scheduler.step()


# ----------------------------------------------------------------------------------------------
# Throughput

# Dense (no sparsity) bf16 tensor-core FLOP/s per GPU, NVIDIA's datasheets; the first name found in
# torch.cuda.get_device_name wins ("H100 PCIe" before "H100", the SXM part).
PEAK_BF16_FLOPS = [
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H200 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
]


def peak_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of the GPU called `device_name`; None for a CPU ("") or a GPU not in
    the table, and then no MFU is logged rather than a made-up one."""
    return next((flops for name, flops in PEAK_BF16_FLOPS if name in device_name), None)


def matmul_params(model) -> int:
    """Parameters that take part in a matmul for every token: all but the input embedding (a lookup),
    unless the output head shares its weight."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    total = sum(p.numel() for p in model.parameters())  # a DTensor's numel is the whole tensor's
    return total if head is not None and head.weight is embedding.weight else total - embedding.weight.numel()


def mfu(flops_per_token: float, tokens: float, seconds: float, peak: float, world_size: int) -> float:
    """Model FLOPs utilization: flops_per_token * tokens (summed over ranks) / seconds / (world_size * peak).

    flops_per_token is Kaplan et al.'s 2N for a forward, 6N for forward and backward, N the matmul
    parameters: attention's own FLOPs (which grow with the sequence length) are not counted, nor is the
    forward that gradient checkpointing recomputes (8N of hardware FLOPs: MFU counts the model's, not
    the hardware's). Tokens are real ones: padding is not work the model needed.
    """
    return flops_per_token * tokens / seconds / (world_size * peak)


def throughput(
    lengths: torch.Tensor,
    *,
    seconds: float,
    phase_seconds: dict,
    device: torch.device,
    forward_params: int,
    update_params: int,
    epochs: int,
    weight_grads: bool = True,
) -> dict:
    """A step's perf/ metrics over all ranks, from each row's real tokens (`lengths`, prompt and response): tokens per
    second of the step so far (`seconds`); the busiest rank's tokens over the mean (1: even, `balance`); on a GPU of
    known peak FLOP/s (`device`'s, peak_flops: no MFU elsewhere), the MFU of the log-prob phase (a forward, 2N FLOPs a token, of `forward_params` N: every
    model it runs) and of the update (6N of `update_params`, `epochs` passes; 4N without `weight_grads`: a frozen base under
    LoRA has no weight gradients), from `phase_seconds` (MemoryLog's)."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    peak = peak_flops(torch.cuda.get_device_name(device) if device.type == "cuda" else "")
    real_tokens = float(all_reduce(lengths.sum()))
    out = {
        "perf/tokens_per_s": real_tokens / seconds,
        "perf/rank_tokens_max_over_mean": float(all_reduce(lengths.sum(), dist.ReduceOp.MAX))
        * world_size
        / real_tokens,
    }
    if peak:
        out["perf/logprob_mfu"] = mfu(2 * forward_params, real_tokens, phase_seconds["logprob"], peak, world_size)
        per_token = 6 if weight_grads else 4  # forward 2N, backward 4N (2N without weight gradients)
        out["perf/update_mfu"] = mfu(
            per_token * update_params, real_tokens * epochs, phase_seconds["update"], peak, world_size
        )
    return out


def lr_lambda(warmup_steps: int, schedule: str, min_lr_ratio: float, total_steps: int):
    """LambdaLR factor: linear warm-up from 0, then constant, cosine or linear decay that reaches
    min_lr_ratio at total_steps."""

    def f(i: int) -> float:
        if i < warmup_steps:
            return (i + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (i - warmup_steps) / max(1, total_steps - warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
        return min_lr_ratio + (1 - min_lr_ratio) * decay

    return f
