"""Write a random-weight model with the shapes of a Qwen2.5 size or of SmolLM2-135M, plus a tokenizer, as an HF folder.

    python bench/make_random_model.py --shape 1.5b --tokenizer $SMOLLM2 --out /tmp/models/qwen2.5-1.5b-random
    python bench/make_random_model.py --shape smollm2 --tokenizer ./tiny-model --out /tmp/models/smollm2-random  # no hub

Random weights are right for speed and memory measurements and meaningless for reward. The
tokenizer is borrowed (its ids are a subset of the model's vocabulary); the model's stop tokens
are the tokenizer's, so random generations almost always run to the length limit: the worst case
for memory. `--stop-tokens K` adds K more stop ids (generation_config.json's eos_token_id): a random model samples
near-uniformly over its vocabulary V, so each token ends a sample with probability ~K/V and the lengths are
geometric, mean ~V/K, the longest of n samples ~(V/K) ln n: a thin long tail, as a reasoning model's lengths have.
Checked: the 1.5B shape with 380 ids, mean 406 (bench/results/server_tail_1p5b_h200x4.json); the SmolLM2 shape
with 200 ids fell into repeats instead (48 samples on a CPU: 31 ran to 1500 tokens): look at the lengths first.

    python bench/make_random_model.py --shape 1.5b --tokenizer $SMOLLM2 --stop-tokens 400 --out /tmp/models/tail
"""

import sys
from dataclasses import dataclass
from typing import Literal

import torch
import tyro

# Qwen2.5 base shapes and SmolLM2-135M's (a Llama) from their published config.json files.
SHAPES = {
    "0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "smollm2": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
}
# the rest of each config: SmolLM2-135M is a Llama (no q/k/v bias), with its own context, RoPE base and norm eps
LLAMA = {"smollm2": dict(max_position_embeddings=8192, rope_theta=1e5, rms_norm_eps=1e-5)}


@dataclass
class Args:
    shape: Literal["0.5b", "1.5b", "7b", "smollm2"]
    """which Qwen2.5 size (or SmolLM2-135M) to copy the shapes of"""
    tokenizer: str
    """folder whose tokenizer to borrow"""
    out: str
    """output folder"""
    seed: int = 0
    """weight init seed"""
    stop_tokens: int = 0
    """this many more stop ids, spread evenly over the vocabulary (0: the tokenizer's only)"""


def main(args: Args):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    ids = dict(eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    if args.shape in LLAMA:
        config, model_class, name = (
            LlamaConfig(**SHAPES[args.shape], **LLAMA[args.shape], **ids),
            LlamaForCausalLM,
            "SmolLM2-135M",
        )
    else:
        config = Qwen2Config(
            **SHAPES[args.shape], max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, **ids
        )
        model_class, name = Qwen2ForCausalLM, f"Qwen2.5-{args.shape}"
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = model_class(config).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    if args.stop_tokens:
        vocab = config.vocab_size
        extra = [i for i in range(vocab // args.stop_tokens // 2, vocab, vocab // args.stop_tokens)][: args.stop_tokens]
        model.generation_config.eos_token_id = [tok.eos_token_id] + [i for i in extra if i != tok.eos_token_id]
        model.generation_config.save_pretrained(args.out)
        print(f"{len(extra)} more stop ids: lengths geometric, mean ~{vocab // len(extra)} tokens", file=sys.stderr)
    print(f"{args.out}: {name} shapes, {n / 1e9:.3f}B parameters, random weights", file=sys.stderr)


if __name__ == "__main__":
    main(tyro.cli(Args))
