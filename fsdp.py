"""Training on N GPUs: torch.distributed set-up, FSDP2 models, the log-prob forward, metric reduction
and rank-0 logging.

    rank, world_size, device = init_distributed()         # torchrun, or plain `python` (world 1)
    model = load_model(path, device, dtype=torch.float32, gradient_checkpointing=True)
    shard_model(model, param_dtype=torch.bfloat16)        # FSDP2: each decoder layer, then the root
    logp, entropy = token_logprobs(model, ids, mask, temperature=1.0, with_entropy=True)   # [B, T-1]
    old_logp = batch_logprobs(model, batch, micro_batch_size=8, temperature=1.0, device=device)
"""

import datetime
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

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
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group(backend, timeout=timeout, device_id=device if use_cuda else None)
    else:  # plain python: a one-process group, no port needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout,
                                device_id=device if use_cuda else None)
    return dist.get_rank(), dist.get_world_size(), device


def print0(*args, **kwargs):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def all_reduce(x: float | torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce a number or tensor over ranks (a CPU-GPU sync point on NCCL)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.as_tensor(x, dtype=torch.float64, device=device).clone()
    dist.all_reduce(t, op=op)
    return t.cpu()


# ----------------------------------------------------------------------------------------------
# Models


def load_model(path: str, device: torch.device, dtype: torch.dtype, gradient_checkpointing: bool = False,
               attn_implementation: str = "sdpa", model_class=None, **kwargs):
    """A Hugging Face model from a hub id or local folder, on the CPU in `dtype`.

    PLUMBING: every rank reads the whole checkpoint into CPU memory, then `shard_model` moves its
    shard to the GPU. Simple and fine to ~14B on one node; beyond that, build on the meta device
    and broadcast rank 0's weights instead.
    """
    from transformers import AutoModelForCausalLM  # lazy: keeps `import fsdp` light for notebooks

    model_class = model_class or AutoModelForCausalLM
    try:
        model = model_class.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation, **kwargs)
    except OSError as e:
        raise OSError(f"could not load model {path!r}: {e}\nPass a hub id (e.g. Qwen/Qwen2.5-0.5B-Instruct) "
                      f"or a local folder with config.json and weights.") from None
    model.config.use_cache = False  # training forwards never use the KV cache
    for module in model.modules():
        # Dropout off: the old log-probs, the values and the update must see the same function
        # (token-classification heads, used as critics, come with dropout 0.1).
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if gradient_checkpointing:
        # Non-reentrant checkpointing composes with FSDP2: each layer's activations are recomputed
        # in backward, trading ~30% more compute for activations of one layer instead of all.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def shard_model(model, param_dtype: torch.dtype | None = torch.bfloat16):
    """FSDP2: shard each decoder layer, then the root (embeddings, final norm, head).

    With param_dtype=bf16 the fp32 master shards are all-gathered as bf16 for compute and
    gradients are reduce-scattered in fp32 (reduce_dtype), as in torchtitan. param_dtype=None
    computes in the stored dtype (the frozen bf16 reference model). Parameters land on the GPU.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class in _no_split_modules; "
                         f"cannot shard it layer by layer")
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float,
                   with_entropy: bool = False, entropy_grad: bool = False):
    """Log-prob of each next token under `model` at sampling temperature `temperature`.

    Returns logp [B, T-1] (logp[:, t] scores input_ids[:, t+1]) and, if asked, the entropy of the
    next-token distribution [B, T-1]: a metric without gradient, unless `entropy_grad` (an entropy
    bonus; it keeps a [B, T, V] graph alive). Dividing by the temperature matters: SGLang reports
    log-probs of the distribution it sampled from, softmax(logits / T).
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # [B, T, V]
    # fp32 for the softmax: bf16 log-probs are off by ~1e-2, enough to skew the PPO ratio.
    logits = logits[:, :-1].float() / temperature                        # [B, T-1, V]
    target = logits.gather(-1, input_ids[:, 1:, None]).squeeze(-1)      # [B, T-1]
    logsumexp = torch.logsumexp(logits, dim=-1)                          # [B, T-1]
    logp = target - logsumexp
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            probs = torch.softmax(logits, dim=-1)
            entropy = logsumexp - (probs * logits).sum(-1)                # [B, T-1]
    return logp, entropy


def micro_batches(n: int, size: int) -> list[torch.Tensor]:
    """Row indices [0, n) cut into chunks of `size` (the last may be smaller)."""
    return list(torch.arange(n).split(size))


