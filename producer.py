"""Fully asynchronous rollout (--max-staleness k >= 2): a producer keeps the rollout servers full while the trainer
trains, and the trainer never waits for a step's slowest sample.

    producer = Producer(engine, sampler, prompts, sampling=..., group_size=16, groups_per_step=32, max_staleness=4)
    producer.start()                    # rank 0, the servers' owner: groups go out while the gate admits them
    ...the loop, each step:
    producer.pause()                    # a weight update interrupts, never drains: requests abort with their tokens
    wake_up(...)                        # the weight sync (memory.py), the servers idle
    producer.resume(version=step - 1)   # aborted requests go out again from prompt + tokens so far
    pending = producer.take(version=step - 1)   # this rank's share of B finished groups, none staler than k
    producer.close()                    # after the loop

The three pieces every fully async trainer has (shared/notes/fully-async.md: AReaL, prime-rl, verl, slime):
1. The gate: a group goes out while accepted + running < (k + v + 1) x B (v the trained weights' version, B groups a
   step), so the generator always has work and never runs more than k versions ahead.
2. Drop at consumption: a group whose oldest token was sampled by version v - k - 1 or older is discarded when the
   trainer takes it, so the bound holds for every sample, not on average; its place is taken by a new group.
3. Interrupt, then resume in the client: pause (SGLang's /pause_generation, mode abort) returns every running
   request's tokens so far with their log-probs; after the sync the request goes out again from prompt + tokens so far
   with what is left of its token budget (kept cumulative), each token keeping the version that sampled it.

Each Sample carries `versions` (one per response token); its staleness is v minus its oldest. The objective for
k >= 2 is grpo.py's decoupled PPO (--rollout-correction decoupled): the ratio clipped against the log-probs the
trainer recomputes (the proximal policy), each token weighted by proximal / sampler probability, masked above a cap.
"""

import asyncio
import threading
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from common import Interrupted, all_reduce, interruptible
from data import Sample, seed_for
from rollout import Pending, Sampling, adapter_named, all_or_none, read_output


@dataclass
class Group:
    """One prompt's G samples as the producer tracks them."""

    index: int  # the prompt's index in the training prompts
    number: int  # the producer's count of groups drawn: each sample's seed comes from it
    before: dict  # the data position before this prompt's draw (a checkpoint's, while it is unconsumed)
    samples: list[Sample] = field(default_factory=list)  # each one's tokens so far, `versions` one per token
    done: bool = False
    partial: int = 0  # samples that were interrupted by a weight update and resumed


