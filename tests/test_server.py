"""server.ServerEngine against a stand-in SGLang server (tests/stand_in_server.py) on the CPU:
generation equal to the in-process engine's, the health wait, timeouts, a server that goes away."""

import asyncio
import time

import pytest
from stand_in_server import StandInServer

from rollout import HFEngine, Sampling, generate
from server import ServerEngine, ServerError, wait_healthy

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]


@pytest.fixture
def servers(tiny_model_dir):
    started = [StandInServer(tiny_model_dir, starting=2).start() for _ in range(2)]
    yield started
    for s in started:
        s.stop()


def test_a_batch_over_two_servers_equals_the_engine_request_by_request(servers, tiny_model_dir):
    sampling = Sampling(max_new_tokens=8, stop_ids=[0], temperature=1.0)
    params = [sampling.params(seed) for seed in (11, 12, 13, 14)]
    engine = ServerEngine([s.url for s in servers], timeout_s=30, start_timeout_s=10)  # each answers 503 twice first
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True)
    local = HFEngine(tiny_model_dir)
    for prompt, sp, out in zip(PROMPTS, params, outs):
        expected = local.generate([prompt], [sp], return_logprob=True)[0]
        assert out["output_ids"] == expected["output_ids"]
        assert [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]] == pytest.approx(
            [lp for lp, _, _ in expected["meta_info"]["output_token_logprobs"]], abs=1e-6)
    assert [len(r["input_ids"]) for s in servers for r in s.requests] == [2, 2]  # one request per server, half each
    samples = generate(engine, PROMPTS, [11, 12, 13, 14], sampling=sampling)  # what grpo.py calls
    assert [s.response_ids for s in samples] == [o["output_ids"] for o in outs]
    # one request at a time, as multi-turn episodes send their turns: concurrently, round-robin
    async def all_turns():
        return await asyncio.gather(*[engine.async_generate(p, sp, True) for p, sp in zip(PROMPTS, params)])

    turns = engine.loop.run_until_complete(all_turns())
    assert [t["output_ids"] for t in turns] == [o["output_ids"] for o in outs]
    assert [len(s.requests) for s in servers] == [1 + 1 + 2, 1 + 1 + 2]  # generate twice, then two single turns each
    engine.shutdown()


def test_no_server_is_an_error_naming_the_url_and_how_to_start_one():
    t0 = time.time()
    with pytest.raises(ServerError, match=r"no rollout server ready at http://127.0.0.1:9 after 1 s .*sglang.launch_server"):
        wait_healthy("http://127.0.0.1:9", timeout_s=1, every_s=0.2)
    assert time.time() - t0 < 5


def test_a_stalled_server_ends_the_request_within_the_timeout(tiny_model_dir):
    server = StandInServer(tiny_model_dir, delay_s=3.0).start()
    engine = ServerEngine([server.url], timeout_s=0.5)
    t0 = time.time()
    with pytest.raises(ServerError, match=r"/generate did not answer within --rollout-timeout 0.5 s"):
        engine.generate(input_ids=PROMPTS[:1], sampling_params=[Sampling(4, [0]).params(0)])
    engine.shutdown()
    assert time.time() - t0 < 2.5
    engine.shutdown()
    server.stop()


def test_a_server_that_went_away_is_named(tiny_model_dir):
    server = StandInServer(tiny_model_dir).start()
    engine = ServerEngine([server.url], timeout_s=5)
    server.stop()
    with pytest.raises(ServerError, match=rf"rollout server {server.url}/generate cannot be reached"):
        engine.generate(input_ids=PROMPTS[:1], sampling_params=[Sampling(4, [0]).params(0)])
    engine.shutdown()
