"""Training on N GPUs: the process group, FSDP2 models, their forward passes.

    rank, world_size, device = init_distributed()         # torchrun, or plain `python` (world 1)
    dtype = compute_dtype(device)                         # bf16, or fp32 on a CPU without bf16 instructions
    model = load_model(path, device, dtype=torch.float32, gradient_checkpointing=True)
    shard_model(model, param_dtype=dtype)                 # FSDP2: each decoder layer, then the root
    logp, entropy = token_logprobs(model, ids, mask, temperature=1.0, with_entropy=True)   # [B, T-1]
    logp, _ = token_logprobs(model, ids, mask, temperature=1.0, packed=True)  # the same: real tokens in one row
    old_logp = batch_logprobs(model, batch, micro_batch_size=8, temperature=1.0, device=device)
    old_logp, ref_logp = old_and_ref_logprobs(policy, ref, batch, micro_batch_size=8, temperature=1.0, device=device)
    for rows in micro_batches(rows, lengths, size=8, max_tokens=8192):  # packed: <= 8192 tokens, as many on all ranks
    utilization = mfu(6 * matmul_params(model), tokens, seconds, peak_flops(gpu_name), world_size)
    metrics = throughput(lengths, seconds=..., phase_seconds=mem.seconds, peak=..., ...)  # tokens/s, balance, MFU
    total = all_reduce(local_sum)                         # over ranks; the identity in a notebook

PLUMBING: a reader of the algorithm can take these as given.
"""

import datetime
import logging
import math
import os
import warnings
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from lora import adapter_off

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


@contextmanager
def without_agent_store():
    """Under torchrun, TORCHELASTIC_USE_AGENT_STORE makes every new TCPStore a client of torchrun's
    store: one this process (or a child inheriting its environment) must host itself would wait
    forever. Hidden meanwhile (SGLang's start, the weight-update group's rendezvous)."""
    saved = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = saved


def all_reduce(x: float | torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce a number or tensor over ranks, in float64, back on the CPU (a CPU-GPU sync point on
    NCCL). Without a process group (a notebook) it is the identity."""
    if not dist.is_initialized():
        return torch.as_tensor(x, dtype=torch.float64).clone().cpu()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.as_tensor(x, dtype=torch.float64, device=device).clone()
    dist.all_reduce(t, op=op)
    return t.cpu()


def all_reduce_dict(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sum each value over ranks, by name, in one collective. float64 on the CPU."""
    return dict(zip(sums, all_reduce(torch.stack(list(sums.values())))))


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
    and Mistral's attention: config.attention_dropout), wherever a module or config holds a rate."""
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
        if ("dropout" in name or name.endswith("pdrop")) and isinstance(value, float) and value > 0:
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
    elementwise ops into a few kernels, and logits_to_logprobs: the first forwards and backwards compile.

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
    if compile:  # token_logprobs' passes over [chunk, V] too
        model.logits_to_logprobs = torch.compile(logits_to_logprobs)
    fully_shard(model, mp_policy=mp)
    # Gradients are summed over ranks, not averaged: the loss already divides by the global token
    # (or sequence) count, computed once before the micro-batches (the scripts' `aggregate`), as in
    # torchtitan. Plain SUM reductions, which gloo supports too (PREMUL_SUM is NCCL's alone).
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def forward_tokens(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, packed: bool = False, head=None):
    """model(...).logits of a right-padded micro-batch [b, t], the ids they score, and `unpack`: per-token
    values of the next-token positions -> [b, t-1] (padded: the identity). head(hidden [b, t, H], ids [b, t]): what
    the output head returns instead of the logits (token_logprobs'), run in the forward, where FSDP2 gathered its weight.

    packed: the rows' real tokens in one row [1, n], no padding, positions restarting at 0 in each
    sequence. With attention_mask None, transformers reads the restarts as sequence boundaries
    (masking_utils.find_packed_sequence_indices) and keeps attention within each: sdpa and eager by a
    block-diagonal causal mask [1, 1, n, n] (n^2 memory; all n^2 pairs computed), flex_attention by a
    block mask that skips the other sequences' blocks, flash_attention_2 by per-sequence lengths.
    """
    unpack, positions = (lambda x: x), None
    if packed:
        real = attention_mask.bool()  # [b, t]
        rows, cols = real.nonzero(as_tuple=True)  # [n] each, row by row (a CPU-GPU sync point: n is data-dependent)
        positions = (real.cumsum(-1) - 1)[rows, cols][None]  # [1, n]: 0, 1, ... in each sequence
        input_ids, attention_mask = input_ids[rows, cols][None], None  # [1, n]
        # packed position j predicts token j+1 of its own sequence, unless j ends it: that value is zeroed onto the
        # column past the sequence's end (boolean indexing would stop the CPU until the GPU caught up)
        own, shape = rows[1:] == rows[:-1], real.shape  # [n-1]

        def unpack(x):  # [1, n-1] -> [b, t-1], zero past each sequence's end; gradients flow back through it
            out = x.new_zeros(shape)  # [b, t]
            return out.index_put((rows[:-1], cols[:-1]), x[0] * own)[:, :-1]

    sequences = {}  # varlen_attention's sequences in the packed row (else it finds them: one sync a layer)
    if packed and getattr(model.config, "_attn_implementation", None) == VARLEN:
        lengths = real.sum(-1)  # [b]: the row's sequences, in order
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int()  # [b+1]: where each starts, and the end
        sequences = dict(cu_seq_lens_q=cu, max_length_q=int(lengths.max()))
    if head is not None:  # on this module object, for this call only
        model.get_output_embeddings().forward = lambda hidden: head(hidden, input_ids)
    try:
        logits = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False, **sequences
        ).logits  # [b, t, V] or [1, n, V]
    finally:
        if head is not None:
            del model.get_output_embeddings().forward  # the class's forward again
    return logits, input_ids, unpack


