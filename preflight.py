"""Checks that run before anything is loaded or written, and errors that say what to do.

    with friendly_errors("grpo.py"):                # an InputError ends the run in one or two lines
        main(tyro.cli(Args))
    check_flags([("--lr", args.lr, args.lr > 0, "> 0"), ...])
    args = parse_args(Args, cpu_sizes={"prompts_per_step": 4, ...})   # the command line; no GPU: smaller defaults
    tokenizer, context = check_model("Qwen/Qwen2.5-0.5B-Instruct")      # before SGLang starts

An InputError is bad input a person can fix: it prints its message, no traceback, and exits with
code 2. A RunFailed is a failure that is not bad input (an engine that could not start, a rollout
server that died, a full disk): the same, with code 1. RL_DEBUG=1 shows the traceback as well. Under torchrun the
message also goes where torchrun looks for a rank's error (`tell_torchrun`): its summary, the last
thing it prints, shows it.
"""

import ast
import dataclasses
import gc
import glob
import inspect
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import textwrap
import time
import traceback
from contextlib import contextmanager
from typing import Annotated

from common import TINY_MODEL, EngineStartFailed, InputError, Interrupted, RunFailed


OOM_HINT = (
    "lower --micro-batch-size (one micro-batch's log-probs take micro-batch x tokens x vocabulary x 4 "
    "bytes) or the engine's share, --sglang-mem-fraction; in the optimizer's step, the training state (16 bytes a "
    "trained parameter, shared by the ranks): more GPUs, or --lora-rank"
)
ENGINE_HINT = (
    "SGLang's --mem-fraction-static is --sglang-mem-fraction here: change it as that error says, "
    "or free the GPU of other processes (nvidia-smi)"
)


@contextmanager
def friendly_errors(script: str, oom_hint: str = OOM_HINT, engine_hint: str = ENGINE_HINT):
    """Run a script's main: an InputError prints '<script>: <message>' and exits 2, a RunFailed exits 1 (followed
    by `engine_hint` where SGLang failed to start); a CUDA out-of-memory error keeps its traceback and adds a line
    on which flags lower the memory. Under torchrun each node's first rank prints (see `report`)."""
    try:
        yield
        # main's reference cycles freed now, not at interpreter exit, where a gloo process group's work held by
        # FSDP2's modules aborted 1 in 10 to 1 in 3 two-rank CPU runs ("terminate called ...", tests/gloo_exit_check.py)
        gc.collect()
    except Interrupted as e:  # a signal during start-up (nothing to save), or during a weight sync that never ended
        leave_process_group()
        during = e.args[1] + "; --resume continues from the last checkpoint" if len(e.args) > 1 else "start-up"
        report(f"{script}: stopped by {signal.Signals(e.args[0]).name} during {during}", wait=False)
        raise SystemExit(128 + e.args[0]) from None
    except (InputError, RunFailed) as e:
        if os.environ.get("RL_DEBUG"):
            raise
        leave_process_group()
        report(f"{script}: {e}" + f"\n  {engine_hint}" * isinstance(e, EngineStartFailed))
        raise SystemExit(2 if isinstance(e, InputError) else 1) from None
    except Exception as e:
        if type(e).__name__ != "OutOfMemoryError":  # torch's, not imported here
            raise
        traceback.print_exc()
        leave_process_group()
        report(f"{script}: the GPU ran out of memory: {oom_hint}", wait=False)
        raise SystemExit(1) from None


def report(message: str, wait: bool = True):
    """Print `message`, the run's last line, on each node's first rank (ranks fail alike). Under torchrun every rank
    first hands it to torchrun; with `wait`, another rank waits up to 10 s for the SIGTERM that torchrun sends all
    ranks once one exits, and prints only if none comes (it failed alone)."""
    tell_torchrun(message)
    first, stopped, deadline = os.environ.get("LOCAL_RANK", "0") == "0", [], time.time() + 10
    if not first and wait:
        signal.signal(signal.SIGTERM, lambda signum, frame: stopped.append(signum))
        while not stopped and time.time() < deadline:
            time.sleep(0.05)
    if first or (wait and not stopped):
        print(message, file=sys.stderr, flush=True)


