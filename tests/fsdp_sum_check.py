"""Under torchrun: the gradient FSDP2 gives two ranks, each with half a batch and a loss normalized by
the global token count, equals the gradient of the whole batch's mean on one process (fsdp.shard_model
sums over ranks; nothing divides by the world size). Run by tests/test_smoke.py:

    torchrun --nproc_per_node=2 tests/fsdp_sum_check.py MODEL_DIR
"""

import gc
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])  # the repo root, for the modules
from fsdp import init_distributed, load_model, shard_model  # noqa: E402
from logprobs import token_logprobs
from common import all_reduce

rank, world, device = init_distributed()
torch.manual_seed(0)
ids = torch.randint(1, 100, (4, 6))  # [B, T], the same on every rank
mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]], dtype=torch.float)  # [B, T-1]
num_tokens = float(all_reduce(mask[rank::world].sum()))  # the whole batch's, over ranks


def loss_of(model, rows):
    logp, _ = token_logprobs(model, ids[rows], torch.ones_like(ids[rows]), 1.0)
    return (logp * mask[rows]).sum() / num_tokens


policy = shard_model(load_model(sys.argv[1], device, torch.float32), param_dtype=None)
loss_of(policy, slice(rank, None, world)).backward()
grads = {n: p.grad.full_tensor() for n, p in policy.named_parameters()}
if rank == 0:
    whole = load_model(sys.argv[1], device, torch.float32)
    loss_of(whole, slice(None)).backward()
    for n, p in whole.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
    print("gradients match", flush=True)
policy = None  # FSDP2 modules left for the interpreter's teardown can abort it under gloo (gloo_exit_check.py)
gc.collect()
dist.barrier()  # gloo: a rank that tears down while another still computes can abort (exit -6)
dist.destroy_process_group()
