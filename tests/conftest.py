"""Shared pytest set-up: import the scripts and modules from the repo root, and one tiny model per session."""

import os
import signal
import subprocess
import sys

import pytest

# The suite computes the same numbers on any x86-64 CPU with AVX2: each library's kernel choice is pinned before torch
# loads (here and in every process a test starts, which inherits the environment). Unpinned, ATen picks its AVX-512
# kernels where the CPU has them (other reduction orders in softmax and log_softmax), MKL its AVX-512 sgemm on Intel
# only, and oneDNN bf16 matmuls on CPUs with avx512_bf16 (fsdp.compute_dtype): an AMD EPYC and an Intel Xeon gave
# golden entropies 2.5e-4 to 4.6e-4 apart. One thread: ATen's and MKL's results can follow the thread count.
for key, value in {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "AVX2,STRICT",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OMP_NUM_THREADS": "1",
}.items():
    os.environ.setdefault(key, value)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "tests")):  # `from grpo import ...`, `from tiny_model import ...`
    if path not in sys.path:
        sys.path.insert(0, path)


def pytest_terminal_summary(terminalreporter):
    """Which CPU ran the suite and the kernel pins in force, after the results (shown under -q too): a golden value
    off on one machine names its CPU."""
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    pins = ", ".join(f"{k}={os.environ.get(k)}" for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA"))
    terminalreporter.write_line(f"cpu: {model}, {os.cpu_count()} cores; {pins}")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: launches scripts (first-hour, failure, server, jail suites; multi-rank and variant runs); the fast tier "
        "is pytest -m 'not slow': the hand-worked unit tests, the golden tests, one smoke run per script, the notebook",
    )


def torchrun_check(script: str, *args: str) -> subprocess.CompletedProcess:
    """tests/<script> under torchrun as two CPU ranks (gloo): the checks that need a real two-rank world."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.fixture(autouse=True)
def signal_handlers_restored():
    """A test that leaves a signal handled or ignored (stop.py's handlers; a start cut short leaves SIGQUIT
    ignored) must not change the next test in the same process (pytest -n 2)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT)}
    yield
    for s, handler in saved.items():
        if handler is not None and signal.getsignal(s) is not handler:
            signal.signal(s, handler)


@pytest.fixture(scope="module")
def gloo():
    """A world of one process, for FSDP2 and barriers in-process."""
    import torch.distributed as dist

    if dist.is_initialized():  # someone else's group: use it, leave it
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def one_model(tmp_path_factory, name: str, build=None, **how) -> str:
    """A tiny model built once per test session: under pytest-xdist (-n 2) the workers' temp folders share this
    session's parent, and a lock makes one build it while the other waits (each built its own: 150 SFT steps, twice).
    `build(folder)` makes it instead of build_tiny_model(folder, **how)."""
    from filelock import FileLock
    from tiny_model import build_tiny_model

    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    with FileLock(f"{folder}.lock"):
        if not folder.exists():  # built beside it, then renamed: a folder there is whole
            os.rename((build or (lambda f: build_tiny_model(f, **how)))(f"{folder}.building"), folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A 2-layer Llama + BPE tokenizer with a chat template, untrained (sft_steps=0: a few seconds)."""
    return one_model(tmp_path_factory, "tiny-model", sft_steps=0)


@pytest.fixture(scope="session")
def trained_tiny_model_dir(tmp_path_factory) -> str:
    """The tiny model after a few seconds of SFT on addition answers: it answers in the '#### N'
    format with mostly wrong numbers, so GRPO rewards vary within groups and gradients are real."""
    return one_model(tmp_path_factory, "tiny-model-sft", sft_steps=150)


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory, trained_tiny_model_dir) -> str:
    """The SFT'd tiny model with a 2048-token context: the tools' system prompt alone is ~600 of its tokens. The context
    (max_position_embeddings) enters neither the tokenizer nor the SFT (its sequences are short; Llama's default RoPE
    does not read it), so build_tiny_model(context=2048) makes the same files but config.json, byte for byte: the SFT'd
    folder is copied and that one number changed (150 SFT steps once, not twice)."""

    def widen(folder: str) -> str:
        import json
        import shutil

        shutil.copytree(trained_tiny_model_dir, folder)
        with open(path := os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        with open(path, "w") as f:
            json.dump({**config, "max_position_embeddings": 2048}, f, indent=2)
        return folder

    return one_model(tmp_path_factory, "tiny-model-tools", build=widen)


@pytest.fixture(scope="session")
def one_grpo_step(tmp_path_factory, trained_tiny_model_dir) -> str:
    """A finished grpo.py run of one step on the SFT'd model (--eval-every 0, the checkpoint of step 1), made once a
    session for the tests that damage, rerun or resume such a run (each ran this same command first): they copy its
    folder, copy_run(one_grpo_step, tmp_path), and act on their copy. A resume may name another --output-dir."""

    def run(folder: str) -> str:
        from test_smoke import run_grpo

        run_grpo(trained_tiny_model_dir, folder, "--steps", "1", "--eval-every", "0", "--log-samples-every", "1")
        return folder

    return one_model(tmp_path_factory, "one-grpo-step", build=run)


def copy_run(shared: str, out_dir) -> None:
    """The shared run's folder as out_dir/r, the run folder of run_grpo(model, out_dir, ...)."""
    import shutil

    shutil.copytree(os.path.join(shared, "r"), os.path.join(out_dir, "r"))


def install_fake_sglang(monkeypatch, engine_class):
    """Make `from sglang.srt.entrypoints.engine import Engine` give `engine_class` (SGLang is not
    installed on CPU machines)."""
    import types

    for name in ("sglang", "sglang.srt", "sglang.srt.entrypoints"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.entrypoints.engine", types.SimpleNamespace(Engine=engine_class))