VARLEN = "varlen"  # --attn-implementation varlen: varlen_attention


def varlen_attention(
    module, query, key, value, attention_mask, scaling=None, cu_seq_lens_q=None, max_length_q=None, **kwargs
):
    """transformers' attention for --attn-implementation varlen: query [b, h, t, d], key and value [b, kv, t, d]
    -> [b, t, h, d], each sequence attending causally to its own tokens only, by the FlashAttention-2 kernel that
    torch itself ships (torch.nn.attention.varlen: CUDA, no flash-attn package). A packed row costs the sum of its
    sequences' squared lengths, not the square of the row's as sdpa's block-diagonal mask does. The sequences:
    forward_tokens' cu_seq_lens_q [s+1] in a packed row, else where position_ids restart at 0 (each row of an
    unpadded batch). A padded batch (sdpa's [b, 1, t, t] mask) and a KV cache go to sdpa."""
    from torch.nn.attention.varlen import varlen_attn
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None or query.shape[2] != key.shape[2]:
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
    out = varlen_attn(q, k, v, cu, cu, n, n, scale=scaling, window_size=(window - 1, 0))  # [b*t, h, d]
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


LOGIT_CHUNK = 2048  # tokens whose [chunk, V] logits exist at once in token_logprobs (~3 GB fp32 at V = 152k)


def logits_to_logprobs(logits, targets, temperature: float, with_entropy: bool, entropy_grad: bool) -> torch.Tensor:
    """[c, V] logits, [c] target ids -> [c, 2]: each target's log-prob at `temperature` and the entropy (zeros unless
    with_entropy; no gradient unless entropy_grad). shard_model(compile=True) compiles it: model.logits_to_logprobs."""
    logits = logits if temperature == 1.0 else logits.float() / temperature
    # fp32 (bf16 log-probs are off by ~1e-2, enough to skew the PPO ratio), in one fused pass over the logits
    logp_all = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # [c, V]
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else logp_all[:, 0] * 0
    return torch.stack([logp_all.gather(-1, targets[:, None]).squeeze(-1), entropy], -1)


