"""One GPU, two tenants: the training state and the SGLang engine take turns with the memory.

A step, as the GPU memory sees it ("multi-stage awake"):

    [update]   params + grads + optimizer state + activations       SGLang: nothing
    wake_up(engine, policy=..., models=..., optimizers=..., offload=..., mem=...)
      1. free_grads        grads -> None; optimizer state -> CPU (offload)
      2. resume_weights    empty the cache; SGLang gets its weight memory back
      3. sync_weights      FSDP2 shards -> full bf16 tensors (one bucket at a time) -> SGLang (HF engine: its dtype)
      4. offload_model     the gathered copies are gone; training params -> CPU (offload)
      5. resume_kv_cache   empty the cache; SGLang gets its KV cache (and CUDA graphs) back
    [generate]             SGLang: weights + KV cache          training: params unless offloaded
    sleep(engine, models=..., optimizers=..., offload=..., mem=..., device=...)
      6. release           SGLang frees KV cache, weights and graphs
      7. reload            training params and optimizer state -> GPU (offload)
    [log-probs, update]

With --lora-sync adapter (wake_up's `adapter`) the engine keeps its weights, the base, from the first sync on (it
holds no copy elsewhere: released, they would be gone): 2. resumes nothing after the first step, 3. sends the
adapter alone (lora.sync_adapter), 6. frees the KV cache and graphs only (`engine.kept`).

Rules: never resume a region that was not released; always empty PyTorch's cache before a resume
(memory PyTorch keeps cached is memory SGLang cannot map). Each phase records its seconds and the
GPU memory it ended with and peaked at, as the training process and the whole device see it.
"""

import atexit
import threading
import time
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist

from lora import engine_weights, sync_adapter

ALL_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's memory regions
GiB = 1024**3


# ----------------------------------------------------------------------------------------------
# The two halves of the step


def wake_up(
    engine,
    *,
    policy,
    models: list,
    optimizers: list,
    offload: bool,
    mem: "MemoryLog",
    bucket_bytes: int = 512 * 2**20,
    tp_group=None,
    dtype: torch.dtype = torch.bfloat16,
    adapter: bool = False,
):
    """Training state -> rollout. `models` are all training-side FSDP2 models (policy, reference,
    critic); `optimizers` their optimizers. `engine` is None on non-owner ranks of a TP group;
    `tp_group`: that group, when it shares an in-process SGLang engine (see sync_weights); `dtype`: the engine's;
    `adapter`: a LoRA policy's adapter goes to the engine as an adapter (the base once), not merged (sync_weights)."""
    with mem.phase("free_grads"):
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        if offload:
            for opt in optimizers:
                move_optimizer(opt, "cpu")
    with mem.phase("resume_weights"):
        resume(engine, ["weights"])  # kept ones (--lora-sync adapter's base) are there already
    with mem.phase("sync_weights"):
        sync_weights(policy, engine, bucket_bytes, tp_group=tp_group, dtype=dtype, adapter=adapter)
    with mem.phase("offload_model"):
        if offload:
            for model in models:
                model.to("cpu", non_blocking=True)  # into pinned host memory (see move_optimizer)
            synchronize()
    with mem.phase("resume_kv_cache"):
        resume(engine, ["kv_cache", "cuda_graph"])


def sleep(engine, *, models: list, optimizers: list, offload: bool, mem: "MemoryLog", device):
    """Rollout -> training state (`engine` None: only bring the training state back)."""
    with mem.phase("release"):
        release(engine, ALL_TAGS)
    with mem.phase("reload"):
        if offload:
            for model in models:
                model.to(device, non_blocking=True)
            for opt in optimizers:
                move_optimizer(opt, device)


# ----------------------------------------------------------------------------------------------
# The pieces


