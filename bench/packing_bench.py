"""Padded vs packed micro-batches: seconds of the log-prob and update phases at the same samples per step.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        python bench/packing_bench.py --model 1.5b --out bench/results/packing_1.5b_h100.json  # Qwen2.5-1.5B shapes
    python bench/packing_bench.py --model /tmp/tiny-model --device cpu --steps 1 --samples 8 \
        --runs padded/sdpa packed/sdpa                                                        # CPU smoke check

Every step holds the same `samples` sequences: `prompt_len` prompt tokens plus a response of a length drawn
uniformly from [min_len, max_len] (seeded), random ids. The log-prob phase is logprobs.batch_logprobs (no
gradient); the update phase is token_logprobs with entropy, a token-mean loss, backward and one AdamW
step, as grpo.py runs them. Each run loads the model afresh (FSDP2, bf16 compute): `padded/ATTN` takes
--micro-batch-size rows per micro-batch (today's path), `packed/ATTN` at most --max-tokens tokens per
micro-batch with no padding. The first `warmup` steps are not timed (flex_attention compiles there; it has
no backward on a CPU).
A model of 0.5b / 1.5b / 7b is random weights of that Qwen2.5 shape (make_random_model.SHAPES).
"""

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import tyro

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
import logprobs  # noqa: E402
from data import Sample, collate  # noqa: E402
from common import to_device  # noqa: E402
from preflight import friendly_errors  # noqa: E402
from fsdp import init_distributed, load_model, matmul_params, mfu, micro_batches, peak_flops, shard_model
from logprobs import batch_logprobs, token_logprobs
from make_random_model import SHAPES  # noqa: E402  (bench/ is on sys.path: this file's folder)


@dataclass
class Args:
    model: str
    """a model folder or hub id, or 0.5b / 1.5b / 7b: random weights of that Qwen2.5 shape"""
    runs: tuple[str, ...] = ("padded/sdpa", "packed/sdpa", "packed/flex_attention")
    """padded|packed / the transformers attention implementation [/ tokens per packed micro-batch, else --max-tokens]
    [/ compile: torch.compile each decoder layer and the log-prob math] [/ eagerhead: that math not compiled]
    [/ whole: the head's logits all at once, not logprobs.LOGIT_CHUNK tokens] [/ waits: the micro-batches copied as
    before issue 55, blocking, the mask on the GPU: the CPU waits for the GPU each micro-batch] [/ direct: copied
    non-blocking from ordinary memory, not through common.to_device's pinned buffers, the mask on the CPU]"""
    samples: int = 256
    """sequences per step (the same in every run)"""
    prompt_len: int = 100
    """prompt tokens of each sequence"""
    min_len: int = 50
    """shortest response, tokens"""
    max_len: int = 1024
    """longest response, tokens"""
    micro_batch_size: int = 8
    """rows per padded micro-batch"""
    max_tokens: int = 8192
    """tokens per packed micro-batch (8 padded rows of ~1124 tokens hold up to 8992)"""
    steps: int = 3
    """timed steps per run"""
    warmup: int = 2
    """untimed steps before them (flex_attention compiles again when the grad mode or the shapes change)"""
    gradient_checkpointing: bool = False
    """recompute activations in backward"""
    device: Literal["auto", "cpu"] = "auto"
    """cpu: run on the CPU even where CUDA is available"""
    seed: int = 0
    """seeds the lengths and the ids"""
    profile: bool = False
    """after each run's timed steps, profile one log-prob and one update micro-batch and print the top GPU kernels"""
    out: str = ""
    """write the results here as JSON"""


def random_model(shape: str, folder: str) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


