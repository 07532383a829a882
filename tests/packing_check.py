"""Under torchrun: packed micro-batches by a token budget give FSDP2 the same log-probs and the same
gradient as padded ones, on ranks whose rows need different numbers of micro-batches (the rank with
fewer runs stand-ins), fp32 compute; and balance() evens out the ranks' tokens, each keeping as many
items. Run by tests/test_packing.py:

    torchrun --nproc_per_node=2 tests/packing_check.py MODEL_DIR
"""

import gc
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])  # the repo root, for the modules
from data import Sample, collate  # noqa: E402
from fsdp import balance, init_distributed, load_model, micro_batches, shard_model
from logprobs import batch_logprobs, token_logprobs
from common import all_reduce

rank, world, device = init_distributed()
gen = torch.Generator().manual_seed(rank)
# rank 0: six sequences of 12 to 90 tokens (several micro-batches of <= 96 tokens); rank 1: two (one micro-batch)
shapes = [(4, 8), (9, 81), (5, 30), (3, 40), (7, 2), (6, 60)] if rank == 0 else [(5, 20), (4, 30)]
samples = [
    Sample(
        torch.randint(3, 300, (p,), generator=gen).tolist(),
        torch.randint(3, 300, (r,), generator=gen).tolist(),
        [0.0] * r,
        False,
    )
    for p, r in shapes
]
batch = collate(samples, pad_id=0)
batch.loss_mask = batch.response_mask
weights = torch.rand(batch.response_mask.shape, generator=gen)  # [B, T-1] stand-in advantages
num_tokens = float(all_reduce(batch.loss_mask.sum()))  # over ranks, as grpo.py's
lengths = batch.attention_mask.sum(-1)
policy = shard_model(load_model(sys.argv[1], device, torch.float32), param_dtype=None)


def gradient(max_tokens: int) -> dict[str, torch.Tensor]:
    """The gradient of a token-mean loss over both ranks' rows, micro-batch by micro-batch."""
    plan = micro_batches(torch.arange(len(batch)), lengths, 8, max_tokens)  # padded: one micro-batch on each rank
    for rows in plan:
        mb = batch.select(rows)
        logp, _ = token_logprobs(policy, mb.input_ids, mb.attention_mask, 1.0, packed=max_tokens > 0)
        w = weights[rows] if len(rows) else torch.zeros(1)
        (logp * mb.loss_mask * w[..., : logp.shape[1]]).sum().div(num_tokens).backward()
    grads = {n: p.grad.full_tensor() for n, p in policy.named_parameters()}
    policy.zero_grad(set_to_none=True)
    return grads, plan


padded, packed = (
    batch_logprobs(policy, batch, 8, 1.0, device),
    batch_logprobs(policy, batch, 8, 1.0, device, max_tokens=96),
)
real = torch.zeros_like(batch.response_mask)
for i, n in enumerate(lengths.tolist()):
    real[i, : n - 1] = 1.0
torch.testing.assert_close(packed * real, padded * real, rtol=0, atol=2e-5)
assert (packed * (1 - real)).abs().max() == 0  # zero past each sequence's end
(g_padded, _), (g_packed, plan) = gradient(0), gradient(96)
assert all(int(lengths[rows].sum()) <= 96 for rows in plan)
counts = [torch.zeros(1) for _ in range(world)]
dist.all_gather(counts, torch.tensor([float(len(plan))]))
stand_ins = int(all_reduce(sum(len(rows) == 0 for rows in plan)))
assert counts[0] == counts[1] and stand_ins > 0, (counts, stand_ins)  # as many on both ranks; rank 1 ran stand-ins
for n in g_padded:
    torch.testing.assert_close(g_packed[n], g_padded[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
# balance: rank 0's groups are long, rank 1's short; afterwards every rank holds as many, their tokens within one group
tokens = [[900, 700, 650, 400], [120, 80, 60, 30]]  # each rank's groups, before
groups = [(rank, k, w) for k, w in enumerate(tokens[rank])]
mine = balance(groups, [w for _, _, w in groups], world)
everyone = [None] * world
dist.all_gather_object(everyone, mine)
loads = [sum(w for _, _, w in part) for part in everyone]
assert sorted(x for part in everyone for x in part) == [
    (r, k, w) for r, ws in enumerate(tokens) for k, w in enumerate(ws)
]  # each group once
assert all(len(part) == 4 for part in everyone) and max(loads) - min(loads) <= 900, loads  # was 2650 vs 290
assert balance(groups, [w for _, _, w in groups], world) == mine  # the same deal again
# dynamic sampling's kept groups, uneven: rank 0 kept 3, rank 1 none. Each rank trains on 3 // 2 = 1 (grpo.py's
# n_groups), dealt from the pool in rank order whatever the tokens: rank 0's first two, not the heaviest two
kept = [[(0, 0, 50), (0, 1, 10), (0, 2, 900)], []][rank]
dealt = balance(kept, [w for _, _, w in kept], world, share=3 // world)
everyone = [None] * world
dist.all_gather_object(everyone, dealt)
assert sorted(x for part in everyone for x in part) == [(0, 0, 50), (0, 1, 10)] and [len(p) for p in everyone] == [
    1,
    1,
], everyone
if rank == 0:
    print(f"balanced tokens per rank: {loads}", flush=True)
    print(f"packed matches padded: {int(counts[0])} micro-batches per rank, {stand_ins} stand-in(s)", flush=True)
policy = None  # FSDP2 modules left for the interpreter's teardown can abort it under gloo (gloo_exit_check.py)
gc.collect()
dist.barrier()  # gloo: a rank that tears down while another still finishes its last gather aborts (exit -6)
dist.destroy_process_group()
