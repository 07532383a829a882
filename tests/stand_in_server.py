"""A stand-in for an SGLang server (the endpoints server.ServerEngine uses), generating with
rollout.HFEngine on the CPU: tests run the client end to end without a GPU.

    server = StandInServer(model_dir, starting=2, delay_s=0.0).start()   # server.url: http://127.0.0.1:<port>
    ...
    server.stop()

`starting`: how many /health_generate calls answer 503 first; `delay_s`: how long each /generate
waits before answering (a stalled server).
"""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rollout import HFEngine

GENERATE = threading.Lock()  # one generation at a time in this process: torch's RNG is global, and
# two stand-ins in one test would otherwise interleave their seeds


class StandInServer:
    def __init__(self, model_dir: str, *, starting: int = 0, delay_s: float = 0.0, seed: int = 0):
        self.engine, self.starting, self.delay_s = HFEngine(model_dir, seed=seed), starting, delay_s
        self.requests = []  # the /generate payloads received
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
                if self.path != "/health_generate":
                    return self.answer(404, {"error": self.path})
                if stand_in.starting > 0:
                    stand_in.starting -= 1
                    return self.answer(503, {"error": "starting"})
                self.answer(200, {})

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/generate":
                    return self.answer(404, {"error": self.path})
                stand_in.requests.append(payload)
                time.sleep(stand_in.delay_s)
                batch = isinstance(payload["input_ids"][0], list)
                ids = payload["input_ids"] if batch else [payload["input_ids"]]
                params = payload["sampling_params"] if batch else [payload["sampling_params"]]
                with GENERATE:  # each request alone, with its own seed, as SGLang samples it
                    outs = [stand_in.engine.generate([p], [sp], payload.get("return_logprob", False))[0]
                            for p, sp in zip(ids, params)]
                self.answer(200, outs if batch else outs[0])

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = False  # stop() waits for requests in flight (no torch call left running at exit)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def start(self) -> "StandInServer":
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        return self

    def stop(self):
        self.http.shutdown()
        self.http.server_close()
