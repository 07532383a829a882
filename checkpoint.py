"""Checkpoints that survive a kill and resume exactly.

    save_checkpoint(out_dir, step, {"policy": (model, optimizer)}, {"model": model}, tokenizer=tok, state={...})
    path = latest_checkpoint(out_dir)        # highest complete step, or None
    path = checkpoint_to_resume(out_dir, resume=True)   # the highest readable one; damaged ones moved aside
    state = load_checkpoint(path, {"policy": (model, optimizer)})
    saves = Checkpoints(out_dir, stateful=..., hf_models=..., tokenizer=tok, state=lambda: {...}, every=100, keep=2)
    if saves.due(step, total): saves.save(step, sampler.state_dict())   # 'saved ... (2.1s)'; saves.last: its step

Layout of one checkpoint, `out_dir/checkpoints/step_000100/`:
    model/          Hugging Face folder (bf16 safetensors + config + tokenizer): loads in transformers and SGLang
    adapter/        (--lora-rank) the policy's adapter alone, PEFT's format; model/ is then the merged model
    critic/         (PPO) the value model, as a Hugging Face token-classification folder
    state/          fp32 weights + optimizer state, sharded (torch.distributed.checkpoint): for resume (with LoRA
                    the adapter's and its optimizer's only: the frozen base comes from --model again)
    trainer.pt      step, data position, LR schedule, anything the script adds
    rng_rank{r}.pt  each rank's RNG states
    manifest.json   every file above with its size and a CRC-32 of each 256 MiB piece: --resume checks them

Everything is written under `step_000100.tmp/` and renamed when complete, so a kill mid-save
leaves the previous checkpoints untouched and the half-written one is never picked for resume.
"""

import errno
import functools
import glob
import json
import os
import random
import re
import shutil
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from lora import is_lora, merged_state_dict, save_adapter
from preflight import RENAMED, as_flags
from common import InputError, RunFailed


def checkpoint_dir(out_dir: str, step: int) -> str:
    return os.path.join(out_dir, "checkpoints", f"step_{step:06d}")


def latest_checkpoint(out_dir: str) -> str | None:
    """The complete checkpoint with the highest step (half-written `.tmp` folders are ignored)."""
    done = [
        p
        for p in glob.glob(os.path.join(out_dir, "checkpoints", "step_*"))
        if re.fullmatch(r"step_\d+", os.path.basename(p)) and os.path.isfile(os.path.join(p, "trainer.pt"))
    ]
    return max(done, key=lambda p: int(p.rsplit("_", 1)[1])) if done else None


def damage(path: str, rank: int = 0, world_size: int = 1) -> str | None:
    """What makes a complete-looking checkpoint unreadable, or None: trainer.pt and every rank's RNG
    file load, every shard file that the DCP metadata names is there and long enough, and the files
    of this rank's share (`owner`) have the size and checksums of manifest.json."""
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
        if state.get("manifest"):  # checkpoints saved before there were checksums have none
            return changed_file(path, rank, world_size)
    except Exception as e:  # noqa: BLE001 -- any unreadable file means the same: not resumable
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


# The flags a resumed run may change: where things are and how the run runs, not what it trains. Every other flag
# must be what the checkpoint was saved with (its trainer.pt keeps them): a resumed run trains as it started.
HOW_IT_RUNS = {
    "steps",
    "resume",
    "output_dir",
    "run_name",
    "model",
    "critic_model",
    "eval_every",
    "eval_before_train",
    "save_every",
    "keep_checkpoints",
    "save_on_signal",
    "log_samples_every",
    "track",
    "wandb_project",
    "max_nonfinite_steps",
    "dist_timeout_minutes",
    "micro_batch_size",
    "max_tokens_per_micro_batch",
    "gradient_checkpointing",
    "compile",
    "offload",
    "attn_implementation",
    "reward_model_micro_batch_size",
    "reward_workers",
    "reward_timeout_s",
    "tool_workers",
    "tool_timeout_s",
    "python_sandbox",
    "rollout_engine",
    "rollout_tp",
    "rollout_mode",
    "rollout_url",
    "rollout_gpus",
    "rollout_timeout",
    "rollout_sync_backend",
    "rollout_sync_address",
    "sync_bucket_mb",
    "lora_sync",
    "lora_gap_ratio",
}


