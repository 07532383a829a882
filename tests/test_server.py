"""server.ServerEngine against a stand-in SGLang server (tests/stand_in_server.py) on the CPU:
generation equal to the in-process engine's, the health wait, timeouts, a server that goes away;
weights over a gloo group; generation ahead (--async-rollout); grpo.py against the stand-in."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from stand_in_server import StandInServer
from test_smoke import ROOT, metrics, run_grpo
from transformers import AutoModelForCausalLM

from memory import sync_weights
from rollout import HFEngine, Sampling, SGLangOptions, generate, graph_batch, send, stop_engine
from server import (
    ServerEngine,
    ServerError,
    ServerInputError,
    check_graphs,
    check_nccl_memory,
    in_thread,
    launch_servers,
    post,
    wait_healthy,
)
from stop import EngineWatch

pytestmark = pytest.mark.slow  # the suite launches scripts (the fast tier: pytest -m "not slow")

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
            [lp for lp, _, _ in expected["meta_info"]["output_token_logprobs"]], abs=1e-6
        )
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
    with pytest.raises(
        ServerError, match=r"no rollout server ready at http://127.0.0.1:9 after 1 s .*sglang.launch_server"
    ):
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


# ----------------------------------------------------------------------------------------------
# Weights over a process group, to a stand-in in a process of its own (as a real server is)


@pytest.fixture
def stand_in(tiny_model_dir):
    """Start stand-in servers in processes of their own: stand_in(*flags, model=...) -> (URL, process)."""
    started = []

    def start(*flags, model=tiny_model_dir):
        proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "stand_in_server.py"), model, *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        started.append(proc)
        line = proc.stdout.readline()
        assert line.startswith("ready "), line
        return line.split()[1], proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


@pytest.fixture
def server_process(stand_in):
    """A stand-in server in its own process: (its URL, the process)."""
    return stand_in()


def events(url: str) -> list:
    return post(url, "/stand_in_events", None, 5)


def test_weights_reach_the_server_bucket_by_bucket(server_process, tiny_model_dir):
    url, _ = server_process
    engine = ServerEngine([url], timeout_s=30, model=tiny_model_dir, sync_backend="gloo")
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    for p in policy.parameters():  # weights the server has never seen
        p.data.add_(0.05 * torch.randn_like(p))
    sync_weights(policy, engine, bucket_bytes=64 * 1024)  # memory.py's sync, as in the scripts: many buckets
    local = HFEngine(tiny_model_dir)
    local.update_weights_from_tensor([(n, p.detach().to(torch.bfloat16)) for n, p in policy.named_parameters()])
    greedy = [Sampling(max_new_tokens=8, stop_ids=[0], temperature=0.0).params(0)] * len(PROMPTS)
    got = engine.generate(input_ids=PROMPTS, sampling_params=greedy, return_logprob=True)
    want = local.generate(PROMPTS, greedy, return_logprob=True)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert [lp for o in got for lp, _, _ in o["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [lp for o in want for lp, _, _ in o["meta_info"]["output_token_logprobs"]], abs=1e-5
    )
    assert events(url) == [["flush", 1], ["generate", len(PROMPTS), 1]]
    engine.shutdown()


def test_a_server_of_another_model_is_refused(tiny_model_dir, tmp_path):
    config = json.load(open(os.path.join(tiny_model_dir, "config.json")))
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": config["hidden_size"] * 2}))
    server = StandInServer(tiny_model_dir).start()
    server.info["model_path"] = str(other)  # what /server_info says it serves
    with pytest.raises(
        ServerError,
        match=rf"{server.url} serves {other}, whose shapes are not the policy's .*hidden_size "
        rf"{config['hidden_size'] * 2} vs {config['hidden_size']}.*--model-path",
    ):
        ServerEngine([server.url], timeout_s=5, model=tiny_model_dir)
    server.stop()


def test_the_weight_sync_group_is_not_split_from_a_bound_default_group(gloo, monkeypatch):
    """fsdp.init_distributed binds the default group to the rank's GPU; torch then builds every new NCCL group
    by splitting the default group's communicator, which the servers are not in, and both sides waited
    forever (seen on 2 H200s). join_group unbinds it while the weight-update group forms, then binds it back."""
    import socket

    from torch.distributed import distributed_c10d as c10d

    from server import join_group

    default, seen = c10d._get_default_group(), []
    helper = c10d._new_process_group_helper
    monkeypatch.setattr(
        c10d, "_new_process_group_helper", lambda *a, **k: seen.append(default.bound_device_id) or helper(*a, **k)
    )
    default.bound_device_id = torch.device("cpu", 0)  # as init_distributed's device_id does on a GPU
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        group = join_group(
            address="127.0.0.1", port=port, world_size=1, rank=0, group_name="t_bound", backend="gloo", timeout_s=10
        )
        assert seen == [None] and default.bound_device_id == torch.device("cpu", 0)
        torch.distributed.destroy_process_group(group)
    finally:
        default.bound_device_id = None


def test_a_group_that_cannot_form_fails_within_the_timeout(server_process):
    url, _ = server_process
    t0 = time.time()  # the server is told to join at an address nobody listens on
    with pytest.raises(
        ServerError,
        match=r"forming the weight-update group did not finish within --rollout-timeout 3 s "
        rf"\(no answer from {url}\).*--rollout-sync-address",
    ):
        ServerEngine([url], timeout_s=3, sync_backend="gloo", sync_address="192.0.2.1")
    assert time.time() - t0 < 10


def test_a_server_that_died_fails_the_sync_naming_it(server_process, tiny_model_dir):
    url, proc = server_process
    engine = ServerEngine([url], timeout_s=10, sync_backend="gloo")
    proc.kill()
    proc.wait()
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    t0 = time.time()
    with pytest.raises(ServerError, match=rf"{url}.*(cannot be reached|still running)"):
        sync_weights(policy, engine)
    assert time.time() - t0 < 12


# ----------------------------------------------------------------------------------------------
# Servers this job starts (--rollout-gpus): launch_servers with the stand-in as the launcher


STAND_IN = (sys.executable, os.path.join(ROOT, "tests", "stand_in_server.py"))


def test_launched_servers_generate_take_weights_and_stop_with_the_run(tiny_model_dir, tmp_path):
    urls, processes = launch_servers(
        tiny_model_dir, gpus=[2, 3], tp_size=1, seed=0, options=SGLangOptions(), log_dir=str(tmp_path), command=STAND_IN
    )
    engine = ServerEngine(urls, processes=processes, timeout_s=60, model=tiny_model_dir, sync_backend="gloo")
    # SGLang's flags, as the launcher got them: its GPU, random weights until the first sync, no torchrun variables
    assert [p.gpus for p in processes] == [[2], [3]] and "--base-gpu-id 3" in " ".join(processes[1].args)
    assert "--load-format dummy" in " ".join(processes[0].args) and "--mem-fraction-static" not in processes[0].args
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        policy.model.embed_tokens.weight.mul_(0.5)
    sync_weights(policy, engine)  # to both servers: one group, ranks 1 and 2
    local = HFEngine(tiny_model_dir)
    sync_weights(policy, local)
    sampling = Sampling(max_new_tokens=6, stop_ids=[0], temperature=0.0)
    got = generate(engine, PROMPTS, [1, 2, 3, 4], sampling=sampling)
    assert [s.response_ids for s in got] == [
        s.response_ids for s in generate(local, PROMPTS, [1, 2, 3, 4], sampling=sampling)
    ]
    assert [len([e for e in events(u) if e[0] == "generate"]) for u in urls] == [1, 1]  # split over both
    watch = EngineWatch(engine, phase=lambda: "test")
    assert watch.names[processes[0].pid] == "sglang.launch_server"
    stop_engine(engine, watch)  # as the run's end does: the servers go with it
    assert all(p.poll() is not None for p in processes)
    engine.shutdown()


def test_a_launched_server_that_fails_to_start_is_reported_at_once_with_its_log(tiny_model_dir, tmp_path):
    crash = (sys.executable, "-c", "import sys; print('RuntimeError: no CUDA GPU found'); sys.exit(3)")
    urls, processes = launch_servers(
        tiny_model_dir, gpus=[1], tp_size=1, seed=0, options=SGLangOptions(), log_dir=str(tmp_path), command=crash
    )
    t0 = time.time()
    with pytest.raises(
        ServerError, match=r"(?s)exited with code 3 while starting.*rollout_server_1.log.*no CUDA GPU found"
    ):
        ServerEngine(urls, processes=processes, timeout_s=600)
    assert time.time() - t0 < 10


def test_grpo_refuses_rollout_gpus_without_the_gpus(tiny_model_dir, tmp_path):
    proc = run_grpo(tiny_model_dir, tmp_path, "--rollout-mode", "server", "--rollout-gpus", "1", expect_ok=False)
    assert proc.returncode != 0 and "--rollout-gpus" in proc.stderr and "torchrun --nproc_per_node" in proc.stderr
    assert not os.path.exists(tmp_path / "r")


# ----------------------------------------------------------------------------------------------
# Generation ahead (--async-rollout): in the background, errors reach the trainer


class SlowEngine:
    def __init__(self, error=None):
        self.error, self.started = error, threading.Event()

    def generate(self, input_ids, sampling_params, return_logprob=False):
        self.started.set()
        time.sleep(0.3)
        if self.error:
            raise self.error
        return [
            {
                "output_ids": [7, 0],
                "meta_info": {
                    "finish_reason": {"type": "stop"},
                    "output_token_logprobs": [(-0.1, 7, None), (-0.2, 0, None)],
                },
            }
            for _ in input_ids
        ]


def test_a_batch_sent_ahead_generates_while_the_caller_goes_on():
    engine = SlowEngine()
    t0 = time.time()
    pending = send(engine, [[1, 2]] * 3, [1, 2, 3], sampling=Sampling(4, [0]), ahead=True)
    assert time.time() - t0 < 0.2 and engine.started.wait(1)  # sent, not waited for
    samples = pending.result()
    assert [s.response_ids for s in samples] == [[7, 0]] * 3 and pending.seconds >= 0.3
    assert pending.result() is samples  # once: every rank calls it once, whatever the script does twice


def test_an_error_in_the_background_generation_reaches_the_trainer():
    pending = send(
        SlowEngine(error=ServerError("rollout server http://x/generate did not answer")),
        [[1, 2]],
        [1],
        sampling=Sampling(4, [0]),
        ahead=True,
    )
    t0 = time.time()
    with pytest.raises(ServerError, match="did not answer"):
        pending.result()
    assert time.time() - t0 < 2


# ----------------------------------------------------------------------------------------------
# grpo.py against a stand-in server: plain, and torchrun x2 with --async-rollout


def test_grpo_trains_against_a_server(server_process, trained_tiny_model_dir, tmp_path):
    url, _ = server_process
    run_grpo(
        trained_tiny_model_dir,
        tmp_path / "sync",
        "--rollout-mode",
        "server",
        "--rollout-url",
        url,
        "--steps",
        "3",
        "--eval-every",
        "0",
    )
    train, _ = metrics(tmp_path / "sync")
    assert [r["step"] for r in train] == [1, 2, 3] and any(r["train/grad_norm"] > 0 for r in train)
    assert all(r["rollout/logprob_abs_diff"] < 0.05 and r["rollout/staleness"] == 0 for r in train)  # synced every step
    assert [e for e in events(url) if e[0] == "generate"] == [
        ["generate", 16, 1],
        ["generate", 16, 2],
        ["generate", 16, 3],
    ]


@pytest.mark.parametrize("mode", [(), ("--max-staleness", "2")], ids=["sync", "fully-async"])
def test_a_server_killed_mid_run_ends_it_with_exit_code_1(stand_in, tiny_model_dir, tmp_path, mode):
    """The server dies between steps: the run ends within seconds, its last line naming the server, with exit
    code 1 (it was 2, which docs/stopping.md keeps for bad input); what the finished steps wrote stays. Fully async
    (--max-staleness 2): the producer's requests, a pause or the sync meet the dead server, never a hang."""
    from test_failures import console_lines, start, wait_for

    url, server = stand_in(*(("--delay-s", "0.1") if mode else ()))
    proc = start(
        tiny_model_dir,
        tmp_path,
        "--rollout-mode",
        "server",
        "--rollout-url",
        url,
        "--steps",
        "200",
        "--eval-every",
        "0",
        "--save-every",
        "1",
        "--keep-checkpoints",
        "0",
        *mode,
    )
    wait_for(tmp_path, "step 2/", proc, timeout=240)
    server.kill()
    t0 = time.time()
    proc.wait(timeout=120)
    lines = console_lines(tmp_path)
    assert proc.returncode == 1 and time.time() - t0 < 30, lines[-5:]
    assert not any("Traceback" in x for x in lines)
    # its next request, or the weight sync under way, meets the dead server
    assert lines[-1].startswith("grpo.py: ") and url in lines[-1] and "still running?" in lines[-1], lines[-3:]
    assert os.path.isdir(tmp_path / "r" / "checkpoints" / "step_000002") and len(metrics(tmp_path)[0]) >= 2


