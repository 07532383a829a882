"""Time the training-side forward/backward of grpo.py on one GPU, to find where the step goes.

    python bench/profile_train.py --model $SMOLLM2

Times token_logprobs (no grad) and forward+backward over a fixed random batch for several
micro-batch sizes, with and without MemoryLog's background memory sampler, then prints the
top CUDA/CPU ops of one profiled forward+backward.
"""

import sys
import time
from dataclasses import dataclass

import torch
import tyro

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from fsdp import init_distributed, load_model, shard_model  # noqa: E402
from logprobs import token_logprobs
from memory import MemoryLog  # noqa: E402


@dataclass
class Args:
    model: str
    """model folder"""
    num_seqs: int = 512
    """sequences in the batch"""
    seq_len: int = 200
    """tokens per sequence"""
    micro_batch_sizes: tuple[int, ...] = (32, 128)
    """micro-batch sizes to time"""


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(args: Args):
    _, _, device = init_distributed()
    model = load_model(args.model, device, torch.float32)
    shard_model(model)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.num_seqs, args.seq_len), device=device)
    mask = torch.ones_like(ids)

    def logprob_pass(mbs):
        with torch.no_grad():
            for i in range(0, args.num_seqs, mbs):
                token_logprobs(model, ids[i : i + mbs], mask[i : i + mbs], 1.0)[0].cpu()

    def update_pass(mbs):
        for i in range(0, args.num_seqs, mbs):
            logp, ent = token_logprobs(model, ids[i : i + mbs], mask[i : i + mbs], 1.0, with_entropy=True)
            logp.mean().backward()
        model.zero_grad(set_to_none=True)

    for sampler in (False, True):
        log = MemoryLog() if sampler else None
        for mbs in args.micro_batch_sizes:
            logprob_pass(mbs)  # warm-up
            update_pass(mbs)
            t_lp, t_up = timed(lambda: logprob_pass(mbs)), timed(lambda: update_pass(mbs))
            tokens = args.num_seqs * args.seq_len
            print(
                f"sampler={sampler} micro_batch={mbs}: logprob {t_lp:.2f}s ({tokens / t_lp:.0f} tok/s) | "
                f"fwd+bwd {t_up:.2f}s ({tokens / t_up:.0f} tok/s)",
                flush=True,
            )
        if log:
            log.close()

    # the same passes on a plain bf16 model (no FSDP2): the floor FSDP2's overhead is measured against
    plain = load_model(args.model, device, torch.bfloat16).to(device)
    fsdp_model, model = model, plain
    for mbs in args.micro_batch_sizes:
        logprob_pass(mbs)
        update_pass(mbs)
        t_lp, t_up = timed(lambda: logprob_pass(mbs)), timed(lambda: update_pass(mbs))
        print(f"plain bf16 (no FSDP2) micro_batch={mbs}: logprob {t_lp:.2f}s | fwd+bwd {t_up:.2f}s", flush=True)
    model = fsdp_model

    mbs = args.micro_batch_sizes[-1]
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        update_pass(mbs)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main(tyro.cli(Args))
