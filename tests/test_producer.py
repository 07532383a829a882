"""The fully async producer (producer.py, --max-staleness k >= 2) against a scripted engine: the gate's
(k + v + 1) x B, a weight update's abort and resume with the token budget kept cumulative and each token's version,
stale groups dropped at consumption, the data position a checkpoint keeps, and a wait that ends on a signal."""

import os
import signal
import threading
import time

import pytest

from data import PromptSampler, Prompts
from producer import Producer
from rollout import Sampling

STOP = 0  # the stop token
pytestmark = pytest.mark.usefixtures("gloo")


class ScriptedEngine:
    """Each request answers token 7 (log-prob -1) until its max_new_tokens, or with a stop token after `stop_after`
    tokens; a call waits `delay_s` first. A pause while a call runs aborts it: half of its tokens, finish_reason
    abort (SGLang's mode abort: its tokens so far); new calls wait for continue_generation. `hold` blocks every call."""

    def __init__(self, delay_s=0.0, stop_after=None):
        self.delay_s, self.stop_after, self.pauses = delay_s, stop_after, 0
        self.paused, self.hold, self.calls = threading.Event(), threading.Event(), []

    def generate(self, input_ids, sampling_params, return_logprob=False, **kwargs):
        while self.paused.is_set() or self.hold.is_set():
            time.sleep(0.005)
        pauses = self.pauses
        self.calls.append(
            [(len(ids), sp["max_new_tokens"], sp["sampling_seed"]) for ids, sp in zip(input_ids, sampling_params)]
        )
        time.sleep(self.delay_s)
        outs = []
        for sp in sampling_params:
            n = sp["max_new_tokens"]
            ids = [7] * n if self.stop_after is None or self.stop_after >= n else [7] * self.stop_after + [STOP]
            finish = "stop" if ids and ids[-1] == STOP else "length"
            if self.pauses != pauses:
                ids, finish = ids[: len(ids) // 2], "abort"
            outs.append(
                {
                    "output_ids": ids,
                    "meta_info": {
                        "finish_reason": {"type": finish},
                        "output_token_logprobs": [(-1.0, t, None) for t in ids],
                    },
                }
            )
        return outs

    def pause_generation(self):
        self.pauses += 1
        self.paused.set()

    def continue_generation(self):
        self.paused.clear()


def producer(engine, *, k=2, B=2, G=2, max_new=8, prompts=50, timeout_s=10.0):
    pool = Prompts(ids=[[1, 2, 3]] * prompts, examples=[None] * prompts, dropped=0)
    p = Producer(
        engine,
        PromptSampler(prompts, seed=0),
        pool,
        sampling=Sampling(max_new, [STOP]),
        group_size=G,
        groups_per_step=B,
        max_staleness=k,
        seed=0,
        timeout_s=timeout_s,
    )
    p.start()
    return p


def until(condition, seconds=5.0):
    deadline = time.time() + seconds
    while not condition() and time.time() < deadline:
        time.sleep(0.005)
    return condition()


def test_the_gate_admits_k_plus_v_plus_one_steps_of_groups():
    """k = 2, B = 2: nothing goes out before the first resume (the servers hold no weights yet); then (2 + 0 + 1) x 2 = 6
    groups at version 0, held running; version 3 admits (2 + 3 + 1) x 2 = 12."""
    engine = ScriptedEngine()
    engine.hold.set()
    p = producer(engine)
    time.sleep(0.1)
    assert p.drawn == 0
    p.resume(version=0)
    assert until(lambda: p.drawn == 6) and (time.sleep(0.1) or p.drawn == 6) and p.running == 6
    p.resume(version=3)
    assert until(lambda: p.drawn == 12) and (time.sleep(0.1) or p.drawn == 12)
    engine.hold.clear()
    p.close()


def test_a_weight_update_aborts_and_the_request_resumes_with_the_budget_left():
    """k = 2, B = 1, G = 1: three requests run at version 0 when a pause comes: each answers with 4 of its 8 tokens;
    after the sync (version 1) each goes out again from prompt + those 4, asking for the 4 left (the budget cumulative:
    never 8 again), with another seed; the gate admits a fourth group, all version 1. Each resumed sample: 8 tokens,
    versions [0] * 4 + [1] * 4, cut by the length limit (no stop token), staleness 1 (its oldest token), partial."""
    engine = ScriptedEngine(delay_s=0.3)
    p = producer(engine, k=2, B=1, G=1)
    p.resume(version=0)
    assert until(lambda: len(engine.calls) == 3)
    p.pause()
    p.resume(version=1)
    taken = [p.take(version=1) for _ in range(4)]
    partial = [t for t in taken if t.partial]
    assert len(partial) == 3 and sum(t.partial for t in taken) == 3
    for t in partial:
        (sample,) = t.result()
        assert sample.response_ids == [7] * 8 and sample.versions == [0] * 4 + [1] * 4 and sample.truncated
        assert sample.rollout_logprobs == [-1.0] * 8 and t.staleness == [1]
    (fresh,) = [t.result()[0] for t in taken if not t.partial]
    assert fresh.versions == [1] * 8
    firsts, resumed = engine.calls[:3], [c for c in engine.calls[3:] if c[0][0] == 3 + 4]
    assert all(c[0][:2] == (3, 8) for c in firsts) and len(resumed) == 3 and all(c[0][1] == 4 for c in resumed)
    assert {c[0][2] for c in firsts}.isdisjoint({c[0][2] for c in resumed})  # resumed with seeds of their own
    p.close()


def test_a_stop_token_ends_a_sample_and_is_not_a_cut():
    engine = ScriptedEngine(stop_after=3)
    p = producer(engine, B=1, G=2)
    p.resume(version=0)
    samples = p.take(version=0).result()
    assert [s.response_ids for s in samples] == [[7, 7, 7, STOP]] * 2 and not any(s.truncated for s in samples)
    assert [s.versions for s in samples] == [[0] * 4] * 2
    p.close()


def test_groups_older_than_k_are_dropped_when_taken_and_replaced():
    """k = 2: groups finished at version 0 are stale at version 3 (their oldest token 3 updates old, more than 2):
    take drops them (counted), the gate refills their places, and what is taken is sampled by version 3."""
    engine = ScriptedEngine()
    p = producer(engine, k=2, B=2)
    p.resume(version=0)
    assert until(lambda: p.accepted == 6)  # (2 + 0 + 1) x 2, all finished at version 0
    p.pause()
    p.resume(version=3)
    pending = p.take(version=3)
    assert pending.dropped == 6 and all(v == 3 for s in pending.result() for v in s.versions)
    assert pending.staleness == [0, 0, 0, 0]
    p.close()


def test_the_data_position_is_before_the_oldest_group_not_trained_on():
    """Groups drawn but not taken are drawn again on resume: the position a checkpoint keeps is before the oldest
    of them (the sampler itself has moved on)."""
    engine = ScriptedEngine()
    p = producer(engine, k=2, B=2, prompts=50)
    p.resume(version=0)
    assert until(lambda: p.accepted == 6)
    pending = p.take(version=0)  # the first two to finish
    oldest = min(g.number for g in p.open)  # group n is the prompt drawn at index n
    assert pending.before == {"epoch": 0, "index": oldest, "num_prompts": 50, "seed": 0} and oldest <= 2
    assert p.sampler.state_dict()["index"] == 6
    p.close()


def test_a_signal_ends_the_wait_for_groups_in_seconds(monkeypatch):
    """The servers never finish; SIGTERM while take waits: it returns within a second with no samples (the loop's
    signal check then stops the run), and the groups are left for a resumed run."""
    import common

    monkeypatch.setitem(common._state, "signum", 0)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    common.handle_signals()
    engine = ScriptedEngine()
    engine.hold.set()
    p = producer(engine)
    p.resume(version=0)
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        t0 = time.time()
        pending = p.take(version=0)
        assert time.time() - t0 < 1.5 and pending.result() == [] and common.requested() == signal.SIGTERM
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        engine.hold.clear()
        p.close()


def test_servers_that_finish_nothing_end_the_wait_at_the_timeout():
    engine = ScriptedEngine()
    engine.hold.set()
    p = producer(engine, timeout_s=0.5)
    p.resume(version=0)
    with pytest.raises(RuntimeError, match="finished 0 of a step's 2 groups within --rollout-timeout 0.5 s"):
        p.take(version=0)
    engine.hold.clear()
    p.close()


class ScriptedTurns:
    """Turn k of an episode writes turns[k] and the end-of-turn token (the turn read from the assistant headers in the
    request, as tests/test_tools.py's engine does); a pause while a call runs aborts it with half of those tokens.
    The first call waits `delay_s`, so that a pause can land in it."""

    def __init__(self, tokenizer, turns, delay_s=0.3):
        self.tok, self.turns, self.delay_s, self.pauses, self.calls = tokenizer, turns, delay_s, 0, []
        self.paused, self.tokenizing = threading.Event(), threading.Lock()  # its calls run in several threads

    def generate(self, input_ids, sampling_params, return_logprob=False, **kwargs):
        while self.paused.is_set():
            time.sleep(0.005)
        pauses = self.pauses
        self.calls.append((len(input_ids[0]), sampling_params[0]["max_new_tokens"]))
        time.sleep(self.delay_s if len(self.calls) == 1 else 0.0)
        with self.tokenizing:
            turn = self.tok.decode(input_ids[0]).count("<|im_start|>assistant") - 1
            full = self.tok.encode(self.turns[turn], add_special_tokens=False) + [self.tok.eos_token_id]
        ids = full[self._sofar(input_ids[0], full) :]  # a resumed turn: what is left of it
        finish = "stop"
        if self.pauses != pauses:
            ids, finish = ids[: len(ids) // 2], "abort"
        logprobs = [(-0.5, t, None) for t in ids]
        return [
            {"output_ids": ids, "meta_info": {"finish_reason": {"type": finish}, "output_token_logprobs": logprobs}}
        ]

    @staticmethod
    def _sofar(input_ids, full):
        """How many of the turn's tokens end input_ids already (a resumed turn's prefix)."""
        return max((n for n in range(len(full) + 1) if n == 0 or input_ids[-n:] == full[:n]), default=0)

    def pause_generation(self):
        self.pauses += 1
        self.paused.set()

    def continue_generation(self):
        self.paused.clear()


def test_a_tool_episode_interrupted_mid_turn_goes_on_from_its_tokens(tool_model_dir):
    """--tools with --max-staleness 2: a weight update lands in the first turn (a calculator call): that turn answers
    half its tokens (version 0), goes out again from them (version 1) and finishes the call; the tool runs, its reply
    follows, the second turn answers. The episode is the one an uninterrupted run gives, token for token (the model's
    turns and the tool's reply), with a version per token: the first turn's first half 0, the rest 1."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoTokenizer

    from tools import TOOLS, ToolUse

    tok = AutoTokenizer.from_pretrained(tool_model_dir)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>'
    turns = [call, "#### 408"]
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 12 * 34?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    engine = ScriptedTurns(AutoTokenizer.from_pretrained(tool_model_dir), turns)  # its own: it runs in other threads
    tool_use = ToolUse(TOOLS, tok, ThreadPoolExecutor(2), max_turns=4, max_reply_tokens=64)
    p = Producer(
        engine,
        PromptSampler(1, seed=0),
        Prompts(ids=[prompt], examples=[None], dropped=0),
        sampling=Sampling(400, [tok.eos_token_id]),
        group_size=1,
        groups_per_step=1,
        max_staleness=2,
        seed=0,
        tool_use=tool_use,
    )
    p.start()
    p.resume(version=0)
    assert until(lambda: len(engine.calls) >= 1)
    p.pause()
    p.resume(version=1)
    taken = [p.take(version=1) for _ in range(4)]  # the gate's (2 + 1 + 1) x 1 groups, in the order they finished
    first = tok.encode(call, add_special_tokens=False) + [tok.eos_token_id]
    half = len(first) // 2
    # the pause lands in the first call (it sleeps), and in any other turn in flight then (a second turn, say)
    partial = [t for t in taken if t.partial]
    for t in partial:  # each: one interruption, its tokens before it version 0, after it 1
        (s,) = t.result()
        assert t.partial == 1 and t.staleness == [1] and len(s.versions) == len(s.response_ids)
        assert s.versions == sorted(s.versions) and set(s.versions) == {0, 1}
    cut_in_first_turn = [  # one or more: every episode in its first turn when the pause came
        s for t in partial for s in t.result() if s.versions[:half] == [0] * half and 0 not in s.versions[half:]
    ]
    assert cut_in_first_turn, [s.versions for t in partial for s in t.result()]
    for sample in cut_in_first_turn:
        assert sample.response_ids[: len(first)] == first and "408" in sample.text and sample.turns == 2
        assert sample.tool_calls and sample.tool_calls[0][:2] == ("calculator", "ok")
    assert (len(prompt) + half, 400 - half) in engine.calls  # the turn resumed from its tokens, with its budget left
    for t in taken:  # the uninterrupted episodes: the same tokens, all of one version
        assert t.result()[0].response_ids == sample.response_ids
    p.close()
