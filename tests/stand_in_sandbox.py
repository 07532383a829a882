"""A stand-in for a SandboxFusion server's POST /run_code (github.com/bytedance/SandboxFusion,
sandbox/server/sandbox_api.py: RunCodeRequest -> RunCodeResponse), so sandbox.run_on_service is
tested end to end without the service. It runs each program in sandbox.py's own jail, with the
request's run_timeout and memory_limit_MB, and answers in SandboxFusion's shape:

    {"status": "Success" | "Failed" | "SandboxError", "message": "...",
     "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error", "return_code": 0,
                    "execution_time": 0.05, "stdout": "...", "stderr": "..."}, ...}

    service = StandInSandbox(mode="ok").start()   # service.url; service.requests: the bodies received
    service.stop()

`mode`: "ok"; "error" (every answer a SandboxError); "slow" (answers after `delay_s`); "huge" (an
answer bigger than sandbox.SERVICE_MAX_BYTES); "http500".
"""

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sandbox  # noqa: E402


class StandInSandbox:
    def __init__(self, *, mode: str = "ok", delay_s: float = 0.0):
        self.mode, self.delay_s, self.requests = mode, delay_s, []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def start(self) -> "StandInSandbox":
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def run_code(self, request: dict) -> dict:
        if self.mode == "error":
            return {"status": "SandboxError", "message": "executor pod unavailable", "run_result": None}
        t0 = time.time()
        limits = {"seconds": request["run_timeout"], "memory_mb": request["memory_limit_MB"], "output_chars": 1 << 20}
        try:
            out = sandbox.run_program(request["code"], sandbox="bwrap", limits=limits)
            run = {"status": "Finished", "return_code": 0, "stdout": out, "stderr": ""}
        except TimeoutError:
            run = {"status": "TimeLimitExceeded", "return_code": None, "stdout": "", "stderr": ""}
        if self.mode == "huge":
            run["stdout"] = "x" * (sandbox.SERVICE_MAX_BYTES + 10)
        run["execution_time"] = time.time() - t0
        return {
            "status": "Success" if run["status"] == "Finished" else "Failed",
            "message": "",
            "compile_result": None,
            "run_result": run,
            "executor_pod_name": None,
            "files": {},
        }

    def _handler(self):
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                if self.path != "/run_code":
                    self.send_error(404)
                    return
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                service.requests.append(request)
                if service.mode == "http500":
                    self.send_error(500, "internal error")
                    return
                time.sleep(service.delay_s)
                body = json.dumps(service.run_code(request)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler
