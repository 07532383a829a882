"""The house's layering, read from the source (ast): a reading core that never imports the run's machinery, no import
circle, small import closures for the modules a notebook imports, few floors, no module function that takes a
script's whole `args`, and a reading edition over the core alone. Every import counts, function-level ones too."""

import ast
import os
import subprocess
import sys

import pytest
from test_smoke import ROOT

CORE = {"common", "data", "reward", "rollout", "memory", "fsdp", "logprobs", "lora", "producer"}
MACHINERY = {
    "preflight",
    "start",
    "runlog",
    "stop",
    "checkpoint",
    "server",
    "tools",
    "sandbox",
    "reward_jail",
    "reward_model",
    "plot",
}
SCRIPTS = {"grpo", "ppo", "grpo_minimal", "train_rm", "evaluate"}
MODULES = CORE | MACHINERY | SCRIPTS


def source(module: str) -> str:
    with open(os.path.join(ROOT, module + ".py"), encoding="utf-8") as f:
        return f.read()


def imports(module: str) -> set[str]:
    """The project modules `module` imports anywhere in its file."""
    found = set()
    for node in ast.walk(ast.parse(source(module))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return (found & MODULES) - {module}


def closure(module: str) -> set[str]:
    """`module` and every project module importing it loads."""
    seen, todo = {module}, [module]
    while todo:
        for m in imports(todo.pop()) - seen:
            seen.add(m)
            todo.append(m)
    return seen


def test_every_top_level_module_has_a_layer():
    files = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")}
    assert files == MODULES, f"a module without a layer here: {files ^ MODULES}"


@pytest.mark.parametrize("module", sorted(CORE))
def test_the_core_never_imports_the_machinery_or_a_script(module):
    assert not imports(module) & (MACHINERY | SCRIPTS), imports(module) & (MACHINERY | SCRIPTS)


@pytest.mark.parametrize("module", sorted(MACHINERY))
def test_the_machinery_never_imports_a_script(module):
    assert not imports(module) & SCRIPTS


def test_common_is_a_leaf_that_loads_without_torch():
    """common.py imports nothing of the project, and `from common import exit_on_interrupt` runs before torch loads:
    each script's first line (a Ctrl-C during `import torch` is one line, not a traceback)."""
    assert imports("common") == set()
    code = "import sys, common; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_no_import_circle_and_at_most_seven_floors():
    """A floor: a module stands above everything it imports (floor 1 imports nothing of the project)."""
    floors = {}

    def floor(module, path=()):
        assert module not in path, f"an import circle: {' -> '.join(path + (module,))}"
        if module not in floors:
            floors[module] = 1 + max((floor(m, path + (module,)) for m in imports(module)), default=0)
        return floors[module]

    assert max(floor(m) for m in MODULES) <= 7, floors


@pytest.mark.parametrize("module, most", [("reward", 2), ("data", 3), ("memory", 3), ("rollout", 5)])
def test_what_importing_a_core_module_loads(module, most):
    """`import reward` is plain functions (completion, answer) -> float and their metrics: it loads common.py beside
    itself, not the checkpoint writer, the plotter or the jail."""
    assert len(closure(module)) <= most, sorted(closure(module))


def test_the_reading_edition_loads_the_core_alone_in_300_lines():
    assert closure("grpo_minimal") <= CORE | {"grpo_minimal"}, sorted(closure("grpo_minimal") - CORE)
    assert len(source("grpo_minimal").splitlines()) <= 300  # as ruff formats it (CI: ruff format --check)


@pytest.mark.parametrize("module", sorted(CORE | MACHINERY))
def test_no_module_function_takes_a_scripts_whole_args(module):
    """A module function takes explicit parameters or its own small option group (rollout.SGLangOptions,
    server.ServerOptions), never the script's Args whole: an implicit contract on field names (one such read of
    --beta stopped ppo.py on every GPU). plot.py, a command of its own too, has a main of its own Args."""
    tree = ast.parse(source(module))
    own_args = any(isinstance(n, ast.ClassDef) and n.name == "Args" for n in tree.body)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not (own_args and node.name == "main"):
            params = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            named = [
                p.arg for p in params if p.arg in ("args", "a") or p.annotation and "Args" in ast.unparse(p.annotation)
            ]
            assert not named, f"{module}.{node.name} takes {named}"


def test_the_loops_call_each_phase_by_name():
    """grpo.py's and ppo.py's loops call the memory phases, the rollout, the evaluation, the log, the save and the signal
    check themselves: no partial or closure stands between a reader and a step."""
    for script in ("grpo", "ppo"):
        main = next(n for n in ast.parse(source(script)).body if isinstance(n, ast.FunctionDef) and n.name == "main")
        loop = next(n for n in ast.walk(main) if isinstance(n, ast.For) and ast.unparse(n.target) == "step")
        called = {ast.unparse(n.func) for n in ast.walk(loop) if isinstance(n, ast.Call)}
        for phase in (
            "wake_up",
            "sleep",
            "send_prompts",
            "held_out_eval",
            "log.log",
            "checkpoints.save",
            "agreed_signal",
        ):
            assert phase in called, f"{script}.py's loop does not call {phase}"
