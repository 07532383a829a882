"""Sync seconds of a LoRA policy to SGLang on one GPU: merged into the weights vs as an adapter (issue 42).

    source bench/gpu_env.sh && python3 bench/make_random_model.py --shape 1.5b --tokenizer $SMOLLM2 --out /tmp/m15
    python3 bench/lora_sync_bench.py --model /tmp/m15 --rank 8 --out $OUT/lora_sync_1p5b.json

One in-process SGLang engine started with LoRA on (what --lora-sync adapter starts; merge needs no LoRA, and its
weights load the same way: SGLang's LoRA layers keep the base weight under its own name), the FSDP2 LoRA policy
(base bf16, adapter fp32, every linear layer) on the same GPU, both awake throughout (no memory phases), each way
timed `reps` times as memory.sync_weights runs it in grpo.py:
  merge    every weight gathered, the adapted ones as W + alpha/r B A, sent as weights (update_weights_from_tensor)
  adapter  the base once (`first_sync_s`: base + adapter), then the adapter alone (load_lora_adapter_from_tensors),
           the old one unloaded first; every request names it
After each way SGLang samples and the trainer rescores (the mean |log-prob gap|, as grpo.py logs it), with an adapter
made to matter (B random: a fresh adapter's B is 0, and either way would pass with the base); then the adapter
changes and is not synced: the gap must leave its level (lora.GapCheck's test).
"""

import json
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import tyro

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])  # the repo root, for the modules

from fsdp import init_distributed, load_model, shard_model  # noqa: E402
from lora import ALL_LINEAR, adapter_tensors, apply_lora, check_lora, lora_modules  # noqa: E402
from memory import sync_weights  # noqa: E402
from rollout import HFEngine, SGLangOptions, start_sglang, stop_engine, tp_group  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from sync_bench import gap  # noqa: E402  (SGLang samples random prompts, the trainer rescores them)


@dataclass
class Args:
    model: str
    """model folder (bench/make_random_model.py's Qwen2.5 shapes)"""
    rank: int = 8
    """LoRA rank"""
    alpha: float = 32.0
    """LoRA alpha"""
    out: str = "lora_sync.json"
    """where the result is written"""
    reps: int = 5
    """timed syncs each way"""
    sglang_mem_fraction: float = 0.4
    """SGLang's share of the GPU"""
    b_std: float = 2e-3
    """B's random values (std): the adapter's change to the model, large enough to show in the log-probs"""
    engine: str = "sglang"
    """'hf': the HF engine on the CPU, a dry run of this script (its seconds mean nothing)"""


@torch.no_grad()
def main(args: Args):
    rank, world, device = init_distributed()
    assert world == 1, "one GPU: python bench/lora_sync_bench.py"
    targets = check_lora(args.model, args.rank, (ALL_LINEAR,), sglang=True)
    tp = tp_group(1)
    t0 = time.perf_counter()
    options = SGLangOptions(
        mem_fraction=args.sglang_mem_fraction, disable_cuda_graph=True, lora_rank=args.rank, lora_targets=tuple(targets)
    )
    engine = start_sglang(args.model, gpu_id=0, options=options) if args.engine == "sglang" else HFEngine(args.model)
    engine_start_s = time.perf_counter() - t0
    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    policy = load_model(args.model, device, torch.bfloat16)
    apply_lora(policy, args.rank, args.alpha, targets)
    for _, m in lora_modules(policy):
        m.lora_B.normal_(0, args.b_std)
    shard_model(policy, param_dtype=torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    n_params = sum(p.numel() for p in policy.parameters())
    n_adapter = sum(v.numel() for v in adapter_tensors(policy, torch.bfloat16).values())

    def timed(adapter: bool) -> float:
        torch.cuda.synchronize() if cuda else None
        t0 = time.perf_counter()
        sync_weights(policy, engine, adapter=adapter, dtype=torch.bfloat16 if cuda else torch.float32)
        torch.cuda.synchronize() if cuda else None
        return time.perf_counter() - t0

    result = {
        "model": args.model,
        "params": n_params,
        "adapter_params": n_adapter,
        "rank": args.rank,
        "alpha": args.alpha,
        "targets": targets,
        "gpu": torch.cuda.get_device_name() if cuda else "cpu (a dry run)",
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "engine_start_s": engine_start_s,
        "sync_s": {},
        "sync_s_all": {},
        "gap": {},
    }
    # merge: every weight, the adapted ones merged as they are gathered
    times = [timed(adapter=False) for _ in range(args.reps + 1)]  # the first opens SGLang's side for the first time
    result["first_sync_s"] = {"merge": times[0]}
    result["sync_s"]["merge"], result["sync_s_all"]["merge"] = statistics.median(times[1:]), times
    result["gap"]["merge"] = gap(engine, policy, tp, device, seed=1)
    # adapter: the base once (the engine's weights are the merged ones now), then the adapter alone
    policy.engine_has_base = False
    result["first_sync_s"]["adapter"] = timed(adapter=True)  # base + adapter
    times = [timed(adapter=True) for _ in range(args.reps)]
    result["sync_s"]["adapter"], result["sync_s_all"]["adapter"] = statistics.median(times), times
    result["gap"]["adapter"] = gap(engine, policy, tp, device, seed=2)
    for _, m in lora_modules(policy):  # the trainer moves on, the engine is not told: the check must see it
        m.lora_B.add_(torch.randn_like(m.lora_B) * 4 * args.b_std)
    result["gap"]["adapter_stale"] = gap(engine, policy, tp, device, seed=3)
    result["merge_over_adapter"] = result["sync_s"]["merge"] / result["sync_s"]["adapter"]
    print(json.dumps(result, indent=2))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    stop_engine(engine, None)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(tyro.cli(Args))
