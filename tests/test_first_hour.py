"""A newcomer's first hour, on a CPU machine with no model hub: each mistake ends in one or two lines
that name the input and the fix, exit code 2, no traceback, and nothing written.

Every run here is a subprocess, as a person would start it. The hub is made unreachable
(HF_ENDPOINT on a closed local port, an empty cache) and GPUs hidden (CUDA_VISIBLE_DEVICES=""), so the
tests behave the same on any machine: on a GPU machine a run that expects no GPU would otherwise start SGLang.
The README's install commands themselves run in bench/fresh_machine.sh (a fresh virtualenv).
"""

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest

pytestmark = pytest.mark.slow  # the suite launches scripts (the fast tier: pytest -m "not slow")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script: str, *args, cwd=ROOT, tmp=None, timeout=300, env=None, launcher=()):
    """Run `python <script> args` like a person would; returns (exit code, stdout + stderr, seconds)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "CUDA_VISIBLE_DEVICES": "",
        "HF_ENDPOINT": "http://127.0.0.1:9",
        "HF_HUB_CACHE": str(tmp / "hf-cache") if tmp else "/nonexistent",
        **(env or {}),
    }
    env.pop("RL_DEBUG", None)
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, *launcher, os.path.join(ROOT, script), *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout + proc.stderr, time.time() - t0


def last_lines(output: str, n: int = 2) -> str:
    return "\n".join(output.strip().splitlines()[-n:])


def assert_clean_failure(code: int, output: str, *expected: str):
    """Exit 2, no traceback, and the last one or two lines hold every expected piece."""
    assert code == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    tail = last_lines(output)
    for piece in expected:
        assert piece in tail, f"{piece!r} not in the last lines:\n{tail}"


def ours_last(code: int, output: str, script: str, *expected: str, exit_code: int = 2) -> list[str]:
    """`exit_code`, no traceback, and the output ends with our message: '<script>: ...' and at most one more
    (indented) line, holding every expected piece. Returns the message's lines."""
    assert code == exit_code and "Traceback" not in output, output[-3000:]
    lines = output.strip().splitlines()
    start = max(i for i, x in enumerate(lines) if x.startswith(f"{script}: "))
    message = lines[start:]
    assert len(message) <= 2 and all(x.startswith("  ") for x in message[1:]), output[-3000:]
    for piece in expected:
        assert piece in "\n".join(message), f"{piece!r} not in our last lines:\n" + "\n".join(message)
    return message


def write_rows(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ----------------------------------------------------------------------------------------------
# The model


def test_no_hub_fails_fast_naming_the_model_and_a_way_out(tmp_path):
    """A hub id that is not cached, with no hub: one request, then the way out (a local folder, the tiny model)."""
    code, out, seconds = run(
        "grpo.py", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--output-dir", tmp_path / "runs", tmp=tmp_path
    )
    assert_clean_failure(
        code,
        out,
        "'HuggingFaceTB/SmolLM2-135M-Instruct' is not a local folder",
        "the hub can't be reached",
        "tests/tiny_model.py ./tiny-model",
    )
    assert seconds < 30 and not (tmp_path / "runs").exists()


def test_readme_cpu_line_relative_folder(tiny_model_dir, tmp_path):
    """`--model ./tiny-model` is a folder relative to where you stand: missing, it says where it looked
    and how to build one; present, the run starts (it was taken for a hub id before: the run of
    test_cpu_machine_says_so_and_sizes_the_run_for_it is such a run, from the folder that holds ./tiny-model)."""
    code, out, _ = run(
        "grpo.py", "--model", "./tiny-model", "--output-dir", tmp_path / "runs", cwd=tmp_path, tmp=tmp_path
    )
    assert_clean_failure(code, out, f"'./tiny-model' does not exist ({tmp_path / 'tiny-model'})", "tests/tiny_model.py")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "remove, missing",
    [
        (["tokenizer.json", "tokenizer_config.json"], "has no tokenizer files"),
        (["config.json"], "has no config.json"),
        (["model.safetensors"], "has no weights"),
    ],
)
def test_model_folder_missing_files(tiny_model_dir, tmp_path, remove, missing):
    """grpo.py and evaluate.py for the first, as a user meets it (exit 2, one line, nothing written); the others
    through the same preflight.check_model in this process (the scripts' own launch adds nothing to them)."""
    from preflight import check_model
    from common import InputError

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    for name in remove:
        (folder / name).unlink()
    if "tokenizer_config.json" not in remove:
        with pytest.raises(InputError, match=re.escape(f"--model '{folder}' {missing}")):
            check_model(str(folder))
        return
    scripts = (("grpo.py", ["--output-dir", tmp_path / "runs"]), ("evaluate.py", ["--out", tmp_path / "e.json"]))
    for script, out_flag in scripts:
        code, out, _ = run(script, "--model", folder, *out_flag, tmp=tmp_path)
        assert_clean_failure(code, out, f"--model '{folder}' {missing}")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "e.json").exists()


def test_prompt_plus_new_tokens_longer_than_the_context(tiny_model_dir, tmp_path):
    """The tiny model's context is 512: 256 + 300 tokens is refused with the numbers, before loading."""
    code, out, _ = run("grpo.py", "--model", tiny_model_dir, "--max-new-tokens", 300, "--output-dir", tmp_path / "runs")
    assert_clean_failure(
        code,
        out,
        "--max-prompt-len 256 + --max-new-tokens 300 = 556 tokens",
        "the model's context of 512",
        "lower --max-new-tokens to 256 or --max-prompt-len to 212",
    )
    assert not (tmp_path / "runs").exists()


def test_tools_prompt_longer_than_the_context_names_a_model_that_fits(tiny_model_dir, tmp_path):
    """docs/tools.md's example on the tiny model (context 512): no flag can make room for the tools' prompt, so the
    error names a longer context only, and tiny_model.py's option that builds one."""
    code, out, _ = run(
        "grpo.py",
        "--model",
        tiny_model_dir,
        "--dataset",
        "multiplication",
        "--tools",
        "calculator",
        "--output-dir",
        tmp_path / "runs",
    )
    assert_clean_failure(
        code,
        out,
        "more than the model's context of 512",
        "the tools' prompt alone leaves no room",
        "tests/tiny_model.py ./tiny-model --context 2048",
    )
    assert "lower" not in out
    code, out, _ = run("tests/tiny_model.py", "--help")
    assert code == 0 and "--context" in out


