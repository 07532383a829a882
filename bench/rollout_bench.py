"""Rollout efficiency and weight-sync time: our rollout phase vs SGLang's raw Engine.generate.

    source bench/gpu_env.sh && python bench/rollout_bench.py --model $SMOLLM2 --out $OUT/rollout_smollm2.json

One process, one engine, one FSDP2 policy, as in grpo.py. Each repetition, side by side:
  raw          engine.generate(input_ids, sampling_params) on an awake engine: SGLang alone
  raw+logprob  the same with return_logprob=True (what RL needs)
  ours         the rollout phase of a GRPO step: wake_up (resume weights, sync, resume KV cache),
               rollout.generate (token ids + log-probs -> Samples), sleep (release all)
  server       with --server: rollout.generate of the same batch through an SGLang server on the same GPU
               (sglang.launch_server as --rollout-gpus starts it, the checkpoint's weights, the same CUDA graphs),
               over HTTP: the server against the in-process engine's generate, one GPU, one batch
All three use the same prompts, sampling settings and per-sample seeds. Responses still differ
between calls (bf16 kernels give batch-dependent numerics, and one changed token changes the rest:
`identical_responses_ours_vs_raw` says how many matched), so the comparison is tokens per second
(new tokens / wall seconds) over equally distributed samples, median of `reps` interleaved runs.
"""

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace

import torch
import tyro

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from data import load_task, tokenize_prompts  # noqa: E402
from fsdp import init_distributed, load_model, shard_model  # noqa: E402
from memory import ALL_TAGS, MemoryLog, release, sleep, wake_up  # noqa: E402
from rollout import HFEngine, Sampling, SGLangOptions, generate, start_sglang, stop_engine, stop_token_ids  # noqa: E402
from server import ServerEngine, launch_servers  # noqa: E402


@dataclass
class Args:
    model: str
    """model folder (SmolLM2, or a random-weight folder from bench/make_random_model.py)"""
    out: str
    """JSON file to write"""
    prompts_per_step: int = 32
    """distinct prompts of the built-in addition task"""
    group_size: int = 16
    """samples per prompt (prompts_per_step x group_size requests in one generate call)"""
    max_new_tokens: int = 512
    """length limit of each response"""
    temperature: float = 1.0
    """sampling temperature"""
    top_p: float = 1.0
    """nucleus sampling"""
    reps: int = 3
    """timed repetitions of each mode (after one untimed warm-up of each)"""
    sglang_mem_fraction: float = 0.6
    """SGLang memory fraction"""
    cuda_graph_max_bs: int | None = None
    """largest decode batch captured as a CUDA graph; None: SGLang's default"""
    prefill_cuda_graph: bool = False
    """SGLang's default piecewise prefill graphs (grpo.py's default: off)"""
    rollout_engine: str = "sglang"
    """'sglang', or 'hf' to check this script on a CPU"""
    log_level: str = "error"
    """SGLang's log level ('info' prints its start-up stages with timestamps)"""
    server: bool = False
    """also time the batch through an SGLang server on this GPU (its own --sglang-mem-fraction share)"""


