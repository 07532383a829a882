"""LoRA (Hu et al. 2021) for RL (--lora-rank R): the base model frozen in bf16, a trainable fp32 adapter on each
chosen linear layer, y = W x + (alpha / r) B A x.

    targets = check_lora(model_path, rank=8, targets=("all-linear",))  # before anything loads: bad input, one line
    policy = load_model(model_path, device, torch.bfloat16)            # the base in bf16 (fsdp.py)
    apply_lora(policy, rank=8, alpha=32, targets=targets)              # before shard_model; freezes all else
    with adapter_off(policy): ref_logp = batch_logprobs(policy, ...)   # the reference model (--beta > 0)
    for name, w in engine_weights(policy, torch.bfloat16, merge=True)  # what an engine takes: W + alpha/r B A
    save_adapter(policy, folder, full_state)                           # PEFT's adapter_model.safetensors + config

A [r, in] starts as nn.Linear's (and PEFT's) uniform init, B [out, r] at zero: the policy starts as the base model.
"LoRA Without Regret" (Schulman et al., Thinking Machines 2025): for RL even rank 1 learns as full fine-tuning does,
with LoRA on every layer (MLP too: --lora-targets all-linear, the default) at ~10x full fine-tuning's learning rate,
alpha 32 at every rank.

Why a module of our own, not PEFT: PEFT is not in the GPU image (it would travel as one more wheel), and its
LoraLayer moves the base weight to `q_proj.base_layer.weight`: every name the weight sync, the HF export and the
resume rely on would change. Here `q_proj.weight` stays where it was and the adapter sits beside it
(`q_proj.lora_A`, `q_proj.lora_B`); PEFT's names and adapter_config.json are written only where PEFT's format is
the point (save_adapter, an engine's adapter).

FSDP2: one unit per decoder layer holds both the bf16 base and the fp32 adapter. FSDP2 asks for one dtype among a
unit's *trainable* parameters (the adapter's fp32; frozen ones may differ: torch's FSDPParamGroup._init_mp_dtypes)
and casts every parameter to param_dtype (bf16) for the all-gather, so a layer computes in bf16 as in full
fine-tuning; gradients are reduce-scattered in fp32 into the fp32 adapter shards, which AdamW steps in fp32. Base
and adapter in separate units would double the all-gathers of every layer for nothing. The frozen base has no
gradient and no optimizer state; checkpoints hold the adapter and its optimizer only (checkpoint.py).
"""

import json
import math
import os
from contextlib import contextmanager

import torch

from common import InputError, RunFailed

ALL_LINEAR = "all-linear"  # every nn.Linear inside the decoder layers (PEFT's name; not the output head)
ADAPTER_NAME = "policy"  # the adapter's name at the engine: every request names it (--lora-sync adapter)
# SGLang 0.5.16's LoRA layers (sglang.srt.utils.common.SUPPORTED_LORA_TARGET_MODULES), those of a decoder layer
SGLANG_LORA_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj"}
GAP_FLOOR = 0.01  # nats: the sync check's allowance on top of ratio x level (check_gap)


class LoRALinear(torch.nn.Module):
    """A linear layer's own weight and bias (frozen, the base's dtype) plus lora_A [r, in] and lora_B [out, r]."""

    def __init__(self, linear: torch.nn.Linear, rank: int, alpha: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters: names and state dicts unchanged
        self.lora_A = torch.nn.Parameter(torch.empty(rank, self.in_features, dtype=dtype))
        self.lora_B = torch.nn.Parameter(torch.zeros(self.out_features, rank, dtype=dtype))
        torch.nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's init, as PEFT's
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.active = True  # adapter_off switches it off: the base model

    def forward(self, x):  # [..., in] -> [..., out]
        y = torch.nn.functional.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        if not self.active:
            return y
        a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)  # under FSDP2: param_dtype already, no copy
        return y + torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * self.scaling