@pytest.mark.parametrize(
    "context, prompt, tools, new, fixes",
    [
        (
            512,
            256,
            0,
            300,
            ["--max-new-tokens to 256", "--max-prompt-len to 212", "context of 556 or more", "--context 1024"],
        ),
        (
            512,
            256,
            400,
            64,
            ["--max-prompt-len to 48", "context of 720 or more", "--context 1024"],
        ),  # new tokens can't fit
        (512, 256, 776, 64, ["the tools' prompt alone leaves no room", "context of 1096 or more", "--context 2048"]),
        (512, 256, 256, 1, ["--max-prompt-len to 255", "context of 513 or more", "--context 1024"]),
        (
            512,
            500,
            100,
            500,
            ["so that they add up to 412 or less", "context of 1100 or more", "--context 2048"],
        ),  # both
    ],
)
def test_context_error_offers_only_fixes_that_fit(context, prompt, tools, new, fixes):
    """Hand-computed: tokens that fit = context - tools' prompt - the other flag; each fix offered, applied, fits."""
    from data import check_context
    from common import InputError

    check_context(context, context - tools - new, new, tools_prompt=tools)  # exactly full: fine
    check_context(None, prompt, new, tools_prompt=tools)  # context unknown: nothing to check
    with pytest.raises(InputError) as e:
        check_context(context, prompt, new, tools_prompt=tools)
    message = str(e.value)
    assert all(fix in message for fix in fixes), message
    lowered = {f: int(v) for f, v in re.findall(r"(--max-new-tokens|--max-prompt-len) to (\d+)", message)}
    assert len(lowered) == sum(f.startswith("--max") for f in fixes) and all(v >= 1 for v in lowered.values())
    for flag, value in lowered.items():  # each lowering alone makes it fit
        check_context(
            context,
            value if flag == "--max-prompt-len" else prompt,
            value if flag == "--max-new-tokens" else new,
            tools_prompt=tools,
        )
    if together := re.search(r"add up to (\d+)", message):
        total = int(together.group(1))
        check_context(context, total // 2, total - total // 2, tools_prompt=tools)
    bigger = int(re.search(r"--context (\d+)", message).group(1))
    check_context(bigger, prompt, new, tools_prompt=tools)  # the model it names fits


# ----------------------------------------------------------------------------------------------
# A machine without a GPU


def test_cpu_machine_says_so_and_sizes_the_run_for_it(tiny_model_dir, tmp_path):
    """No GPU: one line says so, names the engine, the compute dtype and the CPU-sized flags it chose; flags given win.
    Its --model is the README's CPU line's `./tiny-model`, a folder relative to where the run starts: present, the
    run starts (test_readme_cpu_line_relative_folder: missing)."""
    import torch

    from fsdp import compute_dtype

    shutil.copytree(tiny_model_dir, tmp_path / "tiny-model")
    code, out, _ = run(
        "grpo.py",
        "--model",
        "./tiny-model",
        "--steps",
        "1",
        "--eval-every",
        "0",
        "--group-size",
        "2",
        "--output-dir",
        tmp_path / "runs",
        "--run-name",
        "r",
        cwd=tmp_path,
        tmp=tmp_path,
    )
    assert code == 0, out[-3000:]
    line = next(x for x in out.splitlines() if "no GPU found" in x)
    assert "--rollout-engine hf" in line and "--prompts-per-step 4" in line and "--max-new-tokens 64" in line
    assert "--group-size" not in line  # given on the command line
    assert (
        f"computing in {str(compute_dtype(torch.device('cpu'))).removeprefix('torch.')}" in line
    )  # fsdp.compute_dtype's
    args = json.loads((tmp_path / "runs" / "r" / "args.json").read_text())
    assert (args["prompts_per_step"], args["group_size"], args["max_new_tokens"]) == (4, 2, 64)
    assert "step 1/" in out


def test_sglang_asked_for_without_a_gpu(tiny_model_dir, tmp_path):
    code, out, _ = run(
        "grpo.py", "--model", tiny_model_dir, "--rollout-engine", "sglang", "--output-dir", tmp_path / "runs"
    )
    assert_clean_failure(code, out, "--rollout-engine sglang needs a CUDA GPU", "use --rollout-engine hf")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "kind, dont_write, compiled, noted",
    [
        ("sglang", True, False, True),  # a container image's PYTHONDONTWRITEBYTECODE, nothing compiled in it
        ("sglang", True, True, False),  # the image compiled its bytecode: the flag costs nothing
        ("sglang", False, False, False),  # the first run writes the cache
        ("hf", True, False, False),  # one process: no SGLang processes compiling it all again
    ],
)
def test_uncached_bytecode_is_named_with_its_cost(monkeypatch, capsys, tmp_path, kind, dont_write, compiled, noted):
    """With SGLang, bytecode compiled on every launch took the start-up from 44-46 s to 82-89 s on an H100
    (bench/results, start-up): the run says so before it starts, and how to stop it."""
    import importlib.util

    import torch

    import preflight

    pyc = tmp_path / "torch.pyc"
    if compiled:
        pyc.write_bytes(b"")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "sglang" else find_spec(name, *a)
    )
    monkeypatch.setattr(importlib.util, "cache_from_source", lambda path: str(pyc))
    monkeypatch.setattr(sys, "dont_write_bytecode", dont_write)
    assert preflight.check_engine(kind) == kind
    out = capsys.readouterr().out
    assert ("unset PYTHONDONTWRITEBYTECODE" in out) == noted, out


# ----------------------------------------------------------------------------------------------
# Flags: checked before anything is loaded or written, in grpo.py, ppo.py and evaluate.py alike


BAD_FLAGS = [  # (flag, value, what the run says)
    ("--lr", "-1e-4", "--lr -0.0001 must be >= 0"),
    ("--max-new-tokens", "0", "--max-new-tokens 0 must be >= 1"),
    ("--prompts-per-step", "0", "--prompts-per-step 0 must be >= 1"),
    ("--micro-batch-size", "0", "--micro-batch-size 0 must be >= 1"),
    ("--steps", "0", "--steps 0 must be >= 1 (to only evaluate a model: python evaluate.py)"),
    ("--eval-samples", "-1", "--eval-samples -1 must be >= 0 (0: greedy only) and at most 1024"),
    ("--eval-top-p", "0", "--eval-top-p 0.0 must be in (0, 1]"),
    (
        "--tools",
        "calculator, pyton",
        "--tools 'calculator, pyton' must be a comma-separated list of calculator, python ('pyton' is not one of them)",
    ),
]


def test_sampled_evaluation_at_temperature_0_is_refused():
    """K samples at temperature 0 would be K copies of the greedy answer: refused, in the three scripts that take it."""
    import evaluate
    import grpo
    import ppo
    from common import InputError

    message = "--eval-temperature 0.0 must be > 0 with --eval-samples (at 0 every sample is the greedy answer)"
    for script in (grpo, ppo):
        with pytest.raises(InputError, match=re.escape(message)):
            script.check_args(script.Args(eval_samples=4, eval_temperature=0.0), world_size=1)
        script.check_args(script.Args(eval_samples=0, eval_temperature=0.0), world_size=1)  # greedy only: fine
    with pytest.raises(InputError, match=re.escape(message)):
        evaluate.main(evaluate.Args(model="no-model", eval_samples=4, eval_temperature=0.0))


@pytest.mark.parametrize("script", ["grpo.py", "ppo.py"])
def test_bad_flags_fail_before_anything_loads(tmp_path, script):
    """The model does not even exist: one bad flag is our last line; several are reported at once, a line each, under
    'bad arguments:' (one process for all: each is a check_args rule); no run folder appears."""
    flag, value, message = BAD_FLAGS[0]
    code, out, _ = run(script, "--model", tmp_path / "no-model", flag, value, "--output-dir", tmp_path / "runs")
    assert_clean_failure(code, out, f"{script}: {message}")
    code, out, _ = run(
        script,
        "--model",
        tmp_path / "no-model",
        *[x for f, v, _ in BAD_FLAGS for x in (f, v)],
        "--output-dir",
        tmp_path / "runs",
    )
    assert code == 2 and "Traceback" not in out, out[-3000:]
    lines = out.strip().splitlines()[-len(BAD_FLAGS) - 1 :]
    assert lines[0] == f"{script}: bad arguments:" and all(any(m in x for x in lines[1:]) for _, _, m in BAD_FLAGS), (
        lines
    )
    assert not (tmp_path / "runs").exists()


