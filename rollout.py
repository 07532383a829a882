"""Generation: an in-process SGLang Engine on the training GPUs, or plain transformers on the CPU.

    engine = start_engine("sglang", model_path, seed=0, sglang=SGLangOptions(mem_fraction=0.6))  # then memory.release
    sampling = Sampling(max_new_tokens=256, stop_ids=stop_token_ids(tokenizer, model_path), temperature=1.0)
    samples = generate(engine, prompt_ids, seeds, sampling=sampling, tokenizer=tokenizer)   # list[Sample]
    stats = mismatch_stats(batch)     # sampler vs trainer log-probs of a collated batch: did the sync work? KL, ...

What the training scripts call, with the Rollout that server.start_rollout gives (engine, TP group, sampling, ...):

    pending = send_prompts(rollout, sampler, prompts, n=32, group_size=16, seeds=(0, "sample", step))  # a step's
    samples = pending.result()                                                 # this rank's, each prompt's G in a row
    stats = step_rollout_stats(samples, pending, generate_s=9.5)  # the step's rollout/ metrics
    metrics = held_out_eval(rollout, eval_prompts, step=step, k=0, temperature=1.0, top_p=1.0, seed=0)  # eval/ ...

Both engines answer SGLang's calls (`generate`, `update_weights_from_tensor`, `flush_cache`,
`release/resume_memory_occupation`), so the loop and memory.py read the same on a laptop as on a GPU
node. `HFEngine`'s release/resume do nothing, but it refuses to generate while released. Token ids
in, token ids out: a sample's tokens are exactly the ones the sampler drew.

Tensor parallel size k: ranks are cut into groups of k; the first rank of each group owns an engine
spanning the group's k GPUs, the others have `engine=None` and send their prompts to the owner.
"""

import asyncio
import atexit
import contextlib
import dataclasses
import functools
import logging
import math
import multiprocessing
import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from data import Sample, distinct, label, sample_seeds, seed_for, shard
from common import EngineStartFailed, Interrupted, agreed_signal, all_reduce, interruptible
from reward import eval_stats, rollout_stats, sampled_eval_stats

# ----------------------------------------------------------------------------------------------
# Engines


@dataclass
class SGLangOptions:
    """How SGLang starts (grpo.py and ppo.py fill it from their --sglang-* flags)."""

    mem_fraction: float = 0.6  # share of the GPU for SGLang's weights + KV cache while awake
    tp_size: int = 1  # GPUs one engine spans (tensor parallel)
    attention_backend: str = "triton"
    sampling_backend: str = "pytorch"
    cuda_graph_max_bs: int | None = None  # largest decode batch captured as a CUDA graph (None: SGLang's)
    disable_cuda_graph: bool = False
    prefill_cuda_graph: bool = False
    load_format: str = "dummy"  # "dummy": weights only from the sync; "auto": read the checkpoint
    log_level: str = "error"
    deterministic: bool = False  # SGLang's deterministic inference (--deterministic-rollout); the HF engine's too
    lora_rank: int = 0  # > 0: LoRA served (--lora-sync adapter), adapters up to this rank on `lora_targets`
    lora_targets: tuple[str, ...] = ()  # the adapted layers' names (lora.check_lora), SGLang's --lora-target-modules

    def lora_flags(self) -> dict:
        """SGLang's LoRA settings for --lora-sync adapter (none without): the policy's adapter in every batch."""
        if not self.lora_rank:
            return {}
        return dict(
            enable_lora=True,
            max_lora_rank=self.lora_rank,
            lora_target_modules=list(self.lora_targets),
            max_loras_per_batch=2,  # SGLang counts the base model as one
            lora_strict_loading=True,  # adapter tensors that fit no layer: an error, not skipped with a warning
        )


def graph_batch(requests: int, given: int | None) -> int | None:
    """The largest decode batch to capture as a CUDA graph for an engine or server that runs `requests`
    at once: `given` (--sglang-cuda-graph-max-bs) if set, else `requests` where it exceeds SGLang's
    default (256 on an H100/H200), else None (SGLang's). Beyond its largest graph SGLang decodes without
    graphs, launch-bound on a small model: a server sent 512 samples ran 0.63x a colocated engine's
    per-GPU rate at SmolLM2 (bench/results/README.md, decoupled rollout)."""
    return given if given is not None else (requests if requests > 256 else None)