def test_sigterm_during_a_fully_async_run_saves_and_stops_in_seconds(stand_in, tiny_model_dir, tmp_path):
    """--max-staleness 2: SIGTERM while the producer keeps the server busy: the run stops within seconds, exit 143,
    the finished steps saved, and the server paused then continued (its requests aborted, not drained)."""
    from test_failures import console_lines, start, wait_for

    url, _ = stand_in("--delay-s", "0.2")
    proc = start(
        tiny_model_dir,
        tmp_path,
        "--rollout-mode",
        "server",
        "--rollout-url",
        url,
        "--steps",
        "200",
        "--eval-every",
        "0",
        "--save-every",
        "100",
        "--max-staleness",
        "2",
    )
    wait_for(tmp_path, "step 2/", proc, timeout=240)
    proc.send_signal(signal.SIGTERM)
    t0 = time.time()
    proc.wait(timeout=60)
    lines = console_lines(tmp_path)
    assert proc.returncode == 143 and time.time() - t0 < 20, lines[-5:]
    assert any("stopped by SIGTERM after step" in x for x in lines) and not any("Traceback" in x for x in lines)
    done = len(metrics(tmp_path)[0])
    assert os.path.isdir(tmp_path / "r" / "checkpoints" / f"step_{done:06d}")
    # the producer closed: the server paused (mode abort) and continued after the last sync's continue, the running
    # requests aborted, not drained. A request that reached the server while it was paused runs after that continue
    # (SGLang holds it too); the run does not wait for it.
    names = [e[0] for e in events(url)]
    after_last_sync = names[len(names) - names[::-1].index("flush") :]
    assert [n for n in after_last_sync if n in ("pause", "continue")] == ["continue", "pause", "continue"], names[-12:]
    assert ["pause", "abort"] in events(url)