def test_bad_input_under_torchrun_is_the_root_cause_in_its_summary(tiny_model_dir, tmp_path):
    """torchrun prints its own traceback and a summary of the failed ranks after ours: our line is the summary's root
    cause (its 'traceback' entry, the last line before the closing rule) instead of a link to torchrun's docs. The rank
    that waits for the first to print stops as soon as torchrun stops it (it slept 5 s before)."""
    message = (
        "grpo.py: --rollout-tp 3 must be a divisor of the 2 ranks of each node (one engine's GPUs are on one node: "
        "torchrun --nproc_per_node a multiple of it)"
    )
    code, out, seconds = run(
        "grpo.py",
        "--model",
        tiny_model_dir,
        "--rollout-tp",
        "3",
        "--output-dir",
        tmp_path / "runs",
        launcher=["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
    )
    lines = out.strip().splitlines()
    print(f"{len(lines)} lines, {seconds:.1f} s")
    assert code == 1 and lines.count(message) == 1, out  # torchrun's own exit code; ours printed once, by local rank 0
    root = lines.index("Root Cause (first observed failure):")
    assert lines[-2:] == [f"  traceback : {message}", "=" * 60] and root > len(lines) - 10, out
    assert out.count(f"traceback : {message}") == 2  # rank 1's entry above it: the same error
    assert "To enable traceback" not in out and len(lines) <= 45 and not (tmp_path / "runs").exists()


def test_several_bad_flags_are_listed_together(tmp_path):
    code, out, _ = run("grpo.py", "--lr", "-1", "--micro-batch-size", "0", "--output-dir", tmp_path / "runs")
    assert code == 2 and "Traceback" not in out
    assert out.strip().splitlines()[-3:] == [
        "grpo.py: bad arguments:",
        "  --lr -1.0 must be >= 0 (0: the default: 1e-6, 1e-5 with --lora-rank)",
        "  --micro-batch-size 0 must be >= 1",
    ]


@pytest.mark.parametrize(
    "flag, value, message",
    [
        (
            "--num-prompts",
            "8",
            "--num-prompts is now --num-eval-prompts, its name in every script: pass --num-eval-prompts",
        ),
        ("--max-new-tokens", "0", "--max-new-tokens 0 must be >= 1"),
        ("--out", "no/such/dir/eval.json", "--out 'no/such/dir/eval.json': its folder does not exist"),
    ],
)
def test_evaluate_bad_flags(tmp_path, flag, value, message):
    code, out, _ = run("evaluate.py", "--model", tmp_path / "no-model", flag, value, cwd=tmp_path)
    assert_clean_failure(code, out, message)
    assert os.listdir(tmp_path) == []


def test_a_run_folder_or_an_adapter_folder_as_model_names_the_folder_to_pass(one_grpo_step, tmp_path):
    """evaluate.py (and grpo.py) on a run's folder or a checkpoint's adapter/ ended with 'copy the missing files in':
    the line now says what the folder is and which to pass (a run's newest checkpoint's model/, the checkpoint's
    merged model/ beside its adapter/, how to merge a lone adapter)."""
    run_dir = os.path.join(one_grpo_step, "r")
    newest = os.path.join(run_dir, "checkpoints", "step_000001", "model")
    code, out, _ = run("evaluate.py", "--model", run_dir, cwd=tmp_path)
    assert_clean_failure(
        code,
        out,
        f"evaluate.py: --model {run_dir!r} is a run's folder: pass a checkpoint's model folder, its newest {newest}",
    )
    checkpoint = tmp_path / "checkpoints" / "step_000010"
    (checkpoint / "adapter").mkdir(parents=True), (checkpoint / "model").mkdir()
    (checkpoint / "adapter" / "adapter_config.json").write_text('{"base_model_name_or_path": "Qwen/Qwen3-8B"}')
    (checkpoint / "model" / "config.json").write_text("{}")
    code, out, _ = run("grpo.py", "--model", checkpoint / "adapter", "--output-dir", tmp_path / "runs", cwd=tmp_path)
    assert_clean_failure(
        code,
        out,
        f"is a LoRA adapter (PEFT's files): its checkpoint's model with the adapter "
        f"merged in is {checkpoint / 'model'}",
    )
    shutil.rmtree(checkpoint / "model")
    code, out, _ = run("evaluate.py", "--model", checkpoint / "adapter", cwd=tmp_path)
    assert_clean_failure(
        code,
        out,
        "is a LoRA adapter (PEFT's files) of Qwen/Qwen3-8B: pass a model with it merged "
        "in (PEFT's merge_and_unload, then save_pretrained)",
    )
    assert sorted(os.listdir(tmp_path)) == ["checkpoints"]


def test_help_groups_the_flags_with_their_cpu_defaults(capsys, monkeypatch):
    """--help was 319 lines in one box, GPU defaults only (issue 40, item 17): a group per comment rule of Args (tyro
    draws groups of nested dataclasses only: preflight.help_groups nests a copy), -h a line a flag, -H with each flag's
    docstring, each CPU-sized default beside its GPU one; every flag once, its group's in order."""
    import dataclasses
    import inspect

    import evaluate
    import grpo
    import ppo
    import train_rm
    from preflight import parse_args

    monkeypatch.setenv("COLUMNS", "100")  # one column (a wide terminal gets two)
    for script in (grpo, ppo, train_rm, evaluate):
        out = {}
        for asked in ("--help", "-H")[: 1 + (script is grpo)]:  # -H's groups are -h's, each flag with its docstring
            with pytest.raises(SystemExit) as e:
                parse_args(script.Args, getattr(script, "CPU_SIZES", None), argv=["--lr", "1", asked])
            out[asked] = capsys.readouterr().out
            assert e.value.code == 0
        titles = re.findall(r"# --- (.+)", inspect.getsource(script.Args))
        found = re.findall(r"^\W*(.+?) options\b", out["--help"], re.M)
        assert found == titles, found
        flags = re.findall(r"^\W*--([a-z][\w-]*)[ ,]", out["--help"], re.M)  # a line each, in Args' order
        assert flags == [f.name.replace("_", "-") for f in dataclasses.fields(script.Args)], flags
        if script is grpo:  # -H's lines wrap: compared with the spaces collapsed
            assert (
                "--group-size INT (default: 16; CPU: 4) " in out["--help"] and "normalized within" not in out["--help"]
            )
            assert "per prompt; advantages are normalized within each group (default: 16; CPU: 4)" in " ".join(
                out["-H"].split()
            )


@pytest.mark.parametrize(
    "script, old, new",
    [
        ("ppo.py", "--samples-per-prompt", "--group-size"),
        ("evaluate.py", "--engine=hf", "--rollout-engine"),
        ("evaluate.py", "--mem-fraction", "--sglang-mem-fraction"),
    ],
)
def test_a_flag_by_its_old_name_names_the_new_one(capsys, script, old, new):
    """One name for a thing in every script (issue 40, item 18: --samples-per-prompt was ppo.py's --group-size,
    evaluate.py had --num-prompts, --engine, --mem-fraction): the old name is bad input, one line naming the new one,
    exit 2 (the path of the scripts' own `friendly_errors(...): main(parse_args(Args))`; evaluate.py's as a subprocess
    in test_evaluate_bad_flags)."""
    import importlib

    from preflight import friendly_errors, parse_args

    with pytest.raises(SystemExit) as e, friendly_errors(script):
        parse_args(importlib.import_module(script.removesuffix(".py")).Args, argv=[old, "4"])
    flag = old.split("=")[0]
    assert (
        e.value.code == 2
        and capsys.readouterr().err == f"{script}: {flag} is now {new}, its name in every script: pass {new}\n"
    )


def test_a_template_with_another_placeholder_is_refused_before_anything_loads(tmp_path):
    """--prompt-template '{prompt} (hint: {answer})' put '{answer}' as written into every prompt: now one line naming
    the flag, what is wrong and the fix, before the model is looked at (it does not exist here); ppo.py's and
    evaluate.py's checks are the same rule (data.template_rule), asked in this process."""
    import evaluate
    import ppo
    from common import InputError

    template, refused = (
        "{prompt} (hint: {answer})",
        "must be text whose only placeholder is {prompt} (the row's question)",
    )
    code, out, _ = run(
        "grpo.py", "--model", tmp_path / "no-model", "--prompt-template", template, "--output-dir", tmp_path / "runs"
    )
    message = ours_last(
        code,
        out,
        "grpo.py",
        f"--prompt-template '{template}' {refused}: {{answer}} would reach the model "
        "as written, not filled in; write its words into the template",
    )
    assert len(message) == 1 and os.listdir(tmp_path) == []
    for check in (
        lambda: ppo.check_args(ppo.Args(prompt_template=template), world_size=1),
        lambda: evaluate.main(evaluate.Args(model=str(tmp_path / "no-model"), prompt_template=template)),
    ):
        with pytest.raises(InputError, match=re.escape(refused)):
            check()


def a_run(tmp_path, **flags) -> tuple[str, dict]:
    """A run folder as grpo.py writes it (args.json: every flag, as json gives them back) holding a checkpoint's model
    folder path, for evaluate.py's look-up (nothing else is read)."""
    from dataclasses import asdict

    import grpo

    run = json.loads(json.dumps(asdict(grpo.Args(**flags))))
    (tmp_path / "runs" / "r" / "checkpoints" / "step_000002").mkdir(parents=True, exist_ok=True)
    (tmp_path / "runs" / "r" / "args.json").write_text(json.dumps(run))
    return str(tmp_path / "runs" / "r" / "checkpoints" / "step_000002" / "model"), run


def test_evaluate_scores_what_the_run_held_out(tmp_path):
    """Issue 40 item 5: evaluate.py on a run's checkpoint scored all of the file the run trained on. Now the rows the
    run held out (its --seed 3 and --num-eval-prompts; 40 rows hold out 4: random.Random(3).sample(range(40), 40)
    begins 15, 37, 34, 8); rows it trained on only when asked (--split train) or where it trained on a whole file,
    and then a note says so; another file, or no run: all its rows."""
    from evaluate import Args, rows_to_score, run_of
    from common import InputError

    data = write_rows(tmp_path / "my.jsonl", [{"prompt": f"Q{i}?", "answer": str(i)} for i in range(40)])
    model, run = a_run(tmp_path, dataset=(data,), seed=3, num_eval_prompts=16)
    run_dir = str(tmp_path / "runs" / "r")
    assert run_of(model) == (run_dir, run) and run_of(data) == (None, None)

    def score(**flags):
        examples, rows, trained = rows_to_score(Args(model=model, **flags), run_dir, run)
        return [int(e.answer) for e in examples], rows, trained

    assert score() == ([15, 37, 34, 8], f"the prompts {run_dir} held out of {data} (seed 3)", "")
    assert score(dataset=data) == score() and score(seed=3) == score()
    train = score(split="train")
    assert len(train[0]) == 36 and not {15, 37, 34, 8} & set(train[0]) and train[2] == "--split train"
    with pytest.raises(InputError, match=f"--seed 4: {run_dir} split its data with seed 3; leave --seed out"):
        score(seed=4)
    other = write_rows(tmp_path / "other.jsonl", [{"prompt": "R?", "answer": "1"}] * 3)
    assert score(dataset=other) == ([1, 1, 1], f"all rows of {other}", "")
    assert rows_to_score(Args(model="m", dataset=data), None, None)[1:] == (f"all rows of {data}", "")
    model, run = a_run(tmp_path, dataset=(data,), eval_dataset=other, seed=3)  # its held-out prompts: other.jsonl's
    assert score() == ([1, 1, 1], f"the rows of {other}, {run_dir}'s --eval-dataset", "")
    assert score(dataset=data) == (list(range(40)), f"all rows of {data}", f"it held out {other} instead")
    model, run = a_run(
        tmp_path, dataset=(other,), eval_dataset=other
    )  # docs/data-and-reward.md's capitals: one file both ways
    assert score()[2] == f"they are its --dataset {other} too"


def test_evaluate_a_runs_checkpoint_says_which_rows_it_scored(tiny_model_dir, tmp_path):
    """Where a user meets it: the first line names the rows, and the summary and its samples hold just those."""
    data = write_rows(tmp_path / "my.jsonl", [{"prompt": f"Q{i}?", "answer": str(i)} for i in range(40)])
    model, _ = a_run(tmp_path, dataset=(data,), seed=3, num_eval_prompts=16)
    shutil.copytree(tiny_model_dir, model)
    code, out, _ = run(
        "evaluate.py",
        "--model",
        model,
        "--max-new-tokens",
        2,
        "--out",
        tmp_path / "e.json",
        "--eval-samples",
        4,
        "--eval-temperature",
        0.7,
    )
    assert code == 0, out[-3000:]
    assert f"evaluating 4 prompts, the prompts {tmp_path / 'runs' / 'r'} held out of {data} (seed 3) (0 dropped" in out
    summary = json.loads((tmp_path / "e.json").read_text())
    assert "note:" not in out and summary["trained_on"] is False
    rows = [json.loads(line) for line in (tmp_path / "e.samples.jsonl").read_text().splitlines()]
    assert [r["answer"] for r in rows] == ["15", "37", "34", "8"] and all(len(r["samples"]) == 4 for r in rows)
    # --eval-samples 4: what a paper reports, with the settings that made it (issue 43)
    assert {"avg@4", "pass@1", "pass@2", "pass@4", "maj@4"} <= summary.keys() and summary["avg@4"] == summary["pass@1"]
    assert summary["pass@1"] <= summary["pass@2"] <= summary["pass@4"]
    assert (
        summary["eval_samples"],
        summary["eval_temperature"],
        summary["eval_top_p"],
        summary["max_new_tokens"],
        summary["seed"],
    ) == (4, 0.7, 1.0, 2, 3) and summary["commit"]


def test_evaluate_reports_each_source_of_a_run_on_several_datasets(tiny_model_dir, tmp_path):
    """Issue 54, item 4: docs/evaluation.md says the numbers come overall and per source, and training logs them so,
    but evaluate.py's summary had the overall ones only. A run on addition and multiplication: both sources' greedy
    and sampled numbers, and the overall ones their prompt-weighted mean."""
    model, _ = a_run(tmp_path, dataset=("addition", "multiplication"), num_eval_prompts=8)
    shutil.copytree(tiny_model_dir, model)
    flags = ("--max-new-tokens", 2, "--eval-samples", 2, "--out", tmp_path / "e.json")
    code, out, _ = run("evaluate.py", "--model", model, *flags)
    assert code == 0, out[-3000:]
    summary = json.loads((tmp_path / "e.json").read_text())
    for source in ("addition", "multiplication"):
        assert {f"{source}/{k}" for k in ("strict_acc", "flexible_acc", "format_rate", "avg@2", "pass@2", "maj@2")} <= (
            summary.keys()
        )
    rows = [json.loads(line) for line in (tmp_path / "e.samples.jsonl").read_text().splitlines()]
    assert summary["prompts"] == len(rows) == 16  # 8 held out of each


def test_debug_shows_the_traceback(tmp_path):
    env_run = subprocess.run(
        [sys.executable, "grpo.py", "--steps", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "RL_DEBUG": "1"},
        timeout=120,
    )
    assert env_run.returncode != 0 and "Traceback" in env_run.stderr and "InputError" in env_run.stderr


# ----------------------------------------------------------------------------------------------
# Data


def test_one_dataset_file_holds_out_an_eval_part_and_says_so(tiny_model_dir, tmp_path):
    """One file, no --eval-dataset: a seeded held-out part, printed, never trained on; answers may be numbers."""
    data = write_rows(tmp_path / "my.jsonl", [{"question": f"What is {i} + 1?", "answer": i + 1} for i in range(40)])
    code, out, _ = run(
        "grpo.py",
        "--model",
        tiny_model_dir,
        "--dataset",
        data,
        "--steps",
        "1",
        "--eval-every",
        "1",
        "--num-eval-prompts",
        "8",
        "--save-every",
        "-1",
        "--output-dir",
        tmp_path / "runs",
    )
    assert code == 0, out[-3000:]
    assert f"held out 4 of 40 rows of {data} for evaluation" in out
    assert "data: 36 train prompts, 4 eval prompts" in out


def test_dropped_eval_prompts_are_counted(tiny_model_dir, tmp_path):
    data = write_rows(tmp_path / "train.jsonl", [{"question": f"What is {i} + 1?", "answer": i + 1} for i in range(8)])
    evals = write_rows(
        tmp_path / "eval.jsonl", [{"question": "What is 1 + 1?", "answer": 2}, {"question": "long " * 300, "answer": 1}]
    )
    code, out, _ = run(
        "grpo.py",
        "--model",
        tiny_model_dir,
        "--dataset",
        data,
        "--eval-dataset",
        evals,
        "--steps",
        "1",
        "--eval-every",
        "0",
        "--save-every",
        "-1",
        "--output-dir",
        tmp_path / "runs",
    )
    assert code == 0, out[-3000:]
    assert "data: 8 train prompts, 1 eval prompts (dropped as longer than 256 tokens: 0 train, 1 eval)" in out


@pytest.mark.parametrize(
    "dataset, rows, message",
    [
        ("data/train.jsonl", None, "dataset 'data/train.jsonl': no such file or folder"),
        ("empty.jsonl", [], "empty.jsonl has no rows"),
        (
            "bad.jsonl",
            [{"question": "Q?", "answer": [1]}],
            "bad.jsonl, line 1: needs a 'question' string and an 'answer'",
        ),
        ("long.jsonl", [{"question": f"{i} " + "long " * 300, "answer": 1} for i in range(20)], "all 18 prompts of"),
    ],
)
def test_dataset_errors_name_the_file(tiny_model_dir, tmp_path, dataset, rows, message):
    """A missing relative path is never tried as a hub id; an empty or malformed file is named."""
    if rows is not None:
        write_rows(tmp_path / dataset, rows)
    code, out, seconds = run(
        "grpo.py", "--model", tiny_model_dir, "--dataset", dataset, "--output-dir", "runs", cwd=tmp_path
    )
    assert_clean_failure(code, out, message)
    assert seconds < 60 and not (tmp_path / "runs").exists()


def test_a_data_file_that_is_not_utf8_names_its_line(tiny_model_dir, tmp_path):
    """A Latin-1 file (an export from a spreadsheet, say) was a UnicodeDecodeError traceback."""
    (tmp_path / "latin.jsonl").write_bytes(
        b'{"prompt": "2 + 2?", "answer": "4"}\n{"prompt": "Caf\xe9?", "answer": "1"}\n'
    )
    code, out, _ = run(
        "grpo.py", "--model", tiny_model_dir, "--dataset", "latin.jsonl", "--output-dir", "runs", cwd=tmp_path
    )
    ours_last(
        code,
        out,
        "grpo.py",
        "latin.jsonl, line 2: not UTF-8 text (byte 0xe9 at column 16)",
        "save it as UTF-8",
        "iconv -f latin1 -t utf-8 latin.jsonl",
    )
    assert not (tmp_path / "runs").exists()


def test_a_hub_dataset_without_the_hub_fails_at_once(tiny_model_dir, tmp_path):
    """openai/gsm8k with `datasets` installed and no network: datasets retried for 31-37 s, then a ConnectionError
    traceback. One quick request now; unreachable, datasets reads its cache at once (here empty). Without
    `datasets` installed (CI) a stand-in of it stands in: it waits a minute unless told it is offline, as datasets 5.2."""
    env = {"HF_HOME": str(tmp_path / "hf-home")}  # datasets' own cache: empty
    try:
        import datasets  # noqa: F401
    except ImportError:
        (tmp_path / "lib" / "datasets").mkdir(parents=True)
        (tmp_path / "lib" / "datasets" / "__init__.py").write_text(
            "import time, types\nconfig = types.SimpleNamespace(HF_HUB_OFFLINE=False)\n"
            "def load_dataset(path, name=None, split=None):\n"
            "    if not config.HF_HUB_OFFLINE:\n        time.sleep(60)  # its retries\n"
            "    raise ConnectionError(f\"Couldn't reach the Hugging Face Hub for dataset '{path}'\")\n"
        )
        env["PYTHONPATH"] = str(tmp_path / "lib")
    code, out, seconds = run(
        "grpo.py",
        "--model",
        tiny_model_dir,
        "--dataset",
        "openai/gsm8k",
        "--output-dir",
        tmp_path / "runs",
        tmp=tmp_path,
        env=env,
    )
    ours_last(
        code,
        out,
        "grpo.py",
        "dataset 'openai/gsm8k' is not in the datasets cache and the hub can't be reached",
        "pass a local .jsonl file or folder",
    )
    assert seconds < 25 and not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "source, expected",
    [
        (
            "import sympyx\n",
            ["an import in r.py fails (No module named 'sympyx')", "pip install it", "drop the import"],
        ),
        ("TABLE = {}\nSCALE = TABLE['scale']\n", ["r.py, line 2, raised KeyError: 'scale'; fix the file"]),
        # argparse at its top level read grpo.py's own flags: its usage and 'grpo.py: error: ...' blamed them, exit 2
        (
            "import argparse\nargparse.ArgumentParser().parse_args()\n",
            [
                "r.py parses the command line (argparse: unrecognized arguments: --model ",
                "under if __name__ == '__main__'",
            ],
        ),
    ],
)
def test_a_reward_file_that_fails_to_import(tiny_model_dir, tmp_path, source, expected):
    (tmp_path / "r.py").write_text(source + "def reward(completion, answer):\n    return 1.0\n")
    code, out, _ = run(
        "grpo.py", "--model", tiny_model_dir, "--reward", "r.py:reward", "--output-dir", "runs", cwd=tmp_path
    )
    ours_last(code, out, "grpo.py", "--reward 'r.py:reward'", *expected)
    assert not (tmp_path / "runs").exists() and "usage:" not in out