def tell_torchrun(message: str):
    """Under torchrun, write `message` where its agent reads a failed rank's error: the file TORCHELASTIC_ERROR_FILE
    names, in the JSON that torch's own @record writes (errors/error_handler.py). torchrun's summary of the
    failed ranks then shows it as the rank's "traceback" instead of a link to its documentation."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    error = {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}
    try:
        with open(path, "w") as f:
            json.dump({"message": error}, f)
    except OSError:  # torchrun's temporary folder gone: its summary links its docs instead
        pass


def leave_process_group():
    """Destroy the process group if there is one: else NCCL's warning that nobody did is the last line."""
    dist = sys.modules.get("torch.distributed")  # not imported: no group (plot.py never imports torch)
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def check_flags(rules: list[tuple[str, object, bool, str]]):
    """rules: (flag, its value, whether it holds, what it must be). All broken rules are reported at once."""
    problems = [f"{flag} {value} must be {must}" for flag, value, holds, must in rules if not holds]
    if len(problems) == 1:
        raise InputError(problems[0])
    if problems:
        raise InputError("bad arguments:\n  " + "\n  ".join(problems))


# SGLang 0.5.16's attention backends for its deterministic inference (srt/server_args.py,
# DETERMINISTIC_ATTENTION_BACKEND_CHOICES), copied so that a machine without SGLang checks the flag before anything
# loads; tests/test_deterministic.py compares the copy with an installed SGLang's (bench/run_deterministic.sh runs it)
DETERMINISTIC_ATTENTION = ("ascend", "fa3", "fa4", "flashinfer", "triton")
# the most requests an SGLang 0.5.16 engine runs at once unless told (its request pool: 2048 to 4096, fewer where
# its KV cache is small; mem_cache/kv_cache_configurator.py, resolve_max_num_reqs)
ENGINE_BATCH = 4096


def engine_count(world_size: int, rollout_tp: int, servers: int = 0) -> int:
    """The engines a step's samples are split over: the servers (--rollout-mode server), else one per --rollout-tp
    ranks."""
    return servers or max(world_size // rollout_tp, 1)


def sampling_rules(
    *,
    num_eval_prompts: int,
    eval_samples: int,
    eval_temperature: float,
    engines: int,
    deterministic: bool,
    attention_backend: str,
    rollout_tp: int = 1,
) -> list[tuple[str, object, bool, str]]:
    """check_flags' rules for sampled evaluation (each engine gets its share of the held-out prompts x K in calls of
    ENGINE_BATCH at most; with --rollout-tp > 1 in one call, as the group's ranks must make the same calls: there the
    samples must fit the engine's batch) and for --deterministic-rollout (SGLang's mode runs on DETERMINISTIC_ATTENTION
    only: any other backend is an error of SGLang's start, after the imports)."""
    K, T, fits = eval_samples, eval_temperature, ENGINE_BATCH * max(engines, 1) // max(num_eval_prompts, 1)
    return [
        ("--eval-samples", K, 0 <= K <= 1024, ">= 0 (0: greedy only) and at most 1024"),
        (
            "--eval-samples",
            K,
            not 0 <= K <= 1024 or K <= fits or rollout_tp == 1,
            f"at most {fits} with --num-eval-prompts {num_eval_prompts} on {engines} engine(s) of --rollout-tp "
            f"{rollout_tp}: a TP group evaluates its prompts x K samples at once, and an SGLang engine runs "
            f"{ENGINE_BATCH} at most",
        ),
        (
            "--eval-temperature",
            T,
            T > 0 if K else T >= 0,
            "> 0 with --eval-samples (at 0 every sample is the greedy answer)" if K else ">= 0",
        ),
        (
            "--sglang-attention-backend",
            attention_backend,
            not deterministic or attention_backend in DETERMINISTIC_ATTENTION,
            f"one of {', '.join(DETERMINISTIC_ATTENTION)} with --deterministic-rollout (the backends SGLang 0.5.16's "
            f"deterministic inference runs on)",
        ),
    ]


def package_rules(*, track: bool, attn_implementation: str) -> list[tuple[str, object, bool, str]]:
    """check_flags' rules for the flags that need a package the requirements leave out (--track: wandb), and for an
    attention implementation that can't train on this machine (attn_problem)."""
    from importlib.util import find_spec

    attn = attn_problem(attn_implementation)
    return [
        (
            "--track",
            track,
            not track or find_spec("wandb") is not None,
            "given with wandb installed (pip install wandb; wandb login)",
        ),
        ("--attn-implementation", attn_implementation, attn is None, attn),
    ]


def rollout_rules(
    *,
    mode: str,
    tp: int,
    urls: tuple[str, ...],
    gpus: int,
    timeout: float,
    mem_fraction: float,
    sync_bucket_mb: int,
    world_size: int,
) -> list[tuple[str, object, bool, str]]:
    """check_flags' rules for where the rollout runs: --rollout-mode (`mode`), --rollout-tp, --rollout-url,
    --rollout-gpus, --rollout-timeout, --sglang-mem-fraction, --sync-bucket-mb. One engine's GPUs are on one node."""
    import torch

    server = mode == "server"
    local_ranks, node_gpus = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), torch.cuda.device_count()
    return [
        ("--sglang-mem-fraction", mem_fraction, 0 < mem_fraction < 1, "in (0, 1)"),
        (
            "--rollout-tp",
            tp,
            tp >= 1 and (not urls or tp == 1) and (server or world_size % tp == local_ranks % tp == 0),
            f"a divisor of the {local_ranks} ranks "
            f"of each node (one engine's GPUs are on one node: torchrun --nproc_per_node a multiple of it)"
            if not server
            else "1 with --rollout-url (the server's own --tp-size counts); with --rollout-gpus, each server's GPUs",
        ),
        (
            "--rollout-url",
            urls,
            all(u.startswith("http") for u in urls) and (bool(urls) != (gpus > 0) if server else not urls),
            "http://HOST:PORT of each "
            "server, with --rollout-mode server; that mode takes these or --rollout-gpus k (servers this job starts), not both",
        ),
        (
            "--rollout-gpus",
            gpus,
            gpus == 0 or (server and gpus % tp == 0 and local_ranks + gpus <= node_gpus),
            f"with --rollout-mode server, a multiple of --rollout-tp, at most the "
            f"{node_gpus} GPUs of this node less its {local_ranks} training ranks (torchrun --nproc_per_node {node_gpus - gpus})",
        ),
        ("--rollout-timeout", timeout, timeout > 0, "> 0"),
        ("--sync-bucket-mb", sync_bucket_mb, sync_bucket_mb >= 1, ">= 1"),
    ]


