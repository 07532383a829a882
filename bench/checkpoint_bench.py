"""What the checksums cost a checkpoint save: save_checkpoint with and without manifest.json, alternated.

    python tests/tiny_model.py /tmp/tiny && python bench/make_random_model.py --shape 1.5b --tokenizer /tmp/tiny --out /tmp/m15
    python bench/checkpoint_bench.py --model /tmp/m15 --save-dir /tmp/ckpt --out bench/results/checkpoint_checksum_h100.json

One process, a world of one (gloo on a CPU, NCCL on a GPU): the model loaded and sharded as the
scripts do, fp32 masters and AdamW state filled by one real update, then `reps` rounds of saves
(checkpoint.save_checkpoint, its folder removed and the disk synced after each, untimed), each
round every variant once, the order rotated from round to round:
  none    no manifest.json (checkpoint.write_manifest replaced by nothing): the save before checksums
  crc32   the save as it is: a CRC-32 of each 256 MiB piece, pieces in threads
  sha256  the same with sha256 pieces: the alternative
Also: --resume's check of a fresh checkpoint (checkpoint.damage, its files in the page cache), and
the checksum throughput over one checkpoint's files (GB/s, all threads and one), from which larger
shapes are extrapolated (`extrapolate`): their files computed from the shape (bf16 Hugging Face
weights; fp32 weights and AdamW's two moments in DCP shards), on 1 GPU and on 8.
"""

import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import tyro

ROOT = __file__.rsplit("/bench/", 1)[0]
sys.path.insert(0, ROOT)  # the repo root, for the modules
sys.path.insert(0, os.path.join(ROOT, "bench"))

import checkpoint  # noqa: E402
from fsdp import init_distributed, load_model, shard_model  # noqa: E402
from make_random_model import SHAPES  # noqa: E402


@dataclass
class Args:
    model: str
    """model folder with a tokenizer (bench/make_random_model.py)"""
    save_dir: str = "/tmp/checkpoint_bench"
    """where the checkpoints are written (and removed)"""
    out: str = "checkpoint_checksum.json"
    """the result"""
    reps: int = 4
    """rounds; each saves once per variant"""
    variants: tuple[str, ...] = ("none", "crc32", "sha256")
    """which saves to time"""


def sha256_piece(path: str, start: int, length: int) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        while length > 0 and (block := f.read(min(length, 16 << 20))):
            h.update(block)
            length -= len(block)
    return h.hexdigest()


