"""On a GPU: the weight-update group (server.join_group) gets an NCCL communicator of its own, not one split
from this process's default group. fsdp.init_distributed binds the default group to the GPU, and torch then
builds a new NCCL group with ncclCommSplit of the default communicator, which an SGLang server is not in: the
trainer and the server waited for each other until the timeout. One GPU, groups of one member; NCCL_DEBUG=INFO
shows the split ("ncclCommSplit ... parent"). Run by tests/test_gpu.py:

    python tests/nccl_split_check.py
"""

import datetime
import socket
import sys

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _get_default_group,
    _new_process_group_helper,
    _world,
    rendezvous,
)

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])  # the repo root, for the modules
from fsdp import init_distributed  # noqa: E402
from server import join_group  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


init_distributed()
default, t = _get_default_group(), torch.ones(4, device="cuda")
splits = lambda: default._get_backend(t.device).comm_split_count()  # noqa: E731  (communicators split from the default's)
dist.barrier()
assert default.bound_device_id is not None and splits() == 0
# the plain way (what join_group did before): split from the default communicator
store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{free_port()}", 0, 1))
plain, _ = _new_process_group_helper(
    1, 0, [], Backend("nccl"), PrefixStore("plain", store), group_name="plain", timeout=datetime.timedelta(seconds=30)
)
_world.pg_group_ranks[plain] = {0: 0}
dist.broadcast(t, src=0, group=plain)
torch.cuda.synchronize()
assert splits() == 1, splits()
group = join_group(
    address="127.0.0.1", port=free_port(), world_size=1, rank=0, group_name="sync", backend="nccl", timeout_s=30
)
dist.broadcast(t, src=0, group=group)
torch.cuda.synchronize()
assert splits() == 1 and default.bound_device_id == t.device, (splits(), default.bound_device_id)
print(f"torch {torch.__version__}: a plain new group was split from the default communicator; join_group's was not")
dist.destroy_process_group()