def attn_problem(impl: str) -> str | None:
    """What --attn-implementation must be instead of `impl` (check_flags' words), None if it can train here. Each was
    a traceback after the models loaded: a name transformers does not know, flex_attention or a flash kernel on a
    machine without a GPU (flex_attention has no backward on a CPU; varlen, fsdp.varlen_attention, is torch's CUDA
    kernel), flash_attention_N without its package."""
    if impl in ("sdpa", "eager"):
        return None
    import torch
    from transformers.modeling_flash_attention_utils import FLASH_ATTENTION_COMPATIBILITY_MATRIX
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    known, base = ["eager", "varlen", *ALL_ATTENTION_FUNCTIONS.valid_keys()], impl.removeprefix("paged|")
    if impl not in known and "/" not in impl:  # 'org/name': a kernel from the hub (transformers' kernels package)
        return f"one that transformers knows: {', '.join(k for k in known if '|' not in k)}"
    if not torch.cuda.is_available() and base not in ("sdpa", "eager"):
        why = "has no backward on a CPU" if base == "flex_attention" else "runs on a GPU only"
        return f"sdpa or eager on a machine without a GPU: {impl} {why}"
    version = int(base.removeprefix("flash_attention_")) if base.startswith("flash_attention_") else None
    if version in FLASH_ATTENTION_COMPATIBILITY_MATRIX:
        if not FLASH_ATTENTION_COMPATIBILITY_MATRIX[version]["general_availability_check"]():
            how = "flash-attn (pip install flash-attn)" if version == 2 else f"flash-attn-{version}, not installed here"
            return f"sdpa or eager: {base} needs {how}"
    return None