@functools.cache  # once a process: checkpoint_to_resume and the script's set-up both ask
def model_fingerprint(model: str, piece: int = 1 << 20) -> str:
    """Which weights --model holds: a CRC-32 over each weight file's size and its first and last `piece` bytes (a
    fine-tune of the same shapes differs there; 2 MiB read a file), its safetensors where it has any, else its .bin
    files (as transformers loads them). A hub id: those files in the Hugging Face cache, fetched there if they are not
    yet (load_model would fetch them next). "" where no weight file is found (check_model says why, in its own line)."""
    folder, files = model, []
    for pattern in ("*.safetensors", "*.bin"):
        if not os.path.isdir(model):
            from huggingface_hub import snapshot_download

            try:
                folder = snapshot_download(model, allow_patterns=[pattern])
            except Exception:  # noqa: BLE001 (not a hub id, or the hub not reachable: check_model's line names it)
                return ""
        if files := sorted(glob.glob(os.path.join(folder, pattern))):
            break
    crc = 0
    for path in files:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(piece)
            f.seek(max(size - piece, 0))
            crc = zlib.crc32(
                f.read(piece), zlib.crc32(head, zlib.crc32(f"{os.path.basename(path)}:{size}".encode(), crc))
            )
    return f"{crc:08x}" if files else ""


def checkpoint_to_resume(run_dir: str, resume: bool, config: dict | None = None) -> str | None:
    """With `resume`: the newest checkpoint of run_dir that `damage` finds nothing wrong with. A
    damaged newer one is renamed step_N.damaged (kept, never resumed or rotated away) and named in a
    line. A run folder with no checkpoint at all (its run stopped before the first save) starts again
    from step 0 (None). Checked here, before anything loads: the run's flags (`config`: its args as a dict), as
    saved but for HOW_IT_RUNS. (runlog.claim_run_dir checks the folder first: whose, in use, an earlier run.)"""
    if not resume:
        return None
    damaged = []
    while (path := latest_checkpoint(run_dir)) is not None:
        problems = [None] * dist.get_world_size()  # each rank reads the files it wrote: all read it before it moves
        dist.all_gather_object(problems, damage(path, dist.get_rank(), dist.get_world_size()))
        problem = next((p for p in problems if p), None)
        if problem is None:
            state = torch.load(os.path.join(path, "trainer.pt"), weights_only=False)
            renamed = {old[2:].replace("-", "_"): new[2:].replace("-", "_") for old, new in RENAMED.items()}
            then = {renamed.get(k, k): v for k, v in state.get("args", {}).items()}  # saved before a flag's rename too
            now = config or {}
            if changed := [k for k in now if k in then and k not in HOW_IT_RUNS and now[k] != then[k]]:
                raise InputError(
                    f"--resume: {path} was trained with {as_flags(then, changed)}, this command gives "
                    f"{as_flags(now, changed)}: resume with the flags it started with, or start a new run "
                    f"(--run-name)"
                )
            if state["step"] >= now.get("steps", float("inf")):
                raise InputError(
                    f"--resume: {path} is at step {state['step']} and --steps {now['steps']} ends there or before: "
                    f"give the steps in all (--steps {state['step'] + 100} trains 100 more)"
                )
            base = state.get("model_fingerprint")  # saved since 2026-11-28: older checkpoints are not checked
            if base and (mine := model_fingerprint(now["model"])) and mine != base:
                raise InputError(  # LoRA's frozen base and the KL's reference are --model's, loaded again on resume
                    f"--resume: {path} was trained from --model {then['model']}, and --model {now['model']} holds "
                    f"other weights ({mine}, not {base}): resume with the model it started "
                    f"from, or start a new run (--run-name)"
                )
            if (saved := state.get("world_size", 1)) != dist.get_world_size():  # optimizer shards and RNG are per rank
                raise InputError(
                    f"--resume: {path} was saved by {saved} rank(s) and this run has {dist.get_world_size()}: resume it "
                    f"with {'plain python' if saved == 1 else f'torchrun --nproc_per_node {saved} (on one node)'}"
                )
            return path
        if dist.get_rank() == 0:
            os.rename(path, path + ".damaged")
            print(f"checkpoint {path} is damaged ({problem}): moved aside to {path}.damaged", flush=True)
        dist.barrier()
        damaged.append(path)
    if damaged:
        raise InputError(
            f"--resume: {run_dir} has no intact checkpoint (damaged: {', '.join(damaged)}, moved aside): "
            f"--resume again starts it from step 0"
        )
    if dist.get_rank() == 0:
        print(
            f"--resume: {run_dir} has no checkpoint (its run stopped before the first save): starting it again from "
            f"step 0",
            flush=True,
        )
    return None


