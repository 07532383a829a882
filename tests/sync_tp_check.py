"""Under torchrun: memory.sync_weights with a TP group (--rollout-tp 2) hands SGLang, per parameter, one
handle per TP rank, each rank's own gathered copy, in the group's order, bucket by bucket. SGLang's
LocalSerializedTensor is stood in for, and the handles are plain pickles (on a GPU: CUDA IPC handles). Run by
tests/test_memory.py:

    torchrun --nproc_per_node=2 tests/sync_tp_check.py MODEL_DIR
"""

import gc
import pickle
import sys
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])  # the repo root, for the modules
from fsdp import init_distributed, load_model, shard_model  # noqa: E402
import memory  # noqa: E402

rank, world, device = init_distributed()


@dataclass
class LocalSerializedTensor:  # SGLang's: values[i] is what TP worker i opens
    values: list


stand_ins = {
    "sglang": {},
    "sglang.srt": {},
    "sglang.srt.model_executor": {},
    "sglang.srt.model_executor.model_runner_components": {},
    "sglang.srt.model_executor.model_runner_components.weight_updater": {
        "LocalSerializedTensor": LocalSerializedTensor
    },
}
for name, attrs in stand_ins.items():
    sys.modules[name] = types.SimpleNamespace(**attrs)
# on a GPU, a handle is torch's pickling of a CUDA tensor; here a copy that says which rank made it
memory.ipc_handle = lambda tensor: pickle.dumps((dist.get_rank(), tensor.clone()))


class Engine:
    def __init__(self):
        self.buckets, self.flushed = [], 0

    def update_weights_from_tensor(self, named_tensors, flush_cache=True):
        assert not flush_cache
        self.buckets.append(named_tensors)

    def flush_cache(self):
        self.flushed += 1


model = shard_model(load_model(sys.argv[1], device, torch.float32), param_dtype=None)
full = {name: p.full_tensor().to(torch.bfloat16) for name, p in model.named_parameters()}
engine = Engine() if rank == 0 else None
group = dist.new_group([0, 1])
memory.sync_weights(model, engine, bucket_bytes=4096, tp_group=group)  # a bucket per few tensors
if rank == 0:
    sent = [item for bucket in engine.buckets for item in bucket]
    assert len(engine.buckets) > 2 and engine.flushed == 1
    assert [name for name, _ in sent] == list(full), "every parameter once, in order"
    for name, handle in sent:
        assert isinstance(handle, LocalSerializedTensor) and len(handle.values) == 2
        for tp_rank, value in enumerate(handle.values):
            made_by, tensor = pickle.loads(value)
            assert made_by == tp_rank and torch.equal(tensor, full[name]), name
    print(f"tp sync ok: {len(sent)} tensors in {len(engine.buckets)} buckets, a handle per TP rank, each rank's own")
model = None  # FSDP2 modules left for the interpreter's teardown can abort it under gloo (gloo_exit_check.py)
gc.collect()
dist.barrier()  # gloo: a rank leaving right after a collective can abort the other's exit
dist.destroy_process_group()