def check_writable(run_dir: str, flag: str = "--output-dir"):
    """run_dir is a folder this process can write, or one it can create: tried with a folder made and
    removed in the nearest existing folder on its path (read-only mounts, /proc, permissions)."""
    near = run_dir
    while near and not os.path.exists(near):
        near = os.path.dirname(near.rstrip("/"))
    near = near or "."
    if not os.path.isdir(near):
        raise InputError(f"{flag}: the run's folder {run_dir} can't be made, {near} is a file: pass another {flag}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=near))  # runlog.claim ignores these (runlog.WRITE_CHECK)
    except OSError as e:
        raise InputError(
            f"{flag}: the run's folder {run_dir} can't be written, {near} refuses a new folder "
            f"({e.strerror}): pass another {flag}, one this user can write"
        ) from None


def run_folder(output_dir: str, run_name: str) -> str:
    """output_dir/run_name: `~` expanded (a shell leaves it as typed after `--output-dir=`), and the run name one plain
    folder name, so that the run's folder is inside --output-dir."""
    if run_name in ("", ".", "..") or "/" in run_name or "\0" in run_name:
        raise InputError(
            f"--run-name {run_name!r} is not a plain folder name (the run's folder goes inside --output-dir "
            f"{output_dir}): pass a name without '/'; to write elsewhere, change --output-dir"
        )
    return os.path.join(os.path.expanduser(output_dir), run_name)


# one name for a flag in every script (issue 40): an old name is refused in one line that names the new one
RENAMED = {
    "--samples-per-prompt": "--group-size",
    "--num-prompts": "--num-eval-prompts",
    "--engine": "--rollout-engine",
    "--mem-fraction": "--sglang-mem-fraction",
}


def parse_args(cls, cpu_sizes: dict | None = None, argv: list[str] | None = None, shown: dict | None = None):
    """tyro.cli(cls) of a script's flat Args, where a flag's old name (RENAMED) is bad input, and the help groups the
    flags as the comment rules of `cls` do ('# --- sampling'), each of `cpu_sizes` beside its default, '(default: 16;
    CPU: 4)', and `shown`'s words in place of a default that stands for others ('--lr 0': '1e-6; LoRA: 1e-5'): -h a
    line a flag, -H with each flag's docstring. On a machine without a GPU, `cpu_sizes` for the flags the command line
    does not give (one line says so)."""
    import tyro  # lazy: `import preflight` stays light

    argv = sys.argv[1:] if argv is None else argv
    if old := [a.split("=")[0] for a in argv if a.split("=")[0] in RENAMED]:
        raise InputError(f"{old[0]} is now {RENAMED[old[0]]}, its name in every script: pass {RENAMED[old[0]]}")
    if asked := [a for a in argv if a in ("-h", "--help", "-H", "--help-verbose")]:
        about = sys.modules[cls.__module__].__doc__.strip().splitlines()[0] + " The flags by purpose."
        about += " '(CPU: N)': the default on a machine without a GPU (the run's first line says so)." * bool(cpu_sizes)
        # tyro groups flags by nested dataclasses only: a nested copy of `cls` for the help, its flags unprefixed
        config = (tyro.conf.OmitArgPrefixes,)
        groups = help_groups(cls, cpu_sizes or {}, shown or {})
        tyro.cli(groups, args=asked[:1], description=about, compact_help=True, config=config)
    args = tyro.cli(cls, args=argv)
    import torch  # lazy, as tyro

    from fsdp import compute_dtype  # lazy, as torch

    if not cpu_sizes or torch.cuda.is_available():
        return args
    # no GPU: the GPU-sized defaults would take hours a step; `cpu_sizes` for every flag not given, said in one line
    changed = {k: v for k, v in cpu_sizes.items() if k not in given_flags(argv)}
    if os.environ.get("RANK", "0") == "0":
        script = os.path.basename(getattr(sys.modules[cls.__module__], "__file__", None) or f"{cls.__module__}.py")
        colocated = dataclasses.asdict(args).get("rollout_mode") == "colocate"  # grpo's, ppo's: generated here
        where = (
            "generating with plain transformers (--rollout-engine hf) on the CPU"
            if colocated
            else "training on the CPU"
        )
        bf16 = compute_dtype(torch.device("cpu")) == torch.bfloat16  # fsdp.compute_dtype says why
        dtype = "bfloat16" if bf16 else "float32 (this CPU has no bf16 instructions)"
        flags = as_flags(changed, list(changed))
        print(
            f"{script}: no GPU found (torch.cuda.is_available() is False): {where}, computing in {dtype}"
            + (f", CPU-sized defaults: {flags}" if flags else ""),
            flush=True,
        )
    return dataclasses.replace(args, **changed)


def help_groups(cls, cpu_sizes: dict, shown: dict | None = None):
    """A dataclass of dataclasses, one per comment rule of `cls` ('# --- sampling'), each with the fields below its
    rule, their docstrings as help: what tyro draws as a box per group."""
    import tyro

    source, fields, groups = textwrap.dedent(inspect.getsource(cls)), {f.name: f for f in dataclasses.fields(cls)}, {}
    rules = [(n, m[1]) for n, text in enumerate(source.splitlines(), 1) if (m := re.match(r"\s*# --- (.+)", text))]
    body = ast.parse(source).body[0].body
    for a, b in zip(body, body[1:] + [None]):  # a field, and the docstring under it
        if isinstance(a, ast.AnnAssign):
            f, cpu = fields[a.target.id], cpu_sizes.get(a.target.id)
            doc = " ".join(b.value.value.split()) if isinstance(b, ast.Expr) else ""
            hint = None if cpu is None else (lambda default, cpu=cpu: f"(default: {default}; CPU: {cpu})")
            words = (shown or {}).get(a.target.id)  # a default that stands for others: what it stands for
            hint = (lambda default, words=words: f"(default: {words})") if words else hint
            default = () if f.default is dataclasses.MISSING else (f.default,)
            title = next((t for n, t in reversed(rules) if n < a.lineno), "flags")
            arg = tyro.conf.arg(help=doc, help_behavior_hint=hint)
            groups.setdefault(title, []).append((f.name, Annotated[f.type, arg], *default))
    boxes = [dataclasses.make_dataclass(f"Group{k}", g) for k, g in enumerate(groups.values())]
    named = [(f"group{k}", Annotated[box, tyro.conf.arg(name=t)]) for k, (t, box) in enumerate(zip(groups, boxes))]
    return dataclasses.make_dataclass(cls.__name__, named)


def given_flags(argv: list[str]) -> set[str]:
    """Field names of the flags on a command line: '--max-new-tokens=64' -> 'max_new_tokens'."""
    return {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}


def as_flags(values: dict, names: list[str]) -> str:
    """'--policy-loss cispo --correction-bounds 0.5 2.0 --no-scale-rewards': flags as a command line gives them."""

    def one(k, v):
        flag = k.replace("_", "-")
        if isinstance(v, bool):
            return f"--{'' if v else 'no-'}{flag}"
        return f"--{flag} {' '.join(map(str, v)) if isinstance(v, (list, tuple)) else v}"

    return " ".join(one(k, values[k]) for k in names)


def check_engine(kind: str, flag: str = "--rollout-engine") -> str:
    """'auto' -> 'sglang' with a GPU, 'hf' without; SGLang must be installed and have a GPU."""
    import importlib.util

    import torch

    cuda = torch.cuda.is_available()
    if kind == "sglang" and not cuda:
        raise InputError(f"{flag} sglang needs a CUDA GPU and none was found: use {flag} hf")
    if kind != "hf" and cuda and importlib.util.find_spec("sglang") is None:
        raise InputError(
            "SGLang is not installed: pip install -r requirements.txt (SGLang 0.5.16 pins torch 2.11), "
            f"or {flag} hf to generate with plain transformers (slow)"
        )
    kind = kind if kind != "auto" else ("sglang" if cuda else "hf")
    # Container images often set PYTHONDONTWRITEBYTECODE: with no bytecode compiled in the image, this process and
    # each one SGLang spawns compile torch, transformers and SGLang from source (82-89 s to step 1 vs 44-46 s, H100)
    uncached = sys.dont_write_bytecode and not os.path.exists(importlib.util.cache_from_source(torch.__file__))
    if kind == "sglang" and uncached and os.environ.get("RANK", "0") == "0":
        print(
            "note: PYTHONDONTWRITEBYTECODE is set and torch has no compiled bytecode, so every process compiles torch "
            "and SGLang from source (~40 s more start-up on an H100): unset PYTHONDONTWRITEBYTECODE to cache it",
            flush=True,
        )
    return kind


# ----------------------------------------------------------------------------------------------
# Models

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
TINY_MODEL_HINT = f"for a CPU try-out build a tiny one: python {TINY_MODEL} ./tiny-model, then --model ./tiny-model"


def not_a_model_folder(name: str, path: str) -> str | None:
    """What a folder a user may take for a model (`name` as given, `path` expanded) is instead, and the folder to
    pass: a checkpoint (its model/), a run's folder (its newest checkpoint's model/), a LoRA adapter (its checkpoint's
    merged model/, else how to make one). None: none of them."""
    if os.path.isfile(os.path.join(path, "model", "config.json")):
        return f"is a checkpoint: pass its model folder, {os.path.join(name, 'model')}"
    if os.path.isfile(os.path.join(path, "args.json")):
        steps = sorted(glob.glob(os.path.join(path, "checkpoints", "step_*[0-9]", "model")))
        if steps:
            return f"is a run's folder: pass a checkpoint's model folder, its newest {steps[-1]}"
        return "is a run's folder and has no checkpoint to evaluate or start from (it ran with --save-every -1?)"
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        merged = os.path.join(os.path.dirname(os.path.normpath(path)), "model")
        if os.path.isfile(os.path.join(merged, "config.json")):
            return f"is a LoRA adapter (PEFT's files): its checkpoint's model with the adapter merged in is {merged}"
        with open(os.path.join(path, "adapter_config.json")) as f:
            base = json.load(f).get("base_model_name_or_path")
        return (
            f"is a LoRA adapter (PEFT's files) of {base or 'a base model'}: pass a model with it merged in "
            f"(PEFT's merge_and_unload, then save_pretrained)"
        )
    return None


def check_model(
    name: str,
    flag: str = "--model",
    with_tokenizer: bool = True,
    raw_text: bool = True,
    rollout_tp: int = 1,
    generates: bool = False,
):
    """Before anything starts: the model is a folder with config.json, weights and (with_tokenizer) a tokenizer, or a
    hub id that is cached or reachable, and SGLang can split it over `rollout_tp` GPUs; `generates` (a policy, a model
    to evaluate): not a reward model or critic (a scoring head). Returns (tokenizer or None, context length or None);
    raw_text: said (no template)."""
    from transformers import AutoConfig, AutoTokenizer  # lazy: `import preflight` stays light
    from transformers.utils import logging

    from data import looks_like_path  # lazy, as transformers

    # transformers' bars at every model load and save fill log files; the run prints its own lines
    logging.disable_progress_bar()
    if looks_like_path(name):
        path = os.path.expanduser(name)
        if not os.path.isdir(path):
            what = "is a file, not a folder" if os.path.isfile(path) else f"does not exist ({os.path.abspath(path)})"
            raise InputError(
                f"{flag} {name!r} {what}: pass a folder holding config.json, the weights and the "
                f"tokenizer, or a hub id like Qwen/Qwen2.5-0.5B-Instruct"
                + f";\n  {TINY_MODEL_HINT}"
                * (flag == "--model")
            )
        files = set(os.listdir(path))
        missing = [
            what
            for what, ok in (
                ("config.json", "config.json" in files),
                ("weights (*.safetensors or *.bin)", any(f.endswith((".safetensors", ".bin")) for f in files)),
                (
                    "tokenizer files (tokenizer.json or tokenizer_config.json)",
                    files & set(TOKENIZER_FILES) or not with_tokenizer,
                ),
            )
            if not ok
        ]
        if missing and (problem := not_a_model_folder(name, path)):  # a checkpoint, a run, an adapter
            raise InputError(f"{flag} {name!r} {problem}")
        if missing:
            raise InputError(
                f"{flag} {name!r} has no {' and no '.join(missing)}: a model folder needs them "
                f"(a checkpoint's is runs/<run>/checkpoints/step_N/model); copy the missing files in"
            )
        if problem := weights_problem(path):
            raise InputError(f"{flag} {name!r}: {problem}: a copy or download cut short? copy the file again")
    else:
        hub_reachable(name, flag)
    try:
        config = AutoConfig.from_pretrained(name)
        tokenizer = AutoTokenizer.from_pretrained(name) if with_tokenizer else None
        backend = type(getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)).__name__
        if tokenizer is not None and tokenizer.clean_up_tokenization_spaces and backend == "BPE":
            # transformers ignores it for BPE tokenizers and warns at every decode: say False outright
            tokenizer.clean_up_tokenization_spaces = False
    except (OSError, ValueError, ImportError) as e:
        raise InputError(
            f"{flag} {name!r}: transformers could not load its config or tokenizer: {first_line(e)}"
        ) from e
    scorer = [a for a in config.architectures or [] if a.endswith(("SequenceClassification", "TokenClassification"))]
    if generates and scorer:  # it would load as a causal LM: its score head dropped, an output head it never trained
        where = "--reward-model" if scorer[0].endswith("SequenceClassification") else "ppo.py's --critic-model"
        raise InputError(
            f"{flag} {name!r} is a {scorer[0]} (config.json), a model that scores text and can't generate it: "
            f"pass it as {where}, and a causal LM (*ForCausalLM) as {flag}"
        )
    if problem := tp_problem(config, rollout_tp):
        raise InputError(f"--rollout-tp {rollout_tp} can't split {flag} {name} over {rollout_tp} GPUs: {problem}")
    context = getattr(config, "max_position_embeddings", None)
    if with_tokenizer and os.environ.get("RANK", "0") == "0":
        template = (
            "chat template"
            if tokenizer.chat_template
            else "no chat template" + ": prompts go in as raw text" * raw_text
        )
        print(f"model {name}: {(config.architectures or ['?'])[0]}, context {context}, {template}", flush=True)
    return tokenizer, context


