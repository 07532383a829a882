"""PLUMBING: an SGLang server on GPUs of its own, or on another node, as the rollout engine
(grpo.py --rollout-mode server --rollout-url http://HOST:PORT). The user starts it with SGLang's
own launcher, and for several GPUs or nodes SGLang's router in front:

    python -m sglang.launch_server --model-path Qwen/Qwen2.5-1.5B-Instruct --port 30000 --base-gpu-id 1
    engine = ServerEngine(["http://localhost:30000"], timeout_s=600)   # waits for /health_generate
    engine.generate(input_ids=[[...], ...], sampling_params=[{...}, ...], return_logprob=True)

`generate` and `async_generate` take and return what sglang.Engine's do (token ids in, token ids
and per-token log-probs out), so rollout.generate and rollout.episode drive either. Requests go
over HTTP to SGLang's `/generate` (endpoints of SGLang 0.5.16); a batch is split evenly over the
URLs (data parallel over servers), each part sent as one request. Nothing here waits without a
limit: a server that does not answer within `timeout_s` ends the run with an error naming it.
"""

import asyncio
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

LAUNCH_HINT = "start it with: python -m sglang.launch_server --model-path <the policy's model> --port <port>"


class ServerError(RuntimeError):
    """A rollout server failed, stalled or could not be reached; the message names the URL."""


def post(url: str, path: str, payload: dict, timeout_s: float):
    """POST JSON to url + path and read the JSON answer; any failure -> ServerError naming the URL."""
    request = urllib.request.Request(url + path, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as e:  # the server answered with an error: its message is the useful part
        raise ServerError(f"rollout server {url}{path} answered {e.code}: {e.read().decode(errors='replace')[:500]}") from None
    except TimeoutError:
        raise ServerError(f"rollout server {url}{path} did not answer within --rollout-timeout {timeout_s:g} s") from None
    except (urllib.error.URLError, ConnectionError) as e:
        reason = getattr(e, "reason", e)
        raise ServerError(f"rollout server {url}{path} cannot be reached ({reason}); is it still running?") from None


def wait_healthy(url: str, timeout_s: float, every_s: float = 2.0):
    """Wait until the server generates (`/health_generate`: 503 while it starts, 200 once it can
    produce a token). Not up within `timeout_s` -> ServerError saying how to start one."""
    deadline, last = time.time() + timeout_s, "no answer"
    while True:
        try:
            with urllib.request.urlopen(url + "/health_generate", timeout=max(1.0, min(every_s * 5, timeout_s))) as answer:
                if answer.status == 200:
                    return
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}"  # starting
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            last = str(getattr(e, "reason", e))
        if time.time() >= deadline:
            raise ServerError(f"no rollout server ready at {url} after {timeout_s:g} s (last: {last}); {LAUNCH_HINT}")
        time.sleep(every_s)


class ServerEngine:
    """sglang.Engine's generate/async_generate over HTTP, on one or several servers (or a router)."""

    def __init__(self, urls: list[str], *, timeout_s: float, start_timeout_s: float | None = None):
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        for url in self.urls:
            wait_healthy(url, timeout_s if start_timeout_s is None else start_timeout_s)
        self.pool = ThreadPoolExecutor(max(4, 2 * len(self.urls)), thread_name_prefix="rollout-http")
        self.loop = asyncio.new_event_loop()  # drives multi-turn episodes (rollout.episode), as SGLang's Engine's
        self.processes = []  # none of ours: stop.EngineWatch has nothing to watch, the timeouts do that job
        self._next = 0  # round-robin over the URLs for single requests

    def generate(self, input_ids: list[list[int]], sampling_params: list[dict], return_logprob: bool = False) -> list[dict]:
        """A batch, split into one contiguous part per URL, the parts sent concurrently."""
        n, k = len(input_ids), len(self.urls)
        bounds = [n * i // k for i in range(k + 1)]
        parts = [(url, lo, hi) for url, lo, hi in zip(self.urls, bounds, bounds[1:]) if hi > lo]
        futures = [self.pool.submit(post, url, "/generate", {"input_ids": input_ids[lo:hi], "sampling_params": sampling_params[lo:hi],
                                                             "return_logprob": return_logprob}, self.timeout_s)
                   for url, lo, hi in parts]
        return [out for f in futures for out in f.result()]

    async def async_generate(self, input_ids: list[int], sampling_params: dict, return_logprob: bool = False) -> dict:
        """One request (one turn of an episode), on the next URL; the event loop stays free meanwhile."""
        url = self.urls[self._next % len(self.urls)]
        self._next += 1
        payload = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": return_logprob}
        return await self.loop.run_in_executor(self.pool, post, url, "/generate", payload, self.timeout_s)

    def shutdown(self):
        """The servers are the user's: only this client's threads and loop end here."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.loop.close()
