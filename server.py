"""PLUMBING: an SGLang server on GPUs of its own, or on another node, as the rollout engine
(grpo.py --rollout-mode server --rollout-url http://HOST:PORT). The user starts it with SGLang's
own launcher, and for several GPUs or nodes SGLang's router in front:

    python -m sglang.launch_server --model-path Qwen/Qwen2.5-1.5B-Instruct --port 30000 --base-gpu-id 1
    engine = ServerEngine(["http://localhost:30000"], timeout_s=600)   # waits for /health_generate

or the job starts them itself on GPUs of its own (grpo.py --rollout-mode server --rollout-gpus k):

    urls, processes = launch_servers(model, gpus=[6, 7], tp_size=1, seed=0, options=SGLangOptions(), log_dir=run_dir)
    engine = ServerEngine(urls, timeout_s=600, processes=processes)    # watched, and stopped with the run
    engine.generate(input_ids=[[...], ...], sampling_params=[{...}, ...], return_logprob=True)

`start_rollout` starts either kind for grpo.py and ppo.py: the colocated engines (rollout.start_engine), or the
servers at --rollout-url, or those it launches (--rollout-gpus); rank 0 speaks to servers for every rank.

`generate` and `async_generate` take and return what sglang.Engine's do (token ids in, token ids
and per-token log-probs out), so rollout.generate and rollout.episode drive either. Requests go
over HTTP to SGLang's `/generate` (endpoints of SGLang 0.5.16); a batch is split evenly over the
URLs (data parallel over servers), each part sent as one request. Nothing here waits without a
limit: a server that does not answer within `timeout_s` ends the run with an error naming it.

Weights go to the servers over NCCL, never through disk or HTTP (SGLang's distributed weight
update). The trainer's rank 0 and every server's TP ranks form one group; rank 0 broadcasts:

    rank 0 (trainer)     server 1: ranks 1 .. tp1     server 2: ranks tp1+1 .. tp1+tp2   ...
    `update_weights_from_tensor(bucket)` announces the bucket's names, dtypes and shapes to each
    server (/update_weights_from_distributed), then broadcasts it as one flat byte tensor, which
    the servers' ranks receive and load. memory.sync_weights drives it as it drives sglang.Engine.

With --lora-sync adapter the base weights go that way once; each adapter after them is written to `adapter_dir`
(PEFT's format) and each server loads it from there (/load_lora_adapter): that folder must be one the servers
read at the same path (this machine, or a shared file system). The servers run with --enable-lora.
"""

import asyncio
import dataclasses
from dataclasses import dataclass
import datetime
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, wait

import torch
import torch.distributed as dist

from rollout import Rollout, Sampling, SGLangOptions, graph_batch, kill, start_engine, tp_group, without_agent_store
from memory import ALL_TAGS, release
from preflight import engine_count, first_line
from common import InputError, Interrupted, RunFailed, requested
from stop import EngineWatch

SHAPES = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)
LAUNCH_HINT = "start it with: python -m sglang.launch_server --model-path <the policy's model> --port <port>"
STUCK_S = 10.0  # a /health_generate 503 this slow is SGLang's failed health check (20 s), not a server starting
SIGNAL_GRACE_S = 5.0  # a weight sync under way when a signal comes gets this long to finish: a server left
# inside a broadcast that never ends is stuck until it is restarted


class ServerError(RunFailed):
    """A rollout server failed, stalled, could not be reached or serves another model; the message names the
    URL. The run ends with it, no traceback, exit code 1 (a RunFailed), or 2 if it is a ServerInputError."""


class ServerInputError(ServerError, InputError):
    """The user's own servers can't serve from the start (their URLs, their model, the sync address): bad input."""