def test_the_users_server_that_is_not_there_is_bad_input(tiny_model_dir, tmp_path):
    """At start-up a URL of the user's that nobody answers is bad input: exit code 2, one line."""
    proc = run_grpo(
        tiny_model_dir,
        tmp_path,
        "--rollout-mode",
        "server",
        "--rollout-url",
        "http://127.0.0.1:9",
        "--rollout-timeout",
        "1",
        expect_ok=False,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("grpo.py: no rollout server ready at http://127.0.0.1:9 after 1 s")
    )
    assert not os.path.exists(tmp_path / "r")


def test_grpo_async_under_torchrun_is_one_step_off_policy(server_process, trained_tiny_model_dir, tmp_path):
    url, _ = server_process
    proc = run_grpo(
        trained_tiny_model_dir,
        tmp_path,
        "--rollout-mode",
        "server",
        "--rollout-url",
        url,
        "--steps",
        "4",
        "--eval-every",
        "0",
        "--async-rollout",
        nproc=2,
    )
    train, _ = metrics(tmp_path)
    assert [r["rollout/staleness"] for r in train] == [0, 1, 1, 1]
    assert (
        json.loads((tmp_path / "r" / "args.json").read_text())["rollout_correction"] == "tis"
    )  # the default with async
    assert all(0 <= r["rollout/correction_frac"] <= 1 and r["rollout/mismatch_ratio_max"] > 0 for r in train)
    # the server's view: batch k+1 is asked for before the weights of update k arrive (one flush per sync)
    assert [e[2] for e in events(url) if e[0] == "generate"] == [1, 1, 2, 3]
    assert "step 4/" in proc.stdout


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_grpo_fully_async_bounds_staleness_and_resumes_interrupted_samples(
    stand_in, trained_tiny_model_dir, tmp_path, lora
):
    """--max-staleness 2 against a server whose requests take 0.2 s each, two ranks: every weight sync is a pause
    (abort), the flush of the new weights, then continue, and requests go out again in between; no sample is more
    than 2 updates stale, some are interrupted and resumed, the loss is decoupled PPO, and the run ends cleanly. With
    --lora-rank 4 the adapter goes to the paused server and every request names it."""
    url, _ = stand_in("--delay-s", "0.2", *(("--max-lora-rank", "4") if lora else ()))
    proc = run_grpo(
        trained_tiny_model_dir,
        tmp_path,
        "--rollout-mode",
        "server",
        "--rollout-url",
        url,
        "--steps",
        "5",
        "--eval-every",
        "0",
        "--max-staleness",
        "2",
        *(("--lora-rank", "4") if lora else ()),
        nproc=2,
    )
    train, _ = metrics(tmp_path)
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5] and train[0]["rollout/staleness"] == 0
    assert all(r["rollout/logprob_abs_diff"] < 0.05 for r in train)  # the server samples with the synced weights
    for r in train:  # the staleness histogram adds up, one share per lag 0..largest; versions of the step's tokens
        shares = [r[f"rollout/staleness_frac_{k}"] for k in range(int(r["rollout/staleness_max"]) + 1)]
        assert abs(sum(shares) - 1) < 1e-9 and 1 <= r["rollout/versions"] <= 3
    assert all(r["rollout/staleness_max"] <= 2 for r in train) and max(r["rollout/staleness"] for r in train) > 0
    assert any(r["rollout/partial_frac"] > 0 for r in train)  # a weight update cut samples, which were resumed
    assert all(r["time/pause"] > 0 and r["time/continue"] > 0 for r in train)  # each step's pause and continue, timed
    config = json.loads((tmp_path / "r" / "args.json").read_text())
    assert (config["rollout_correction"], config["correction_bounds"], config["async_rollout"]) == (
        "decoupled",
        [0.0, 5.0],
        False,
    )
    kinds = [e[0] for e in events(url) if e[0] != "lora"]  # the adapter's load and unload: while paused
    syncs = [i for i, k in enumerate(kinds) if k == "flush"]
    assert len(syncs) == 5 and all(kinds[i - 1] == "pause" and kinds[i + 1] == "continue" for i in syncs)
    assert "| stale " in proc.stdout and "| partial " in proc.stdout and "step 5/5" in proc.stdout


