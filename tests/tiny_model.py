"""Build a tiny Llama model and a real BPE tokenizer with a chat template, entirely offline.

python tests/tiny_model.py /tmp/tiny-llama                  # for notebooks and manual CPU runs
python tests/tiny_model.py /tmp/tiny-llama --context 2048   # room for the tools' prompt (--tools: ~800 tokens)
"""

import argparse
import os

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_model(
    path: str,
    seed: int = 0,
    vocab_size: int = 512,
    hidden: int = 64,
    layers: int = 2,
    sft_steps: int = 150,
    context: int = 512,
):
    """A 2-layer Llama with a BPE tokenizer trained on addition text. `sft_steps` of supervised
    warm-up on chat-formatted answers ("a + b = c\n#### c") make it answer in the task's format
    with wrong-ish numbers, so GRPO rewards vary within groups and updates have real gradients."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        f"What is {a} + {b}? Put the final answer after ####. The answer is {a + b}.\n#### {a + b}"
        for a in range(10, 100, 7)
        for b in range(10, 100, 11)
    ]
    corpus += ["Think step by step, then put the final answer after ####. user assistant system"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token="<|im_start|>",
        unk_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(sft_steps):
        texts = []
        for a, b in torch.randint(10, 100, (16, 2), generator=gen).tolist():
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": f"What is {a} + {b}? Put the final answer after ####."}],
                add_generation_prompt=True,
                tokenize=False,
            )
            texts.append(prompt + f"{a} + {b} = {a + b}\n#### {a + b}<|im_end|>")
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
        loss = model(**enc, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="Build a tiny Llama (2 layers, BPE tokenizer, chat template) offline, "
        "trained a few seconds on addition answers, into FOLDER."
    )
    parser.add_argument(
        "folder",
        metavar="FOLDER",
        help="where to write it, e.g. ./tiny-model (created; a model already there is replaced)",
    )
    parser.add_argument(
        "--sft-steps", type=int, default=150, help="steps of supervised warm-up (0: untrained, seconds)"
    )
    parser.add_argument("--context", type=int, default=512, help="max_position_embeddings, in tokens (default 512)")
    args = parser.parse_args()
    if os.path.isfile(args.folder):
        parser.error(f"{args.folder!r} is a file: name a folder, e.g. ./tiny-model")
    print(build_tiny_model(args.folder, sft_steps=args.sft_steps, context=args.context))
