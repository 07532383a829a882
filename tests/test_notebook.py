"""notebooks/grpo_step_by_step.ipynb: it runs top to bottom in a fresh kernel (nbclient), its one GRPO step
changes the log-probs the way the advantages say, every name it cites still exists where it points, it builds
its step from the reading core and grpo_minimal.py (not the run's machinery), and git holds it without outputs.

The notebook builds its own tiny model and runs on a CPU in well under a minute; this test is what keeps
it from rotting as grpo_minimal.py, grpo.py and the modules change.
"""

import ast
import glob
import json
import os
import re
import time

import nbformat
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "grpo_step_by_step.ipynb")
# [`name`](../file.py) in the prose: a function, class or constant of that file, or a comment of it
# ("# -- 5. advantages": a section of grpo_minimal.py's or grpo.py's loop)
CITATION = re.compile(r"\[`([^`]+)`\]\(\.\./([\w./]+\.py)\)")
# what a code cell may import of the project: the reading core, the reading edition, the tiny model's builder
CORE = {"common", "data", "reward", "rollout", "memory", "fsdp", "logprobs", "lora"}
READABLE = CORE | {"grpo_minimal", "tiny_model"}
VARIANTS_TAG = "grpo-variants"  # the one cell that imports grpo.py, for its other policy losses


def citations() -> list[tuple[str, str]]:
    """(name, file) of every citation in the notebook's prose."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    return [m.groups() for cell in nb.cells if cell.cell_type == "markdown" for m in CITATION.finditer(cell.source)]


def test_notebook_is_stored_without_outputs():
    """Outputs would go stale in git (and bloat diffs): clear them before committing
    (Jupyter: Edit > Clear Outputs of All Cells)."""
    with open(NOTEBOOK) as f:
        nb = json.load(f)
    dirty = [
        i
        for i, cell in enumerate(nb["cells"])
        if cell["cell_type"] == "code" and (cell.get("outputs") or cell.get("execution_count") is not None)
    ]
    assert not dirty, f"code cells {dirty} of {NOTEBOOK} hold outputs or execution counts: clear them before committing"


def test_every_cited_name_still_exists():
    """The prose links names, not line numbers (they drift); a renamed or removed function must fail here."""
    cited = citations()
    assert {"group_advantages", "grpo_loss", "clipped_policy_loss"} <= {name for name, _ in cited}
    assert {
        ("group_advantages", "grpo_minimal.py"),
        ("grpo_loss", "grpo_minimal.py"),
        ("update", "grpo_minimal.py"),
    } <= set(cited), "the step's pieces are cited from grpo_minimal.py, the reading edition"
    missing = []
    for name, path in cited:
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        if name == os.path.basename(path):
            continue  # the file itself
        if name.startswith("#"):  # a comment of the file: a section of a script's loop
            found = name in text
        else:  # a def, a class, or a module-level NAME = / NAME: (nested defs of main() count)
            found = re.search(rf"^\s*(?:def|class)\s+{re.escape(name)}\b|^{re.escape(name)}\s*[:=]", text, re.M)
        if not found:
            missing.append(f"{name} in {path}")
    assert not missing, f"the notebook cites names that are gone: {missing}; update its prose"


def imported_modules(source: str) -> set[str]:
    """The top-level names of the modules a code cell imports (`import a.b`, `from a import b`: "a")."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_notebook_builds_its_step_from_the_core():
    """Its code cells import, of the project, only the reading core, grpo_minimal.py and tests/tiny_model.py: none of
    the run's machinery (preflight, start, runlog, stop, checkpoint, server, tools, sandbox, reward_model, plot) and not
    grpo.py, but in the one cell tagged grpo-variants, which shows grpo.py's other policy losses and may import grpo."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    files = glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "tests", "*.py"))
    project = {os.path.basename(p)[:-3] for p in files}  # the scripts, the modules, the tests' helpers
    assert {"preflight", "start", "runlog", "stop", "checkpoint", "grpo"} <= project  # the check sees them
    code = [c for c in nb.cells if c.cell_type == "code"]
    variants = [c for c in code if VARIANTS_TAG in c.metadata.get("tags", [])]
    assert len(variants) == 1, f"expected one code cell tagged {VARIANTS_TAG!r}, found {len(variants)}"
    wrong = []
    for i, cell in enumerate(code):
        allowed = READABLE | ({"grpo"} if cell is variants[0] else set())
        if bad := (imported_modules(cell.source) & project) - allowed:
            wrong.append(f"code cell {i} ({cell.get('id')}): {sorted(bad)}")
    assert not wrong, f"the notebook imports more of the project than the core and grpo_minimal.py: {wrong}"


def test_notebook_runs_one_grpo_step():
    """Executed as Jupyter would, from notebooks/. The step must move the log-probs, and on average up for
    completions with a positive advantage and down for a negative one."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    t0 = time.time()
    run_in = {"metadata": {"path": os.path.dirname(NOTEBOOK)}}  # the kernel's working folder: notebooks/, as in Jupyter
    NotebookClient(nb, timeout=300, kernel_name="python3", resources=run_in).execute()
    seconds = time.time() - t0
    assert seconds < 180, f"the notebook took {seconds:.0f} s; it should run in under 3 minutes on a CPU"

    (cell,) = [c for c in nb.cells if "before-after" in c.metadata.get("tags", [])]
    text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
    change = re.search(r"max \|change\| of a response token's log-prob: ([0-9.]+)", text)
    assert change and float(change.group(1)) > 1e-3, text
    means = re.search(r"advantage > 0: ([-+][0-9.]+), advantage < 0: ([-+][0-9.]+)", text)
    assert means and float(means.group(1)) > float(means.group(2)), text