def test_ppo_async_against_a_server(server_process, trained_tiny_model_dir, tmp_path):
    url, _ = server_process
    run_grpo(
        trained_tiny_model_dir,
        tmp_path,
        "--rollout-mode",
        "server",
        "--rollout-url",
        url,
        "--steps",
        "3",
        "--eval-every",
        "0",
        "--async-rollout",
        script="ppo.py",
    )
    train, _ = metrics(tmp_path)
    assert [r["rollout/staleness"] for r in train] == [0, 1, 1] and all("train/tis_weight" in r for r in train)
    assert [e[2] for e in events(url) if e[0] == "generate"] == [1, 1, 2]


# ----------------------------------------------------------------------------------------------
# A weight sync that goes wrong on the server's side: the run ends, in time, naming the server (issue 37)


@pytest.mark.parametrize("case", ["refused", "no answer", "SIGTERM"])
def test_a_sync_that_fails_on_the_servers_side_never_hangs_the_run(stand_in, tiny_model_dir, tmp_path, case):
    """The server refuses the second sync's bucket with its error, or never takes it (a server stuck in its side of the
    broadcast): the run ends with exit code 1 and one last line naming the server and what it said, within
    --rollout-timeout; a SIGTERM while it waits ends the run within seconds. The main thread never sits in the
    collective; what step 1 wrote stays."""
    from test_failures import console_lines, start, wait_for

    url, _ = stand_in("--sync-fail-at" if case == "refused" else "--sync-hang-at", "2")
    timeout = "600" if case == "SIGTERM" else "15"  # 8 s: a loaded 2-core CI machine's step-1 generate ran past it
    proc = start(
        tiny_model_dir,
        tmp_path,
        "--rollout-mode",
        "server",
        "--rollout-url",
        url,
        "--steps",
        "5",
        "--eval-every",
        "0",
        "--save-every",
        "1",
        "--rollout-timeout",
        timeout,
    )
    wait_for(tmp_path, "step 1/", proc, timeout=240)
    t0 = time.time()
    if case == "SIGTERM":
        time.sleep(1.0)  # the second sync is under way: the server has taken the announcement, not the bytes
        proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    seconds, lines = time.time() - t0, console_lines(tmp_path)
    assert not any("Traceback" in x for x in lines), lines[-8:]
    if case == "refused":
        assert proc.returncode == 1 and seconds < 15, (seconds, lines[-3:])
        assert (
            lines[-1].startswith(
                f"grpo.py: the weight sync failed: rollout server {url}/update_weights_from_distributed "
                f"answered 400: Failed to update parameter online: NCCL error"
            )
            and '"success"' not in lines[-1]
        )
    elif case == "no answer":
        assert proc.returncode == 1 and 14 < seconds < 30, (seconds, lines[-3:])
        assert lines[-1] == (
            f"grpo.py: the weight sync did not finish within --rollout-timeout 15 s (no answer from {url}): "
            f"is every server still running?"
        )
    else:
        assert proc.returncode == 143 and seconds < 1.0 + 5 + 8, (seconds, lines[-3:])  # the grace, then out
        assert lines[-1] == (
            "grpo.py: stopped by SIGTERM during the weight sync to the rollout servers, which had not "
            "finished 5 s later; --resume continues from the last checkpoint"
        )
    assert [r["step"] for r in metrics(tmp_path)[0]] == [1]
    assert os.path.isdir(tmp_path / "r" / "checkpoints" / "step_000001")