@torch.no_grad()
def sync_weights(
    model,
    engine,
    bucket_bytes: int = 512 * 2**20,
    tp_group=None,
    dtype: torch.dtype = torch.bfloat16,
    adapter: bool = False,
):
    """Push the FSDP2 model's weights into the engine, in buckets of about `bucket_bytes`.

    Every rank all-gathers every parameter (`full_tensor()` is a collective: all ranks, same order); ranks that own an
    engine hand it the full tensors in `dtype` (SGLang: bf16) by CUDA IPC, no copy through the CPU. Buckets bound the
    extra memory to one bucket of gathered weights. The prefix cache holds KV of the old weights: flushed at the end.
    A LoRA policy (lora.engine_weights): each adapted weight merged, W + alpha/r B A, as it is gathered, so any
    engine takes it; with `adapter`, the base weights go once, then the adapter alone each time (lora.sync_adapter).

    `tp_group` (--rollout-tp k, one SGLang engine over the group's GPUs): SGLang's TP worker i opens the copy
    rank i gathered, on its own GPU. Given only the owner's, every worker opened GPU 0's memory: 1.05 s
    against 0.32 s per sync at 1.5B on 2 H200s (bench/results/sync_tp2_1p5b_h200x2.json).
    """
    if adapter and getattr(model, "engine_has_base", False):  # the engine kept the base: the adapter is new
        sync_adapter(model, engine, dtype)
        if engine is not None:
            engine.flush_cache()
        return
    bucket, size = [], 0
    for name, full in engine_weights(model, dtype, merge=not adapter):
        if engine is None and tp_group is None:
            continue  # it only helps gather
        bucket.append((name, full))
        size += full.numel() * full.element_size()
        if size >= bucket_bytes:
            _send(bucket, engine, tp_group)
            bucket, size = [], 0
    if bucket:
        _send(bucket, engine, tp_group)
    if adapter:  # the base is there: kept from now on (release leaves it), the adapter follows
        model.engine_has_base = True
        if engine is not None:
            engine.kept = {"weights"}
        sync_adapter(model, engine, dtype)
    if engine is not None:
        engine.flush_cache()


def _send(bucket: list, engine, tp_group):
    """One bucket to the engine; with `tp_group`, a CUDA IPC handle (bytes) per TP rank for each tensor."""
    if tp_group is not None:
        handles = [ipc_handle(tensor) for _, tensor in bucket]
        per_rank = [None] * dist.get_world_size(tp_group) if engine is not None else None
        dist.gather_object(handles, per_rank, dst=dist.get_global_rank(tp_group, 0), group=tp_group)
        if engine is not None:  # [(name, LocalSerializedTensor(values=[rank 0's handle, rank 1's, ...]))]
            from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor  # lazy

            bucket = [
                (name, LocalSerializedTensor(values=list(values))) for (name, _), values in zip(bucket, zip(*per_rank))
            ]
    if engine is not None:
        engine.update_weights_from_tensor(bucket, flush_cache=False)
    if tp_group is not None:
        dist.barrier(group=tp_group)  # a rank's tensors stay alive until its TP worker has loaded them


def ipc_handle(tensor: torch.Tensor) -> bytes:
    """A CUDA tensor pickled as SGLang's MultiprocessingSerializer does (an IPC handle, no data), SGLang not imported."""
    return bytes(ForkingPickler.dumps(tensor))


def release(engine, tags):
    """SGLang frees `tags` (its scheduler must be idle: call between generations), but those it keeps
    (`engine.kept`: --lora-sync adapter's base weights, which exist nowhere else on the engine)."""
    tags = [t for t in tags if t not in getattr(engine, "kept", ())]
    if engine is not None and tags:
        engine.release_memory_occupation(tags=tags)
        engine.released = getattr(engine, "released", set()) | set(tags)
    empty_cache()


def resume(engine, tags):
    """Give SGLang `tags` back. Every rank empties its cache first, and the barrier makes sure all
    have, because with tensor parallelism the engine's memory spans the whole group's GPUs."""
    tags = [t for t in tags if t not in getattr(engine, "kept", ())]  # never released (release)
    if engine is not None:
        not_released = set(tags) - getattr(engine, "released", set())
        if not_released:
            raise RuntimeError(
                f"resume of {sorted(not_released)}, which was never released: the memory phases ran out of order"
            )
    empty_cache()
    if dist.is_initialized():
        dist.barrier()
    if engine is not None and tags:
        engine.resume_memory_occupation(tags=list(tags))
        engine.released -= set(tags)