def start_sglang(model_path: str, *, gpu_id: int, seed: int = 0, options: SGLangOptions | None = None):
    """Start an SGLang Engine in this process (its scheduler runs in child processes on GPUs
    gpu_id .. gpu_id+tp_size-1). Release its memory (memory.release) until the first weight sync.

    Call this before building the training state: SGLang sizes its KV cache from the GPU memory it
    finds free, so it must see an empty GPU. `options.mem_fraction` is the share of the whole GPU
    that SGLang's weights + KV cache take while awake.

    load_format="dummy": no checkpoint read; weights are random until the first `sync_weights`
    (before every generation), so a parameter that sync forgot shows up as garbage, not stale.

    prefill_cuda_graph=False: SGLang's piecewise prefill graphs (torch.compile) cost ~45 s of a
    fresh machine's start-up and ~15 s warm, for no throughput we could measure on RL's one big
    prefill per step (bench/results/README.md, start-up). Decode graphs stay on.

    sleep_on_idle=True: with nothing to do, SGLang's scheduler otherwise polls its sockets in a loop, a CPU core at 100%
    (its idle_sleeper.py says so), also while it sleeps through the trainer's log-prob and update phases, whose torch
    threads take every core; it waits on the sockets instead, and a request wakes it at once. Measured on one H200
    (SmolLM2 addition, bench/results/cpu_side_ab_h200.json): the old log-probs and update 1.93x faster, generate
    0.2-0.4 s slower, the step 1.09x faster.

    deterministic: SGLang's `enable_deterministic_inference` (0.5.16, server_args.py): batch-invariant matmul,
    log-softmax and reductions, fixed attention splits, the pytorch sampler (it sets that itself), and each request
    sampled from its own `sampling_seed` (a Gumbel draw keyed by seed and position; without the mode SGLang ignores
    the seed). CUDA graphs, radix cache and chunked prefill stay on: the mode aligns prefill chunks itself, and keeps
    the radix cache on triton and fa3. With tp_size > 1 it exports NCCL_ALGO=allreduce:tree in this process too.
    """
    from sglang.srt.entrypoints.engine import Engine  # lazy: SGLang needs CUDA; CPU runs and tests never import it

    # The object first, then its start: a start cut short (Ctrl-C, a failure) still leaves an
    # engine whose processes can be stopped, and whose atexit shutdown can be taken back.
    engine = Engine.__new__(Engine)
    engine.run_scheduler_process_func = functools.partial(run_without_signals, Engine.run_scheduler_process_func)
    engine.run_detokenizer_process_func = functools.partial(run_without_signals, Engine.run_detokenizer_process_func)
    before = set(multiprocessing.active_children())
    o = options or SGLangOptions()
    logging.getLogger("sglang.srt.entrypoints.engine").addFilter(not_the_handler_line)
    quit_while_starting.ran = False
    with without_agent_store():  # SGLang's schedulers inherit our environment and host their own group's store
        try:
            engine.__init__(
                model_path=model_path,
                skip_tokenizer_init=True,
                load_format=o.load_format,
                dtype="bfloat16",
                enable_memory_saver=True,
                mem_fraction_static=o.mem_fraction,
                base_gpu_id=gpu_id,
                tp_size=o.tp_size,
                random_seed=seed,
                attention_backend=o.attention_backend,
                sampling_backend=o.sampling_backend,
                cuda_graph_max_bs_decode=o.cuda_graph_max_bs,
                disable_cuda_graph=o.disable_cuda_graph,
                log_level=o.log_level,
                cuda_graph_backend_prefill=None if o.prefill_cuda_graph else "disabled",
                enable_deterministic_inference=o.deterministic,
                custom_sigquit_handler=quit_while_starting,
                sleep_on_idle=True,
                **o.lora_flags(),
            )  # a failed scheduler's SIGQUIT ends the start, not the process
        except BaseException as e:  # Ctrl-C during start-up, or a failed start: stop what was started
            engine.processes = [p for p in multiprocessing.active_children() if p not in before]
            stop_engine(engine, None)
            # a scheduler failed: quit_while_starting ran whether its Interrupted is e or was swallowed where
            # Python ignores exceptions (a callback after a fork: then e is SGLang's own error)
            if not (quit_while_starting.ran or isinstance(e, Exception)):  # Ctrl-C, SIGTERM: friendly_errors says so
                raise
            what = (
                "its error is above"
                if quit_while_starting.ran
                else f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
            )
            raise EngineStartFailed(
                f"the rollout engine (SGLang) failed while starting, on GPU {gpu_id} with mem_fraction "
                f"{o.mem_fraction} ({what}); nothing was trained or written"
            ) from e
    engine.processes = [p for p in multiprocessing.active_children() if p not in before]  # scheduler(s), detokenizer
    return engine


def not_the_handler_line(record) -> bool:  # SGLang logs the SIGQUIT handler it is given as an error, every start
    return not record.getMessage().startswith("Using custom SIGQUIT handler")