def test_a_reward_file_that_exits_or_prints_on_import(tmp_path, capsys):
    """sys.exit at a reward file's top level printed its message and exited 1, naming nothing; what its top level
    prints to stderr and then imports fine is shown as it was."""
    from common import InputError
    from reward import load_reward

    (tmp_path / "r.py").write_text("import sys\nsys.exit('no table.csv here')\n")
    with pytest.raises(InputError) as e:
        load_reward(f"{tmp_path}/r.py:reward")
    assert str(e.value) == (
        f"--reward '{tmp_path}/r.py:reward': {tmp_path}/r.py calls sys.exit('no table.csv here') "
        "on import; put it under if __name__ == '__main__'"
    )
    (tmp_path / "ok.py").write_text(
        "import sys\nprint('loading', file=sys.stderr)\ndef reward(c, a):\n    return 1.0\n"
    )
    assert load_reward(f"{tmp_path}/ok.py:reward")("c", "a") == 1.0 and capsys.readouterr().err == "loading\n"


def test_a_reward_that_returns_no_number_stops_the_first_step(tiny_model_dir, tmp_path):
    """A --reward returning "1" was taken for 1.0 (None, a list, ... scored 0 with a warning each step, exit 0): one line
    at the first step now, naming --reward and what it returned, exit 2. The same run shows issue 40's item 4: with
    --dataset addition, --eval-dataset capitals.jsonl is what is evaluated (it was ignored without a word)."""
    caps = write_rows(
        tmp_path / "capitals.jsonl",
        [
            {"prompt": "Name the capital of Australia.", "answer": "Canberra"},
            {"prompt": "Name the capital of Canada.", "answer": "Ottawa"},
        ],
    )
    (tmp_path / "r.py").write_text("def reward(completion, answer):\n    return '1'\n")
    inputs = {p: p.read_bytes() for p in tmp_path.iterdir()}
    code, out, _ = run(
        "grpo.py",
        "--model",
        tiny_model_dir,
        "--dataset",
        "addition",
        "--eval-dataset",
        caps,
        "--reward",
        "r.py:reward",
        "--eval-before-train",
        "--output-dir",
        "runs",
        cwd=tmp_path,
    )
    message = ours_last(code, out, "grpo.py", "--reward 'r.py:reward' returned '1' (str), not a number: return a float")
    assert len(message) == 1 and "step 1/" not in out
    assert "data: 7600 train prompts, 2 eval prompts" in out and f"eval prompts from {caps}" in out
    assert "eval after step 0 | eval strict acc" in out
    assert {p: p.read_bytes() for p in inputs} == inputs and not list(tmp_path.glob("runs/*/checkpoints"))