def first_line(e: BaseException) -> str:
    """An exception's first line of text, or its type's name where it has none."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def tp_problem(config, tp: int) -> str | None:
    """Why SGLang's tensor parallelism over `tp` GPUs can't split this model (its attention heads and MLP split
    evenly; KV heads split evenly or are copied to each GPU: tp a multiple of them), None if it can."""
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    mlp = getattr(config, "intermediate_size", None)
    if tp == 1 or heads is None:
        return None
    if heads % tp:
        return f"it has {heads} attention heads (SGLang needs a --rollout-tp that divides them)"
    if kv % tp if kv >= tp else tp % kv:
        return f"it has {kv} key-value heads (SGLang needs a --rollout-tp that divides them or is a multiple of them)"
    if mlp is not None and mlp % tp:
        return f"its MLP is {mlp} wide (SGLang needs a --rollout-tp that divides it)"
    return None


def weights_problem(folder: str) -> str | None:
    """Without reading the weights: a *.safetensors file shorter than its header says or without one, or a shard
    that the index names and the folder lacks (a copy or download cut short); None if none."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    for name in files:
        size = os.path.getsize(os.path.join(folder, name))
        n, header = safetensors_header(os.path.join(folder, name))
        try:
            ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
        except (AttributeError, TypeError, KeyError):  # not JSON, not UTF-8 (cut short), not a header
            return f"{name} ({size:,} bytes) has no readable safetensors header"
        if 8 + n + max(ends, default=0) > size:
            return f"{name} is {size:,} bytes, less than its header says ({8 + n + max(ends, default=0):,})"
    if os.path.isfile(index := os.path.join(folder, "model.safetensors.index.json")):
        with open(index) as f:
            lost = sorted(set(json.load(f).get("weight_map", {}).values()) - set(files))
        if lost:
            return f"model.safetensors.index.json names {', '.join(lost)}, not in the folder"
    return None