def run_without_signals(target, *args, **kwargs):
    """An SGLang process (scheduler, detokenizer) that ignores Ctrl-C and SIGTERM. In a terminal,
    Ctrl-C reaches the whole process group, and Slurm signals every process of a job: the engine
    must not die of them (that would look like a crash), the trainer stops it itself when it has
    saved what it should (stop_engine). A Ctrl-C in the few seconds before this line runs (the
    child importing the script) can still end the child, with its KeyboardInterrupt traceback. Its
    progress bars get a thread lock, as the trainer's (stop.EngineWatch says why)."""
    from tqdm import tqdm  # lazy: only in SGLang's processes

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tqdm.set_lock(threading.RLock())
    return target(*args, **kwargs)


@contextmanager
def without_agent_store():
    """Under torchrun, TORCHELASTIC_USE_AGENT_STORE makes every new TCPStore a client of torchrun's
    store: one this process (or a child inheriting its environment) must host itself would wait
    forever. Hidden meanwhile (SGLang's start, the weight-update group's rendezvous)."""
    saved = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = saved


def quit_while_starting(signum, frame):
    """SGLang's `custom_sigquit_handler` (rollout.start_sglang). A scheduler that fails while starting prints its
    traceback and sends us SIGQUIT; SGLang's own handler would SIGKILL the whole process tree (exit 137, its
    traceback last). This one cuts the start short, once (each TP rank sends one): the start stops what it began
    and says what failed (start_sglang reads `.ran`: SIGQUIT's state can be inherited). Not a lambda: SGLang pickles it."""
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)
    quit_while_starting.ran = True
    raise Interrupted(signum)


def stop_engine(engine, watch=None):
    """Stop the engine's processes (and theirs), on purpose: its `watch` (a stop.EngineWatch) first, so that it does not
    report them.

    Not sglang.Engine.shutdown(): it kills every child of this process, multiprocessing's resource
    tracker too, and the tracker relaunched at exit prints a KeyError traceback for each semaphore
    it never saw. Safe to call twice."""
    if watch is not None:
        watch.close()
    if engine is None:
        return
    atexit.unregister(engine.shutdown)
    kill(getattr(engine, "processes", []))


def kill(processes: list):
    """SIGKILL these multiprocessing processes and all of their children; wait for them."""
    victims = list(processes)
    with contextlib.suppress(ImportError):
        import psutil  # SGLang depends on it; the CPU stand-in engine has no grandchildren

        for p in processes:
            with contextlib.suppress(psutil.Error):
                victims += psutil.Process(p.pid).children(recursive=True)
    for p in victims:
        with contextlib.suppress(Exception):  # gone already
            p.kill()
    for p in processes:
        p.join(timeout=10)