def main(args: Args):
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before CUDA starts: init_distributed then takes the CPU and gloo
    _, world_size, device = init_distributed()
    cuda = device.type == "cuda"
    path = random_model(args.model, tempfile.mkdtemp()) if args.model in SHAPES else args.model
    vocab = __import__("transformers").AutoConfig.from_pretrained(path).vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.samples,), generator=gen).tolist()
    samples = [
        Sample(
            torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist(),
            torch.randint(3, vocab, (n,), generator=gen).tolist(),
            [0.0] * n,
            False,
        )
        for n in lengths
    ]
    batch = collate(samples, pad_id=0)
    rows, tokens = torch.arange(len(batch)), batch.attention_mask.sum(-1)  # [B]
    padded_tokens = sum(len(r) * int(tokens[r].max()) for r in micro_batches(rows, tokens, args.micro_batch_size))
    num_loss_tokens = float(batch.response_mask.sum())
    peak = peak_flops(torch.cuda.get_device_name(device) if cuda else "")

    def sync():
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def update(model, mb, max_tokens: int, mask=None):  # mask: where forward_tokens plans a packed row (the CPU's)
        mask = mb.attention_mask if mask is None else mask
        logp, _ = token_logprobs(model, mb.input_ids, mask, 1.0, with_entropy=True, packed=max_tokens > 0)
        (-(logp * mb.response_mask).sum() / num_loss_tokens).backward()

    copies = {  # how a run moves a micro-batch to the GPU: grpo.py's way (common.to_device), and two others
        "pinned": to_device,
        "direct": lambda x, device: x.to(device, non_blocking=True),
        "waits": lambda x, device: x.to(device),
    }

    @torch.no_grad()
    def own_logprobs(model, max_tokens: int, copy):
        """batch_logprobs' loop with another copy: `waits` as before issue 55 (blocking copies; the mask on the GPU,
        whose packed row makes the CPU read nonzero's size there)."""
        out = torch.zeros_like(batch.response_mask, device=device)  # [B, T-1]
        for r in micro_batches(rows, tokens, args.micro_batch_size, max_tokens):
            part = batch.select(r)
            mask = copies["waits"](part.attention_mask, device) if copy == "waits" else part.attention_mask
            y = token_logprobs(model, copies[copy](part.input_ids, device), mask, 1.0, packed=max_tokens > 0)[0]
            out[copies[copy](r, device), : y.shape[1]] = y[: len(r)]
        return out.cpu()

    def step(model, optimizer, max_tokens: int, copy: str) -> tuple[float, float, float]:
        """One step's log-prob and update phases, and the optimizer step within the update, in seconds; `copy`: how
        the micro-batches go to the GPU (`copies`)."""
        t0 = sync()
        if copy == "pinned":  # the library's own loop
            batch_logprobs(model, batch, args.micro_batch_size, 1.0, device, max_tokens=max_tokens)
        else:
            own_logprobs(model, max_tokens, copy)
        t1 = sync()
        for r in micro_batches(rows, tokens, args.micro_batch_size, max_tokens):
            part = batch.select(r)  # on the CPU
            mb = part.apply(lambda x: copies[copy](x, device))
            update(model, mb, max_tokens, mask=mb.attention_mask if copy == "waits" else part.attention_mask)
        t2 = sync()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return t1 - t0, sync() - t1, sync() - t2

    def profile(model, max_tokens: int):
        """The top GPU kernels of the fullest micro-batch's log-prob forward and of its update forward + backward."""
        from torch.profiler import ProfilerActivity, profile

        mb = batch.select(micro_batches(rows, tokens, args.micro_batch_size, max_tokens)[0]).to(device)
        for name, fn in (
            (
                "log-prob",
                lambda: torch.no_grad()(token_logprobs)(
                    model, mb.input_ids, mb.attention_mask, 1.0, packed=max_tokens > 0
                ),
            ),
            ("update", lambda: update(model, mb, max_tokens)),
        ):
            with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
                fn()
                sync()
            print(f"--- {name}: one micro-batch of {int(mb.attention_mask.sum())} tokens", flush=True)
            print(
                prof.key_averages().table(
                    sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=25, max_name_column_width=70
                ),
                flush=True,
            )
        model.zero_grad(set_to_none=True)

    results, chunk = [], logprobs.LOGIT_CHUNK
    for run in args.runs:
        layout, attn, *rest = run.split("/")
        budget = [int(x) for x in rest if x.isdigit()]
        max_tokens = 0 if layout == "padded" else budget[0] if budget else args.max_tokens
        logprobs.LOGIT_CHUNK = 2**40 if "whole" in rest else chunk  # whole: as before the chunked head
        model = shard_model(
            load_model(path, device, torch.float32, args.gradient_checkpointing, attn), compile="compile" in rest
        )  # --compile: each decoder layer through torch.compile
        if "compile" in rest and "eagerhead" not in rest:  # eagerhead: compiled layers, logits_to_logprobs as it is
            logprobs.compile_head(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7, fused=cuda)
        n_params, out = matmul_params(model), {"run": run}
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            runs = range(args.warmup + args.steps)
            copy = "waits" if "waits" in rest else "direct" if "direct" in rest else "pinned"
            times = [step(model, optimizer, max_tokens, copy) for _ in runs][args.warmup :]
            out.update(
                {
                    k: sum(t[i] for t in times) / len(times)
                    for i, k in enumerate(("logprob_s", "update_s", "optimizer_s"))
                }
            )
            if args.profile:
                profile(model, max_tokens)
        except torch.OutOfMemoryError:  # a result too: this layout does not fit at this budget
            out["error"] = "out of memory"
        out.update(
            micro_batches=len(micro_batches(rows, tokens, args.micro_batch_size, max_tokens)),
            peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        )
        if peak and "error" not in out:
            all_tokens = float(tokens.sum()) * world_size  # every rank runs the same samples
            out["logprob_mfu"] = mfu(2 * n_params, all_tokens, out["logprob_s"], peak, world_size)
            out["update_mfu"] = mfu(6 * n_params, all_tokens, out["update_s"], peak, world_size)
        print(" | ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in out.items()), flush=True)
        results.append(out)
        del model, optimizer
        if cuda:
            torch.cuda.empty_cache()

    base = results[0]
    for r in results[1:]:
        if "error" not in r and "error" not in base:
            r["speedup_vs_" + base["run"]] = (base["logprob_s"] + base["update_s"]) / (r["logprob_s"] + r["update_s"])
    summary = {
        "gpu": torch.cuda.get_device_name(device) if cuda else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "args": asdict(args),
        "parameters": n_params,
        "real_tokens": int(tokens.sum()),
        "padded_tokens": padded_tokens,
        "runs": results,
    }
    if args.model in SHAPES:
        shutil.rmtree(path)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    print(
        f"real tokens {summary['real_tokens']}, padded {padded_tokens} ({padded_tokens / summary['real_tokens']:.2f}x)"
    )
    torch.distributed.destroy_process_group()


if (
    __name__ == "__main__"
):  # friendly_errors collects main's FSDP2 modules: gloo can abort at exit otherwise (tests/gloo_exit_check.py)
    with friendly_errors("bench/packing_bench.py"):
        main(tyro.cli(Args))
