"""Checkpoints that survive a kill and resume exactly.

    save_checkpoint(out_dir, step, {"policy": (model, optimizer)}, {"model": model}, tokenizer=tok, state={...})
    path = latest_checkpoint(out_dir)        # highest complete step, or None
    path = checkpoint_to_resume(out_dir, resume=True)   # the highest readable one; damaged ones moved aside
    state = load_checkpoint(path, {"policy": (model, optimizer)})

Layout of one checkpoint, `out_dir/checkpoints/step_000100/`:
    model/          Hugging Face folder (bf16 safetensors + config + tokenizer): loads in transformers and SGLang
    critic/         (PPO) the value model, as a Hugging Face token-classification folder
    state/          fp32 weights + optimizer state, sharded (torch.distributed.checkpoint): for resume
    trainer.pt      step, data position, LR schedule, anything the script adds
    rng_rank{r}.pt  each rank's RNG states

Everything is written under `step_000100.tmp/` and renamed when complete, so a kill mid-save
leaves the previous checkpoints untouched and the half-written one is never picked for resume.
"""

import glob
import json
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict

from preflight import InputError


def checkpoint_dir(out_dir: str, step: int) -> str:
    return os.path.join(out_dir, "checkpoints", f"step_{step:06d}")


def latest_checkpoint(out_dir: str) -> str | None:
    """The complete checkpoint with the highest step (half-written `.tmp` folders are ignored)."""
    done = [p for p in glob.glob(os.path.join(out_dir, "checkpoints", "step_*"))
            if re.fullmatch(r"step_\d+", os.path.basename(p)) and os.path.isfile(os.path.join(p, "trainer.pt"))]
    return max(done, key=lambda p: int(p.rsplit("_", 1)[1])) if done else None


def damage(path: str) -> str | None:
    """What makes a complete-looking checkpoint unreadable, or None: trainer.pt and every rank's RNG
    file load, and every shard file that the DCP metadata names is there and long enough."""
    try:
        state = torch.load(os.path.join(path, "trainer.pt"), weights_only=False)
        for r in range(state.get("world_size", 1)):
            torch.load(os.path.join(path, f"rng_rank{r}.pt"), weights_only=False)
        meta = dcp.FileSystemReader(os.path.join(path, "state")).read_metadata()
        need = {}  # shard file -> bytes it must hold
        for info in meta.storage_data.values():
            need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
        for name, size in sorted(need.items()):
            file = os.path.join(path, "state", name)
            have = os.path.getsize(file) if os.path.exists(file) else -1
            if have < size:
                return f"state/{name} is " + ("missing" if have < 0 else f"{have} bytes, expected {size}")
    except Exception as e:  # noqa: BLE001 -- any unreadable file means the same: not resumable
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def checkpoint_to_resume(run_dir: str, resume: bool) -> str | None:
    """With `resume`: the newest checkpoint of run_dir that `damage` finds nothing wrong with. A
    damaged newer one is renamed step_N.damaged (kept, never resumed or rotated away) and named in a
    line. Without `resume`, run_dir must hold no earlier run: nothing is overwritten silently."""
    if not resume:
        if latest_checkpoint(run_dir) or os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
            raise InputError(f"{run_dir} holds an earlier run: pass --resume to continue it, or a new --run-name")
        return None
    damaged = []
    while (path := latest_checkpoint(run_dir)) is not None:
        problem = damage(path)
        if problem is None:
            saved = torch.load(os.path.join(path, "trainer.pt"), weights_only=False).get("world_size", 1)
            if saved != dist.get_world_size():  # optimizer shards and RNG are per rank: said before anything loads
                raise InputError(f"--resume: {path} was saved by {saved} rank(s) and this run has {dist.get_world_size()}: resume it "
                                 f"with {'plain python' if saved == 1 else f'torchrun --nproc_per_node {saved} (on one node)'}")
            return path
        dist.barrier()  # every rank has read it before rank 0 moves it
        if dist.get_rank() == 0:
            os.rename(path, path + ".damaged")
            print(f"checkpoint {path} is damaged ({problem}): moved aside to {path}.damaged", flush=True)
        dist.barrier()
        damaged.append(path)
    raise InputError(f"--resume: {run_dir} has no " + (f"intact checkpoint (damaged: {', '.join(damaged)})" if damaged else
                     "checkpoint (check --output-dir and --run-name, or drop --resume to start fresh)"))