def test_resuming_with_another_number_of_ranks_says_how_many(tiny_model_dir, tmp_path):
    """A checkpoint of 2 ranks resumed by plain python: the right message was a ValueError traceback after the
    model had loaded; now it comes before anything loads."""
    import torch
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "runs" / "r" / "checkpoints" / "step_000003"
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.zeros(4)}, checkpoint_id=str(ckpt / "state"))  # what damage() reads: intact
    torch.save({"step": 3, "world_size": 2}, ckpt / "trainer.pt")
    for r in range(2):
        torch.save({}, ckpt / f"rng_rank{r}.pt")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code, out, _ = run(
        "grpo.py", "--model", tiny_model_dir, "--resume", "--output-dir", tmp_path / "runs", "--run-name", "r"
    )
    ours_last(
        code,
        out,
        "grpo.py",
        f"--resume: {ckpt} was saved by 2 rank(s) and this run has 1",
        "resume it with torchrun --nproc_per_node 2",
    )
    assert "model " not in out  # before the model, even its tokenizer, loaded
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_evaluate_a_model_file_cut_short(tiny_model_dir, tmp_path):
    """A truncated model.safetensors (a copy cut short) was safetensors' 'incomplete metadata' traceback."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, size // 2)
    code, out, _ = run("evaluate.py", "--model", folder, "--out", tmp_path / "e.json")
    ours_last(
        code,
        out,
        "evaluate.py",
        f"--model '{folder}': model.safetensors is {size // 2:,} bytes, less than its header says ({size:,})",
        "copy the file again",
    )
    assert not (tmp_path / "e.json").exists()


def test_plot_without_a_run_folder(tmp_path):
    """`python plot.py` alone was a StopIteration traceback (and a folder without metrics exit code 1)."""
    code, out, _ = run("plot.py", cwd=tmp_path)
    assert (
        ours_last(code, out, "plot.py", "give one or more run folders: python plot.py runs/A") and out.count("\n") == 1
    )
    code, out, _ = run("plot.py", tmp_path, cwd=tmp_path)
    ours_last(code, out, "plot.py", f"{tmp_path}: no metrics.jsonl there")
    assert os.listdir(tmp_path) == []


def test_tiny_model_help_builds_nothing(tmp_path):
    """`python tests/tiny_model.py --help` built a model in a folder named '--help'."""
    code, out, seconds = run(os.path.join("tests", "tiny_model.py"), "--help", cwd=tmp_path)
    assert (
        code == 0
        and out.startswith("usage: tiny_model.py [-h] [--sft-steps SFT_STEPS] [--context CONTEXT] FOLDER")
        and seconds < 10
    )
    code, out, _ = run(os.path.join("tests", "tiny_model.py"), cwd=tmp_path)
    assert (
        code == 2
        and out.strip().splitlines()[-1] == "tiny_model.py: error: the following arguments are required: FOLDER"
    )
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------------------------
# The run's folder: whose it is, whether a run holds it, where it is


def fake_run(folder, script: str, command_only: bool = False) -> dict:
    """A run folder as `script` leaves it after 2 steps and a checkpoint; with `command_only`, as runs left it before
    run_info.json named its script (its command does). Returns its files' bytes."""
    (folder / "checkpoints" / "step_000002").mkdir(parents=True)
    (folder / "checkpoints" / "step_000002" / "trainer.pt").write_bytes(b"never read: refused before")
    info = {"command": f"/home/me/rl/{script} --model m"} if command_only else {"script": script, "command": script}
    (folder / "run_info.json").write_text(json.dumps(info))
    write_rows(folder / "metrics.jsonl", [{"step": 1}, {"step": 2}])
    return files_of(folder)


