"""--deterministic-rollout (issue 43): each sample's seed, the HF engine's per-sample sampling, the options SGLang and
the job's servers start with, a user's server without the mode, and the bad input the flag and sampled evaluation
refuse in one line. The GPU side (SGLang's own determinism, its cost) is bench/run_deterministic.sh's."""

import importlib.util
import re
import sys

import pytest
import torch
from stand_in_server import StandInServer
from test_first_hour import ours_last, run

from data import sample_seeds, seed_for, shard
from preflight import DETERMINISTIC_ATTENTION
from common import InputError
from rollout import GumbelNoise, HFEngine, Sampling
from server import ServerEngine, ServerInputError, launch_servers


def test_a_samples_seed_is_its_own_whatever_the_ranks():
    """The j-th sample of the p-th prompt of a step's draw: seed_for(..., p, j), on one rank or on four; all differ.
    The first is the seed the HF engine's batch took before (tests/golden_steps.json's runs are unchanged)."""
    seeds = sample_seeds(0, "sample", 3, 0, prompts=8, group_size=4)
    assert len(set(seeds)) == 32 and seeds[4 * 5 + 2] == seed_for(0, "sample", 3, 0, 5, 2)
    assert sum((shard(seeds, r, 4) for r in range(4)), []) == seeds
    assert seeds[0] == seed_for(0, "sample", 3, 0, 0, 0)  # the old rank 0, k 0
    assert sample_seeds(0, "sample", 4, 0, prompts=8, group_size=4)[0] != seeds[0]


def test_gumbel_noise_samples_the_softmax():
    """Argmax of scores + GumbelNoise draws from softmax(scores), each row from its own seed alone."""
    p = torch.tensor([0.6, 0.3, 0.1])
    scores = p.log().expand(4000, 3)
    tokens = GumbelNoise(list(range(4000)))(None, scores).argmax(-1)
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, p, atol=0.03), freq
    assert torch.equal(GumbelNoise([7, 3])(None, scores[:2])[0], GumbelNoise([7])(None, scores[:1])[0])


def test_the_hf_engine_samples_each_request_from_its_own_seed(tiny_model_dir):
    """Deterministic: two engines, the same seeds, the same tokens; the same request alone, or with the batch reversed,
    the same tokens too (its noise is its own). Without the mode one random stream serves the batch."""
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
    sampling = Sampling(max_new_tokens=10, stop_ids=[0], temperature=1.0, top_p=0.9)
    params = [sampling.params(seed_for(1, "x", i)) for i in range(3)]
    a, b = HFEngine(tiny_model_dir, deterministic=True), HFEngine(tiny_model_dir, deterministic=True)

    def tokens(engine, p, sp):
        return [o["output_ids"] for o in engine.generate(p, sp, return_logprob=True)]

    first = tokens(a, prompts, params)
    assert tokens(b, prompts, params) == first
    assert tokens(a, prompts[::-1], params[::-1]) == first[::-1]
    assert tokens(a, prompts[1:2], params[1:2]) == first[1:2]
    plain = HFEngine(tiny_model_dir)
    same = tokens(plain, prompts, params)
    assert tokens(plain, prompts, params) == same  # one stream, seeded by the first request's seed ...
    assert tokens(plain, prompts[::-1], params[::-1]) != same[::-1]  # ... so a request's tokens follow its batch


def test_sglang_and_the_jobs_servers_start_in_deterministic_mode(monkeypatch, tmp_path):
    """The in-process engine gets enable_deterministic_inference (its attention and sampler: triton, pytorch, both
    in SGLang's lists); a server this job launches gets --enable-deterministic-inference; neither without the flag."""
    import rollout
    from conftest import install_fake_sglang

    seen = []

    class FakeEngine:
        run_scheduler_process_func = run_detokenizer_process_func = staticmethod(print)

        def __init__(self, **kwargs):
            seen.append(kwargs)

    install_fake_sglang(monkeypatch, FakeEngine)
    for deterministic in (True, False):
        rollout.start_sglang("/m", gpu_id=0, options=rollout.SGLangOptions(deterministic=deterministic))
        assert seen[-1]["enable_deterministic_inference"] is deterministic
        assert seen[-1]["sleep_on_idle"] is True  # idle, the scheduler waits on its sockets: no core spinning
    assert seen[-1]["attention_backend"] in DETERMINISTIC_ATTENTION and seen[-1]["sampling_backend"] == "pytorch"
    for deterministic in (True, False):
        _, (process,) = launch_servers(
            "/m",
            gpus=[0],
            tp_size=1,
            seed=0,
            options=rollout.SGLangOptions(deterministic=deterministic),
            log_dir=str(tmp_path),
            command=("true",),
        )
        process.wait()
        assert ("--enable-deterministic-inference" in process.args) is deterministic
        assert "--sleep-on-idle" in process.args