class Producer:
    """Groups of `group_size` samples of one prompt each, drawn from `sampler` over `prompts` (data.Prompts) and sent to
    `engine` (rank 0's: a server.ServerEngine, or a stand-in with its calls), at most (k + v + 1) x `groups_per_step`
    accepted or running at once. A thread of its own runs each group (its requests in one call to the engine), so that
    the trainer's thread only takes finished ones. Rank 0 owns it; every rank calls `take`."""

    def __init__(
        self,
        engine,
        sampler,
        prompts,
        *,
        sampling: Sampling,
        group_size: int,
        groups_per_step: int,
        max_staleness: int,
        seed: int,
        tokenizer=None,
        tool_use=None,
        timeout_s: float = 600.0,
    ):
        self.engine, self.sampler, self.prompts, self.sampling = engine, sampler, prompts, sampling
        self.tool_use = tool_use  # tools.ToolUse: each sample an episode, resumed mid-turn (Resuming)
        self.G, self.B, self.k, self.seed, self.tokenizer = group_size, groups_per_step, max_staleness, seed, tokenizer
        self.timeout_s = timeout_s
        self.version, self.drawn, self.running, self.ready = 0, 0, 0, []  # ready: finished, not yet taken
        self.accepted, self.dropped = 0, 0  # groups finished and not dropped (ready or taken); dropped at take
        self.open: list[Group] = []  # drawn and not yet taken or dropped: where a checkpoint leaves the data
        self.last_take = time.perf_counter()
        self.lock, self.changed = threading.Lock(), threading.Condition()
        self.unpaused, self.closed, self.error = threading.Event(), False, None  # paused until the first resume
        self.thread, self.loop = None, None  # with tools: one event loop runs every episode (episodes)
        self.decoding = threading.Lock()  # a fast tokenizer is not for two threads at once ("Already borrowed")

    # ---- the gate, in a thread of its own ------------------------------------------------------------

    def start(self):
        if self.engine is not None:
            self.thread = threading.Thread(target=self._admit, daemon=True, name="producer")
            self.thread.start()

    def _admit(self):
        while not self.closed:
            with self.changed:
                while not self.closed and not (self.unpaused.is_set() and self._room()):
                    self.changed.wait(0.5)
                if self.closed:
                    return
                with self.lock:  # the trainer reads the data position under it
                    before = self.sampler.state_dict()
                    (index,) = self.sampler.draw(1)
                group = Group(index, self.drawn, before)
                self.drawn += 1
                self.running += 1
                self.open.append(group)
            threading.Thread(target=self._run, args=(group,), daemon=True, name=f"group-{group.number}").start()

    def _room(self) -> bool:
        """AReaL's gate: accepted + running < (k + v + 1) x B."""
        return self.accepted + self.running < (self.k + self.version + 1) * self.B

    def _run(self, group: Group):
        """The group's G requests; those a weight update aborted go out again after it, from their tokens so far."""
        try:
            if self.tool_use is not None:
                self._episodes(group)
            else:
                self._requests(group)
            with self.changed:
                group.done, self.running, self.accepted = True, self.running - 1, self.accepted + 1
                self.ready.append(group)
                self.changed.notify_all()
        except Closed:  # the producer closed while the group waited for a resume: left unfinished
            pass
        except BaseException as e:  # noqa: BLE001 (it goes to the trainer, at its next take)
            with self.changed:
                self.error = self.error or e
                self.changed.notify_all()

    def _requests(self, group: Group):
        """One turn a sample: its G requests in one call, and again for those a weight update aborted."""
        prompt = self.prompts.ids[group.index]
        group.samples = [
            Sample(prompt_ids=prompt, response_ids=[], rollout_logprobs=[], truncated=False, versions=[])
            for _ in range(self.G)
        ]
        todo, rounds = list(range(self.G)), 0
        while todo:
            self.unpaused.wait()
            if self.closed:
                raise Closed()
            version = self.version  # the weights these tokens are sampled with (no sync runs while unpaused)
            outs = self.engine.generate(
                input_ids=[prompt + group.samples[j].response_ids for j in todo],
                sampling_params=[self._params(group, j, rounds) for j in todo],
                return_logprob=True,
                **adapter_named(self.engine, len(todo)),
            )
            todo = [j for j, out in zip(todo, outs) if not self._extend(group.samples[j], out, version)]
            group.partial += len(todo) if rounds == 0 else 0
            rounds += 1
        with self.decoding:
            for s in group.samples:
                s.text = self.tokenizer.decode(s.response_ids, skip_special_tokens=True) if self.tokenizer else ""

    def _episodes(self, group: Group):
        """With tools: each sample an episode of turns and tool replies (tools.ToolUse.episode, through the seam), its
        engine a Resuming one: a turn a weight update aborts goes on from its tokens so far, the episode mid-way."""
        engines = [Resuming(self) for _ in range(self.G)]
        episodes = [
            self.tool_use.episode(e, self.prompts.ids[group.index], self._seed(group, j, 0), sampling=self.sampling)
            for j, e in enumerate(engines)
        ]
        with self.decoding:  # every group's episodes on one loop thread: the tokenizer in one thread at a time
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                threading.Thread(target=self.loop.run_forever, daemon=True, name="episodes").start()
        group.samples = asyncio.run_coroutine_threadsafe(all_or_none(episodes), self.loop).result()
        for sample, engine in zip(group.samples, engines):
            sample.versions = spread(engine.versions, sample.model_mask)
        group.partial = sum(e.resumed for e in engines)

    def _seed(self, group: Group, j: int, rounds: int) -> int:
        """Sample j's seed, from the group's number; a resumed request another one, so that it does not replay the
        first tokens' draws."""
        if rounds == 0:
            return seed_for(self.seed, "sample", group.number, j)
        return seed_for(self.seed, "resume", group.number, j, rounds)

    def _params(self, group: Group, j: int, rounds: int) -> dict:
        """Sampling params of sample j's request: its seed, the budget left of max_new_tokens (cumulative)."""
        budget = self.sampling.max_new_tokens - len(group.samples[j].response_ids)
        return {**self.sampling.params(self._seed(group, j, rounds)), "max_new_tokens": budget}

    def _extend(self, sample: Sample, out: dict, version: int) -> bool:
        """Add a request's tokens to its sample, each with `version`. Returns whether the sample is finished: False for
        a request a pause aborted before its end (it goes out again from its tokens so far)."""
        aborted = out["meta_info"]["finish_reason"]["type"] == "abort"
        if aborted:  # its tokens so far (none where it was still queued), read as a cut: read_output refuses an abort
            out = {**out, "meta_info": {**out["meta_info"], "finish_reason": {"type": "length"}}}
        part = read_output(sample.prompt_ids, out, self.sampling)
        sample.response_ids += part.response_ids
        sample.rollout_logprobs += part.rollout_logprobs
        sample.versions += [version] * len(part.response_ids)
        ended = bool(sample.response_ids) and sample.response_ids[-1] in self.sampling.stop_ids
        full = len(sample.response_ids) >= self.sampling.max_new_tokens
        if aborted and not (ended or full):
            return False
        sample.truncated = full and not ended  # the whole budget used, no stop token: cut by the length limit
        return True

    # ---- the trainer's side -------------------------------------------------------------------------

    def pause(self):
        """No new request goes out, and the running ones abort with their tokens so far (the engine's
        pause_generation): the servers are idle for the weight sync. Rank 0; a no-op elsewhere."""
        if self.engine is None:
            return
        self.unpaused.clear()
        self.engine.pause_generation()

    def resume(self, version: int):
        """The servers hold weights `version` (the updates trained so far): requests go out again, the aborted ones
        from their tokens so far, and the gate admits up to (k + version + 1) x B groups."""
        if self.engine is None:
            return
        self.engine.continue_generation()
        with self.changed:
            self.version = version
            self.unpaused.set()
            self.changed.notify_all()

    def take(self, *, version: int) -> Pending:
        """B finished groups, oldest first, none with a token older than version - k (those are dropped: their
        places go to new groups), B / ranks to each rank. A collective: every rank calls it.
        Returns a rollout.Pending whose result() is this rank's samples (sample_idx, before and staleness set): none
        where a signal cut the wait short (every rank's)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        taken, stopped = [], False
        if self.engine is not None:
            try:
                taken = self._wait(version)
            except Interrupted:
                stopped = True
        if bool(all_reduce(float(stopped), dist.ReduceOp.MAX)):  # the loop's signal check stops the run
            with self.changed:
                self.ready[:0], taken = taken, []  # not trained on: a checkpoint's data position stays before them
        with self.changed:
            self.open = [g for g in self.open if g not in taken]
        shares = [None] * world
        if rank == 0:  # B groups: B / world to each rank, each whole
            per = len(taken) // world
            shares = [taken[r * per : (r + 1) * per] for r in range(world)]
            after = self.data_position()
            shares = [(share, after, self.dropped) for share in shares]
        mine = [None]
        dist.scatter_object_list(mine, shares if rank == 0 else None, src=0)
        groups, after, dropped = mine[0]
        pending = Pending(None)
        now = time.perf_counter()
        pending.seconds, self.last_take = now - self.last_take, now  # the servers' time on them: since the last take
        pending.samples = pending.mine = [s for g in groups for s in g.samples]
        pending.sample_idx = [g.index for g in groups for _ in g.samples]
        pending.before, pending.ahead = after, True
        pending.staleness = [version - min(s.versions, default=version) for s in pending.samples]
        pending.partial = sum(g.partial for g in groups)
        pending.dropped = dropped
        return pending

    def _wait(self, version: int) -> list[Group]:
        """Rank 0: B fresh groups, dropping stale ones, within --rollout-timeout; a signal: Interrupted."""
        deadline = time.time() + self.timeout_s
        with interruptible():
            with self.changed:
                while True:
                    if self.error is not None:
                        raise self.error
                    stale = [g for g in self.ready if oldest(g, version) < version - self.k]
                    for g in stale:
                        self.ready.remove(g)
                        self.open.remove(g)
                    self.dropped += len(stale)
                    self.accepted -= len(stale)  # their places go to new groups
                    if stale:
                        self.changed.notify_all()
                    if len(self.ready) >= self.B:
                        taken, self.ready = self.ready[: self.B], self.ready[self.B :]
                        return taken
                    if time.time() > deadline:
                        raise RuntimeError(
                            f"the rollout servers finished {len(self.ready)} of a step's {self.B} groups within "
                            f"--rollout-timeout {self.timeout_s:g} s ({self.running} running): are they still running?"
                        )
                    self.changed.wait(0.5)

    def data_position(self) -> dict:
        """Where a checkpoint leaves the data: before the oldest group drawn and not yet trained on (running or ready),
        whose prompts a resumed run draws again; the sampler's own position where there is none."""
        with self.changed, self.lock:
            return self.open[0].before if self.open else self.sampler.state_dict()  # open: in the order drawn

    def close(self):
        """No more groups: the running ones abort and are left (the engine's pause, then continue: the servers serve
        what comes next, a last evaluation). A request that reached a server while it was paused runs after the
        continue, as SGLang holds it; nothing waits for its answer."""
        if self.engine is None or self.closed:
            return
        with self.changed:
            self.closed = True
            self.unpaused.set()  # groups waiting for a resume see `closed` and end
            self.changed.notify_all()
        try:
            self.engine.pause_generation()
            self.engine.continue_generation()
        except Exception:  # noqa: BLE001 (a server already gone: nothing to abort)
            pass