def empty_cache():
    """Return PyTorch's cached, unused blocks to the driver (a no-op on CPU)."""
    synchronize()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize():
    """Wait for the non_blocking copies: their host buffers are not readable before."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def move_optimizer(optimizer, device):
    """Move the optimizer state (Adam's exp_avg and exp_avg_sq: 2x the fp32 params) to `device`.

    GPU -> CPU with non_blocking=True lands in pinned host memory from PyTorch's caching host
    allocator: DMA at full PCIe/NVLink-C2C speed, and from the second step on the pinned buffers
    freed by the last reload are reused instead of allocated again (so host RAM the size of what is
    offloaded stays pinned). A plain .to("cpu") was 7x slower at 1.5B (bench/results/README.md, memory).
    """
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)
    synchronize()


# ----------------------------------------------------------------------------------------------
# Sizing a micro-batch


def activation_bytes(*, layers: int, hidden: int, intermediate: int, checkpointing: bool) -> int:
    """Bytes one token of a micro-batch keeps on the GPU from its forward until its backward: each decoder layer's bf16
    activations, about 10 x hidden + 4 x intermediate values (the norms' inputs, q, k, v, the attention's output, the
    MLP's gate, up, activation and down input); with gradient checkpointing only each layer's input, plus one layer's
    whole set (recomputed in backward). Plus the final hidden state, kept for the log-prob head's recompute. Measured
    at Qwen2.5-1.5B shapes (1 H100, packed, varlen): ~2.4 MiB a token, against 2.7 from this."""
    layer = 2 * (10 * hidden + 4 * intermediate)
    kept = 2 * hidden * layers + layer if checkpointing else layer * layers
    return kept + 4 * hidden


def token_budget(
    *, gpu_bytes: int, state_bytes: float, token_bytes: int, vocab: int, chunk: int, engine_bytes: float
) -> int:
    """Tokens a packed micro-batch may hold on one GPU of `gpu_bytes` (a multiple of 1024, 0 where none fit): what is
    left of the GPU after a tenth of it and 2 GiB (CUDA's context, the allocator's fragments), the engine's share while
    it sleeps (`engine_bytes`: a colocated SGLang engine keeps a few GiB), the training state on this rank
    (`state_bytes`) and the log-prob head's `chunk` tokens of logits ([chunk, vocab]: bf16, the fp32 log-softmax, its
    exp, their gradient: 14 bytes each), over `token_bytes` (activation_bytes) a token."""
    head = 14 * chunk * vocab
    spare = gpu_bytes * 0.9 - 2 * GiB - engine_bytes - state_bytes - head
    return max(int(spare // token_bytes) // 1024 * 1024, 0)


# ----------------------------------------------------------------------------------------------
# Measuring


class MemoryLog:
    """Seconds and GPU memory per named phase.

    For each phase: `allocated` (this process's tensors at the end), `peak` (this process's most
    during the phase), `device_used` (the whole GPU at the end: SGLang's child processes included)
    and `device_peak` (the whole GPU's most during the phase, sampled every `interval` s by a
    background thread; SGLang's memory lives in other processes, so only the device sees it).
    """

    def __init__(self, interval: float = 0.01):
        self.cuda = torch.cuda.is_available()
        self.seconds: dict[str, float] = {}
        self.gib: dict[str, dict[str, float]] = {}
        self.current = "start-up"  # the phase running now, or the last one (for error messages)
        self._device_peak, self._stop = 0, threading.Event()
        if self.cuda:
            self._device = torch.cuda.current_device()
            self._thread = threading.Thread(target=self._sample, args=(interval,), daemon=True)
            self._thread.start()
            # stopped before exit on every path: a thread still inside a CUDA call while CUDA tears
            # down can abort the process ("terminate called without an active exception")
            atexit.register(self.close)

    def _sample(self, interval):
        torch.cuda.set_device(self._device)
        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info()
            self._device_peak = max(self._device_peak, total - free)
            time.sleep(interval)

    @contextmanager
    def phase(self, name: str):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            free, total = torch.cuda.mem_get_info()
            self._device_peak = total - free
        t0 = time.perf_counter()
        self.current = name
        yield
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
        if self.cuda:
            free, total = torch.cuda.mem_get_info()
            self.gib[name] = {
                "allocated": torch.cuda.memory_allocated() / GiB,
                "peak": torch.cuda.max_memory_allocated() / GiB,
                "device_used": (total - free) / GiB,
                "device_peak": max(self._device_peak, total - free) / GiB,
            }

    def metrics(self) -> dict[str, float]:
        out = {f"time/{name}": s for name, s in self.seconds.items()}
        for name, stats in self.gib.items():
            out.update({f"memory/{name}_{k}_gib": v for k, v in stats.items()})
        return out

    def reset(self):
        self.seconds, self.gib = {}, {}

    def close(self):
        self._stop.set()
        if self.cuda and self._thread.is_alive():
            self._thread.join(timeout=1.0)