def main(args: Args):
    t_launch = time.time()
    _, _, device = init_distributed()
    t0 = time.time()
    options = SGLangOptions(
        mem_fraction=args.sglang_mem_fraction,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        prefill_cuda_graph=args.prefill_cuda_graph,
        log_level=args.log_level,
    )
    engine = (
        start_sglang(args.model, gpu_id=0, options=options) if args.rollout_engine == "sglang" else HFEngine(args.model)
    )
    release(engine, ALL_TAGS)
    engine_s = time.time() - t0
    server = None
    if args.server:  # started while the engine's memory is released: each takes its share of the whole GPU
        urls, processes = launch_servers(
            args.model,
            gpus=[0],
            tp_size=1,
            seed=0,
            options=replace(options, load_format="auto"),
            log_dir=os.path.dirname(os.path.abspath(args.out)),
            mem_fraction=args.sglang_mem_fraction,
        )
        server = ServerEngine(urls, timeout_s=600, processes=processes, batch=args.prompts_per_step * args.group_size)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    stop_ids = stop_token_ids(tokenizer, args.model)
    t0 = time.time()
    policy = shard_model(load_model(args.model, device, torch.float32))
    model_s = time.time() - t0
    n_params = sum(p.numel() for p in policy.parameters())
    examples, _, _ = load_task("addition", None, seed=0, num_eval=0)
    prompts, examples, _ = tokenize_prompts(tokenizer, examples[: args.prompts_per_step], 256)
    ids = [p for p in prompts for _ in range(args.group_size)]  # [B] lists of token ids
    seeds = list(range(len(ids)))
    sampling = Sampling(
        max_new_tokens=args.max_new_tokens, stop_ids=stop_ids, temperature=args.temperature, top_p=args.top_p
    )
    params = [sampling.params(s) for s in seeds]
    mem = MemoryLog()
    phases = dict(models=[policy], optimizers=[], offload=False, mem=mem)

    def raw(logprob: bool):
        t = time.perf_counter()
        out = engine.generate(input_ids=ids, sampling_params=params, return_logprob=logprob)
        return time.perf_counter() - t, [o["output_ids"] for o in out]

    def ours():
        mem.reset()
        t = time.perf_counter()
        wake_up(engine, policy=policy, **phases)
        with mem.phase("generate"):
            samples = generate(engine, ids, seeds, sampling=sampling, tokenizer=tokenizer)
        sleep(engine, device=device, **phases)
        return time.perf_counter() - t, [s.response_ids for s in samples], mem.metrics()

    def through_server():
        t = time.perf_counter()
        samples = generate(server, ids, seeds, sampling=sampling, tokenizer=tokenizer)
        return time.perf_counter() - t, [s.response_ids for s in samples]

    results = {"raw": [], "raw_logprob": [], "ours": [], "ours_generate": [], "sync_s": [], "identical": []}
    results |= {"server": []} if server else {}
    for rep in range(args.reps + 1):  # rep 0 warms every path up and is not counted
        s_ours, tok_ours, m = ours()
        wake_up(engine, policy=policy, **phases)  # awake, synced: the raw engine's state
        s_raw, tok_raw = raw(False)
        s_lp, tok_lp = raw(True)
        sleep(engine, device=device, **phases)
        s_srv, tok_srv = through_server() if server else (None, None)
        n = sum(map(len, tok_ours))
        row = {
            "raw": sum(map(len, tok_raw)) / s_raw,
            "raw_logprob": sum(map(len, tok_lp)) / s_lp,
            "ours": n / s_ours,
            "ours_generate": n / m["time/generate"],
            "sync_s": m["time/sync_weights"],
            "identical": sum(a == b for a, b in zip(tok_ours, tok_raw)) / len(ids),
        }
        row |= {"server": sum(map(len, tok_srv)) / s_srv} if server else {}
        print(
            f"rep {rep}: ours {row['ours']:.0f} tok/s ({s_ours:.2f} s, generate {m['time/generate']:.2f} s, "
            f"sync {row['sync_s']:.3f} s) | raw {row['raw']:.0f} tok/s | raw+logprob {row['raw_logprob']:.0f} tok/s | "
            f"identical responses {row['identical']:.2f}"
            + (f" | server {row['server']:.0f} tok/s ({s_srv:.2f} s)" if server else ""),
            flush=True,
        )
        if rep == 0:
            continue
        for k, v in row.items():
            results[k].append(v)
        response_len_mean = n / len(ids)
    mem.close()
    stop_engine(engine, None)
    if server:
        server.shutdown()
        stop_engine(server, None)
    med = {k: statistics.median(v) for k, v in results.items()}
    summary = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "model": os.path.basename(args.model.rstrip("/")),
        "params": n_params,
        "requests": len(ids),
        "max_new_tokens": args.max_new_tokens,
        "response_len_mean": response_len_mean,
        "reps": args.reps,
        "raw_tokens_per_s": med["raw"],
        "raw_logprob_tokens_per_s": med["raw_logprob"],
        "ours_tokens_per_s": med["ours"],
        "ours_generate_only_tokens_per_s": med["ours_generate"],
        "rollout_efficiency": med["ours"] / med["raw"],
        "rollout_efficiency_vs_raw_logprob": med["ours"] / med["raw_logprob"],
        "sync_s": med["sync_s"],
        "identical_responses_ours_vs_raw": statistics.mean(results["identical"]),
        **(
            {
                "server_tokens_per_s": med["server"],
                "server_over_in_process_generate": med["server"] / med["ours_generate"],
            }
            if server
            else {}
        ),
        "engine_start_s": engine_s,
        "model_load_and_shard_s": model_s,
        "script_s": time.time() - t_launch,
        "engine_settings": {
            "mem_fraction": args.sglang_mem_fraction,
            "cuda_graph_max_bs": args.cuda_graph_max_bs,
            "prefill_cuda_graph": args.prefill_cuda_graph,
            "attention_backend": "triton",
            "sampling_backend": "pytorch",
        },
        "all_reps": results,
        "command": "python " + " ".join(sys.argv),
    }
    print(json.dumps(summary, indent=1))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":  # SGLang spawns its scheduler: keep this guard
    main(tyro.cli(Args))
