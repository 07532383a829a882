"""On a GPU: the README's command for an exported adapter works, `python -m sglang.launch_server --model-path BASE
--enable-lora --lora-paths policy=.../adapter`, and the server then scores text as the merged model/ does.

    python tests/adapter_server_check.py --model $SMOLLM2 --out /tmp/adapter_server.json

A rank-8 adapter on every linear layer of BASE, with B drawn at random so that it changes the model (a trained one
after a few steps would be too close to the base to tell apart), is written as checkpoint.py writes one: adapter/ by
lora.save_adapter, model/ by lora.merged_state_dict. Then the server's log-probs of a fixed text are compared: with
the adapter named (lora_path) against transformers on model/, without it against transformers on BASE. Writes the
mean |difference| of each pair and of the adapter's against BASE (what a server that ignored the adapter would show).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lora import apply_lora, lora_modules, merged_state_dict, save_adapter  # noqa: E402


def post(url: str, body: dict, timeout: float = 60) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())


def hf_logprobs(path: str, ids: list[int]) -> torch.Tensor:  # [T-1]: each next token's log-prob, fp32 on the GPU
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().float()
    with torch.no_grad():
        logits = model(torch.tensor([ids]).cuda()).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).cuda()[:, None]).squeeze(-1).cpu()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--port", type=int, default=30333)
    p.add_argument("--mem-fraction", type=float, default=0.2)
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = tempfile.mkdtemp(prefix="adapter_check_")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    apply_lora(model, rank=8, alpha=16, targets=("all-linear",))
    gen = torch.Generator().manual_seed(0)
    for _, m in lora_modules(model):
        m.lora_B.data = torch.randn(m.lora_B.shape, generator=gen) * 0.05
    state = model.state_dict()
    save_adapter(model, os.path.join(work, "adapter"), state)
    merged = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    merged.load_state_dict(merged_state_dict(model, state))
    merged.save_pretrained(os.path.join(work, "model"))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.save_pretrained(os.path.join(work, "model"))
    ids = tokenizer.encode("What is 47 + 38? Put the final answer after ####. 47 + 38 = 85\n#### 85")

    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model, "--enable-lora"]
    command += ["--lora-paths", f"policy={work}/adapter", "--port", str(args.port)]
    command += ["--mem-fraction-static", str(args.mem_fraction), "--attention-backend", "triton"]
    command += ["--sampling-backend", "pytorch", "--disable-cuda-graph", "--log-level", "warning"]
    log = open(os.path.join(work, "server.log"), "w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url, result = f"http://127.0.0.1:{args.port}", {"command": " ".join(command)}
    try:
        deadline = time.time() + 400
        while True:
            try:
                urllib.request.urlopen(url + "/health_generate", timeout=10)
                break
            except Exception:
                if server.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"server did not start: {open(log.name).read()[-3000:]}") from None
                time.sleep(3)
        got = {}
        for name, lora in (("adapter", "policy"), ("base", None)):
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
            body.update(return_logprob=True, logprob_start_len=0, **({"lora_path": lora} if lora else {}))
            meta = post(url + "/generate", body)["meta_info"]
            got[name] = torch.tensor([x[0] for x in meta["input_token_logprobs"][1:]], dtype=torch.float32)
        want_merged, want_base = hf_logprobs(os.path.join(work, "model"), ids), hf_logprobs(args.model, ids)
        mean = lambda a, b: float((a - b).abs().mean())  # noqa: E731
        result.update(
            tokens=len(ids),
            adapter_vs_merged=mean(got["adapter"], want_merged),
            base_vs_base=mean(got["base"], want_base),
            adapter_vs_base=mean(got["adapter"], want_base),
            merged_vs_base_hf=mean(want_merged, want_base),
        )
    finally:
        os.killpg(server.pid, 9)
        server.wait()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=1))
    json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
