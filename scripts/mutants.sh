#!/usr/bin/env bash
# Mutation testing of the protective modules (issue 26 item 2):  make mutants
#
# Builds (or reuses) $ENGINEHOOKS_CACHE/venv-mutants (CPU torch, the project editable with
# [test], the pinned mutmut), copies the working tree to $ENGINEHOOKS_MUTANTS_TREE
# (default /tmp/mutants-tree) and runs mutmut THERE: mutmut writes mutated sources into
# mutants/ of the tree it runs in, so the checkout itself is never touched.
# What is mutated and which tests run: [tool.mutmut] in pyproject.toml.
# Survivors are either killed by a test or listed in tests/mutants-allowlist.txt; the
# script ends non-zero if a survivor is neither. Report: docs/testing.md.
#   ENGINEHOOKS_MUTANTS_JOBS   parallel mutant runs (default: number of cores; 1 on a shared machine)
#   ENGINEHOOKS_MUTANTS_KEEP=1 copy over the existing tree instead of starting afresh: mutmut
#                              keeps the verdicts of functions whose source did not change
#                              and re-tests only changed ones (module by module runs)
#   extra arguments are passed to `mutmut run` (e.g. a mutant-name glob to run a subset)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${ENGINEHOOKS_CACHE:-$HOME/.cache/enginehooks}"
venv="$cache/venv-mutants"
tree="${ENGINEHOOKS_MUTANTS_TREE:-/tmp/mutants-tree}"
jobs="${ENGINEHOOKS_MUTANTS_JOBS:-$(nproc)}"
MUTMUT_VERSION=3.8.1
TORCH_VERSION=2.13.0
stamp_want="mutmut==$MUTMUT_VERSION torch==$TORCH_VERSION"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.enginehooks-stamp" 2>/dev/null)" != "$stamp_want" ]; then
  echo "[mutants] building $venv (once)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  # The CPU torch wheel the engine environments use; pip finds it through the machine's find-links.
  "$venv/bin/pip" install -q "torch==$TORCH_VERSION" >&2
  "$venv/bin/pip" install -q -e "$here[test]" "mutmut==$MUTMUT_VERSION" "torch==$TORCH_VERSION" >&2
  echo "$stamp_want" > "$venv/.enginehooks-stamp"
fi
"$venv/bin/pip" install -q -e "$here[test]" "torch==$TORCH_VERSION" >&2

echo "[mutants] copying $here to $tree" >&2
if [ "${ENGINEHOOKS_MUTANTS_KEEP:-0}" != 1 ]; then rm -rf "$tree"; fi
mkdir -p "$tree"
tar -C "$here" --exclude=.git --exclude=./mutants --exclude=__pycache__ --exclude='*.egg-info' \
  --exclude=./benchmarks/results -cf - . | tar -C "$tree" -xf -
cd "$tree"
export PATH="$venv/bin:$PATH" HF_HUB_OFFLINE=1
nice -n 10 mutmut run --max-children "$jobs" "$@" || true
mutmut results --all true > "$tree/mutants-results.txt" 2>&1 || mutmut results > "$tree/mutants-results.txt" 2>&1 || true
python "$here/scripts/mutants_report.py" "$tree" "$here/tests/mutants-allowlist.txt"