class HFEngine:
    """A plain-transformers stand-in for sglang.Engine (CPU runs, tests, notebooks). Like SGLang it
    holds its own unsharded copy of the model: weights arrive only through `update_weights_from_tensor`.
    It generates ROWS requests at a time (its logits, [rows, tokens, vocab] in fp32, stay bounded).
    `deterministic` (--deterministic-rollout): each request samples from its own seed (GumbelNoise), so a sample does
    not depend on the batch it is in nor its place there; the same seeds again give the same tokens. An adapter
    arrives through `load_lora_adapter_from_tensors`, applied to the requests that name it (lora_path) as in SGLang."""

    ROWS = 64

    def __init__(self, model_path: str, dtype: torch.dtype = torch.float32, seed: int = 0, deterministic: bool = False):
        from transformers import AutoModelForCausalLM  # lazy

        self.model, self.dtype = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval(), dtype
        self.params = dict(self.model.named_parameters())
        self.released: set[str] = set()  # kept by memory.release/resume, as for sglang.Engine
        self.seed, self.deterministic = seed, deterministic
        self.processes = []  # it runs in this process (SGLang's Engine: its scheduler and detokenizer)
        self.loop = asyncio.new_event_loop()  # drives multi-turn episodes, as SGLang's Engine.loop
        self.lora_name = None  # the adapter loaded (load_lora_adapter_from_tensors)

    def update_weights_from_tensor(self, named_tensors, flush_cache: bool = True):
        for name, tensor in named_tensors:
            if name not in self.params:
                raise KeyError(f"weight sync sent {name!r}, which the generation model does not have")
            self.params[name].data.copy_(tensor)

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors: dict, config_dict: dict, load_format=None):
        """SGLang's call: the adapter's tensors under PEFT's names, its adapter_config.json as a dict."""
        from lora import apply_lora, load_adapter, lora_modules  # lazy

        if self.lora_name is not None:
            return {"success": False, "error_message": f"adapter {self.lora_name!r} is loaded: unload it first"}
        if not lora_modules(self.model):  # the first adapter: LoRA layers on the engine's copy, as SGLang's enable_lora
            apply_lora(
                self.model, config_dict["r"], config_dict["lora_alpha"], config_dict["target_modules"], self.dtype
            )
        load_adapter(self.model, tensors)
        self.lora_name = lora_name
        return {"success": True}

    def unload_lora_adapter(self, lora_name: str):
        self.lora_name = None if lora_name == self.lora_name else self.lora_name
        return {"success": True}

    def flush_cache(self):
        pass

    def release_memory_occupation(self, tags=None):
        pass  # nothing to free on the CPU; memory.release records the state in `released`

    def resume_memory_occupation(self, tags=None):
        pass

    def generate(self, input_ids, sampling_params, return_logprob=False, lora_path=None):
        """Batched HF generate with left padding, ROWS requests at a time; returns SGLang-shaped outputs. lora_path: the
        adapter each request names (one for the batch here), None: the base model, as SGLang."""
        from lora import adapter_off  # lazy

        if self.released & {"weights", "kv_cache"}:
            raise RuntimeError(f"generate while {sorted(self.released)} are released")
        name = lora_path[0] if lora_path else None
        if name is not None and name != self.lora_name:
            raise ValueError(f"a request names LoRA adapter {name!r}, which is not loaded")
        rows = [slice(i, i + self.ROWS) for i in range(0, len(input_ids), self.ROWS)]
        with adapter_off(self.model) if name is None else contextlib.nullcontext():
            return [out for r in rows for out in self.generate_rows(input_ids[r], sampling_params[r], return_logprob)]

    @torch.no_grad()
    def generate_rows(self, input_ids, sampling_params, return_logprob):
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper  # lazy

        sp = sampling_params[0]  # one setting for the rows
        stop_ids, pad = sp["stop_token_ids"], sp["stop_token_ids"][0]
        P = max(len(p) for p in input_ids)
        ids = torch.tensor([[pad] * (P - len(p)) + p for p in input_ids])  # [B, P]
        mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in input_ids])
        greedy = sp["temperature"] == 0
        seeds = [p.get("sampling_seed", self.seed) for p in sampling_params]
        own = self.deterministic and not greedy
        if own:  # each row its own noise; the token by argmax (GumbelNoise)
            warpers = [TemperatureLogitsWarper(sp["temperature"]), TopPLogitsWarper(sp["top_p"]), GumbelNoise(seeds)]
        else:
            warpers = []
            torch.manual_seed(seeds[0])  # one random stream for the rows: a sample depends on its batch
        # deterministic kernels while generating (the trainer's setting kept, and restored after)
        was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(was[0] or self.deterministic, warn_only=was[1])
        try:
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=sp["max_new_tokens"],
                do_sample=not (greedy or own),
                temperature=None if greedy or own else sp["temperature"],
                top_p=None if greedy or own else sp["top_p"],
                top_k=None,
                logits_processor=LogitsProcessorList(warpers),
                eos_token_id=stop_ids,
                pad_token_id=pad,
                output_logits=True,
                return_dict_in_generate=True,
            )
        finally:
            torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        new = out.sequences[:, P:]  # [B, N]
        logits = torch.stack(out.logits, dim=1).float()  # [B, N, V]
        logp = torch.log_softmax(logits / (1.0 if greedy else sp["temperature"]), -1)
        logp = logp.gather(-1, new[..., None]).squeeze(-1)  # [B, N]
        results = []
        for row, row_logp in zip(new.tolist(), logp.tolist()):
            n = next((i + 1 for i, t in enumerate(row) if t in stop_ids), len(row))
            finish = "stop" if row[n - 1] in stop_ids else "length"
            meta = {"finish_reason": {"type": finish}}
            if return_logprob:
                meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(row_logp[:n], row[:n])]
            results.append({"output_ids": row[:n], "meta_info": meta})
        return results

    async def async_generate(self, input_ids, sampling_params, return_logprob=False, lora_path=None):
        """One request, as SGLang's Engine.async_generate (here it runs at once: on the CPU, one
        episode generates while the others wait for their tools)."""
        return self.generate([input_ids], [sampling_params], return_logprob, [lora_path] if lora_path else None)[0]

    def shutdown(self):
        pass