def safetensors_header(path: str) -> tuple[int, dict | None]:
    """A *.safetensors file's header length and its JSON header (tensor name -> dtype, shape, data_offsets), the
    weights unread (the format: 8 bytes of header length, the JSON header, the data); the header None where it is not
    JSON, not UTF-8 (a file cut short) or not a table."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        try:
            header = json.loads(f.read(min(n, os.path.getsize(path))))
        except ValueError:  # a UnicodeDecodeError too
            return n, None
    return n, header if isinstance(header, dict) else None


def parameter_count(name: str) -> int | None:
    """The parameters of model `name` from its safetensors headers, the weights unread: a local folder, or a hub id's
    downloaded snapshot; None where there is no header to read (.bin weights, a hub id not downloaded yet)."""
    from data import looks_like_path  # lazy: `import preflight` stays light

    folder = os.path.expanduser(name)
    if not looks_like_path(name):
        from huggingface_hub import try_to_load_from_cache

        config = try_to_load_from_cache(name, "config.json")
        folder = os.path.dirname(config) if isinstance(config, str) else None
    if not folder or not os.path.isdir(folder):
        return None
    headers = [safetensors_header(os.path.join(folder, f))[1] for f in os.listdir(folder) if f.endswith(".safetensors")]
    try:
        return sum(math.prod(t["shape"]) for h in headers for k, t in h.items() if k != "__metadata__") or None
    except (AttributeError, TypeError, KeyError):  # a header it can't read (weights_problem names it in a folder)
        return None


TRAINED_BYTES, FROZEN_BYTES = 16, 2  # on the GPUs a parameter: fp32 weight and gradient + AdamW's 2 moments; bf16


def state_bytes(params: int, *, lora: bool, reference: bool) -> int:
    """The training state of a model of `params` parameters over all GPUs: TRAINED_BYTES a parameter for full
    fine-tuning, FROZEN_BYTES for a LoRA base (its adapter's few aside), and FROZEN_BYTES more for a reference model
    (--beta > 0; LoRA's reference is its own base)."""
    return params * ((FROZEN_BYTES if lora else TRAINED_BYTES) + FROZEN_BYTES * (reference and not lora))


def varlen_runs(device, config) -> bool:
    """Whether --attn-implementation varlen (fsdp.varlen_attention: torch's FlashAttention-2 kernel) can train
    `config`'s model on `device`: a GPU of compute capability 8.0 or more (Ampere, Hopper), a torch that ships
    torch.nn.attention.varlen, and attention without logit soft-capping (Gemma 2)."""
    import importlib.util

    import torch

    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
        return False
    if getattr(config, "attn_logit_softcapping", None):
        return False
    try:
        return importlib.util.find_spec("torch.nn.attention.varlen") is not None
    except ModuleNotFoundError:
        return False


def compiler_problem(device_type: str) -> str | None:
    """Why torch.compile could not build its kernels on a `device_type` ('cuda', 'cpu') machine, or None: on a GPU,
    Triton builds each kernel's launcher with a C compiler ($CC, else gcc or clang on the PATH, as Triton looks); on a
    CPU, Inductor compiles C++ ($CXX, g++ or clang++)."""
    if device_type == "cuda":
        if os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang"):
            return None
        return "no C compiler for Triton's kernels ($CC, gcc or clang): install gcc (apt-get install gcc) or set CC"
    if os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++"):
        return None
    return "no C++ compiler for Inductor's kernels ($CXX, g++ or clang++): install g++ (apt-get install g++) or set CXX"


def state_problem(params: int, *, lora: bool, reference: bool, world_size: int, gpu_bytes: int) -> str | None:
    """What --model's training state needs of each GPU where it can't fit before a single activation (None where it
    can): full fine-tuning TRAINED_BYTES a parameter, a LoRA base FROZEN_BYTES (its adapter's few aside), the
    reference model (--beta > 0 without LoRA) FROZEN_BYTES more, FSDP2 sharding it all over the ranks. --offload
    moves it off the GPU only while the engine generates: the update needs it whole."""
    total = state_bytes(params, lora=lora, reference=reference)
    need = total / world_size
    if need <= 0.95 * gpu_bytes:  # CUDA's context and the engine's leftovers take the rest, activations come on top
        return None
    gib, gpus = 2**30, math.ceil(total / (0.95 * gpu_bytes))
    what = "a LoRA base in bf16" if lora else "full fine-tuning: fp32 weights and gradients, AdamW's two moments"
    fixes = f"train on {gpus} GPUs or more (torchrun --nproc_per_node {gpus}: FSDP2 shards it over them)"
    fixes += "" if lora else f", or a LoRA adapter (--lora-rank 8: the base frozen in bf16, {params * 2 / gib:.0f} GiB)"
    return (
        f"--model's {params / 1e9:.1f}B parameters need {total / gib:.0f} GiB of training state ({what}"
        + ", the reference model in bf16" * (reference and not lora)
        + f"), {need / gib:.0f} GiB on each of {world_size} GPU(s), over this GPU's {gpu_bytes / gib:.0f} GiB before "
        f"any activation (--offload frees it only while the engine generates): {fixes}"
    )


def hub_reachable(name: str, flag: str):
    """A hub id must be in the local cache or reachable: one quick request, not a minute of retries."""
    from huggingface_hub import try_to_load_from_cache

    from data import hub_unreachable  # lazy, as huggingface_hub

    if os.environ.get("HF_HUB_OFFLINE") == "1" or isinstance(try_to_load_from_cache(name, "config.json"), str):
        return  # cached: transformers reads it without the network
    if why := hub_unreachable(name, flag):
        raise InputError(
            f"{flag} {name!r} is not a local folder, not in the Hugging Face cache, and the hub "
            f"can't be reached ({why});\n  pass a local folder, or {TINY_MODEL_HINT}"
        )
