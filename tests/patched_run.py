"""Run grpo.py or ppo.py with one thing broken (or watched) on purpose, for the tests:

    python tests/patched_run.py MODE grpo.py --model ... (the script's flags)

MODE: engine_child  the HF engine owns a child process (a stand-in for SGLang's scheduler) and prints its pid
      nan_reward    every reward is NaN from step N (PATCH_FROM, default 1) to step M (PATCH_UNTIL, default: always);
                    PATCH_ONE_IN=k: only one reward call in k (the k-th, 2k-th, ...)
      raising_reward  the reward function raises on every sample
      slow_reward   every reward call from step PATCH_FROM to PATCH_UNTIL sleeps PATCH_SLEEP_S seconds (default 10), then
                    scores as before; the first call of such a step prints 'slow reward: step N' (PATCH_SAMPLES_PER_STEP
                    calls a step, default 16)
      nan_loss      the first update's log-probs (with gradient) are NaN
      tool_caller   the HF engine's first turn of every episode is a calculator call (its tokens
                    forced, their log-probs the model's own; PATCH_TOOL_CALL: another call); later turns are sampled
      engine_owner  every engine start prints the rank, node (torchrun's GROUP_RANK), local rank and GPUs that own it
      sglang_start_fails  the engine is rollout.start_sglang's, with a stand-in for SGLang's Engine that fails while
                    starting as SGLang 0.5.16 does when its memory does not fit (PATCH_SGLANG_HANDLER=sglang: with
                    SGLang's own SIGQUIT handler, whatever handler it is given; PATCH_SGLANG_FAIL=killed: its scheduler
                    is killed instead)
      phases        prints the models each memory phase moves (memory.wake_up, memory.sleep) and when the reward
                    model scores (reward_model.rm_rewards), one line each
"""

import multiprocessing
import os
import runpy
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
mode, script = sys.argv[1], sys.argv[2]

if mode == "engine_child":
    import rollout

    class EngineWithChild(rollout.HFEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.child = multiprocessing.get_context("fork").Process(
                target=time.sleep, args=(600,), daemon=True, name="scheduler-stand-in"
            )
            self.child.start()
            self.processes = [self.child]
            print(f"engine child pid {self.child.pid}", flush=True)

    rollout.HFEngine = EngineWithChild
elif mode in ("nan_reward", "raising_reward", "slow_reward"):
    import threading

    import reward

    calls, lock, real = {"n": 0}, threading.Lock(), reward.format_reward
    per_step = int(os.environ.get("PATCH_SAMPLES_PER_STEP", "16"))

    def format_reward(
        completion: str, kind: str = "gsm8k"
    ) -> float:  # reward_fn adds format_weight * this: NaN * 0 is NaN
        if sys._getframe(1).f_code.co_name != "reward_fn":  # the metrics' own calls (reward.judge): the real one
            return real(completion, kind)
        with lock:  # reward calls run in threads (reward.score_all)
            calls["n"] += 1
            n = calls["n"]
        step = (n - 1) // per_step + 1
        if mode == "raising_reward":
            raise RuntimeError("a buggy reward")
        patched = int(os.environ.get("PATCH_FROM", "1")) <= step <= int(os.environ.get("PATCH_UNTIL", "1000000"))
        if mode == "slow_reward":
            if patched and (n - 1) % per_step == 0:
                print(f"slow reward: step {step}", flush=True)
            time.sleep(float(os.environ.get("PATCH_SLEEP_S", "10")) * patched)
            return real(completion, kind)
        return float("nan") if patched and n % int(os.environ.get("PATCH_ONE_IN", "1")) == 0 else 0.0

    reward.format_reward = format_reward
elif mode == "nan_loss":
    import torch

    import logprobs

    real, calls = logprobs.token_logprobs, {"n": 0}

    def token_logprobs(*args, **kwargs):
        logp, entropy = real(*args, **kwargs)
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] == 1:
                logp = logp * float("nan")
        return logp, entropy

    logprobs.token_logprobs = token_logprobs
elif mode == "tool_caller":
    import torch

    import rollout

    CALL = os.environ.get(
        "PATCH_TOOL_CALL", '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>'
    )

    class ToolCaller(rollout.HFEngine):
        async def async_generate(self, input_ids, sampling_params, return_logprob=False):
            from transformers import AutoTokenizer

            tok = getattr(self, "tok", None) or AutoTokenizer.from_pretrained(self.model.name_or_path)
            self.tok = tok
            if not tok.decode(input_ids).split("<|im_start|>")[-2].startswith("user"):  # after a tool reply: sampled
                return await super().async_generate(input_ids, sampling_params, return_logprob)
            forced = tok.encode(CALL, add_special_tokens=False) + [tok.eos_token_id]
            with torch.no_grad():
                logits = self.model(torch.tensor([input_ids + forced])).logits[0, len(input_ids) - 1 : -1].float()
            logp = torch.log_softmax(logits / sampling_params["temperature"], -1).gather(
                -1, torch.tensor(forced)[:, None]
            )
            return {
                "output_ids": forced,
                "meta_info": {
                    "finish_reason": {"type": "stop"},
                    "output_token_logprobs": [(lp, t, None) for lp, t in zip(logp[:, 0].tolist(), forced)],
                },
            }

    rollout.HFEngine = ToolCaller