class GumbelNoise:
    """A transformers logits processor, last after temperature and top-p: adds to each row's scores Gumbel noise from
    a generator of the row's own seed, one draw per vocabulary entry and token. Greedy decoding of the result samples
    softmax(scores) (the Gumbel-max trick, as SGLang's deterministic sampler), each row's tokens a function of its
    seed and its own logits only."""

    def __init__(self, seeds: list[int]):
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # scores [B, V]
        u = torch.stack([torch.rand(scores.shape[-1], generator=g, dtype=torch.float64) for g in self.generators])
        return scores + (-torch.log(-torch.log(u))).to(scores.dtype)  # u = 0: -inf, never chosen


def start_engine(
    kind: str, model_path: str, *, seed: int, sglang: SGLangOptions | None = None, dtype: torch.dtype = torch.float32
):
    """'sglang' (on this rank's GPU) or 'hf' (CPU stand-in). `engine.processes` lists the child
    processes it started (SGLang's scheduler and detokenizer), for stop.EngineWatch. `dtype`: the HF engine's
    (the trainer's compute dtype, so log-probs match); SGLang's is bf16. `sglang.deterministic` holds for either."""
    if kind == "sglang":
        return start_sglang(model_path, gpu_id=torch.cuda.current_device(), seed=seed, options=sglang)
    return HFEngine(model_path, dtype=dtype, seed=seed, deterministic=bool(sglang and sglang.deterministic))


def stop_token_ids(tokenizer, model_path: str) -> list[int]:
    """Token ids that end a response: the tokenizer's EOS plus the model's generation_config EOS.
    (Chat models often end turns with a token, like <|im_end|>, that only one of them names.)"""
    from transformers import GenerationConfig  # lazy

    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        eos = None
    ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    ids = list(dict.fromkeys(ids))  # dedupe, keep order
    if not ids:
        raise ValueError(f"{model_path!r}: neither the tokenizer nor generation_config.json names an EOS token")
    return ids


# ----------------------------------------------------------------------------------------------
# Generation


@dataclass
class Sampling:
    """How each response is sampled: SGLang's sampling params, less the per-request seed."""

    max_new_tokens: int
    stop_ids: list[int]  # token ids that end a response (stop_token_ids)
    temperature: float = 1.0  # 0: greedy; log-probs are of the distribution at this temperature
    top_p: float = 1.0

    def params(self, seed: int) -> dict:
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stop_token_ids": self.stop_ids,
            "sampling_seed": seed,
        }


@dataclass
class TPGroup:
    """The ranks that share one engine (--rollout-tp k): the first rank of each k owns it."""

    process_group: object | None  # None for k = 1
    owner: int  # the owner's global rank