def linear_names(model, targets) -> list[str]:
    """Names of the nn.Linear modules inside `model`'s decoder layers (_no_split_modules) that `targets` picks:
    ('all-linear',), every one; else those whose last name part is one of `targets` (PEFT's rule: 'q_proj')."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    names = []
    for layer_name, layer in model.named_modules():
        if type(layer).__name__ not in layer_classes:
            continue
        for name, module in layer.named_modules():
            if isinstance(module, (torch.nn.Linear, LoRALinear)) and name:
                if ALL_LINEAR in targets or name.rsplit(".", 1)[-1] in targets:
                    names.append(f"{layer_name}.{name}")
    return names


def apply_lora(model, rank: int, alpha: float, targets, dtype: torch.dtype = torch.float32) -> int:
    """Freeze every parameter of `model`, then put a LoRALinear (adapter in `dtype`) in place of each target linear.
    Returns how many; rank 0 does nothing (full fine-tuning). Call before shard_model (FSDP2 wraps what is there)."""
    if rank <= 0:
        return 0
    names = linear_names(model, targets)
    if not names:
        raise ValueError(f"--lora-targets {' '.join(targets)} match no linear layer of {type(model).__name__}")
    model.requires_grad_(False)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if not isinstance(getattr(parent, child), LoRALinear):
            setattr(parent, child, LoRALinear(getattr(parent, child), rank, alpha, dtype))
    return len(names)


def lora_line(model, sync: str) -> str:
    """The console's line for a LoRA model: its adapters, the share of parameters that train, how the engine gets them."""
    trained, total = sum(p.numel() for p in trainable(model)), sum(p.numel() for p in model.parameters())
    modules = [m for _, m in lora_modules(model)]
    return (
        f"LoRA: rank {modules[0].rank}, alpha {modules[0].alpha:g} on {len(modules)} linear layers: "
        f"{trained / 1e6:.2f}M of "
        f"{total / 1e6:.1f}M parameters train ({trained / total:.2%}); the engine gets them by --lora-sync {sync}"
    )