def token_values(critic, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The critic's value of each state: values[:, t] is read at token t, before input_ids[:, t+1]
    is chosen, so it lines up with token_logprobs. [B, T-1], fp32."""
    out = critic(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # [B, T, 1]
    return out[:, :-1, 0].float()


@torch.no_grad()
def batch_logprobs(model, batch, micro_batch_size: int, temperature: float, device, progress=iter) -> torch.Tensor:
    """token_logprobs over a whole Batch, micro-batch by micro-batch, without gradient. [B, T-1] on CPU."""
    return _batch_forward(lambda mb: token_logprobs(model, mb.input_ids, mb.attention_mask, temperature)[0],
                          batch, micro_batch_size, device, progress)


@torch.no_grad()
def batch_values(critic, batch, micro_batch_size: int, device, progress=iter) -> torch.Tensor:
    """token_values over a whole Batch, without gradient. [B, T-1] on CPU."""
    return _batch_forward(lambda mb: token_values(critic, mb.input_ids, mb.attention_mask),
                          batch, micro_batch_size, device, progress)


def _batch_forward(fn, batch, micro_batch_size, device, progress):
    out = torch.zeros_like(batch.response_mask)
    for idx in progress(micro_batches(len(batch), micro_batch_size)):
        mb = batch.select(idx).to(device)
        out[idx, :mb.input_ids.shape[1] - 1] = fn(mb).cpu()
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


# ----------------------------------------------------------------------------------------------
# Logging (rank 0)


class RunLog:
    """A run's folder on rank 0: args.json, run_info.json, metrics.jsonl, samples.jsonl (+ wandb with `track`).

    On resume from step N, rows of steps after N are dropped from metrics.jsonl and samples.jsonl
    (they are redone), and so is the eval row of step N if the run evaluates it again (`eval_redone`).
    A line cut short by a kill is dropped too.
    """

    def __init__(self, run_dir: str, config: dict, start_step: int, track: bool, project: str, run_name: str,
                 info: dict, eval_redone: bool = False):
        self.rank0, self.path, self.wandb = dist.get_rank() == 0, os.path.join(run_dir, "metrics.jsonl"), None
        if not self.rank0:
            return
        os.makedirs(run_dir, exist_ok=True)
        for name, content in (("args.json", config), ("run_info.json", info)):
            with open(os.path.join(run_dir, name), "w") as f:
                json.dump(content, f, indent=2)
        def redone(row: dict) -> bool:
            return row["step"] > start_step or (row["step"] == start_step and eval_redone
                                                and any(k.startswith("eval/") for k in row))

        for path in (self.path, os.path.join(run_dir, "samples.jsonl")):
            if os.path.exists(path):
                with open(path) as f:
                    kept = [line for line in f if (row := parse_row(line)) is not None and not redone(row)]
                with open(path, "w") as f:
                    f.writelines(kept)
        if track:
            import wandb  # lazy: only with --track

            self.wandb = wandb.init(project=project, name=run_name, config=config)

    def log(self, row: dict):
        if self.rank0:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
            if self.wandb is not None:
                self.wandb.log(row, step=int(row["step"]))

    def samples(self, step: int, samples, n: int = 4):
        """A few completions as text: printed, appended to samples.jsonl, and a wandb table."""
        rows = [{"step": step, "reward": s.reward, "answer": s.answer, "completion": s.text} for s in samples[:n]]
        for r in rows[:2]:
            print0(f"  sample (reward {r['reward']:.2f}, answer {r['answer']}): {r['completion'][:300]!r}")
        if self.rank0:
            with open(self.path.replace("metrics.jsonl", "samples.jsonl"), "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
            if self.wandb is not None:
                import wandb

                table = wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])
                self.wandb.log({"samples": table}, step=step)

    def finish(self):
        if self.wandb is not None:
            self.wandb.finish()


def parse_row(line: str) -> dict | None:
    """A metrics/samples row, or None for a line a kill cut short."""
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def launch_time() -> float:
    """time.time() at which this process started (Linux; elsewhere: now), so start-up times include
    the seconds spent importing torch, transformers and the rest before main() runs."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def run_info(world_size: int, engine: str) -> dict:
    """What ran where: for reports."""
    cuda = torch.cuda.is_available()
    return {"command": " ".join(sys.argv), "world_size": world_size, "engine": engine,
            "gpu": torch.cuda.get_device_name() if cuda else "cpu",
            "gpu_total_gib": torch.cuda.mem_get_info()[1] / 2**30 if cuda else None,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}


def log_line(step: int, metrics: dict, keys: list[tuple[str, str, str]]) -> str:
    """One console line: 'step 12 | reward 0.41 | acc 0.33 | ...' from (label, metric key, format)."""
    parts = [f"step {step}"] + [f"{label} {format(metrics[key], fmt)}" for label, key, fmt in keys if key in metrics]
    return " | ".join(parts)