def tp_group(tp_size: int) -> TPGroup:
    """Cut the ranks into groups of `tp_size`; this rank's group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % tp_size:
        raise ValueError(f"--rollout-tp {tp_size} must divide the number of ranks ({world})")
    mine, owner = None, rank - rank % tp_size
    for start in range(0, world, tp_size):  # every rank must create every group, in order
        group = dist.new_group(list(range(start, start + tp_size))) if tp_size > 1 else None
        if start == owner:
            mine = group
    return TPGroup(mine, owner)


def generate(
    engine,
    prompt_ids: list[list[int]],
    seeds: list[int],
    *,
    sampling: Sampling,
    tokenizer=None,
    tp: TPGroup | None = None,
    tool_use=None,
) -> list[Sample]:
    """Sample one completion per prompt (repeat a prompt to get a group). Token ids in, token ids
    and per-token log-probs out. Each request carries its own `seeds[i]` (SGLang 0.5.16 samples by it in
    its deterministic mode only; the HF engine seeds a batch with the first, or each row by its own with
    `deterministic`). With `tool_use`, each sample is an episode of turns and tool replies (`episode`).
    A signal cuts the generation short: no samples then.

    With a TP group, non-owner ranks (engine=None) send their prompts to the group's owner, which
    generates for the whole group and sends each rank its own samples back.
    """
    return send(engine, prompt_ids, seeds, sampling=sampling, tokenizer=tokenizer, tp=tp, tool_use=tool_use).result()


def generate_groups(
    engine,
    prompt_ids: list[list[int]],
    k: int,
    *,
    seeds: list[int],
    sampling: Sampling,
    tokenizer=None,
    tp: TPGroup | None = None,
    tool_use=None,
    max_requests: int = 4096,
) -> list[list[Sample]]:
    """k samples of each prompt, the j-th with seed seed_for(seeds[i], j) (`seeds`: one a prompt, e.g. from its index
    among the held-out prompts: the same samples on any number of ranks), as [prompt][k] (pass@k and maj@k's input).
    At most `max_requests` a call (SGLang 0.5.16 runs up to 4096 at once; GSM8K's 1319 test prompts x 16 are 21k),
    in one call with a TP group (its ranks must make as many calls: preflight.sampling_rules caps K there)."""
    per_call = len(prompt_ids) if tp is not None else max(max_requests // max(k, 1), 1)  # prompts a call
    groups = []
    for lo in range(0, len(prompt_ids), per_call):
        ids = [p for p in prompt_ids[lo : lo + per_call] for _ in range(k)]
        samples = generate(
            engine,
            ids,
            [x for s in seeds[lo : lo + per_call] for x in distinct([seed_for(s, j) for j in range(k)])],  # per prompt
            sampling=sampling,
            tokenizer=tokenizer,
            tp=tp,
            tool_use=tool_use,
        )
        groups += [samples[i : i + k] for i in range(0, len(samples), k)]
    return groups


def send(
    engine,
    prompt_ids: list[list[int]],
    seeds: list[int],
    *,
    sampling: Sampling,
    tokenizer=None,
    tp: TPGroup | None = None,
    tool_use=None,
    ahead: bool = False,
) -> "Pending":
    """`generate`'s first half: the group's requests gathered on the owner and run there, at once,
    or with `ahead` in a thread of their own while the caller goes on (--async-rollout: the next
    batch generates while this one trains). Every rank of the group calls `.result()` next."""
    group = tp.process_group if tp is not None else None
    requests, pending = (prompt_ids, seeds), Pending(tp)
    if group is not None:
        gathered = [None] * dist.get_world_size(group) if dist.get_rank() == tp.owner else None
        dist.gather_object(requests, gathered, dst=tp.owner, group=group)
        if dist.get_rank() == tp.owner:
            requests = ([p for g in gathered for p in g[0]], [s for g in gathered for s in g[1]])
            pending.sizes = [len(g[0]) for g in gathered]
    if engine is not None:
        run = functools.partial(
            run_requests, engine, *requests, sampling=sampling, tokenizer=tokenizer, tool_use=tool_use
        )
        pending.start(run) if ahead else pending.run(run)
    return pending


@dataclass
class Rollout:
    """How this rank gets its samples, as a step's generation and an evaluation take it: its engine (None on a rank
    whose TP group's owner generates for it), that TP group, the sampling settings, the tokenizer (tool episodes) and
    the tools' runner (None: one turn). server.start_rollout makes it."""

    engine: object | None
    tp: TPGroup
    sampling: Sampling
    tokenizer: object = None
    tool_use: object = None  # tools.ToolUse: how samples call tools


def send_prompts(
    rollout: Rollout, sampler, prompts, *, n: int, group_size: int, seeds: tuple, ahead: bool = False
) -> "Pending":
    """A step's rollout, sent: `n` prompts drawn (`sampler`, a data.PromptSampler; all ranks draw the same), this
    rank's share of them (`prompts`: data.Prompts), each `group_size` times in a row, each sample seeded from its place
    in the step's draw (data.sample_seeds(*seeds, ...): the same on any number of ranks). `.result()` gives the samples; the Pending also holds which prompt each is of (`sample_idx`),
    the data position before the draw (`before`: a checkpoint's while the batch generates) and `ahead` (in the
    background, --async-rollout, with the weights the engine has now)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    before = sampler.state_dict()
    drawn = sampler.draw(n)  # every rank's prompts
    sample_idx = [i for i in shard(drawn, rank, world_size) for _ in range(group_size)]
    pending = send(
        rollout.engine,
        [prompts.ids[i] for i in sample_idx],
        shard(sample_seeds(*seeds, prompts=len(drawn), group_size=group_size), rank, world_size),
        sampling=rollout.sampling,
        tool_use=rollout.tool_use,
        tokenizer=rollout.tokenizer,
        tp=rollout.tp,
        ahead=ahead,
    )
    pending.sample_idx, pending.before, pending.ahead = sample_idx, before, ahead
    return pending


def step_rollout_stats(samples: list[Sample], pending: "Pending", *, generate_s: float) -> dict:
    """A step's rollout/ metrics, all ranks': what its samples scored, their lengths and the engine's tokens a second
    (reward.rollout_stats; its seconds: `pending`'s own when it was sent ahead, --async-rollout and --max-staleness,
    else the generate phase's `generate_s`) and their staleness: updates between the weights that sampled a sample's
    oldest token and the trained ones (1 sent ahead, else 0; fully async, producer.py: each sample's own), its mean and
    largest, with the fully async producer's share of samples a weight update interrupted and resumed, the groups it
    has dropped as staler than --max-staleness so far, the share of samples at each staleness 0..k
    (rollout/staleness_frac_j) and how many weight versions sampled the step's tokens."""
    stats = rollout_stats(samples, seconds=pending.seconds if pending.ahead else generate_s)
    staleness = getattr(pending, "staleness", None) or [float(pending.ahead)] * len(samples)  # one per sample
    total, count = all_reduce(torch.tensor([float(sum(staleness)), float(len(staleness))]))
    stats["rollout/staleness"] = float(total / count.clamp(min=1))
    stats["rollout/staleness_max"] = float(all_reduce(float(max(staleness, default=0)), dist.ReduceOp.MAX))
    if hasattr(pending, "partial"):  # fully async: how stale, by share of samples; how many weight versions sampled
        stats["rollout/partial_frac"] = float(all_reduce(float(pending.partial)) / count.clamp(min=1))
        stats["rollout/dropped_groups"] = float(pending.dropped)
        ks = range(int(stats["rollout/staleness_max"]) + 1)
        shares = all_reduce(torch.tensor([float(sum(s == k for s in staleness)) for k in ks])) / count.clamp(min=1)
        stats |= {f"rollout/staleness_frac_{k}": float(share) for k, share in zip(ks, shares)}
        versions = {v for s in samples for v in (s.versions or [])}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, versions)
        stats["rollout/versions"] = float(len(set().union(*gathered)))  # the weight versions of the step's tokens
    return stats


def held_out_eval(
    rollout: Rollout, prompts, *, step: int, k: int, temperature: float, top_p: float, seed: int
) -> dict | None:
    """Greedy accuracy on the held-out `prompts` (data.Prompts; the engine awake), each rank a strided share, with the
    rollout's token limit and stop tokens; with k > 0, k samples a prompt too, at `temperature` and `top_p` (seeded by
    `seed`, `step` and the prompt): avg@k, pass@1..k, maj@k (reward.sampled_eval_stats). Returns the eval/ metrics of
    all ranks, or None where a signal cut the generation short (common.agreed_signal: every rank returns None)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    share = range(rank, len(prompts.ids), world_size)
    prompt_ids, examples = [prompts.ids[i] for i in share], [prompts.examples[i] for i in share]
    on = dict(tokenizer=rollout.tokenizer, tp=rollout.tp, tool_use=rollout.tool_use)
    greedy = dataclasses.replace(rollout.sampling, temperature=0.0, top_p=1.0)
    samples = generate(rollout.engine, prompt_ids, [0] * len(share), sampling=greedy, **on)
    sampled = dataclasses.replace(rollout.sampling, temperature=temperature, top_p=top_p)
    seeds = [seed_for(seed, "eval", step, i) for i in share]  # a prompt's own, whichever rank evaluates it
    groups = generate_groups(rollout.engine, prompt_ids, k, seeds=seeds, sampling=sampled, **on) if k else []
    if agreed_signal():
        return None
    label(samples + sum(groups, []), examples + [ex for ex in examples for _ in range(k)])
    out = eval_stats(samples, sources=prompts.sources)
    return out | (sampled_eval_stats(groups, sources=prompts.sources) if k else {})


def run_requests(
    engine, prompts: list[list[int]], seeds: list[int], *, sampling: Sampling, tokenizer, tool_use
) -> list[Sample]:
    if tool_use is None:
        outputs = engine.generate(
            input_ids=prompts,
            sampling_params=[sampling.params(s) for s in seeds],
            return_logprob=True,
            **adapter_named(engine, len(prompts)),
        )
        return [read_output(prompt, out, sampling, tokenizer) for prompt, out in zip(prompts, outputs)]
    # the engine's own event loop drives the episodes (SGLang's Engine owns one); tool_use: tools.ToolUse
    episodes = [tool_use.episode(engine, prompt, seed, sampling=sampling) for prompt, seed in zip(prompts, seeds)]
    return engine.loop.run_until_complete(all_or_none(episodes))


class Pending:
    """A generation sent (`send`): `result()` waits for it on the owner and hands each rank of the
    group its samples. Only the engine's work runs in the background thread; the collectives stay
    with the caller, in order. The script may hang its own bookkeeping on it (which prompts)."""

    def __init__(self, tp: TPGroup | None):
        self.tp, self.sizes, self.samples, self.error, self.mine = tp, None, [], None, None
        self.seconds = 0.0  # the engine's time on it (on the owner)
        self.done = threading.Event()
        self.done.set()

    def run(self, fn):
        """Now, in this thread; a signal cuts it short (no samples)."""
        t0 = time.perf_counter()
        try:
            with interruptible():
                self.samples = fn()
        except Interrupted:  # Ctrl-C or SIGTERM: the loop stops at its next check
            self.samples = []
        self.seconds = time.perf_counter() - t0

    def start(self, fn):
        """In a daemon thread; an exception there is raised by `result()`, in the trainer."""

        def target():
            t0 = time.perf_counter()
            try:
                self.samples = fn()
            except BaseException as e:  # noqa: BLE001 (it goes to the trainer)
                self.error = e
            self.seconds = time.perf_counter() - t0
            self.done.set()

        self.done.clear()
        threading.Thread(target=target, daemon=True, name="rollout-ahead").start()

    def result(self) -> list[Sample]:
        """This rank's samples (a collective over the TP group, once). A signal while waiting: none."""
        if self.mine is not None:
            return self.mine
        try:
            with interruptible():
                while not self.done.wait(0.5):
                    pass
        except Interrupted:
            self.samples = []
        if self.error is not None:
            raise self.error
        samples = self.samples
        if self.tp is not None and self.tp.process_group is not None:
            if dist.get_rank() == self.tp.owner:
                starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
                scatter = [samples[s : s + n] for s, n in zip(starts, self.sizes)]  # [] each if cut short
            mine = [None]
            dist.scatter_object_list(
                mine,
                scatter if dist.get_rank() == self.tp.owner else None,
                src=self.tp.owner,
                group=self.tp.process_group,
            )
            samples = mine[0]
        self.mine = samples
        return samples


def adapter_named(engine, n: int | None) -> dict:
    """The LoRA adapter every request must name once lora.sync_adapter loaded one (--lora-sync adapter): a request
    that names none generates with the base model, silently. `n` requests (None: one, as async_generate takes it)."""
    name = getattr(engine, "adapter", None)
    return {} if name is None else {"lora_path": name if n is None else [name] * n}


def read_output(prompt: list[int], out: dict, sampling: Sampling, tokenizer=None) -> Sample:
    """An engine's output for one request (SGLang's shape) -> a Sample of the tokens it sampled."""
    finish = out["meta_info"]["finish_reason"]
    if finish["type"] == "abort":
        raise RuntimeError(
            f"SGLang aborted a request: {finish.get('message')}; a prompt of {len(prompt)} "
            f"tokens + {sampling.max_new_tokens} new may exceed the engine's context length"
        )
    response = list(out["output_ids"])
    logprobs = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    if len(logprobs) != len(response):
        raise RuntimeError(f"engine returned {len(response)} tokens but {len(logprobs)} log-probs")
    # Truncated = stopped by the length limit before any stop token (a response whose last
    # allowed token happens to be EOS is complete, though SGLang reports 'length').
    truncated = finish["type"] == "length" and not (response and response[-1] in sampling.stop_ids)
    text = tokenizer.decode(response, skip_special_tokens=True) if tokenizer is not None else ""
    return Sample(prompt_ids=prompt, response_ids=response, rollout_logprobs=logprobs, truncated=truncated, text=text)


async def all_or_none(coroutines) -> list:
    """Run coroutines concurrently; the first exception surfaces, and the others are cancelled
    (and awaited: no task is left pending on the loop)."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def mismatch_stats(batch, touched: torch.Tensor | None = None) -> dict:
    """The sampler vs the trainer (rollout_logprobs vs old_logprobs) on the model's tokens, all ranks: the mean
    |log-prob difference|, small (bf16 numerics, ~0.02-0.05) when the engine generated with the trainer's weights and
    large if the sync missed or corrupted something; KL(sampler || trainer) by k3 with r = p_trainer / p_sampler
    (r - 1 - log r); the largest r; given `touched` [B, T-1], the share of tokens a rollout correction capped or masked."""
    m = batch.response_mask  # [B, T-1]
    log_r = ((batch.old_logprobs - batch.rollout_logprobs) * m).clamp(-20.0, 20.0)  # a -inf log-prob: finite, not inf
    # clamped log_r: one wild token can't overflow the mean; k3 >= 0 but for fp32's rounding where r is near 1
    k3 = (torch.exp(log_r) - 1 - log_r).clamp(min=0)
    corrected = (touched.float() * m).sum() if touched is not None else torch.zeros(())
    tokens, gap, kl, corrected = all_reduce(torch.stack([m.sum(), log_r.abs().sum(), (k3 * m).sum(), corrected]))
    largest = all_reduce(log_r.masked_fill(m == 0, -math.inf).max(), dist.ReduceOp.MAX)
    tokens = tokens.clamp(min=1)
    stats = {
        "rollout/logprob_abs_diff": float(gap / tokens),
        "rollout/mismatch_kl": float(kl / tokens),
        "rollout/mismatch_ratio_max": float(largest.exp()),
    }
    return stats if touched is None else {**stats, "rollout/correction_frac": float(corrected / tokens)}