def throughput(folder: str, sizes: dict, piece_fn, threads: int) -> float:
    """GB/s of checkpoint.checksums over `sizes` with `threads` threads (through LOCAL_WORLD_SIZE)."""
    checkpoint.piece_crc = piece_fn
    os.environ["LOCAL_WORLD_SIZE"] = str(max(1, len(os.sched_getaffinity(0)) // threads))
    t0 = time.perf_counter()
    checkpoint.checksums(folder, sizes)
    seconds = time.perf_counter() - t0
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    return sum(sizes.values()) / seconds / 1e9


def extrapolate(shape: str, gbps: dict, save_gbps: float | None, cores: int) -> dict:
    """A checkpoint of `shape` as the code saves it: bf16 HF weights (2 B/param) and, in DCP shards,
    fp32 weights + AdamW's two moments (12 B/param); a tied output head is written twice as weights
    (+6 B for each of its params; seen in the files measured here). Its CRC-32 seconds from the GB/s
    measured here, on 1 GPU (one rank, every core) and on 8 (rank 0 checks its shard and the HF files
    with 1/8 of the cores); one GPU's save seconds at the rate this machine saved without checksums."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        n = sum(p.numel() for p in Qwen2ForCausalLM(Qwen2Config(**SHAPES[shape])).parameters())
    head = SHAPES[shape]["vocab_size"] * SHAPES[shape]["hidden_size"] if SHAPES[shape]["tie_word_embeddings"] else 0
    hf, dcp = 2 * (n + head), 12 * n + 4 * head
    out = {
        "params": n,
        "hf_bf16_bytes": hf,
        "dcp_fp32_weights_and_adam_bytes": dcp,
        "how": "extrapolated from the GB/s measured here over this machine's checkpoint files",
    }
    for gpus in (1, 8):
        rank0, threads = dcp // gpus + hf, max(1, cores // gpus)
        rate = gbps["all_threads"] if gpus == 1 else min(gbps["all_threads"], gbps["one_thread"] * threads)
        out[f"{gpus}_gpu"] = {"rank0_bytes": rank0, "threads_per_rank": threads, "crc32_s": rank0 / rate / 1e9}
    if save_gbps:
        out["1_gpu"]["save_s_without_checksums"] = (hf + dcp) / save_gbps / 1e9
        out["1_gpu"]["added_fraction"] = out["1_gpu"]["crc32_s"] / out["1_gpu"]["save_s_without_checksums"]
    return out


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores, {ram:.0f} GiB RAM, {gpu}, {platform.node()}"


def main(args: Args):
    _, _, device = init_distributed()
    policy = load_model(args.model, device, torch.float32)
    shard_model(policy, param_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, fused=True)
    ids = torch.randint(0, policy.config.vocab_size, (1, 16), device=device)
    policy(input_ids=ids, labels=ids).loss.backward()  # one real update: AdamW's moments exist and are not zeros
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()  # a bar at every save
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    n_params = sum(p.numel() for p in policy.parameters())
    real_manifest, real_piece = checkpoint.write_manifest, checkpoint.piece_crc
    timed = {"manifest_s": 0.0}

    def manifest(tmp):
        t0 = time.perf_counter()
        real_manifest(tmp)
        timed["manifest_s"] = time.perf_counter() - t0

    def save(variant: str, step: int) -> tuple[str, float, float]:
        checkpoint.write_manifest = (lambda tmp: None) if variant == "none" else manifest
        checkpoint.piece_crc = sha256_piece if variant == "sha256" else real_piece
        shutil.rmtree(args.save_dir, ignore_errors=True)
        os.sync()  # each save starts with no dirty pages of the one before
        timed["manifest_s"] = 0.0
        t0 = time.perf_counter()
        path = checkpoint.save_checkpoint(
            args.save_dir, step, {"policy": (policy, optimizer)}, {"model": policy}, tokenizer, {"step": step}, keep=0
        )
        return path, time.perf_counter() - t0, timed["manifest_s"]

    save("none", 0)  # warm-up: first-call costs (imports, allocations) out of the rounds
    runs = {v: {"save_s": [], "manifest_s": []} for v in args.variants}
    verify_s = []
    for rep in range(args.reps):
        order = args.variants[rep % len(args.variants) :] + args.variants[: rep % len(args.variants)]
        for variant in order:
            path, seconds, manifest_s = save(variant, rep + 1)
            runs[variant]["save_s"].append(seconds)
            runs[variant]["manifest_s"].append(manifest_s)
            print(f"round {rep} {variant}: save {seconds:.2f} s (manifest {manifest_s:.2f} s)", flush=True)
            if variant == "crc32":
                checkpoint.piece_crc = real_piece
                t0 = time.perf_counter()
                assert checkpoint.damage(path) is None
                verify_s.append(time.perf_counter() - t0)

    # throughput over the files of the last checkpoint, from the page cache
    path, _, _ = save("crc32", 99)
    files = sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)
    sizes = {f: os.path.getsize(os.path.join(path, f)) for f in files}
    total = sum(sizes.values())
    cores = len(os.sched_getaffinity(0))
    gbps = {
        name: {"all_threads": throughput(path, sizes, fn, cores), "one_thread": throughput(path, sizes, fn, 1)}
        for name, fn in (("crc32", real_piece), ("sha256", sha256_piece))
    }
    checkpoint.piece_crc = real_piece
    shutil.rmtree(args.save_dir, ignore_errors=True)

    def summary(xs):
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "each": xs}

    result = {v: {k: summary(xs) for k, xs in r.items()} for v, r in runs.items()}
    base = result["none"]["save_s"]["median"] if "none" in result else None
    for v in result:
        if base and v != "none":
            result[v]["added_s_median"] = result[v]["save_s"]["median"] - base
            result[v]["added_fraction"] = result[v]["save_s"]["median"] / base - 1
    save_gbps = total / base / 1e9 if base else None  # the save's own rate: bytes of files per second
    far = {shape: extrapolate(shape, gbps["crc32"], save_gbps, cores) for shape in ("1.5b", "7b")}
    commit = (
        os.environ.get("BENCH_CODE")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    )
    out = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "code": commit,
        "command": " ".join(["python", *sys.argv]),
        "model": args.model,
        "params": n_params,
        "checkpoint_bytes": total,
        "checkpoint_files": sizes,
        "reps": args.reps,
        "saves": result,
        "resume_check_s": summary(verify_s) if verify_s else None,
        "checksum_GBps": gbps,
        "save_GBps_without_checksums": save_gbps,
        "extrapolated": far,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps({k: out[k] for k in ("machine", "checkpoint_bytes", "checksum_GBps")}, indent=1))
    for v, r in result.items():
        print(v, {k: round(x, 3) for k, x in r["save_s"].items() if k != "each"}, r.get("added_fraction"))
    print("extrapolated", json.dumps(far, indent=1))


if __name__ == "__main__":
    main(tyro.cli(Args))