def files_of(folder) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_run_folder_refuses_every_other_script_and_stays_inside_output_dir(tiny_model_dir, tmp_path):
    """`grpo.py --resume` on a ppo.py run was refused only for its flags; followed, it continued the PPO actor as GRPO,
    overwrote args.json and run_info.json and rotated away the only checkpoints holding the critic; `ppo.py --resume`
    on a grpo.py run was a 42-line traceback. Any other script now refuses a run's folder in one line before anything
    loads or is written, with --resume or without (train_rm.py), a folder from before run_info.json named its script
    too. `--output-dir=~/runs`, where the shell leaves the `~`, is the home's runs/ (it made a folder named `~`), and
    `--run-name ../../x`, which wrote outside --output-dir, is refused. Four processes at once, each stopped at preflight."""
    from concurrent.futures import ThreadPoolExecutor

    from preflight import run_folder
    from common import InputError

    runs = tmp_path / "home" / "runs"
    fake_run(runs / "p", "ppo.py"), fake_run(runs / "g", "grpo.py", command_only=True)
    before, home = files_of(tmp_path), {"HOME": str(tmp_path / "home")}
    cases = [
        (
            "grpo.py",
            "p",
            "--resume",
            f"{runs / 'p'} holds a ppo.py run (its run_info.json), not a grpo.py one: pass "
            "another --run-name, or resume it with ppo.py",
        ),
        (
            "ppo.py",
            "g",
            "--resume",
            f"{runs / 'g'} holds a grpo.py run (its run_info.json), not a ppo.py one: pass "
            "another --run-name, or resume it with grpo.py",
        ),
        (
            "train_rm.py",
            "g",
            "--eval-every=0",
            f"{runs / 'g'} holds a grpo.py run (its run_info.json), not a train_rm.py one: pass another --run-name",
        ),
        (
            "grpo.py",
            "../../x",
            "--resume",
            "--run-name '../../x' is not a plain folder name (the run's folder goes "
            "inside --output-dir ~/runs): pass a name without '/'; to write elsewhere, "
            "change --output-dir",
        ),
    ]
    with ThreadPoolExecutor(len(cases)) as pool:
        runs_ = pool.map(
            lambda c: run(
                c[0], "--model", tiny_model_dir, "--output-dir=~/runs", "--run-name", c[1], c[2], cwd=tmp_path, env=home
            ),
            cases,
        )
        for (script, _, _, message), (code, out, _) in zip(cases, list(runs_)):
            ours_last(code, out, script, message)
            assert f"model {tiny_model_dir}" not in out and out.strip().splitlines()[-1].endswith(message), out
    assert files_of(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["home"]  # nothing written, no `~`
    for name in ("", ".", "..", "a/b", "/abs"):
        with pytest.raises(InputError):
            run_folder("runs", name)


def test_a_live_runs_lock_refuses_another_and_a_dead_runs_does_not(tmp_path):
    """The lock is an OS lock (flock) on run.lock, held for the run's life: a second claim is refused in one line naming
    the holder; once the holder's process is gone (here: its file closed), the same folder is claimed at once, the stale
    file notwithstanding. A folder with no run but a lock file is no earlier run."""
    import fcntl

    from common import InputError
    from runlog import LOCK, claim_run_dir

    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    holder = open(run_dir / LOCK, "a+")  # another open file: another holder, as another process's
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    holder.write("grpo.py, pid 4242 on node7, since 2026-11-26 05:58:23")
    holder.flush()
    with pytest.raises(
        InputError,
        match=f"^{run_dir} is in use by grpo.py, pid 4242 on node7, since 2026-11-26 "
        f"05:58:23 \\({run_dir / LOCK}\\): wait for it to end or stop it, or pass",
    ):
        claim_run_dir(str(tmp_path / "runs"), "r", resume=False)
    holder.close()  # the run died: the lock with it, the file stays
    assert claim_run_dir(str(tmp_path / "runs"), "r", resume=False) == str(run_dir)  # nothing in it but the lock
    assert (run_dir / LOCK).read_text().startswith(f"{os.path.basename(sys.argv[0])}, pid {os.getpid()} on ")


def test_ctrl_c_while_the_imports_run_is_one_line(tmp_path):
    """Ctrl-C in a script's first ~1.5 s was a KeyboardInterrupt traceback from inside `import torch`: now one line,
    exit 130, in every script. The signal goes while torch is being imported (its library mapped: /proc/PID/maps)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    for script in ("grpo.py", "ppo.py", "train_rm.py", "evaluate.py"):
        proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, script), "--model", "no-model"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.time() + 60
        while (
            proc.poll() is None and time.time() < deadline and "libtorch" not in open(f"/proc/{proc.pid}/maps").read()
        ):
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
        assert proc.returncode == 130 and out.strip() == f"{script}: stopped by SIGINT", out[-3000:]
    assert os.listdir(tmp_path) == []


def test_existing_checkpoints_refuse_before_loading(tmp_path):
    (tmp_path / "runs" / "r" / "checkpoints" / "step_000001").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "checkpoints" / "step_000001" / "trainer.pt").write_bytes(b"")
    code, out, _ = run(
        "grpo.py", "--model", tmp_path / "no-model", "--output-dir", tmp_path / "runs", "--run-name", "r"
    )
    assert_clean_failure(code, out, "holds an earlier run: pass --resume to continue it, or a new --run-name")


# ----------------------------------------------------------------------------------------------
# Environment


def test_requirements_do_not_fight():
    """requirements-test.txt only adds to what the main job installs: every package it names with a
    version rule is either absent from requirements.txt's chain or named there with the same rule.
    (.ci/check_requirements.py lets pip resolve both for real.)"""

    def pins(name):
        out = {}
        for line in open(os.path.join(ROOT, name)):
            line = line.split("#")[0].strip()
            if line.startswith("-r "):
                out.update(pins(line[3:].strip()))
            elif line:
                package = re.match(r"[A-Za-z0-9_.\-\[\]]+", line).group(0).lower()
                out[package] = line[len(package) :].strip()
        return out

    main, test = pins("requirements.txt"), pins("requirements-test.txt")
    assert main["sglang"] == "==0.5.16" and "pytest" in test
    assert all(main.get(p, rule) == rule for p, rule in test.items()), (main, test)
    assert "matplotlib" in pins("requirements-cpu.txt")  # every run's curves.png, bench/report.py's plots


def test_report_without_matplotlib_says_what_to_install():
    code = (
        "import sys; sys.modules['matplotlib'] = None; sys.path.insert(0, 'bench'); "
        "import report; report.subplots(1, 2)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "drawing a PNG needs matplotlib: pip install matplotlib (requirements.txt lists it)"


@pytest.mark.skipif(
    bool(importlib.util.find_spec("wandb") or importlib.util.find_spec("flash_attn")),
    reason="wandb or flash-attn is installed here",
)
def test_a_flag_that_needs_a_package_not_installed_says_which(monkeypatch):
    """--track without wandb, --attn-implementation flash_attention_2 without flash-attn (on a GPU machine: without a
    GPU that comes first, below): in each training script's flag checks, before anything loads (they were tracebacks
    after the models loaded)."""
    import torch

    import grpo
    import ppo
    import train_rm
    from common import InputError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for script in (grpo, ppo, train_rm):
        with pytest.raises(InputError) as e:
            script.check_args(script.Args(track=True, attn_implementation="flash_attention_2"), world_size=1)
        assert "--track True must be given with wandb installed (pip install wandb; wandb login)" in str(e.value)
        assert (
            "--attn-implementation flash_attention_2 must be sdpa or eager: flash_attention_2 needs flash-attn "
            "(pip install flash-attn)"
        ) in str(e.value)


def test_an_attention_that_cant_train_on_this_machine_is_refused_before_anything_loads(tiny_model_dir, tmp_path):
    """--attn-implementation flex_attention on a CPU was an 84-line traceback after the model loaded (it has no backward
    there): one line now, before the model is read; ppo.py and train_rm.py share the rule (preflight.attn_problem)."""
    import ppo
    import train_rm
    from common import InputError

    code, out, seconds = run(
        "grpo.py",
        "--model",
        tiny_model_dir,
        "--attn-implementation",
        "flex_attention",
        "--output-dir",
        tmp_path / "runs",
    )
    message = ours_last(
        code,
        out,
        "grpo.py",
        "--attn-implementation flex_attention must be sdpa or eager on a machine "
        "without a GPU: flex_attention has no backward on a CPU",
    )
    assert len(message) == 1 and "model " not in out and not (tmp_path / "runs").exists()
    for script in (ppo, train_rm):
        with pytest.raises(InputError, match="flex_attention has no backward on a CPU"):
            script.check_args(script.Args(attn_implementation="flex_attention"), world_size=1)


def test_varlen_without_packing_is_refused(monkeypatch):
    """--attn-implementation varlen gives the kernel a packed row's sequences; with --micro-batch-size alone the rows
    are padded and would go to sdpa, silently: one line instead (both scripts, on a GPU: the CPU refuses varlen). With
    neither micro-batch flag a GPU packs them by a token budget (start.micro_batching): taken."""
    import sys

    import torch

    import grpo
    import ppo
    from common import InputError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for script in (grpo, ppo):
        monkeypatch.setattr(sys, "argv", ["x.py", "--attn-implementation", "varlen", "--micro-batch-size", "8"])
        with pytest.raises(InputError, match="varlen must be given with --max-tokens-per-micro-batch N") as e:
            script.check_args(script.Args(model="m", attn_implementation="varlen"), world_size=1)
        assert "--attn-implementation" in str(e.value) and str(e.value).count("must be") == 1
        script.check_args(script.Args(model="m", attn_implementation="varlen", max_tokens_per_micro_batch=8192), 1)
        monkeypatch.setattr(sys, "argv", ["x.py", "--attn-implementation", "varlen"])
        script.check_args(script.Args(model="m", attn_implementation="varlen"), world_size=1)


@pytest.mark.parametrize(
    "impl, gpu, must",
    [
        ("sdpa", False, None),
        ("eager", False, None),
        ("paged|sdpa", False, None),
        ("flash_attention_2", False, "sdpa or eager on a machine without a GPU: flash_attention_2 runs on a GPU only"),
        ("flex_attention", True, None),
        ("varlen", True, None),  # fsdp.varlen_attention: ours, registered when a model loads
        ("varlen", False, "sdpa or eager on a machine without a GPU: varlen runs on a GPU only"),
        ("sdpa2", True, "one that transformers knows: eager, "),  # a typo was transformers' ValueError after loading
    ],
)
def test_attention_implementations_by_machine(monkeypatch, impl, gpu, must):
    import torch

    from preflight import attn_problem

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert attn_problem(impl) == must or attn_problem(impl).startswith(must)


@pytest.mark.usefixtures("gloo")  # check_training_state counts the ranks
def test_training_state_that_cant_fit_a_gpu_is_one_line_before_anything_loads(tiny_model_dir, tmp_path, monkeypatch):
    """A Qwen2.5-7B full fine-tuning on one 80 GB GPU ran out of memory at its first optimizer step, with --offload
    too, after SGLang and the model had loaded (bench/results/lora_7b_h100.json), and the hint named the micro-batch:
    now preflight.state_problem says so before anything loads, from the safetensors headers
    (preflight.parameter_count), with the fixes that fit: more GPUs, or LoRA."""
    import torch
    from transformers import AutoModelForCausalLM

    import start
    from preflight import parameter_count, state_problem
    from common import InputError

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert parameter_count(tiny_model_dir) == sum(p.numel() for p in model.parameters())  # tied head counted once
    gpu, p7 = 80 * 10**9, 7_615_616_512  # an H100's bytes, Qwen2.5-7B's parameters
    problem = state_problem(p7, lora=False, reference=False, world_size=1, gpu_bytes=gpu)
    assert "7.6B parameters need 113 GiB of training state" in problem  # 16 bytes each: 121.8e9 bytes
    assert "113 GiB on each of 1 GPU(s), over this GPU's 75 GiB" in problem
    assert "train on 2 GPUs or more (torchrun --nproc_per_node 2" in problem and "--lora-rank 8" in problem
    assert "14 GiB" in problem  # the base in bf16: 2 bytes a parameter
    assert state_problem(p7, lora=False, reference=False, world_size=2, gpu_bytes=gpu) is None  # 57 GiB each
    assert (
        state_problem(p7, lora=True, reference=True, world_size=1, gpu_bytes=gpu) is None
    )  # 14 GiB (ref: adapter off)
    with_ref = state_problem(p7, lora=False, reference=True, world_size=2, gpu_bytes=gpu)  # 18 bytes: 64 GiB each
    assert with_ref is None and state_problem(p7, lora=False, reference=True, world_size=2, gpu_bytes=70 * 10**9)

    # as grpo.py's and ppo.py's mains call it, on a "GPU" whose memory the tiny model's 16 bytes a parameter overflow:
    # one line, nothing loaded
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 10**6})())
    with pytest.raises(InputError, match=r"on each of 1 GPU\(s\), over this GPU's 0 GiB .*--lora-rank 8"):
        start.check_training_state(tiny_model_dir, torch.device("cuda", 0), lora=False, reference=True)
    start.check_training_state(tiny_model_dir, torch.device("cpu"), lora=False, reference=True)  # a CPU: nothing


def scorer_folder(tiny_model_dir, folder, architecture: str) -> str:
    """The tiny model's files with config.json naming a scoring head of one label (what train_rm.py and ppo.py's
    critic export write): enough for every check before loading."""
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps(
            {**config, "architectures": [architecture], "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
        )
    )
    return str(folder)


def test_a_reward_model_passed_as_the_policy_is_refused_before_loading(tiny_model_dir, tmp_path):
    """A train_rm.py checkpoint given as --model loaded as a causal LM with a new, random output head, and trained:
    now one line from config.json's architectures, naming where it belongs, before the model loads; ppo.py's actor and
    evaluate.py make the same call (generates=True). --reward-model (and a critic's folder as --critic-model) keep
    taking them."""
    from preflight import check_model
    from common import InputError
    from reward_model import check_reward_model

    rm = scorer_folder(tiny_model_dir, tmp_path / "rm", "LlamaForSequenceClassification")
    code, out, _ = run("grpo.py", "--model", rm, "--output-dir", tmp_path / "runs")
    message = ours_last(
        code,
        out,
        "grpo.py",
        f"--model '{rm}' is a LlamaForSequenceClassification (config.json), a model "
        "that scores text and can't generate it: pass it as --reward-model, and a causal LM "
        "(*ForCausalLM) as --model",
    )
    assert len(message) == 1 and sorted(os.listdir(tmp_path)) == ["rm"]
    assert not any(x.startswith("model ") for x in out.splitlines())  # check_model's line on a model it took
    critic = scorer_folder(tiny_model_dir, tmp_path / "critic", "LlamaForTokenClassification")
    with pytest.raises(InputError, match="is a LlamaForTokenClassification .* pass it as ppo.py's --critic-model"):
        check_model(critic, generates=True)
    assert (
        check_reward_model(rm)[0] is not None and check_model(critic, "--critic-model", with_tokenizer=False)[1] == 512
    )


def test_a_checkpoint_folder_passed_for_a_model_names_its_model_folder(tiny_model_dir, tmp_path):
    """runs/<run>/checkpoints/step_N given where its model/ belongs: the line names model/; a missing folder under
    another flag than --model gets no hint to build a tiny causal LM."""
    from preflight import check_model
    from common import InputError

    step = tmp_path / "step_000002"
    shutil.copytree(tiny_model_dir, step / "model")
    with pytest.raises(
        InputError, match=f"--reward-model '{step}' is a checkpoint: pass its model folder, {step / 'model'}"
    ):
        check_model(str(step), "--reward-model")
    with pytest.raises(InputError) as e:
        check_model(str(tmp_path / "nothere"), "--reward-model")
    assert "tiny_model.py" not in str(e.value) and "does not exist" in str(e.value)


def test_a_rollout_tp_the_model_cant_split_is_refused_before_loading(tiny_model_dir):
    """SGLang splits attention heads and the MLP evenly over --rollout-tp GPUs, and KV heads evenly or by copies
    (tp a multiple of them); a tp that does not fit was an assert deep in SGLang's start, blamed on its memory."""
    from types import SimpleNamespace

    from preflight import check_model, tp_problem
    from common import InputError

    def shape(heads, kv, mlp):
        return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=mlp)

    smollm2, qwen1p5b, qwen7b = shape(9, 3, 1536), shape(12, 2, 8960), shape(28, 4, 18944)
    assert tp_problem(smollm2, 1) is None and tp_problem(smollm2, 3) is None
    assert tp_problem(smollm2, 2) == "it has 9 attention heads (SGLang needs a --rollout-tp that divides them)"
    assert [tp for tp in (2, 3, 4, 6, 8) if tp_problem(qwen1p5b, tp) is None] == [2, 4]  # 3, 6: 2 KV heads; 8: 12 heads
    assert tp_problem(qwen1p5b, 3).startswith("it has 2 key-value heads")
    assert [tp for tp in (2, 4, 7, 8) if tp_problem(qwen7b, tp) is None] == [2, 4]  # 7: 4 KV heads; 8: 28 heads
    assert tp_problem(shape(8, 8, 100), 8) == "its MLP is 100 wide (SGLang needs a --rollout-tp that divides it)"
    with pytest.raises(
        InputError,
        match=rf"--rollout-tp 3 can't split --model {tiny_model_dir} over 3 GPUs: it has 4 "
        r"attention heads \(SGLang needs a --rollout-tp that divides them\)",
    ):
        check_model(tiny_model_dir, rollout_tp=3)
    check_model(tiny_model_dir, rollout_tp=4)  # 4 heads, 2 KV heads copied twice
