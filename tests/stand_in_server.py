"""A stand-in for an SGLang server (the endpoints server.ServerEngine uses), generating with
rollout.HFEngine on the CPU: tests run the client end to end without a GPU.

    server = StandInServer(model_dir, starting=2, delay_s=0.0).start()   # server.url: http://127.0.0.1:<port>
    ...
    server.stop()

`starting`: how many /health_generate calls answer 503 first; `delay_s`: how long each /generate
waits before answering, after generating (a slow or stalled server; a pause in that time aborts it). A weight sync that goes wrong on the server's side:
`sync_fail_at=N`: the Nth bucket is refused at once (400 and SGLang's message, nothing received);
`sync_hang_at=N`: the Nth bucket is never received nor answered, and from then on the server is stuck
as SGLang's is inside a broadcast that never ends: /health_generate answers 503 after `health_check_s`
(SGLang's health check, 20 s).

It also takes weights as SGLang does (/init_weights_update_group, /update_weights_from_distributed
in the "flattened_bucket" format), over gloo. Two members of one group cannot live in one
process, so a test that syncs runs the stand-in in a process of its own, as a real server is:

    python tests/stand_in_server.py MODEL_DIR [--port P]     # prints "ready <url>" once it listens

server.launch_servers(..., command=(sys.executable, "tests/stand_in_server.py")) starts it as it starts
SGLang's launcher (the flags it does not know are ignored). `lora_rank` > 0 (--max-lora-rank): it serves a LoRA
adapter as SGLang does (/load_lora_adapter from a PEFT folder, /unload_lora_adapter, `lora_path` in /generate).
"""

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rollout import HFEngine  # noqa: E402
from server import join_group  # noqa: E402  (the steps of SGLang's init_custom_process_group)

GENERATE = threading.Lock()  # one generation at a time in this process: torch's RNG is global, and
# two stand-ins in one test would otherwise interleave their seeds


def aborted(out: dict) -> dict:
    """A request a pause (mode abort) cut short, as SGLang answers it: the first half of its tokens and their log-probs,
    finish_reason abort."""
    n = len(out["output_ids"]) // 2
    meta = {**out["meta_info"], "finish_reason": {"type": "abort", "message": "Abort in waiting queue"}}
    if "output_token_logprobs" in meta:
        meta["output_token_logprobs"] = meta["output_token_logprobs"][:n]
    return {**out, "output_ids": out["output_ids"][:n], "meta_info": meta}


