"""Under torchrun, two CPU ranks (gloo): a run that ends as grpo.py's does (an FSDP2 model trained a few
steps, the process group destroyed at the end of main, main run inside preflight.friendly_errors) exits
with code 0. Before friendly_errors collected main's reference cycles, FSDP2's modules kept the process
group's work alive until the interpreter's own teardown, where 2 in 20 of these runs aborted ("terminate
called without an active exception", exit -6; 8 in 25 runs of a plain FSDP2 script). Run by tests/test_smoke.py:

    torchrun --nproc_per_node=2 tests/gloo_exit_check.py MODEL_DIR
"""

import gc
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])  # the repo root, for the modules
from fsdp import init_distributed, load_model, shard_model  # noqa: E402
from logprobs import token_logprobs
from preflight import friendly_errors  # noqa: E402


def main(model_dir: str):
    rank, world, device = init_distributed()
    policy = shard_model(load_model(model_dir, device, torch.float32), param_dtype=None)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    ids = torch.randint(1, 100, (2, 8))  # [B, T]
    for _ in range(3):
        logp, _ = token_logprobs(policy, ids, torch.ones_like(ids), 1.0)  # [B, T-1]
        logp.mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    with friendly_errors("gloo_exit_check.py"):
        main(sys.argv[1])
    # what is left for the interpreter's teardown: no FSDP2 module, so no process group work either
    left = sum(issubclass(type(o), FSDPModule) for o in gc.get_objects())
    os.write(1, f"FSDP2 modules left at exit: {left}\n".encode())  # one write: the two ranks' lines never interleave
