#!/usr/bin/env bash
# A newcomer's first hour, replayed: a fresh clone, one fresh virtualenv, and the README's Quickstart
# commands copied out of README.md and run in order, then the README's CPU line. Prints, for each
# command, its exit code, seconds and last lines; ends with `pip check` on the environment.
#
#   bash bench/fresh_machine.sh [workdir]        # default: a new folder under /tmp; ~10 GB with SGLang
#   CPU=1 bash bench/fresh_machine.sh [workdir]  # a CPU machine: the README's CPU block (torch's CPU build, the
#                                                # tiny model, grpo.py on it as written), then the Quickstart's tests
#
# On a CPU machine without the model hub, expect: command 1 installs, says no GPU was found and which
# engine and sizes it would use, then stops in two lines because SmolLM2 can't be downloaded; command
# 2 passes the tests; the CPU line trains a tiny model for a few steps.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d /tmp/fresh-machine.XXXX)}
mkdir -p "$work" && cd "$work" || exit 1
git clone -q "$repo" clone && cd clone || exit 1
python3 -m venv "$work/venv" && . "$work/venv/bin/activate" || exit 1
echo "fresh clone of $(git -C "$repo" rev-parse --short HEAD) in $work/clone; python $(python --version 2>&1 | cut -d' ' -f2), venv $work/venv"

# The commands of the README's first ```bash block under '## Quickstart', comments dropped.
mapfile -t commands < <(awk '/^## Quickstart/{q=1} q && /^```bash/{b=1; next} b && /^```/{exit} b && !/^#/ && NF' README.md)
if [ -n "${CPU:-}" ]; then  # the second ```bash block (the CPU one) as written, then the Quickstart's test line
  mapfile -t cpu < <(awk '/^## Quickstart/{q=1} q && /^```bash/{n++; if (n == 2) {b=1; next}} b && /^```/{exit} b && !/^#/ && NF' README.md)
  commands=("${cpu[@]}" "$(printf '%s\n' "${commands[@]}" | grep -m1 pytest)")
else
  # The README's CPU line (a tiny model built offline, plain transformers generating), made short.
  cpu_line=$(grep -m1 '^python tests/tiny_model.py' README.md | sed 's/ *#.*//')
  commands+=("$cpu_line --steps 3 --eval-every 3")
fi

status=0
for i in "${!commands[@]}"; do
  cmd=${commands[$i]}
  echo; echo "=== command $((i + 1)): $cmd"
  start=$(date +%s)
  bash -c "$cmd" > "$work/command$((i + 1)).log" 2>&1
  code=$?
  log="$work/command$((i + 1)).log"
  echo "exit $code after $(( $(date +%s) - start )) s; log $log; pip installed" \
    "$(grep -m1 '^Successfully installed' "$log" | wc -w | awk '{print ($1 > 2 ? $1 - 2 : 0)}') packages; the last lines:"
  grep -v -E '^(WARNING: Location|Requirement already satisfied|Processing |Installing collected|Successfully installed|Collecting |Looking in |  (Downloading|Using cached|Obtaining)| +━)' \
    "$log" | tail -n 6 | cut -c1-400 | sed 's/^/  | /'
  [ "$i" -eq 0 ] && [ -z "${CPU:-}" ] || [ "$code" -eq 0 ] || status=1  # GPU's command 1 may stop at the hub
done
echo; echo "=== pip check"
pip check 2>&1 | tail -n 5 | sed 's/^/  | /'
pip check > /dev/null 2>&1 || status=1
echo "=== torch $(python -c 'import torch; print(torch.__version__)'), sglang $(pip show sglang 2>/dev/null | awk '/^Version/{print $2}')"
exit $status