def save_hf_model(model, tokenizer, path: str, dtype: torch.dtype = torch.bfloat16):
    """Gather the FSDP2 model's full weights (a collective: every rank calls this) and write a
    Hugging Face folder from rank 0."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        model.save_pretrained(path, state_dict={k: v.to(dtype) for k, v in full.items()})
        config_path = os.path.join(path, "config.json")
        with open(config_path) as f:
            config = json.load(f)
        config["dtype"] = str(dtype).removeprefix("torch.")  # the weights' dtype, not the fp32 masters'
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
    dist.barrier()


def save_checkpoint(out_dir: str, step: int, stateful: dict, hf_models: dict, tokenizer, state: dict, keep: int = 2):
    """Write checkpoint `step` atomically; keep the newest `keep` (0 keeps all).

    stateful: {name: (model, optimizer)}, the FSDP2 models and optimizers to resume.
    hf_models: {folder: model} exported as Hugging Face folders ({"model": policy}). state: small
    picklable things for trainer.pt (rank 0's copy is saved).
    """
    rank, final = dist.get_rank(), checkpoint_dir(out_dir, step)
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        os.makedirs(tmp)
    dist.barrier()
    for folder, model in hf_models.items():
        save_hf_model(model, tokenizer, os.path.join(tmp, folder))
    sharded = {}
    for name, (model, optimizer) in stateful.items():
        model_sd, optim_sd = get_state_dict(model, optimizer)
        sharded[f"{name}_model"], sharded[f"{name}_optim"] = model_sd, optim_sd
    dcp.save(sharded, checkpoint_id=os.path.join(tmp, "state"))  # each rank writes its own shards
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
               os.path.join(tmp, f"rng_rank{rank}.pt"))
    dist.barrier()
    missing = [r for r in range(dist.get_world_size()) if not os.path.exists(os.path.join(tmp, f"rng_rank{r}.pt"))]
    if missing:  # every rank sees the same and stops: ranks on other machines wrote into folders of their own
        raise InputError(f"{tmp} lacks the files of ranks {missing}: --output-dir must be one folder all nodes share (NFS, Lustre)")
    dist.barrier()  # every rank has looked before rank 0 renames the folder
    if rank == 0:
        torch.save({**state, "world_size": dist.get_world_size()}, os.path.join(tmp, "trainer.pt"))
        if os.path.exists(final):  # the same step saved again (e.g. the final save): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)  # atomic: the checkpoint exists completely or not at all
        if keep > 0:
            steps = sorted(glob.glob(os.path.join(out_dir, "checkpoints", "step_*[0-9]")))
            for old in steps[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path: str, stateful: dict) -> dict:
    """Load weights, optimizer state and RNG into place; return trainer.pt's dict."""
    if not os.path.isfile(os.path.join(path, "trainer.pt")):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no trainer.pt)")
    state = torch.load(os.path.join(path, "trainer.pt"), weights_only=False)
    if state["world_size"] != dist.get_world_size():  # the scripts meet this earlier, in checkpoint_to_resume
        raise ValueError(f"{path} was saved by {state['world_size']} ranks and this run has {dist.get_world_size()}")
    sharded = {}
    for name, (model, optimizer) in stateful.items():
        model_sd, optim_sd = get_state_dict(model, optimizer)
        sharded[f"{name}_model"], sharded[f"{name}_optim"] = model_sd, optim_sd
    dcp.load(sharded, checkpoint_id=os.path.join(path, "state"))
    for name, (model, optimizer) in stateful.items():
        set_state_dict(model, optimizer, model_state_dict=sharded[f"{name}_model"],
                       optim_state_dict=sharded[f"{name}_optim"])
    rng = torch.load(os.path.join(path, f"rng_rank{dist.get_rank()}.pt"), weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return state