def save_hf_model(model, tokenizer, path: str, dtype: torch.dtype = torch.bfloat16, adapter_path: str | None = None):
    """Gather the FSDP2 model's full weights (a collective: every rank calls this) and write a
    Hugging Face folder from rank 0. A LoRA model: the merged weights there (lora.merged_state_dict), and with
    `adapter_path` its adapter alone in PEFT's format (lora.save_adapter)."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        if is_lora(model):
            if adapter_path:
                save_adapter(model, adapter_path, full)
            full = merged_state_dict(model, full)
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


def trained_state(model, optimizer) -> tuple[dict, dict, StateDictOptions]:
    """The sharded state dicts of what trains (get_state_dict's) and the options that read them back. A model with
    frozen parameters (a LoRA policy's base) keeps its trained ones only: the base is --model's, loaded again on
    resume, and 15 GB of a 7B base a checkpoint need not write (a tied embedding, frozen, named twice, dropped too)."""
    frozen = any(not p.requires_grad for p in model.parameters())
    options = StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    if frozen:
        trained = {name for name, p in model.named_parameters() if p.requires_grad}
        model_sd = {k: v for k, v in model_sd.items() if k in trained}
    return model_sd, optim_sd, options


def save_checkpoint(out_dir: str, step: int, stateful: dict, hf_models: dict, tokenizer, state: dict, keep: int = 2):
    """Write checkpoint `step` atomically; keep the newest `keep` (0 keeps all).

    stateful: {name: (model, optimizer)}, the FSDP2 models and optimizers to resume.
    hf_models: {folder: model} exported as Hugging Face folders ({"model": policy}). state: small
    picklable things for trainer.pt (rank 0's copy is saved). A disk that fills up ends the run in a
    line (RunFailed): the unfinished folder is removed, the earlier checkpoints are untouched.
    """
    rank, final = dist.get_rank(), checkpoint_dir(out_dir, step)
    tmp = final + ".tmp"
    try:
        write_checkpoint(tmp, stateful, hf_models, tokenizer, state)
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        if not out_of_space(e, out_dir):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise RunFailed(no_space_line(out_dir, step)) from None
    if rank == 0:
        if os.path.exists(final):  # the same step saved again (e.g. the final save): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)  # atomic: the checkpoint exists completely or not at all
        if keep > 0:
            steps = sorted(glob.glob(os.path.join(out_dir, "checkpoints", "step_*[0-9]")))
            for old in steps[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


class Checkpoints:
    """A run's saves (save_checkpoint): `due` every `every` steps and after the last (0: only then; -1: never), the
    newest `keep` kept. In each: `stateful` and `hf_models` as save_checkpoint takes them, and in trainer.pt the step,
    the data position and `state()`, the script's own (its LR schedules, its args). `resume` loads one back. `last`:
    the newest one's step (0 before any)."""

    def __init__(
        self, run_dir: str, *, stateful: dict, hf_models: dict, tokenizer, state, every: int, keep: int, last: int = 0
    ):
        self.run_dir, self.stateful, self.hf_models, self.tokenizer = run_dir, stateful, hf_models, tokenizer
        self.state, self.every, self.keep, self.last = state, every, keep, last

    def resume(self, path: str | None, sampler) -> dict | None:
        """From checkpoint `path` (checkpoint_to_resume's; None: a new run): the models, optimizers and RNG as saved,
        the data position into `sampler` (data.PromptSampler), `last` its step, and a line that says so. Returns
        trainer.pt's dict, for what the script restores itself (its LR schedules, ...); None without `path`."""
        if not path:
            return None
        state = load_checkpoint(path, self.stateful)
        sampler.load_state_dict(state["sampler"])
        self.last = state["step"]
        if dist.get_rank() == 0:
            print(
                f"resumed from {path}: step {self.last}, data epoch {sampler.epoch} index {sampler.index}", flush=True
            )
        return state

    def due(self, step: int, total: int) -> bool:
        return self.every >= 0 and ((self.every and step % self.every == 0) or step == total)

    def save(self, step: int, sampler_state: dict):
        t0 = time.time()
        state = {"step": step, "sampler": sampler_state, **self.state()}
        path = save_checkpoint(self.run_dir, step, self.stateful, self.hf_models, self.tokenizer, state, self.keep)
        self.last = step
        if dist.get_rank() == 0:
            print(f"saved {path} ({time.time() - t0:.1f}s)", flush=True)


def write_checkpoint(tmp: str, stateful: dict, hf_models: dict, tokenizer, state: dict):
    """Everything of save_checkpoint but the rename, into the folder `tmp`."""
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        os.makedirs(tmp)
    dist.barrier()
    for folder, model in hf_models.items():
        adapter = os.path.join(tmp, "adapter") if folder == "model" else None  # the policy's: PEFT's format
        save_hf_model(model, tokenizer, os.path.join(tmp, folder), adapter_path=adapter)
    sharded = {}
    for name, (model, optimizer) in stateful.items():
        sharded[f"{name}_model"], sharded[f"{name}_optim"], _ = trained_state(model, optimizer)
    dcp.save(sharded, checkpoint_id=os.path.join(tmp, "state"))  # each rank writes its own shards
    torch.save(
        {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        },
        os.path.join(tmp, f"rng_rank{rank}.pt"),
    )
    dist.barrier()
    missing = [r for r in range(dist.get_world_size()) if not os.path.exists(os.path.join(tmp, f"rng_rank{r}.pt"))]
    if missing:  # every rank sees the same and stops: ranks on other machines wrote into folders of their own
        raise InputError(
            f"{tmp} lacks the files of ranks {missing}: --output-dir must be one folder all nodes share (NFS, Lustre)"
        )
    dist.barrier()  # every rank has looked before rank 0 renames the folder
    if rank == 0:
        torch.save(
            {**state, "world_size": dist.get_world_size(), "manifest": MANIFEST}, os.path.join(tmp, "trainer.pt")
        )
    write_manifest(tmp)


def out_of_space(error: BaseException, folder: str) -> bool:
    """Did a write fail for want of space? torch.save's zip writer loses the errno ('unexpected pos 704
    vs 598', inside DCP's CheckpointException), so a disk with less than 1 MiB left counts as full too."""
    errors = [error, *(failure[0] for failure in getattr(error, "failures", {}).values())]  # DCP's: each rank's
    while errors:
        e = errors.pop()
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        errors += [c for c in (e.__cause__, e.__context__) if c is not None]
    return shutil.disk_usage(folder).free < 2**20


def no_space_line(out_dir: str, step: int) -> str:
    """What a save that ran out of space says (its unfinished folder removed): where, what is free, what
    a checkpoint takes, what is intact, what to do."""
    folder, newest = os.path.join(out_dir, "checkpoints"), latest_checkpoint(out_dir)
    takes = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(newest) for f in files) if newest else 0
    intact = (
        f"the earlier checkpoints are intact (newest: {os.path.basename(newest)})"
        if newest
        else "no earlier checkpoint"
    )
    return (
        f"no space left at {folder} while saving step {step} ({gib(shutil.disk_usage(out_dir).free)} free"
        + (f", a checkpoint takes {gib(takes)}" if newest else "")
        + f"); {intact}: free some space or lower "
        "--keep-checkpoints, then add --resume"
    )


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# ----------------------------------------------------------------------------------------------
# Checksums. CRC-32, not a cryptographic hash: it is there to find accidental damage (a bad disk, a
# copy cut short or padded, a stray write), and it is 2-4x faster than sha256 (bench/results/
# checkpoint_checksum_cpu.json). The files are read back after the save, mostly from the page cache
# it has just filled: DCP and safetensors write through writers of their own.

MANIFEST, PIECE = "manifest.json", 256 << 20  # a checksum per 256 MiB, so one 20 GB shard keeps every core busy


def owner(name: str) -> int:
    """The rank that wrote checkpoint file `name` checksums it: each rank its own DCP shards
    (state/__{rank}_{i}.distcp, DCP's names) and RNG file, rank 0 the rest."""
    m = re.fullmatch(r"state/__(\d+)_\d+\.distcp|rng_rank(\d+)\.pt", name)
    return int(m.group(1) or m.group(2)) if m else 0


def checksums(folder: str, sizes: dict[str, int], piece: int = PIECE) -> dict[str, list[str]]:
    """{name: [CRC-32 of each `piece` bytes]} for the files of `sizes` ({name: bytes}) in `folder`,
    pieces read in threads (zlib.crc32 releases the GIL), the node's cores shared by its ranks."""
    jobs = [(name, start) for name, size in sizes.items() for start in range(0, max(size, 1), piece)]
    threads = len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")) or 1
    with ThreadPoolExecutor(threads) as pool:
        crcs = list(pool.map(lambda job: piece_crc(os.path.join(folder, job[0]), job[1], piece), jobs))
    out = {name: [] for name in sizes}
    for (name, _), crc in zip(jobs, crcs):
        out[name].append(crc)
    return out


def piece_crc(path: str, start: int, length: int) -> str:
    crc = 0
    with open(path, "rb") as f:
        f.seek(start)
        while length > 0 and (block := f.read(min(length, 16 << 20))):
            crc, length = zlib.crc32(block, crc), length - len(block)
    return f"{crc:08x}"


def write_manifest(tmp: str):
    """A collective: each rank checksums the files it wrote, rank 0 writes them all to manifest.json."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    names = sorted(os.path.relpath(os.path.join(d, f), tmp) for d, _, files in os.walk(tmp) for f in files)
    sizes = {name: os.path.getsize(os.path.join(tmp, name)) for name in names if owner(name) == rank}
    mine = {name: {"bytes": sizes[name], "crc32": crcs} for name, crcs in checksums(tmp, sizes).items()}
    every = [None] * world_size
    dist.all_gather_object(every, mine)
    if rank == 0:
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(
                {"piece_bytes": PIECE, "files": dict(sorted(kv for files in every for kv in files.items()))},
                f,
                indent=1,
            )


def changed_file(path: str, rank: int = 0, world_size: int = 1) -> str | None:
    """The first file of this rank's share that is not as manifest.json says (missing, its size, the
    checksum of a piece), or None."""
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    files, piece = (
        {n: v for n, v in manifest["files"].items() if owner(n) % world_size == rank},
        manifest["piece_bytes"],
    )
    for name, saved in files.items():
        have = os.path.getsize(os.path.join(path, name)) if os.path.exists(os.path.join(path, name)) else -1
        if have != saved["bytes"]:
            return f"{name} is " + ("missing" if have < 0 else f"{have} bytes, saved as {saved['bytes']}")
    now = checksums(path, {name: saved["bytes"] for name, saved in files.items()}, piece)
    for name, saved in files.items():
        if bad := [i for i, (crc, was) in enumerate(zip(now[name], saved["crc32"])) if crc != was]:
            return (
                f"{name} changed since the save: bytes {bad[0] * piece}-{min(bad[0] * piece + piece, saved['bytes'])} "
                f"fail their checksum in {MANIFEST}"
            )
    return None


def load_checkpoint(path: str, stateful: dict) -> dict:
    """Load weights, optimizer state and RNG into place; return trainer.pt's dict."""
    if not os.path.isfile(os.path.join(path, "trainer.pt")):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no trainer.pt)")
    state = torch.load(os.path.join(path, "trainer.pt"), weights_only=False)
    if state["world_size"] != dist.get_world_size():  # the scripts meet this earlier, in checkpoint_to_resume
        raise ValueError(f"{path} was saved by {state['world_size']} ranks and this run has {dist.get_world_size()}")
    sharded, options = {}, {}
    for name, (model, optimizer) in stateful.items():
        sharded[f"{name}_model"], sharded[f"{name}_optim"], options[name] = trained_state(model, optimizer)
    dcp.load(sharded, checkpoint_id=os.path.join(path, "state"))  # a key the checkpoint lacks fails here
    for name, (model, optimizer) in stateful.items():
        set_state_dict(
            model,
            optimizer,
            model_state_dict=sharded[f"{name}_model"],
            optim_state_dict=sharded[f"{name}_optim"],
            options=options[name],
        )
    rng = torch.load(os.path.join(path, f"rng_rank{dist.get_rank()}.pt"), weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return state
