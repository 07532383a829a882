"""After a weight sync, SGLang's log-probs of its sampled tokens must match the FSDP2 model's.

    python tests/gpu_logprob_check.py --model $SMOLLM2 --out result.json
    python tests/gpu_logprob_check.py --model $SMOLLM2 --rollout-engine launched   # an SGLang server (--rollout-gpus's)

Four measurements of the mean absolute difference over response tokens:
  synced:        sync, sample, rescore with the training model                  -> small (bf16 numerics)
  stale:         the training weights change, the engine is not synced          -> large
  synced_twice:  release, wake up and sync the changed weights (step 2)         -> small
  garbage:       one tensor of the sync is noise                                -> large
and sync_s, the seconds of step 2's weight sync. tests/test_gpu.py runs this and asserts on the JSON it writes.
'launched': server.launch_servers starts SGLang's launcher on GPU 1, weights over NCCL (with one GPU:
beside the trainer on GPU 0, weights over gloo), as --rollout-gpus does.
"""

import json
import os
import sys
import time
from dataclasses import dataclass

import torch
import tyro

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])  # the repo root, for the modules

from data import addition_task, collate, tokenize_prompts  # noqa: E402
from fsdp import init_distributed, load_model, shard_model  # noqa: E402
from logprobs import token_logprobs
from memory import ALL_TAGS, MemoryLog, release, sleep, wake_up  # noqa: E402
from rollout import (
    HFEngine,
    Sampling,
    SGLangOptions,
    generate,
    mismatch_stats,
    start_sglang,
    stop_engine,
    stop_token_ids,
)  # noqa: E402
from server import ServerEngine, launch_servers  # noqa: E402


@dataclass
class Args:
    model: str
    """model folder or hub id"""
    out: str = "logprob_check.json"
    """where to write the measurements"""
    num_eval_prompts: int = 64
    """prompts sampled per measurement"""
    max_new_tokens: int = 64
    """tokens per response"""
    sglang_mem_fraction: float = 0.5
    """SGLang memory fraction"""
    rollout_engine: str = "sglang"
    """'sglang' (in this process), 'launched' (an SGLang server), or 'hf' to check the logic on a CPU"""


DEVICE = torch.device("cpu")


def mean_abs_diff(engine, policy, prompts, stop_ids, args, seed) -> float:
    """Sample at T=1 with SGLang, rescore the same tokens with the training model."""
    sampling = Sampling(max_new_tokens=args.max_new_tokens, stop_ids=stop_ids, temperature=1.0)
    samples = generate(engine, prompts, [seed + i for i in range(len(prompts))], sampling=sampling)
    batch = collate(samples, pad_id=stop_ids[0])
    with torch.no_grad():
        logp, _ = token_logprobs(policy, batch.input_ids.to(DEVICE), batch.attention_mask.to(DEVICE), 1.0)
    batch.old_logprobs = logp.cpu()
    return mismatch_stats(batch)["rollout/logprob_abs_diff"]


def main(args: Args):
    global DEVICE
    _, _, DEVICE = init_distributed()
    backend = None  # of the weight sync to a launched server
    if args.rollout_engine == "sglang":
        engine = start_sglang(
            args.model, gpu_id=0, options=SGLangOptions(mem_fraction=args.sglang_mem_fraction, disable_cuda_graph=True)
        )
    elif args.rollout_engine == "launched":
        two = torch.cuda.device_count() >= 2
        backend = "nccl" if two else "gloo"
        urls, processes = launch_servers(
            args.model,
            gpus=[1 if two else 0],
            tp_size=1,
            seed=0,
            mem_fraction=None if two else args.sglang_mem_fraction,
            options=SGLangOptions(disable_cuda_graph=True),
            log_dir=os.path.dirname(os.path.abspath(args.out)),
        )
        engine = ServerEngine(urls, processes=processes, timeout_s=300, model=args.model, sync_backend=backend)
    else:
        engine = HFEngine(args.model)
    release(engine, ALL_TAGS)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    stop_ids = stop_token_ids(tokenizer, args.model)
    policy = load_model(args.model, DEVICE, torch.float32)
    shard_model(policy)
    _, test = addition_task(seed=0)
    prompts, _, _ = tokenize_prompts(tokenizer, test[: args.num_eval_prompts], 256)
    log = MemoryLog()
    result = {}

    phases = dict(models=[policy], optimizers=[], offload=False, mem=log)
    wake_up(engine, policy=policy, **phases)
    result["synced"] = mean_abs_diff(engine, policy, prompts, stop_ids, args, 0)

    # stale: the training model moves (as an update would), the awake engine keeps the old weights
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "mlp" in name:
                p.mul_(1.1)
    result["stale"] = mean_abs_diff(engine, policy, prompts, stop_ids, args, 1000)

    # step 2: release everything, wake up again with a sync of the moved weights
    sleep(engine, device=DEVICE, **phases)
    t0 = time.time()
    wake_up(engine, policy=policy, **phases)  # returns once the engine holds the weights
    result["sync_s"] = time.time() - t0
    result["synced_twice"] = mean_abs_diff(engine, policy, prompts, stop_ids, args, 2000)

    # garbage: one tensor of the sync is noise (what a wrong name mapping or wrong shard would do)
    name, p = next((n, p) for n, p in policy.named_parameters() if "layers.1.mlp.down_proj" in n)
    engine.update_weights_from_tensor([(name, torch.randn(p.shape, dtype=torch.bfloat16, device=DEVICE))])
    engine.flush_cache()
    result["garbage"] = mean_abs_diff(engine, policy, prompts, stop_ids, args, 3000)

    result.update(
        {
            "model": args.model,
            "num_prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens,
            "device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu",
            "engine": args.rollout_engine,
            "sync_backend": backend,
        }
    )
    print(json.dumps(result, indent=2))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    log.close()
    stop_engine(engine, None)


if __name__ == "__main__":
    main(tyro.cli(Args))