def test_a_server_stuck_in_a_dead_trainers_sync_is_named_at_start(stand_in, monkeypatch):
    """A trainer killed mid-sync leaves an SGLang server inside a broadcast that never ends: its health check then
    fails after 20 s (503) and it never recovers. The next trainer says so at once and how to mend it (restart it),
    instead of waiting --rollout-timeout for a server that looks like it is still starting."""
    import server

    url, _ = stand_in("--sync-hang-at", "1", "--health-check-s", "1.5")
    in_thread(
        post,
        url,
        "/update_weights_from_distributed",
        {
            "names": ["w"],
            "dtypes": ["float32"],
            "shapes": [[4]],
            "group_name": "dead",
            "load_format": "flattened_bucket",
        },
        60,
    )
    time.sleep(0.5)  # the announcement is in: the stand-in waits for bytes that never come
    monkeypatch.setattr(server, "STUCK_S", 1.0)
    t0 = time.time()
    with pytest.raises(
        ServerInputError,
        match=rf"rollout server {url} is up but its scheduler did not generate one token "
        r"in 2 s .*trainer died mid-way.*restart it",
    ):
        ServerEngine([url], timeout_s=600)
    assert time.time() - t0 < 5


def test_nccl_memory_mode_must_agree_with_the_servers(monkeypatch, capsys):
    """A server started with --enable-symm-mem runs NCCL with cuMem (NCCL_CUMEM_ENABLE=1): a trainer with 0 is
    refused in one line naming both fixes; a value exported here that SGLang servers don't share by default is said."""
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "0")
    with pytest.raises(
        ServerError,
        match=r"rollout server http://a:1 runs with --enable-symm-mem, .* this trainer's is 0: "
        r"export NCCL_CUMEM_ENABLE=1 .* or start the server without --enable-symm-mem",
    ):
        check_nccl_memory(["http://b:2", "http://a:1"], [{}, {"enable_symm_mem": True}])
    check_nccl_memory(["http://b:2"], [{"enable_symm_mem": False}])
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")
    check_nccl_memory(["http://b:2"], [{}])
    assert "NCCL_CUMEM_ENABLE=1 is exported here; SGLang servers use 0 unless" in capsys.readouterr().out


