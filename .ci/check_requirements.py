"""CI: the README's two installs, requirements.txt then requirements-test.txt, agree in one environment.

pip resolves requirements.txt alone (what the main job installs: SGLang, its torch and transformers
pins) and then together with requirements-test.txt, without installing anything (--dry-run reads
only the packages' metadata). The test file may add packages but must not move any version the
main job picked: then installing the two one after the other never replaces a pinned package, and
`pip check` stays clean. Exit 1 names every package that moved.

    python .ci/check_requirements.py
"""

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def resolve(*sets: tuple[str, ...]) -> list[dict[str, str]]:
    """For each set of requirement files, {package: version} that pip would install for them in an empty
    environment. The sets resolve at once, in processes of their own: each takes about a minute on 2 cores."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for k, files in enumerate(sets):
            report = os.path.join(tmp, f"report{k}.json")
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--dry-run",
                "--ignore-installed",
                "--quiet",
                "--report",
                report,
            ]
            for f in files:
                cmd += ["-r", os.path.join(ROOT, f)]
            procs.append(
                (files, report, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
            )
        errors = [proc.communicate()[1] for _, _, proc in procs]  # every one finished before any report is read
        out = []
        for (files, report, proc), err in zip(procs, errors):
            if proc.returncode != 0:
                sys.exit(f"pip cannot resolve {' + '.join(files)}:\n{err[-3000:]}")
            with open(report) as fh:
                out.append({i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.load(fh)["install"]})
        return out


main_job, both = resolve(("requirements.txt",), ("requirements.txt", "requirements-test.txt"))
moved = {name: (v, both.get(name)) for name, v in main_job.items() if both.get(name) != v}
if moved:
    sys.exit(
        "requirements-test.txt changes what requirements.txt installs:\n"
        + "\n".join(f"  {name}: {a} -> {b}" for name, (a, b) in sorted(moved.items()))
    )
print(
    f"requirements: requirements.txt resolves to {len(main_job)} packages (torch {main_job.get('torch')}, "
    f"sglang {main_job.get('sglang')}); requirements-test.txt adds {sorted(set(both) - set(main_job))} and moves none"
)