def post(url: str, path: str, payload: dict, timeout_s: float):
    """POST JSON to url + path (payload None: GET) and read the answer (JSON, or the text some of
    SGLang's calls answer with); any failure -> ServerError naming the URL."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            body = answer.read()
            return json.loads(body) if body[:1] in (b"{", b"[") else body.decode()
    except urllib.error.HTTPError as e:  # the server answered with an error: its message is the useful part
        raise ServerError(f"rollout server {url}{path} answered {e.code}: {error_text(e.read())}") from None
    except TimeoutError:
        raise ServerError(
            f"rollout server {url}{path} did not answer within --rollout-timeout {timeout_s:g} s"
        ) from None
    except (urllib.error.URLError, ConnectionError) as e:
        reason = getattr(e, "reason", e)
        raise ServerError(f"rollout server {url}{path} cannot be reached ({reason}); is it still running?") from None


def in_thread(fn, *args, **kwargs) -> Future:
    """fn(*args, **kwargs) in a daemon thread. A request in flight never holds the process at exit (the
    workers of a ThreadPoolExecutor are joined at exit: a stalled server would keep a stopped run
    alive until its timeout)."""
    future = Future()

    def run():
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 (it goes to whoever waits on the future)
            future.set_exception(e)

    threading.Thread(target=run, daemon=True, name="rollout-http").start()
    return future


def wait_healthy(url: str, timeout_s: float, every_s: float = 2.0, process: "ServerProcess | None" = None):
    """Wait until the server generates (`/health_generate`: 503 at once while it starts, 200 once it can
    produce a token). Not up within `timeout_s` -> ServerError saying how to start one; a `process`
    of ours that exits meanwhile -> ServerError with the end of its log, at once. A 503 that took
    STUCK_S or more is SGLang's own health check failing on a server that is up (its scheduler did not
    answer a one-token request for 20 s): it will not recover by waiting -> ServerError at once."""
    deadline, last = time.time() + timeout_s, "no answer"
    while True:
        if process is not None and process.poll() is not None:
            raise ServerError(
                f"the rollout server {url} (GPUs {process.gpus}) exited with code {process.returncode} while "
                f"starting; the end of its log {process.log}:\n{tail(process.log)}"
            )
        t0 = time.time()
        try:  # SGLang answers within its 20 s health-check limit: a longer wait than that is no answer
            with urllib.request.urlopen(url + "/health_generate", timeout=max(1.0, min(30.0, timeout_s))) as answer:
                if answer.status == 200:
                    return
        except urllib.error.HTTPError as e:
            if e.code == 503 and time.time() - t0 >= STUCK_S:
                raise ServerError(
                    f"rollout server {url} is up but its scheduler did not generate one token in "
                    f"{time.time() - t0:.0f} s (SGLang's health check failed): it is stuck, e.g. waiting "
                    f"inside a weight sync whose trainer died mid-way, and will not recover: restart it"
                ) from None
            last = f"HTTP {e.code}"  # starting
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            last = str(getattr(e, "reason", e))
        if time.time() >= deadline:
            raise ServerError(
                f"no rollout server ready at {url} after {timeout_s:g} s (last: {last}); "
                + (f"its log: {process.log}" if process else LAUNCH_HINT)
            )
        time.sleep(every_s)


class ServerEngine:
    """sglang.Engine's generate/async_generate over HTTP, on one or several servers (or a router)."""

    def __init__(
        self,
        urls: list[str],
        *,
        timeout_s: float,
        start_timeout_s: float | None = None,
        model: str | None = None,
        sync_backend: str | None = None,
        sync_address: str | None = None,
        processes: list | None = None,
        batch: int = 0,
        deterministic: bool = False,
        lora_rank: int = 0,
        adapter_dir: str | None = None,
    ):
        """Wait for every server, refuse one that serves another model than `model`; with
        `sync_backend` ('nccl', 'gloo', 'auto': NCCL on GPUs, gloo on CPUs) form the weight-update
        group, this process listening at `sync_address` (default: its address on the route to the
        first server). `processes`: the servers' own processes where this job started them
        (launch_servers), one per URL: stop.EngineWatch watches them, stop_engine stops them, and
        they are stopped here if the start fails. `batch`: the samples each server decodes at once (check_graphs).
        `deterministic` (--deterministic-rollout): refuse a server without SGLang's deterministic inference.
        `lora_rank` > 0: every server must serve LoRA adapters of that rank (--lora-sync adapter), written to
        `adapter_dir`."""
        self.urls = [u.rstrip("/") for u in urls]
        self.lora_rank, self.adapter_dir, self.loaded_adapters = lora_rank, adapter_dir, 0
        self.timeout_s = timeout_s
        self.processes = processes or []  # the user's servers: none; their timeouts do the watch's job
        self.loop = asyncio.new_event_loop()  # drives multi-turn episodes (rollout.episode), as SGLang's Engine's
        self._next, self.group = 0, None  # round-robin over the URLs for single requests
        try:
            self.start(model, start_timeout_s, sync_backend, sync_address, batch, deterministic)
        except BaseException as e:  # a failed start, or Ctrl-C: nothing of ours left running
            kill(self.processes)
            if isinstance(e, ServerError) and not self.processes:  # the user's servers: --rollout-url and the like
                raise ServerInputError(*e.args) from None
            raise

    def start(
        self,
        model: str | None,
        start_timeout_s: float | None,
        sync_backend: str | None,
        sync_address: str | None,
        batch: int,
        deterministic: bool = False,
    ):
        for url, process in zip(self.urls, self.processes or [None] * len(self.urls)):
            wait_healthy(url, self.timeout_s if start_timeout_s is None else start_timeout_s, process=process)
        infos = [post(url, "/server_info", None, self.timeout_s) for url in self.urls]  # SGLang's settings of each
        if model is not None:
            for url, info in zip(self.urls, infos):
                check_same_model(url, info, model, self.timeout_s)
        check_graphs(self.urls, infos, batch)
        if deterministic:
            check_deterministic(self.urls, infos)
        check_lora(self.urls, infos, self.lora_rank)
        if sync_backend == "auto":
            sync_backend = "nccl" if torch.cuda.is_available() else "gloo"
        if sync_backend == "nccl":
            check_nccl_memory(self.urls, infos)
        self.backend = sync_backend
        self.group = self.join_weight_sync(infos, sync_backend, sync_address) if sync_backend else None

    def generate(
        self,
        input_ids: list[list[int]],
        sampling_params: list[dict],
        return_logprob: bool = False,
        lora_path: list[str] | None = None,
    ) -> list[dict]:
        """A batch, split into one contiguous part per URL, the parts sent concurrently. lora_path: each request's
        adapter (--lora-sync adapter), as sglang.Engine's."""
        n, k = len(input_ids), len(self.urls)
        bounds = [n * i // k for i in range(k + 1)]
        parts = [(url, lo, hi) for url, lo, hi in zip(self.urls, bounds, bounds[1:]) if hi > lo]
        futures = [
            in_thread(
                post,
                url,
                "/generate",
                {
                    "input_ids": input_ids[lo:hi],
                    "sampling_params": sampling_params[lo:hi],
                    "return_logprob": return_logprob,
                    **({"lora_path": lora_path[lo:hi]} if lora_path else {}),
                },
                self.timeout_s,
            )
            for url, lo, hi in parts
        ]
        return [out for f in futures for out in f.result()]

    async def async_generate(
        self, input_ids: list[int], sampling_params: dict, return_logprob: bool = False, lora_path: str | None = None
    ) -> dict:
        """One request (one turn of an episode), on the next URL; the event loop stays free meanwhile."""
        url = self.urls[self._next % len(self.urls)]
        self._next += 1
        payload = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": return_logprob}
        payload |= {"lora_path": lora_path} if lora_path else {}
        return await asyncio.wrap_future(in_thread(post, url, "/generate", payload, self.timeout_s), loop=self.loop)

    def join_weight_sync(self, infos: list[dict], backend: str, address: str | None):
        """Form the weight-update group (`infos`: each server's /server_info). Each server's side of
        the init blocks until every member has joined, so the requests go out first and this process
        joins while they wait."""
        sizes = []
        for url, info in zip(self.urls, infos):
            if info.get("dp_size", 1) > 1 and not info.get("enable_dp_attention"):
                raise ServerError(
                    f"rollout server {url} runs --dp-size {info['dp_size']}: SGLang's weight update needs "
                    f"one data-parallel rank per server; start one server per GPU group and pass each URL"
                )
            sizes.append(info.get("tp_size", 1))
        host = self.urls[0].split("://")[-1].rsplit(":", 1)[0]
        address = address or reachable_address(host)
        with socket.socket() as s:  # a free port for the group's store (rank 0 hosts it)
            s.bind(("", 0))
            port = s.getsockname()[1]
        world = 1 + sum(sizes)
        self.group_name = f"weight_sync_{address}_{port}"  # a new name for each trainer: a server outlives restarts
        requests = [
            in_thread(
                post,
                url,
                "/init_weights_update_group",
                {
                    "master_address": address,
                    "master_port": port,
                    "rank_offset": 1 + sum(sizes[:i]),
                    "world_size": world,
                    "group_name": self.group_name,
                    "backend": backend,
                },
                self.timeout_s + 5,
            )
            for i, url in enumerate(self.urls)
        ]
        # rank 0 joins in a thread, watched together with the requests: a server that fails its side
        # (it cannot reach address:port, say) must not leave us waiting for the whole timeout
        joined = in_thread(
            join_group,
            address=address,
            port=port,
            world_size=world,
            rank=0,
            group_name=self.group_name,
            backend=backend,
            timeout_s=self.timeout_s + 10,  # the group's own collectives' limit: past settle's deadline (its docstring)
        )
        self.settle(
            joined,
            requests,
            what="forming the weight-update group",
            late=f"can the servers reach this machine at {address}:{port}? (--rollout-sync-address)",
        )
        return joined.result()

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, torch.Tensor]], flush_cache: bool = True):
        """sglang.Engine's call, over NCCL: announce the bucket to every server, then broadcast its
        tensors as one flat byte tensor (SGLang's "flattened_bucket" format, in order)."""
        payload = {
            "names": [n for n, _ in named_tensors],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named_tensors],
            "shapes": [list(t.shape) for _, t in named_tensors],
            "group_name": self.group_name,
            "flush_cache": flush_cache,
            "load_format": "flattened_bucket",
        }
        requests = [
            in_thread(post, url, "/update_weights_from_distributed", payload, self.timeout_s + 5) for url in self.urls
        ]
        flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for _, t in named_tensors])  # [bytes]
        self.settle(
            in_thread(broadcast, flat, self.group),
            requests,
            what="the weight sync",
            late="is every server still running?",
        )

    def settle(self, work: Future, requests: list[Future], *, what: str, late: str):
        """Wait for this process's side of a collective (`work`, in a thread of its own) and every server's answer to
        its part (`requests`, one per URL), polling: the main thread never sits in a collective. The first error on
        either side, --rollout-timeout, or a signal (after SIGNAL_GRACE_S for the sync to finish) ends the wait, and
        the group is aborted: a collective cut short leaves it unusable. The requests' own HTTP timeout is 5 s longer
        and the group's own 10 s, so that for a server that says nothing this deadline speaks, with `late`'s hint."""
        deadline, signalled = time.time() + self.timeout_s, None
        while True:
            errors = [r.exception() for r in requests if r.done() and r.exception()]  # the server's own words first
            if errors or (work.done() and work.exception()):
                self.abort()
                # this side's collective let out of gloo before the process exits (a dead peer's closed socket ends it
                # at once): a thread whose C++ call returns during the interpreter's finalization re-takes the GIL in
                # pybind11's noexcept destructor, and CPython 3.11's pthread_exit there is std::terminate ('terminate
                # called without an active exception', exit -6 instead of 1: seen once in CI as a server died)
                wait([work], timeout=5)
                raise ServerError(
                    f"{what} failed: {errors[0]}{self.hint(str(errors[0]))}"
                    if errors
                    else f"{what} to the rollout servers {', '.join(self.urls)} failed ({first_line(work.exception())}); "
                    f"{late}"
                ) from None
            if work.done() and all(r.done() for r in requests):
                return
            signalled = signalled or (time.time() if requested() else None)
            if signalled and time.time() > signalled + SIGNAL_GRACE_S:
                self.abort()
                raise Interrupted(
                    requested(), f"{what} to the rollout servers, which had not finished {SIGNAL_GRACE_S:g} s later"
                )
            if time.time() > deadline:
                silent = [url for url, r in zip(self.urls, requests) if not r.done()]
                self.abort()
                raise ServerError(
                    f"{what} did not finish within --rollout-timeout {self.timeout_s:g} s (no answer from "
                    f"{', '.join(silent) if silent else 'this side'}): {late}"
                )
            time.sleep(0.005)

    def hint(self, error: str) -> str:
        """What a failed sync's server error most likely means, where it names NCCL."""
        if "NCCL" not in error or self.backend != "nccl":
            return ""
        return (
            f"\n  the trainer's and the servers' NCCL must agree on NCCL_CUMEM_ENABLE (this trainer's: "
            f"{os.environ.get('NCCL_CUMEM_ENABLE')}; SGLang sets 0 where it starts unless it is exported there); a "
            f"server whose earlier sync was cut short (its trainer killed mid-sync) may need a restart"
        )

    def abort(self):
        """Abort the weight-update group after a failed collective (NCCL: frees a kernel still waiting on it), not
        waiting long for it. The servers keep their side: one stuck inside a broadcast needs a restart."""
        group, self.group = self.group, None
        if group is not None:
            from torch.distributed.distributed_c10d import _abort_process_group

            wait([in_thread(_abort_process_group, group)], timeout=5)

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors: dict, config_dict: dict, load_format=None):
        """sglang.Engine's call, through the disk: the adapter written to adapter_dir/lora_name (PEFT's format), then
        each server loads it from there (/load_lora_adapter). A server that refuses it: ServerError, its own words."""
        from safetensors.torch import save_file  # lazy

        if not self.loaded_adapters:  # a server that outlived its last trainer may hold one of this name
            for url in self.urls:
                try:
                    post(url, "/unload_lora_adapter", {"lora_name": lora_name}, self.timeout_s)
                except ServerError:
                    pass  # none: as expected
        folder = os.path.join(self.adapter_dir, lora_name)
        os.makedirs(folder, exist_ok=True)
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in tensors.items()},
            os.path.join(folder, "adapter_model.safetensors"),
        )
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump(config_dict, f)
        for url in self.urls:
            post(
                url,
                "/load_lora_adapter",
                {"lora_name": lora_name, "lora_path": os.path.abspath(folder)},
                self.timeout_s,
            )
        self.loaded_adapters += 1
        return {"success": True}

    def unload_lora_adapter(self, lora_name: str):
        for url in self.urls:
            post(url, "/unload_lora_adapter", {"lora_name": lora_name}, self.timeout_s)
        return {"success": True}

    def pause_generation(self):
        """--max-staleness >= 2, before a weight sync: every server stops its running requests, which answer with
        their tokens so far (finish_reason abort), and holds new ones until continue_generation (SGLang's
        /pause_generation, mode abort: a sync on an unpaused server waits for every request to drain)."""
        for pausing in [
            in_thread(post, url, "/pause_generation", {"mode": "abort"}, self.timeout_s) for url in self.urls
        ]:
            pausing.result()  # a server's error: its own words

    def continue_generation(self):
        """After the sync: the servers take requests again (SGLang's /continue_generation)."""
        for url in self.urls:
            post(url, "/continue_generation", {}, self.timeout_s)

    def flush_cache(self):
        """The prefix cache holds KV computed with the old weights."""
        for url in self.urls:
            post(url, "/flush_cache", {}, self.timeout_s)

    def release_memory_occupation(self, tags=None):
        """A server on GPUs of its own keeps its memory between rollouts (memory.py's phases: no-ops)."""

    def resume_memory_occupation(self, tags=None):
        """See release_memory_occupation."""

    def shutdown(self):
        """Only this client's loop and group end here (servers this job started: rollout.stop_engine)."""
        self.loop.close()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


