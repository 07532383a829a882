"""bench/report.py's arithmetic on hand-made run folders (the GPU runs themselves are in bench/)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_run(folder, world_size, tokens_per_s):
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step, tps in enumerate(tokens_per_s, 1):
            f.write(json.dumps({"step": step, "train/loss": 0.0, "perf/rollout_tokens_per_s": tps, "perf/step_s": 10.0,
                                "time/generate": 4.0, "time/sync_weights": 0.1}) + "\n")
    json.dump({"world_size": world_size, "gpu": "H", "date": "d", "command": "c", "torch": "t"},
              open(os.path.join(folder, "run_info.json"), "w"))
    json.dump({"prompts_per_step": 16 * world_size}, open(os.path.join(folder, "args.json"), "w"))


def test_scaling_efficiency_is_tokens_per_gpu_relative_to_one_gpu(tmp_path):
    fake_run(tmp_path / "runs" / "scale_1gpu", 1, [999.0, 1000.0, 1000.0])  # step 1 (warm-up) is left out
    fake_run(tmp_path / "runs" / "scale_4gpu", 4, [1.0, 3000.0, 3400.0])     # 3200 tok/s on 4 GPUs
    out = tmp_path / "scaling.json"
    subprocess.run([sys.executable, "bench/report.py", "scaling", str(tmp_path / "runs"), "--out", str(out)],
                   cwd=ROOT, check=True, capture_output=True)
    runs = json.loads(out.read_text())["runs"]
    assert [r["gpus"] for r in runs] == [1, 4]
    assert runs[0]["rollout_scaling_efficiency"] == 1.0
    assert abs(runs[1]["rollout_scaling_efficiency"] - 3200 / 4000) < 1e-9
