"""Under torchrun: the reward model sharded with FSDP2 over two ranks, each scoring its own share of
conversations (rank 0 three, rank 1 one: rank 1 runs stand-in forwards to keep FSDP's collectives in step),
gives each conversation the score the unsharded model gives it run alone. Run by tests/test_reward_model.py:

    torchrun --nproc_per_node=2 tests/rm_score_check.py RM_DIR
"""

import gc
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])  # the repo root, for the modules
from fsdp import init_distributed  # noqa: E402
from reward_model import check_reward_model, load_reward_model, score_conversations  # noqa: E402

rank, world, device = init_distributed()
texts = ["1 + 1 = 2", "What is 12 + 30? #### 42 and some more words", "no", "3 + 4 is 7, so #### 7"]
conversations = [
    [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": t}] for i, t in enumerate(texts)
]
mine = [0, 1, 2] if rank == 0 else [3]
tokenizer, template, _ = check_reward_model(sys.argv[1])
rm = load_reward_model(sys.argv[1], device, torch.float32)
scores, _ = score_conversations(
    rm,
    [conversations[i] for i in mine],
    tokenizer=tokenizer,
    template=template,
    max_len=64,
    micro_batch_size=1,
    device=device,
)
gathered = [None] * world
dist.all_gather_object(gathered, (mine, scores.tolist()))
if rank == 0:
    from transformers import AutoModelForSequenceClassification

    whole = AutoModelForSequenceClassification.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
    for rows, got in gathered:
        for i, g in zip(rows, got):
            ids = tokenizer.apply_chat_template(conversations[i], tokenize=True, return_dict=False)
            with torch.no_grad():
                want = float(whole(input_ids=torch.tensor([ids])).logits[0, 0])
            assert abs(g - want) < 1e-4, (i, g, want)
    print("scores match", flush=True)
rm = None  # FSDP2 modules left for the interpreter's teardown can abort it under gloo (gloo_exit_check.py)
gc.collect()
dist.barrier()