class StandInServer:
    def __init__(
        self,
        model_dir: str,
        *,
        starting: int = 0,
        delay_s: float = 0.0,
        seed: int = 0,
        port: int = 0,
        sync_fail_at: int = 0,
        sync_hang_at: int = 0,
        health_check_s: float = 20.0,
        lora_rank: int = 0,
    ):
        self.engine, self.starting, self.delay_s = HFEngine(model_dir, seed=seed), starting, delay_s
        self.sync_fail_at, self.sync_hang_at, self.health_check_s = sync_fail_at, sync_hang_at, health_check_s
        self.buckets, self.stuck = 0, threading.Event()
        self.requests = []  # the /generate payloads received
        self.info = {"model_path": model_dir, "tp_size": 1, "dp_size": 1}  # /server_info (SGLang's has many more)
        self.info |= {"enable_lora": bool(lora_rank), "max_lora_rank": lora_rank or None}
        self.group, self.syncs = None, 0
        self.events = []  # ["generate", prompts, weight version] and ["flush", version]: GET /stand_in_events
        # /pause_generation (mode abort) and /continue_generation: a request running when a pause comes answers with
        # the first half of its tokens, finish_reason abort (SGLang: its tokens so far); new ones wait for continue
        self.paused, self.pauses = threading.Event(), 0
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def answer(self, code: int, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/server_info":
                    return self.answer(200, stand_in.info)
                if self.path == "/stand_in_events":
                    return self.answer(200, stand_in.events)
                if self.path == "/model_info":
                    return self.answer(200, {"architectures": stand_in.engine.model.config.architectures})
                if self.path != "/health_generate":
                    return self.answer(404, {"error": self.path})
                if stand_in.starting > 0:
                    stand_in.starting -= 1
                    return self.answer(503, {"error": "starting"})
                if stand_in.stuck.is_set():  # SGLang's scheduler inside a broadcast: its health check times out
                    time.sleep(stand_in.health_check_s)
                    return self.answer(503, {})
                self.answer(200, {})

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/init_weights_update_group":  # blocks until every member joined, as SGLang's
                    stand_in.group = join_group(
                        address=payload["master_address"],
                        port=payload["master_port"],
                        world_size=payload["world_size"],
                        rank=payload["rank_offset"],
                        group_name=payload["group_name"],
                        backend=payload["backend"],
                        timeout_s=60,
                    )
                    return self.answer(200, {"success": True, "message": "joined"})
                if self.path == "/update_weights_from_distributed":
                    return self.answer(*stand_in.receive(payload))
                if self.path in ("/load_lora_adapter", "/unload_lora_adapter"):
                    return self.answer(*stand_in.adapter(self.path, payload))
                if self.path == "/pause_generation":
                    stand_in.pauses += 1
                    stand_in.paused.set()
                    stand_in.events.append(["pause", payload.get("mode")])
                    return self.answer(200, {"success": True})
                if self.path == "/continue_generation":
                    stand_in.paused.clear()
                    stand_in.events.append(["continue"])
                    return self.answer(200, {"success": True})
                if self.path == "/flush_cache":  # once per weight sync: the weights' version
                    stand_in.events.append(["flush", sum(e[0] == "flush" for e in stand_in.events) + 1])
                    return self.answer(200, "Cache flushed.")
                if self.path != "/generate":
                    return self.answer(404, {"error": self.path})
                while stand_in.paused.is_set():  # held until /continue_generation
                    time.sleep(0.01)
                pauses = stand_in.pauses
                stand_in.requests.append(payload)
                stand_in.events.append(
                    ["generate", len(payload["input_ids"]), sum(e[0] == "flush" for e in stand_in.events)]
                )
                batch = isinstance(payload["input_ids"][0], list)
                ids = payload["input_ids"] if batch else [payload["input_ids"]]
                params = payload["sampling_params"] if batch else [payload["sampling_params"]]
                loras = payload.get("lora_path") or [None] * len(ids)
                loras = loras if isinstance(loras, list) else [loras]
                with GENERATE:  # each request alone, with its own seed, as SGLang samples it
                    outs = [
                        stand_in.engine.generate([p], [sp], payload.get("return_logprob", False), lora and [lora])[0]
                        for p, sp, lora in zip(ids, params, loras)
                    ]
                time.sleep(stand_in.delay_s)  # the tokens decoded with the weights it started with, then the wait
                if stand_in.pauses != pauses:  # a pause came while it ran: aborted, with half its tokens
                    outs = [aborted(out) for out in outs]
                self.answer(200, outs if batch else outs[0])

        self.http = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.http.daemon_threads = False  # stop() waits for requests in flight (no torch call left running at exit)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def receive(self, payload: dict) -> tuple[int, dict]:
        """One bucket: a flat byte tensor from rank 0, cut back into the announced tensors."""
        assert payload["load_format"] == "flattened_bucket", payload["load_format"]
        self.buckets += 1
        if self.buckets == self.sync_fail_at:
            return 400, {
                "success": False,
                "message": "Failed to update parameter online: NCCL error in: broadcast, "
                "unhandled cuda error (stand-in). The full weights of the ModelRunner "
                "are partially updated. Please discard the whole weights.",
            }
        if self.buckets == self.sync_hang_at:
            self.stuck.set()
            time.sleep(10**6)
        shaped = [
            torch.empty(shape, dtype=getattr(torch, dtype))
            for dtype, shape in zip(payload["dtypes"], payload["shapes"])
        ]
        flat = torch.empty(sum(t.numel() * t.element_size() for t in shaped), dtype=torch.uint8)
        dist.broadcast(flat, src=0, group=self.group)
        offset, named = 0, []
        for name, t in zip(payload["names"], shaped):
            n = t.numel() * t.element_size()
            named.append((name, flat[offset : offset + n].view(t.dtype).view(t.shape)))
            offset += n
        try:
            with GENERATE:
                self.engine.update_weights_from_tensor(named)
        except KeyError as e:  # SGLang answers a failed load with 400 and its message
            return 400, {"success": False, "message": f"Failed to update parameter online: {e}"}
        self.syncs += 1
        return 200, {"success": True, "message": "Succeeded to update parameter online."}

    def adapter(self, path: str, payload: dict) -> tuple[int, dict]:
        """SGLang's /load_lora_adapter (a PEFT folder on this machine) and /unload_lora_adapter: 400 on a failure."""
        from safetensors.torch import load_file

        if not self.info["enable_lora"]:
            return 400, {"success": False, "error_message": "LoRA is not enabled. Please set `--enable-lora`"}
        with GENERATE:
            if path == "/unload_lora_adapter":
                result = self.engine.unload_lora_adapter(payload["lora_name"])
            else:
                with open(os.path.join(payload["lora_path"], "adapter_config.json")) as f:
                    config = json.load(f)
                tensors = load_file(os.path.join(payload["lora_path"], "adapter_model.safetensors"))
                result = self.engine.load_lora_adapter_from_tensors(payload["lora_name"], tensors, config)
        self.events.append(["lora", path, payload["lora_name"]])
        return (200 if result["success"] else 400), result

    def start(self) -> "StandInServer":
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        return self

    def stop(self):
        self.http.shutdown()
        self.http.server_close()


if __name__ == "__main__":  # python tests/stand_in_server.py MODEL_DIR [--port P], or with sglang.launch_server's flags
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--sync-fail-at", type=int, default=0)
    parser.add_argument("--sync-hang-at", type=int, default=0)
    parser.add_argument("--health-check-s", type=float, default=20.0)
    parser.add_argument("--max-lora-rank", type=int, default=0)
    parser.add_argument("--delay-s", type=float, default=0.0)  # each /generate waits this long first
    cli, rest = parser.parse_known_args()  # the rest of launch_servers' flags mean nothing on a CPU
    server = StandInServer(
        cli.model_path or rest[0],
        port=cli.port,
        sync_fail_at=cli.sync_fail_at,
        sync_hang_at=cli.sync_hang_at,
        health_check_s=cli.health_check_s,
        lora_rank=cli.max_lora_rank,
        delay_s=cli.delay_s,
    )
    print(f"ready {server.url}", flush=True)
    server.http.serve_forever()