KL_EXP_CLAMP = 20.0  # k3's exponent is clamped to +-this: one outlier token can't overflow the loss


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) from samples of the policy, r = ref/policy probability of the sampled
    token: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r (Schulman's). grpo.py and ppo.py each say where theirs
    goes (the loss, the reward) and which estimator's gradient is the KL's there. [B, T] -> [B, T]"""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":  # unbiased and always >= 0
        neg = (-log_ratio).clamp(-KL_EXP_CLAMP, KL_EXP_CLAMP)
        return torch.exp(neg) - 1 - neg
    raise ValueError(f"KL estimator {estimator!r} is unknown; use k1, k2 or k3")


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    packed: bool = False,
):
    """Log-prob of each next token under `model` at sampling temperature `temperature`.

    Returns logp [B, T-1] (logp[:, t] scores input_ids[:, t+1]) and, if asked, the entropy of the
    next-token distribution [B, T-1]: a metric without gradient, unless `entropy_grad` (an entropy
    bonus). Dividing by the temperature matters: SGLang reports log-probs of the distribution it
    sampled from, softmax(logits / T). `packed`: one forward over the rows without padding
    (forward_tokens), the same numbers on the real tokens, zero past them.

    The output head runs LOGIT_CHUNK tokens at a time: the [N, V] logits (fp32: 5 GB for 8192 tokens of a 152k
    vocabulary) never exist whole; under autograd each chunk's are recomputed in backward (one more head matmul).
    """
    output, to_logprobs = model.get_output_embeddings(), getattr(model, "logits_to_logprobs", logits_to_logprobs)
    logprobs = lambda logits, y: to_logprobs(logits, y, temperature, with_entropy, entropy_grad)  # noqa: E731  [c, 2]

    def head(hidden, ids):  # [b, t, H], [b, t] -> [b*t, 2] (not a view: FSDP2 hooks the forward's output)
        targets = torch.cat([ids[:, 1:], ids[:, :1]], 1).flatten()  # [b*t]: the last column's is a stand-in
        chunks = zip(hidden.flatten(0, 1).split(LOGIT_CHUNK), targets.split(LOGIT_CHUNK))
        chunk = lambda h, y: logprobs(torch.nn.functional.linear(h, output.weight, output.bias), y)  # noqa: E731
        recompute = torch.is_grad_enabled() and hidden.shape[0] * hidden.shape[1] > LOGIT_CHUNK  # one chunk: kept
        out = [
            torch.utils.checkpoint.checkpoint(chunk, h, y, use_reentrant=False) if recompute else chunk(h, y)
            for h, y in chunks
        ]
        return torch.cat(out)

    if getattr(model.config, "final_logit_softcapping", None):  # Gemma 2 caps the logits after the head: whole ones
        logits, ids, unpack = forward_tokens(model, input_ids, attention_mask, packed)  # [B, T, V] or [1, N, V]
        out = logprobs(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).view(*ids[:, 1:].shape, 2)
    else:
        out, ids, unpack = forward_tokens(model, input_ids, attention_mask, packed, head)  # [B*T, 2] or [N, 2]
        out = out.view(*ids.shape, 2)[:, :-1]  # [B, T-1, 2]
    logp, entropy = out.unbind(-1)  # the stack of the two carries logp's graph: a metric entropy leaves it
    return unpack(logp), unpack(entropy if entropy_grad else entropy.detach()) if with_entropy else None


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


@torch.no_grad()
def batch_forward(fn, batch, micro_batch_size: int, device, progress=iter, max_tokens: int = 0) -> torch.Tensor:
    """fn(micro-batch) -> [b, t-1] over a whole Batch, micro-batch by micro-batch (micro_batches), without
    gradient. [B, T-1] on the CPU, zero past each micro-batch's longest sequence."""
    out = torch.zeros_like(batch.response_mask)
    lengths = batch.attention_mask.sum(-1)  # [B]
    for rows in progress(micro_batches(torch.arange(len(batch)), lengths, micro_batch_size, max_tokens)):
        mb = batch.select(rows).to(device)  # no rows: a stand-in, run for FSDP's collectives only
        y = fn(mb).cpu()  # [b, t-1]
        out[rows, : y.shape[1]] = y[: len(rows)]
    return out


def batch_logprobs(
    model, batch, micro_batch_size: int, temperature: float, device, progress=iter, max_tokens: int = 0
) -> torch.Tensor:
    """token_logprobs over a whole Batch, without gradient; max_tokens > 0: packed micro-batches of at most
    that many tokens. [B, T-1] on the CPU."""
    return batch_forward(
        lambda mb: token_logprobs(model, mb.input_ids, mb.attention_mask, temperature, packed=max_tokens > 0)[0],
        batch,
        micro_batch_size,
        device,
        progress,
        max_tokens,
    )


def old_and_ref_logprobs(
    policy, ref, batch, *, micro_batch_size: int, temperature: float, device, max_tokens: int = 0, progress=iter
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A batch's log-probs before the update (batch_logprobs), [B, T-1] on the CPU: the policy's (the old log-probs,
    the ratio's denominator; `progress` wraps its micro-batches) and the reference's (None without a `ref`). A LoRA
    policy is its own reference: its base, under lora.adapter_off (a no-op for a separate reference model)."""
    old = batch_logprobs(policy, batch, micro_batch_size, temperature, device, progress, max_tokens)
    if ref is None:
        return old, None
    with adapter_off(ref):
        return old, batch_logprobs(ref, batch, micro_batch_size, temperature, device, max_tokens=max_tokens)


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
