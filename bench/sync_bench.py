"""Weight-sync seconds with --rollout-tp: SGLang's TP workers given the owner's tensors vs each rank's own.

    source bench/gpu_env.sh && python3 bench/make_random_model.py --shape 1.5b --tokenizer $SMOLLM2 --out /tmp/m15
    torchrun --nproc_per_node 2 bench/sync_bench.py --model /tmp/m15 --out $OUT/sync_tp2.json

One in-process SGLang engine over both GPUs (tp 2, owned by rank 0), the FSDP2 model sharded over
both ranks, and memory.sync_weights timed `reps` times each way, alternating, in one process
(`python bench/sync_bench.py` on one GPU: tp 1, a TP group of one, both ways on the same GPU):
  owner   every TP worker opens the owner's full tensors (GPU 0) and copies its part over (before)
  each    TP worker i opens rank i's own gathered copy, on its own GPU (sync_weights' tp_group)
`sglang_update_s`: the part of a sync inside SGLang's update calls (its TP workers opening and loading
the tensors); the rest is ours (all-gathers, handles, barriers). Both ways must leave the engine with
the trainer's weights: after each, SGLang samples and the FSDP2 model rescores (mean |log-prob gap|,
small); with the training weights moved and not synced it is large.
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

from data import collate  # noqa: E402
from fsdp import init_distributed, load_model, shard_model  # noqa: E402
from logprobs import token_logprobs
from memory import sync_weights  # noqa: E402
from rollout import Sampling, SGLangOptions, generate, mismatch_stats, start_sglang, stop_engine, tp_group  # noqa: E402


@dataclass
class Args:
    model: str
    """model folder (TP 2 needs head counts that 2 divides: Qwen2.5 shapes, not SmolLM2-135M)"""
    out: str = "sync_tp.json"
    """where rank 0 writes the result"""
    reps: int = 5
    """timed syncs each way"""
    sglang_mem_fraction: float = 0.4
    """SGLang's share of each GPU"""


def gap(engine, policy, tp, device, seed: int) -> float:
    """SGLang samples 16 random prompts per rank at T=1; the FSDP2 model rescores those tokens."""
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    prompts = torch.randint(100, 10000, (16, 32), generator=g).tolist()
    sampling = Sampling(max_new_tokens=32, stop_ids=[0], temperature=1.0)
    samples = generate(
        engine, prompts, [seed * 100 + dist.get_rank() * 16 + i for i in range(16)], sampling=sampling, tp=tp
    )
    batch = collate(samples, pad_id=0)
    batch.old_logprobs, _ = token_logprobs(policy, batch.input_ids.to(device), batch.attention_mask.to(device), 1.0)
    batch.old_logprobs = batch.old_logprobs.cpu()
    return mismatch_stats(batch)["rollout/logprob_abs_diff"]


@torch.no_grad()
def main(args: Args):
    rank, world, device = init_distributed()
    tp = tp_group(world)
    group = tp.process_group or dist.new_group([0])  # one GPU: a group of one, to run the per-rank path there too
    engine = None
    if rank == tp.owner:
        engine = start_sglang(
            args.model,
            gpu_id=0,
            options=SGLangOptions(mem_fraction=args.sglang_mem_fraction, tp_size=world, disable_cuda_graph=True),
        )
    dist.barrier()
    policy = load_model(args.model, device, torch.float32)
    shard_model(policy, param_dtype=torch.bfloat16)
    n_params = sum(p.numel() for p in policy.parameters())

    inside = {"owner": [], "each": []}  # per timed sync: seconds in SGLang's update calls (its workers open and load)
    if engine is not None:
        update = engine.update_weights_from_tensor

        def counted(*args, **kwargs):
            t0 = time.perf_counter()
            out = update(*args, **kwargs)
            counted.seconds += time.perf_counter() - t0
            return out

        engine.update_weights_from_tensor = counted

    def timed(mode: str) -> float:
        torch.cuda.synchronize()
        dist.barrier()
        if engine is not None:
            counted.seconds = 0.0
        t0 = time.perf_counter()
        sync_weights(policy, engine, tp_group=group if mode == "each" else None)
        dist.barrier()
        if engine is not None:
            inside[mode].append(counted.seconds)
        return time.perf_counter() - t0

    result = {
        "model": args.model,
        "params": n_params,
        "tp": world,
        "gpu": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "first_sync_s": {},
        "sync_s": {},
        "gap": {},
    }
    for mode in ("owner", "each"):  # first calls (handles opened for the first time), then a check of each
        result["first_sync_s"][mode] = timed(mode)
        result["gap"][mode] = gap(engine, policy, tp, device, seed=len(result["gap"]))
    for p in policy.parameters():  # the trainer moves on, the engine is not told: the check must see it
        p.mul_(1.1)
    result["gap"]["stale"] = gap(engine, policy, tp, device, seed=7)
    times = {"owner": [], "each": []}
    for _ in range(args.reps):
        for mode in times:
            times[mode].append(timed(mode))
    result["gap"]["each_after_reps"] = gap(engine, policy, tp, device, seed=8)
    result["sync_s"] = {mode: statistics.median(t) for mode, t in times.items()}
    result["sync_s_all"] = times
    result["owner_over_each"] = result["sync_s"]["owner"] / result["sync_s"]["each"]
    # where a sync's time goes: SGLang's side (update calls) and ours (gathers, handles, barriers, cache flush)
    result["sglang_update_s"] = {mode: statistics.median(t[-args.reps :]) for mode, t in inside.items() if t}
    if rank == 0:
        print(json.dumps(result, indent=2))
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    stop_engine(engine, None)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(tyro.cli(Args))