elif mode == "engine_owner":
    import rollout

    real_start = rollout.start_engine

    def start_engine(kind, *args, **kwargs):
        env = os.environ
        print(
            f"engine {kind} started by rank {env['RANK']} on node {env['GROUP_RANK']} (local rank {env['LOCAL_RANK']}, "
            f"CUDA_VISIBLE_DEVICES {env.get('CUDA_VISIBLE_DEVICES', 'unset')})",
            flush=True,
        )
        return real_start(kind, *args, **kwargs)

    rollout.start_engine = start_engine
elif mode == "sglang_start_fails":
    import logging
    import pickle
    import signal
    import traceback

    import pytest

    import rollout
    from conftest import install_fake_sglang

    def failing_scheduler(writer, mem_fraction):
        """SGLang's run_scheduler_process when the KV cache does not fit: its traceback, SIGQUIT to its parent, exit;
        PATCH_SGLANG_FAIL=killed: killed before it could say anything (the kernel's OOM killer)."""
        time.sleep(0.5)  # SGLang's loads the model and measures memory first (seconds): not within the fork's callbacks
        if os.environ.get("PATCH_SGLANG_FAIL") == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            raise RuntimeError(
                f"Not enough memory. Please try to increase --mem-fraction-static. "
                f"Current value: mem_fraction_static={mem_fraction}"
            )
        except RuntimeError:
            print(
                f"[stand-in SGLang] Scheduler hit an exception: {traceback.format_exc()}", file=sys.stderr, flush=True
            )
            os.kill(os.getppid(), signal.SIGQUIT)

    def launch_phase_sigquit_handler(signum, frame):  # SGLang's: the whole process tree, this process included
        print(
            "[stand-in SGLang] Received sigquit from a child process. It usually means the child failed.",
            file=sys.stderr,
            flush=True,
        )
        for p in multiprocessing.active_children():
            p.kill()
        os.kill(os.getpid(), signal.SIGKILL)

    class FailingEngine:
        """SGLang 0.5.16's Engine.__init__ up to the failure (entrypoints/engine.py): the SIGQUIT handler of its
        launch phase (custom_sigquit_handler, or its own), its settings pickled for the scheduler process (spawn),
        the scheduler started through run_scheduler_process_func, its pipe polled as _wait_for_scheduler_ready does."""

        run_scheduler_process_func = staticmethod(failing_scheduler)
        run_detokenizer_process_func = staticmethod(time.sleep)

        def __init__(self, **kwargs):
            pickle.loads(pickle.dumps(kwargs))  # what spawn does to ServerArgs: the handler must pickle
            handler = kwargs.get("custom_sigquit_handler")
            if handler is None or os.environ.get("PATCH_SGLANG_HANDLER") == "sglang":
                handler = launch_phase_sigquit_handler
            else:
                logging.getLogger("sglang.srt.entrypoints.engine").error(f"Using custom SIGQUIT handler: {handler}")
            signal.signal(signal.SIGQUIT, handler)
            reader, writer = multiprocessing.Pipe(duplex=False)
            proc = multiprocessing.get_context("fork").Process(
                target=self.run_scheduler_process_func, args=(writer, kwargs["mem_fraction_static"])
            )
            proc.start()
            while not reader.poll(timeout=1.0):  # SGLang polls every 5 s
                if not proc.is_alive():
                    raise RuntimeError(f"Rank 0 scheduler died during initialization (exit code: {proc.exitcode}).")

        def shutdown(self):
            pass

    logging.basicConfig(format="[%(asctime)s] %(message)s", level=logging.ERROR)  # SGLang's configure_logger
    install_fake_sglang(pytest.MonkeyPatch(), FailingEngine)
    rollout.start_engine = lambda kind, model, *, seed, sglang=None, dtype=None: rollout.start_sglang(
        model, gpu_id=0, seed=seed, options=sglang
    )
elif mode == "phases":
    import memory
    import reward_model

    def watched(name, fn):
        def call(*args, **kwargs):
            print(f"phase {name}: {sorted(type(m).__name__ for m in kwargs.get('models', []))}", flush=True)
            return fn(*args, **kwargs)

        return call

    memory.wake_up, memory.sleep = watched("wake_up", memory.wake_up), watched("sleep", memory.sleep)
    reward_model.rm_rewards = watched("rm_rewards", reward_model.rm_rewards)
else:
    raise SystemExit(f"unknown mode {mode!r}")

sys.argv = [script, *sys.argv[3:]]
runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