@dataclass
class ServerOptions:
    """Where the rollout servers are and how the weights reach them (--rollout-mode server's flags)."""

    urls: tuple[str, ...] = ()  # --rollout-url: each server's http://HOST:PORT
    gpus: int = 0  # --rollout-gpus k: servers this job starts on the last k GPUs of rank 0's node instead
    timeout_s: float = 600.0  # --rollout-timeout: to start, answer a request or take the weights
    sync_backend: str = "auto"  # --rollout-sync-backend: NCCL on GPUs, gloo on CPUs
    sync_address: str | None = None  # --rollout-sync-address: this machine's, as the servers reach it


def start_rollout(
    kind: str,
    model: str,
    *,
    samples: int,
    eval_samples: int = 0,
    options: SGLangOptions,
    servers: ServerOptions | None = None,
    seed: int,
    dtype: torch.dtype,
    sampling: Sampling,
    tokenizer=None,
    tool_use=None,
    log_dir: str = ".",
    phase=lambda: "start-up",
) -> tuple[Rollout, EngineWatch]:
    """The rollout engines, started before any model loads (SGLang sizes its KV cache from the free memory it finds).
    `kind` "sglang" or "hf": colocated, the first rank of each options.tp_size owns one (rollout.start_engine);
    "server": rank 0 speaks to the servers for all ranks, those at servers.urls or, with servers.gpus k, servers it
    launches on the last k GPUs of its node (launch_servers, their logs in `log_dir`). Each decodes its share of `samples` (a step's,
    all ranks') or of `eval_samples` (an evaluation's) up to 1024 at once: its CUDA graphs are sized to it
    (rollout.graph_batch) unless options.cuda_graph_max_bs says: beyond, the few large evaluations decode without
    graphs rather than every start capturing thousands of batch sizes. options.deterministic and options.lora_rank
    (--lora-sync adapter, the adapter written under `log_dir`/adapter_sync for servers) hold for servers too. Its memory is released until the first weight sync, a watch ends the run
    if it dies (stop.EngineWatch, naming `phase()`), and no rank goes on before every engine has started.
    Returns (a rollout.Rollout: this rank's engine, None where it owns none, its TP group, `sampling`, `tokenizer` and
    `tool_use`; the watch)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    server = kind == "server"
    s = servers or ServerOptions()
    urls, gpus = s.urls, s.gpus
    engines = engine_count(world_size, options.tp_size, (len(urls) or gpus // options.tp_size) * server)
    batch = max(samples // engines, min(eval_samples // engines, 1024))  # decoded at once: its CUDA graphs
    options = dataclasses.replace(options, cuda_graph_max_bs=graph_batch(batch, options.cuda_graph_max_bs))
    if server:  # rank 0 speaks to the servers for all ranks, as one TP group's owner
        tp, urls, processes = tp_group(world_size), list(urls), None
        if gpus and rank == 0:  # servers of this job's own, on the last GPUs of rank 0's node
            urls, processes = launch_servers(
                model,
                gpus=list(range(torch.cuda.device_count()))[-gpus:],
                tp_size=options.tp_size,
                seed=seed,
                options=options,
                log_dir=log_dir,
            )
        engine = (
            ServerEngine(
                urls,
                processes=processes,
                model=model,
                timeout_s=s.timeout_s,
                sync_backend=s.sync_backend,
                sync_address=s.sync_address,
                batch=batch,
                deterministic=options.deterministic,
                lora_rank=options.lora_rank,
                adapter_dir=os.path.join(log_dir, "adapter_sync"),
            )
            if rank == 0
            else None
        )
    else:
        tp = tp_group(options.tp_size)
        engine = start_engine(kind, model, seed=seed, sglang=options, dtype=dtype) if rank == tp.owner else None
    release(engine, ALL_TAGS)  # until the first weight sync
    watch = EngineWatch(engine, phase=phase)  # a dead engine ends the run
    dist.barrier()  # no rank loads its model before every engine has measured free memory
    return Rollout(engine, tp, sampling, tokenizer, tool_use), watch


class ServerProcess(subprocess.Popen):
    """A server this job launched, seen as stop.EngineWatch and rollout.kill see an engine's processes
    (multiprocessing.Process's names)."""

    name = "sglang.launch_server"

    def is_alive(self) -> bool:
        return self.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.poll()

    def join(self, timeout: float | None = None):
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


def launch_servers(
    model: str,
    *,
    gpus: list[int],
    tp_size: int,
    seed: int,
    options: SGLangOptions,
    log_dir: str,
    mem_fraction: float | None = None,
    command: tuple = (sys.executable, "-m", "sglang.launch_server"),
):
    """Start one server with SGLang's own launcher per `tp_size` GPUs of `gpus` (their index on this
    node), each on a free port of this machine, its output in log_dir/rollout_server_<first GPU>.log.
    Returns their URLs and processes (not waited for: ServerEngine waits). Weights: random until the
    first sync (`options.load_format`, "dummy" as the colocated engine's). `mem_fraction` None:
    SGLang's default for a GPU of its own. One server per GPU group, not one with --dp-size: SGLang's
    distributed weight update takes one data-parallel rank per server."""
    env = {
        k: v
        for k, v in os.environ.items()  # not a torchrun worker: SGLang forms its own groups
        if k
        not in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "ROLE_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "TORCHELASTIC_USE_AGENT_STORE",
        )
        and not k.startswith("TORCHELASTIC_")
    }
    flags = {
        "--skip-tokenizer-init": True,
        "--load-format": options.load_format,
        "--dtype": "bfloat16",
        "--random-seed": seed,
        "--attention-backend": options.attention_backend,
        "--tp-size": tp_size,
        "--sampling-backend": options.sampling_backend,
        "--cuda-graph-max-bs-decode": options.cuda_graph_max_bs,
        "--disable-cuda-graph": options.disable_cuda_graph,
        "--mem-fraction-static": mem_fraction,
        "--cuda-graph-backend-prefill": None if options.prefill_cuda_graph else "disabled",
        "--enable-deterministic-inference": options.deterministic,
        "--sleep-on-idle": True,  # no core spinning beside the trainer while idle (rollout.start_sglang)
        "--log-level": "warning",
        **{f"--{k.replace('_', '-')}": v for k, v in options.lora_flags().items()},  # --lora-sync adapter
    }
    args = [
        str(x)
        for k, v in flags.items()
        if v not in (None, False)
        for x in ((k,) if v is True else (k, *v) if isinstance(v, list) else (k, v))
    ]
    urls, processes = [], []
    os.makedirs(log_dir, exist_ok=True)
    for first in gpus[::tp_size]:
        with socket.socket() as s:  # a free port (the server binds it a moment later)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = os.path.join(log_dir, f"rollout_server_{first}.log")
        with open(log, "ab") as out:
            p = ServerProcess(
                [
                    *command,
                    "--model-path",
                    model,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--base-gpu-id",
                    str(first),
                    *args,
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )  # a Ctrl-C is the trainer's to handle
        p.gpus, p.log = list(range(first, first + tp_size)), log
        urls.append(f"http://127.0.0.1:{port}")
        processes.append(p)
    return urls, processes


def die_with_parent():
    """In the server's process before it starts (Linux): SIGKILL when the trainer ends, however it
    ends (killed, out of memory), so no server is left holding a GPU. SGLang's own processes end with
    their launcher."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def tail(path: str, lines: int = 15) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:]).rstrip()


def check_same_model(url: str, info: dict, model: str, timeout_s: float):
    """Refuse a server whose model is not the policy's: its architecture, and its shapes where this
    machine can read the server's --model-path (else the first weight sync finds a mismatch)."""
    from transformers import AutoConfig  # lazy

    ours = AutoConfig.from_pretrained(model)
    fix = f"start it with --model-path {model}"
    theirs = post(url, "/model_info", None, timeout_s).get("architectures")
    if theirs and theirs != ours.architectures:
        raise ServerError(
            f"rollout server {url} serves a {theirs[0]}, the policy --model {model} is a {ours.architectures[0]}; {fix}"
        )
    try:
        config = AutoConfig.from_pretrained(info["model_path"], local_files_only=True)
    except (OSError, ValueError, KeyError):
        return
    diff = [
        f"{k} {getattr(config, k, None)} vs {getattr(ours, k, None)}"
        for k in SHAPES
        if getattr(config, k, None) != getattr(ours, k, None)
    ]
    if diff:
        raise ServerError(
            f"rollout server {url} serves {info['model_path']}, whose shapes are not the policy's "
            f"(--model {model}): {', '.join(diff)}; {fix}"
        )


def broadcast(flat: torch.Tensor, group):
    """Rank 0's side of one bucket, run in a thread of its own (NCCL's first broadcast also connects the
    group, which blocks the calling thread until every member does); returns once the bytes are sent."""
    work = dist.broadcast(flat, src=0, group=group, async_op=True)
    while not work.is_completed():  # NCCL: the GPU's kernel finished; gloo: the transfer ended
        time.sleep(0.001)
    work.wait()  # raises a failed transfer's error


def error_text(body: bytes) -> str:
    """An error answer's words: SGLang's {"success": false, "message": ...} as its message's first line, else the text."""
    text = body.decode(errors="replace")
    try:
        text = json.loads(text)["message"]
    except (ValueError, TypeError, KeyError):
        pass
    return text.strip().splitlines()[0][:500] if text.strip() else "(no message)"


def check_nccl_memory(urls: list[str], infos: list[dict]):
    """Both ends of the NCCL weight-update group must map GPU memory alike (NCCL_CUMEM_ENABLE), or the first sync fails
    on the server's side with "unhandled cuda error". SGLang sets it to 0 where it starts unless it is exported there,
    and to 1 with --enable-symm-mem (/server_info says); fsdp.init_distributed sets 0 in the trainer the same way."""
    ours = os.environ.get("NCCL_CUMEM_ENABLE")
    for url, info in zip(urls, infos):
        if info.get("enable_symm_mem") and ours != "1":
            raise ServerError(
                f"rollout server {url} runs with --enable-symm-mem, which sets NCCL_CUMEM_ENABLE=1 in its "
                f"processes, and this trainer's is {ours}: export NCCL_CUMEM_ENABLE=1 before starting the "
                f"trainer, or start the server without --enable-symm-mem"
            )
    if ours != "0" and not all(info.get("enable_symm_mem") for info in infos) and os.environ.get("RANK", "0") == "0":
        print(
            f"weight sync: NCCL_CUMEM_ENABLE={ours} is exported here; SGLang servers use 0 unless it is exported where "
            f"they start too: export the same value there, or the first sync fails",
            flush=True,
        )


def check_lora(urls: list[str], infos: list[dict], rank: int):
    """--lora-sync adapter: each server serves LoRA adapters of `rank` (its /server_info: enable_lora, max_lora_rank);
    a server that does not is bad input, named with the flags it needs."""
    for url, info in zip(urls, infos):
        if rank and not (info.get("enable_lora") and (info.get("max_lora_rank") or 0) >= rank):
            raise ServerError(
                f"rollout server {url} serves no LoRA adapter of rank {rank} (enable_lora {info.get('enable_lora')}, "
                f"max_lora_rank {info.get('max_lora_rank')}): start it with --enable-lora --max-lora-rank {rank} "
                f"--lora-target-modules <the adapted layers>, or train with --lora-sync merge"
            )


def check_graphs(urls: list[str], infos: list[dict], batch: int):
    """A server decodes beyond its largest CUDA graph without graphs, launch-bound on a small model (0.63x a colocated
    engine's rate at SmolLM2, bench/results/README.md): one line naming the flag, where a server's graphs stop short
    of the `batch` it gets (/server_info's cuda_graph_config; servers this job starts get it: rollout.graph_batch)."""
    for url, info in zip(urls, infos):
        decode = (info.get("cuda_graph_config") or {}).get("decode") or {}
        if decode.get("backend", "disabled") != "disabled" and batch > (decode.get("max_bs") or batch):
            print(
                f"rollout server {url} has CUDA graphs for decode batches up to {decode['max_bs']} and gets {batch} "
                f"samples a step: start it with --cuda-graph-max-bs-decode {batch} to decode them all in graphs",
                flush=True,
            )


def check_deterministic(urls: list[str], infos: list[dict]):
    """--deterministic-rollout: every server must run SGLang's deterministic inference (/server_info's
    enable_deterministic_inference, which rl_on_policy_target also turns on); without it a server ignores the
    requests' sampling seeds and its kernels vary with the batch, so the same seed would not give the same samples."""
    for url, info in zip(urls, infos):
        if not info.get("enable_deterministic_inference"):
            raise ServerError(
                f"rollout server {url} runs without deterministic inference, which --deterministic-rollout needs: "
                f"start it with --enable-deterministic-inference (and --attention-backend triton, fa3 or flashinfer)"
            )


def reachable_address(host: str) -> str:
    """This machine's address on the route to `host` (no packet is sent: a UDP socket's connect
    only picks the route). The servers connect to the weight-update group's store there."""
    if host in ("localhost", "127.0.0.1", "[::1]"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host.strip("[]"), 9))
        return s.getsockname()[0]


def join_group(*, address: str, port: int, world_size: int, rank: int, group_name: str, backend: str, timeout_s: float):
    """One member's side of the weight-update group, formed step for step as SGLang 0.5.16 forms
    its side (sglang.srt.utils.common.init_custom_process_group): a TCP rendezvous whose rank 0
    hosts the store, the group's name as the store's key prefix, a group beside the default one.
    Formed any other way (a plain init_process_group, other store keys), both sides wait for each
    other until the timeout."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    with without_agent_store():  # rank 0 hosts this store itself, under torchrun too
        store, rank, world_size = next(rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    # a default group bound to a GPU (fsdp.init_distributed's device_id) makes torch build a new NCCL group by
    # splitting the default group's communicator, which the servers are not in: both sides would wait forever
    default = _world.default_pg
    bound = default.bound_device_id if default is not None else None
    if bound is not None:
        default.bound_device_id = None
    try:
        group, _ = _new_process_group_helper(
            world_size,
            rank,
            [],
            Backend(backend),
            PrefixStore(group_name, store),
            group_name=group_name,
            timeout=timeout,
        )
    finally:
        if bound is not None:
            default.bound_device_id = bound
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group