def test_the_trainer_takes_sglangs_nccl_memory_mode_before_its_first_communicator():
    """fsdp.init_distributed sets NCCL_CUMEM_ENABLE=0 (SGLang's) where nothing set it, and keeps a user's value."""
    code = "import os, fsdp; fsdp.init_distributed(); print(os.environ['NCCL_CUMEM_ENABLE'])"
    env = {k: v for k, v in os.environ.items() if k != "NCCL_CUMEM_ENABLE"}
    for preset, expected in ((None, "0"), ("1", "1")):
        run = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            env={**env, **({"NCCL_CUMEM_ENABLE": preset} if preset else {})},
        )
        assert run.stdout.split() == [expected], run.stderr[-2000:]


def test_cuda_graphs_cover_the_batch_each_engine_or_server_decodes(capsys):
    """Beyond its largest CUDA graph SGLang decodes without graphs: the job's engines and servers capture up to the
    samples each gets (past SGLang's 256; a flag given wins), and a user's server whose graphs stop short is named
    with the flag to start it with (/server_info's cuda_graph_config, as SGLang 0.5.16 writes it)."""
    assert [graph_batch(n, None) for n in (64, 256, 257, 512)] == [None, None, 257, 512]
    assert graph_batch(512, 128) == 128 and graph_batch(64, 300) == 300
    infos = [
        {"cuda_graph_config": {"decode": {"backend": "full", "max_bs": 256, "bs": [1, 2, 256]}}},
        {"cuda_graph_config": {"decode": {"backend": "full", "max_bs": 512}}},
        {"cuda_graph_config": {"decode": {"backend": "disabled", "max_bs": 256}}},
        {},
    ]  # no graphs; an older server
    check_graphs(["http://a:1", "http://b:2", "http://c:3", "http://d:4"], infos, batch=512)
    assert capsys.readouterr().out.splitlines() == [
        "rollout server http://a:1 has CUDA graphs for decode batches up to 256 and gets 512 samples a step: start it "
        "with --cuda-graph-max-bs-decode 512 to decode them all in graphs"
    ]
    check_graphs(["http://a:1"], infos[:1], batch=256)
    assert capsys.readouterr().out == ""