def test_a_users_server_without_deterministic_inference_is_refused(tiny_model_dir):
    """--rollout-url with --deterministic-rollout: /server_info says whether the server runs the mode; without it, one
    line naming the server flag to add (a ServerInputError: exit code 2)."""
    server = StandInServer(tiny_model_dir).start()
    try:
        with pytest.raises(
            ServerInputError,
            match=rf"rollout server {server.url} runs without deterministic inference, which --deterministic-rollout "
            r"needs: start it with --enable-deterministic-inference",
        ):
            ServerEngine([server.url], timeout_s=30, deterministic=True)
        ServerEngine([server.url], timeout_s=30).shutdown()  # without the flag: any server
        server.info["enable_deterministic_inference"] = True
        ServerEngine([server.url], timeout_s=30, deterministic=True).shutdown()
    finally:
        server.stop()


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"eval_samples": -1}, "--eval-samples -1 must be >= 0 (0: greedy only) and at most 1024"),
        ({"eval_temperature": -0.5}, "--eval-temperature -0.5 must be >= 0"),
        ({"eval_samples": 4, "eval_temperature": 0.0}, "--eval-temperature 0.0 must be > 0 with --eval-samples"),
        (
            {"deterministic_rollout": True, "sglang_attention_backend": "torch_native"},
            "--sglang-attention-backend torch_native must be one of ascend, fa3, fa4, flashinfer, triton with "
            "--deterministic-rollout",
        ),
    ],
)
def test_bad_sampling_flags_are_one_line(flags, message):
    """K < 0, T < 0, a K whose evaluation does not fit an engine's batch, --deterministic-rollout on an attention
    backend SGLang's mode does not run on: one line each, before anything loads (grpo.py, ppo.py, evaluate.py)."""
    import evaluate
    import grpo
    import ppo

    for script in (grpo, ppo):
        with pytest.raises(InputError, match="^" + re.escape(message)):
            script.check_args(script.Args(**flags), world_size=1)
    ours = {k: v for k, v in flags.items() if k != "sglang_attention_backend"}
    if "sglang_attention_backend" not in flags:
        with pytest.raises(InputError, match="^" + re.escape(message)):
            evaluate.main(evaluate.Args(model="no-model", **ours))
    grpo.check_args(grpo.Args(eval_samples=16, num_eval_prompts=256, deterministic_rollout=True), world_size=1)
    grpo.check_args(grpo.Args(eval_samples=32, num_eval_prompts=1319), world_size=1)  # 42k: in calls of 4096


def test_a_tp_group_evaluates_in_one_call_so_its_k_must_fit():
    """With --rollout-tp > 1 the group's ranks make one generate call each (a chunked evaluation could make them
    differ): prompts x K beyond an engine's 4096 requests is refused in one line; without TP it runs in chunks."""
    import grpo
    import ppo

    message = (
        "--eval-samples 32 must be at most 16 with --num-eval-prompts 256 on 1 engine(s) of --rollout-tp 2: a TP group "
        "evaluates its prompts x K samples at once, and an SGLang engine runs 4096 at most"
    )
    for script in (grpo, ppo):
        with pytest.raises(InputError, match="^" + re.escape(message)):
            script.check_args(script.Args(eval_samples=32, num_eval_prompts=256, rollout_tp=2), world_size=2)


def test_generate_groups_sends_at_most_max_requests_a_call_with_the_same_seeds():
    """Hand-computed: 5 prompts x K=4 with max_requests 8: calls of 2, 2 and 1 prompts (8, 8, 4 requests); each
    sample keeps the seed it has in one call (seed_for(prompt's seed, j)), so chunking changes no sample."""
    from data import seed_for
    from rollout import Sampling, generate_groups

    calls = []

    class Engine:
        def generate(self, input_ids, sampling_params, return_logprob=False, **_):
            calls.append([p["sampling_seed"] for p in sampling_params])
            meta = {"finish_reason": {"type": "stop"}, "output_token_logprobs": [(-0.5, 7, None)]}
            return [{"output_ids": [7], "meta_info": meta} for _ in input_ids]

    sampling = Sampling(max_new_tokens=4, stop_ids=[7], temperature=1.0)
    groups = generate_groups(
        Engine(), [[1], [2], [3], [4], [5]], 4, seeds=[10, 11, 12, 13, 14], sampling=sampling, max_requests=8
    )
    assert [len(c) for c in calls] == [8, 8, 4] and [len(g) for g in groups] == [4] * 5
    assert sum(calls, []) == [seed_for(s, j) for s in (10, 11, 12, 13, 14) for j in range(4)]


@pytest.mark.slow
def test_deterministic_rollout_on_another_attention_is_one_line_before_anything_loads(tmp_path):
    code, out, _ = run(
        "grpo.py",
        "--model",
        tmp_path / "no-model",
        "--deterministic-rollout",
        "--sglang-attention-backend",
        "torch_native",
        "--output-dir",
        tmp_path / "runs",
    )
    ours_last(code, out, "grpo.py", "--sglang-attention-backend torch_native must be one of ascend, fa3")
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed (a GPU machine's)")
def test_the_copied_attention_list_is_the_installed_sglangs():
    """preflight.DETERMINISTIC_ATTENTION is a copy (CPU machines have no SGLang); where SGLang is installed it must
    still be its list."""
    from sglang.srt.server_args import DETERMINISTIC_ATTENTION_BACKEND_CHOICES

    assert sorted(DETERMINISTIC_ATTENTION) == sorted(DETERMINISTIC_ATTENTION_BACKEND_CHOICES), sys.modules["sglang"]