def lora_modules(model) -> list[tuple[str, LoRALinear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]


@contextmanager
def adapter_off(model):
    """The base model for the duration: every adapter of `model` switched off (no-op for a model without LoRA).
    ALGO: with --lora-rank the reference model of --beta > 0 is this: the policy's own base weights, no second copy."""
    modules = [m for _, m in lora_modules(model)] if model is not None else []
    for m in modules:
        m.active = False
    try:
        yield model
    finally:
        for m in modules:
            m.active = True


# ----------------------------------------------------------------------------------------------
# What an engine takes, what an export writes. Every rank calls these (all-gathers), in the same order.


def full(t: torch.Tensor) -> torch.Tensor:
    """A parameter's whole tensor (an all-gather of an FSDP2 shard: a collective), detached."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def delta(module: LoRALinear) -> torch.Tensor:
    """(alpha / r) B A of a LoRALinear, gathered, in fp32: what merging adds to its weight. [out, in]"""
    return module.scaling * (full(module.lora_B).float() @ full(module.lora_A).float())


@torch.no_grad()
def engine_weights(model, dtype: torch.dtype, merge: bool = True):
    """(name, whole tensor in `dtype`) of every weight as the engine names it (model.named_parameters()'s names, a tied
    weight once), one at a time: a bucket's worth is alive at once (memory.sync_weights). A LoRA layer's weight is
    W + (alpha / r) B A, summed in fp32 (merge), or W alone (merge=False: the base, for --lora-sync adapter); its
    lora_A, lora_B are never sent as weights. Without LoRA: the parameters, each cast to `dtype` before the gather."""
    seen = set()
    for prefix, module in model.named_modules():
        lora = isinstance(module, LoRALinear)
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen or (lora and pname in ("lora_A", "lora_B")):
                continue
            seen.add(id(p))
            name = f"{prefix}.{pname}" if prefix else pname
            if lora and merge and pname == "weight":
                yield name, (full(p).float() + delta(module)).to(dtype)
            else:
                yield name, full(p.to(dtype))  # cast the shard first: bf16 gathers half the bytes


def peft_name(module_name: str, which: str) -> str:
    """PEFT's key of an adapter tensor ('A' or 'B') in adapter_model.safetensors."""
    return f"base_model.model.{module_name}.lora_{which}.weight"


@torch.no_grad()
def adapter_tensors(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every adapter tensor, gathered, in `dtype`, under PEFT's names (an engine's adapter, save_adapter)."""
    out = {}
    for name, m in lora_modules(model):
        out[peft_name(name, "A")], out[peft_name(name, "B")] = full(m.lora_A).to(dtype), full(m.lora_B).to(dtype)
    return out


def adapter_config(model) -> dict:
    """PEFT's adapter_config.json of `model`'s adapter (what PEFT, SGLang and load_adapter read)."""
    modules = lora_modules(model)
    first = modules[0][1]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": getattr(model.config, "_name_or_path", None),
        "r": first.rank,
        "lora_alpha": first.alpha,
        "target_modules": sorted({name.rsplit(".", 1)[-1] for name, _ in modules}),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
    }


def merged_state_dict(model, state: dict) -> dict:
    """A full state dict of a LoRA model (names as get_model_state_dict gives them) -> the merged model's: each LoRA
    layer's weight W + (alpha / r) B A (fp32 sum), its lora_A, lora_B dropped. What transformers and SGLang load."""
    out = {k: v for k, v in state.items() if not k.endswith((".lora_A", ".lora_B"))}
    for name, m in lora_modules(model):
        w = state[f"{name}.weight"]
        out[f"{name}.weight"] = (
            w.float() + m.scaling * (state[f"{name}.lora_B"].float() @ state[f"{name}.lora_A"].float())
        ).to(w.dtype)
    return out


def save_adapter(model, path: str, state: dict):
    """PEFT's adapter folder from a full state dict of `model` (get_model_state_dict's): adapter_model.safetensors
    (fp32, PEFT's names) and adapter_config.json. Loads with peft.PeftModel.from_pretrained(base, path) and as an
    SGLang adapter (--lora-paths, /load_lora_adapter). Rank 0 writes."""
    from safetensors.torch import save_file  # lazy

    tensors = {}
    for name, _ in lora_modules(model):
        for which in "AB":
            tensors[peft_name(name, which)] = state[f"{name}.lora_{which}"].float().contiguous()
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(adapter_config(model), f, indent=2)


@torch.no_grad()
def load_adapter(model, tensors: dict[str, torch.Tensor]):
    """Copy PEFT-named adapter tensors into `model`'s LoRALinear layers (apply_lora first, same rank and targets).
    Every layer must get both of its tensors, and every tensor must find its layer: a name that matches nothing is the
    silent bug of adapter loading (the engine keeps its old adapter), so it raises here."""
    modules = dict(lora_modules(model))
    want = {peft_name(name, which): (m, which) for name, m in modules.items() for which in "AB"}
    if set(tensors) != set(want):
        extra, missing = sorted(set(tensors) - set(want)), sorted(set(want) - set(tensors))
        raise KeyError(
            f"adapter tensors do not fit the model: {len(extra)} unknown {extra[:2]}, {len(missing)} missing {missing[:2]}"
        )
    for key, t in tensors.items():
        m, which = want[key]
        getattr(m, f"lora_{which}").copy_(t)


# ----------------------------------------------------------------------------------------------
# The engine's adapter (--lora-sync adapter), and the check that the engine holds what was trained


def sync_adapter(model, engine, dtype: torch.dtype):
    """Hand `engine` the current adapter (gathered on every rank; the owner's engine takes it): the old one unloaded,
    this one loaded under ADAPTER_NAME, which every request names from then on (rollout.run_requests). SGLang's
    Engine.load_lora_adapter_from_tensors colocated (CUDA IPC, no copy through disk), a server's /load_lora_adapter
    (server.ServerEngine), the HF engine's own. A load the engine refuses ends the run: never generate with the old."""
    tensors = adapter_tensors(model, dtype)
    if engine is None:
        return  # it only helped gather
    if getattr(engine, "adapter", None):
        answer(engine.unload_lora_adapter(ADAPTER_NAME), "unloading the old adapter", RunFailed)
        engine.adapter = None
    answer(
        engine.load_lora_adapter_from_tensors(ADAPTER_NAME, tensors, adapter_config(model)),
        "loading the adapter",
        RunFailed,
    )
    engine.adapter = ADAPTER_NAME


def answer(result, what: str, error):
    """An engine's LoRAUpdateOutput (SGLang's: .success, .error_message; a server's JSON) -> raise `error` on failure."""
    ok = result.get("success") if isinstance(result, dict) else getattr(result, "success", True)
    if not ok:
        message = result.get("error_message") if isinstance(result, dict) else getattr(result, "error_message", "")
        raise error(
            f"the rollout engine refused {what} ({message}): the run stops rather than generate with the old weights"
        )


class GapCheck:
    """After a sync the engine must generate with the trained weights: the sampler-trainer log-prob gap
    (rollout/logprob_abs_diff: mean |log p_engine - log p_trainer| over the step's tokens) stays near its level at
    the first step (bf16 numerics: ~0.02-0.05 on SGLang, ~1e-6 on the HF engine in fp32). A step whose gap exceeds
    ratio x that level + GAP_FLOOR ends the run in one line: the engine generated with other weights than those
    trained (a sync that never arrived, an adapter the requests did not name, names the engine ignored). What it can't
    see: an engine one small update behind, where the change is smaller than bf16's noise; weights that stay behind
    show as the adapter moves on. ratio 0: no check."""

    def __init__(self, ratio: float):
        self.ratio, self.level = ratio, None

    def __call__(self, gap: float, step: int):
        if not self.ratio or not math.isfinite(gap):
            return
        if self.level is None:
            self.level = gap
        elif gap > self.ratio * self.level + GAP_FLOOR:
            raise RunFailed(
                f"step {step}: the sampler-trainer log-prob gap {gap:.3g} is over {self.ratio:g}x its level at the "
                f"first step ({self.level:.3g}) + {GAP_FLOOR}: the engine is not generating with the trained weights "
                f"(a weight or adapter sync that did not arrive; with --lora-sync merge also an update finer than bf16's "
                f"step at the base weights, lost when merged: --lora-sync adapter keeps it); --lora-gap-ratio 0 turns "
                f"this check off"
            )


# ----------------------------------------------------------------------------------------------
# Bad input, before anything loads


# LoRA's learning rate over full fine-tuning's: 'LoRA Without Regret' (Schulman et al., Thinking Machines, 2025) found
# ~10x the full fine-tuning optimum; here rank 1-32 at 1e-4 learned as full fine-tuning at 1e-5 (docs/lora.md)
LORA_LR_FACTOR = 10.0


def default_lr(lr: float, *, full: float, rank: int) -> float:
    """A learning-rate flag's value: as given (> 0), or for 0 (its default) `full` for full fine-tuning and
    LORA_LR_FACTOR x `full` with an adapter (`rank` > 0): at full fine-tuning's rate a LoRA run learns next to nothing."""
    return lr if lr > 0 else full * LORA_LR_FACTOR if rank > 0 else full


def lora_rules(
    *, rank: int, alpha: float, targets, sync: str, gap_ratio: float, rollout_tp: int, given: set[str]
) -> list[tuple[str, object, bool, str]]:
    """preflight.check_flags' rules for the --lora-* flags (`given`: the command line's flags by field name,
    preflight.given_flags): the others only with a rank."""
    others = {"lora_alpha": alpha, "lora_targets": " ".join(targets), "lora_sync": sync, "lora_gap_ratio": gap_ratio}
    alone = [(k, v) for k, v in others.items() if k in given and rank <= 0]
    only = "given with --lora-rank R > 0 only (--lora-rank 0, the default: full fine-tuning)"
    return [
        ("--lora-rank", rank, rank >= 0, ">= 0 (0: full fine-tuning; 1-64 for LoRA)"),
        ("--lora-alpha", alpha, 0 < alpha < math.inf, "> 0 and finite (the adapter's scale is alpha / rank)"),
        ("--lora-gap-ratio", gap_ratio, gap_ratio == 0 or gap_ratio >= 1, ">= 1 (0: no check)"),
        *[(f"--{k.replace('_', '-')}", v, False, only) for k, v in alone],
        (
            "--lora-sync",
            sync,
            not rank or sync == "merge" or not rollout_tp > 1,
            "merge with --rollout-tp > 1: pass --lora-sync merge (an adapter over TP workers is not tested here)",
        ),
    ]


def check_lora(
    model_path: str, rank: int, targets, flag: str = "--model", model_class=None, sglang: bool = False
) -> list[str]:
    """Before anything loads: `targets` pick at least one linear layer of `flag`'s model (built on the meta device from
    its config: no weights read), and with `sglang` (--lora-sync adapter on SGLang) only layers SGLang's LoRA serves.
    Returns the picked layers' names' last parts (SGLang's --lora-target-modules); [] for rank 0."""
    if rank <= 0:
        return []
    from transformers import AutoConfig, AutoModelForCausalLM  # lazy

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = (model_class or AutoModelForCausalLM).from_config(config)
    names = linear_names(model, targets)
    if not names:
        layers = sorted({n.rsplit(".", 1)[-1] for n in linear_names(model, (ALL_LINEAR,))})
        raise InputError(
            f"--lora-targets {' '.join(targets)} match no linear layer of {flag} {model_path} "
            f"({type(model).__name__}): name some of {', '.join(layers)}, or all-linear"
        )
    suffixes = sorted({n.rsplit(".", 1)[-1] for n in names})
    if sglang and (unserved := [s for s in suffixes if s not in SGLANG_LORA_MODULES]):
        raise InputError(
            f"--lora-sync adapter: SGLang serves no LoRA on {', '.join(unserved)} of {flag} {model_path}: "
            f"--lora-targets some of {', '.join(sorted(SGLANG_LORA_MODULES))}, or --lora-sync merge"
        )
    return suffixes


def trainable(model) -> list[torch.nn.Parameter]:
    """The parameters an optimizer steps: all in full fine-tuning, the adapter's (and a critic's head) with LoRA. Of an
    FSDP2 model, its shards: a forward under no_grad leaves the root's gathered copies registered in their place (in
    one process: the embedding, the head and the final norm), and an optimizer built on those would never train them,
    silently; resharding first puts the shards back (an optimizer built before any forward, as the scripts do, gets
    them anyway)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if isinstance(model, FSDPModule):
        model.reshard()
    params = [p for p in model.parameters() if p.requires_grad]
    assert not isinstance(model, FSDPModule) or all(isinstance(p, DTensor) for p in params), "unsharded parameters"
    return params


def is_lora(model) -> bool:
    return model is not None and any(isinstance(m, LoRALinear) for m in model.modules())