def oldest(group: Group, version: int) -> int:
    """The version that sampled the group's oldest token (`version` for a group of no tokens)."""
    return min((min(s.versions, default=version) for s in group.samples), default=version)


class Closed(Exception):
    """The producer closed while a group waited for a resume."""


class Resuming:
    """The engine as one sample's tool episode sees it (tools.ToolUse.episode calls async_generate once a turn): a turn
    a weight update aborts goes out again from its tokens so far, with the turn's budget left and another seed, and
    the episode goes on mid-way with its tool replies intact; `versions` collects each model token's version, in
    order, and `resumed` whether any turn was."""

    def __init__(self, producer: Producer):
        self.producer, self.versions, self.resumed = producer, [], False

    @property
    def adapter(self):  # the LoRA adapter the requests name (rollout.adapter_named), the producer's engine's
        return getattr(self.producer.engine, "adapter", None)

    async def async_generate(self, input_ids, sampling_params, return_logprob=False, lora_path=None):
        loop, p = asyncio.get_running_loop(), self.producer
        ids, logprobs, rounds, budget = [], [], 0, sampling_params["max_new_tokens"]
        while True:
            await loop.run_in_executor(None, p.unpaused.wait)
            if p.closed:
                raise Closed()
            version = p.version
            params = {**sampling_params, "max_new_tokens": budget - len(ids)}
            if rounds:
                params["sampling_seed"] = seed_for(sampling_params["sampling_seed"], "resume", rounds)
            lora = {"lora_path": [lora_path]} if lora_path else {}
            out = await loop.run_in_executor(
                None, lambda: p.engine.generate([input_ids + ids], [params], return_logprob=True, **lora)[0]
            )
            finish = out["meta_info"]["finish_reason"]
            ids += list(out["output_ids"])
            logprobs += out["meta_info"]["output_token_logprobs"]
            self.versions += [version] * len(out["output_ids"])
            rounds += 1
            ended = bool(ids) and ids[-1] in p.sampling.stop_ids
            if finish["type"] != "abort" or ended or len(ids) >= budget:
                self.resumed |= rounds > 1
                if finish["type"] == "abort":
                    finish = {"type": "stop" if ended else "length"}
                return {"output_ids": ids, "meta_info": {"finish_reason": finish, "output_token_logprobs": logprobs}}


def spread(model_versions: list[int], model_mask: list[int] | None) -> list[int]:
    """One version per response token from the model tokens' own, in order: a tool reply's tokens take the version
    of the model token before them (the first model token's where none is)."""
    if model_mask is None:
        return list(model_versions)
    versions, model = [], iter(model_versions)
    last = model_versions[0] if model_versions else 0
    for m in model_mask:
        last = next(model) if m else last
        versions.append(last)
    return versions
