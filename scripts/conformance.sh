#!/usr/bin/env bash
# `make conformance`: every cell of the conformance matrix in each engine's environment,
# then docs/models.md regenerated from the results (also kept as JSON). About an hour
# on a 2-core machine.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
out=benchmarks/results/conformance
mkdir -p "$out"
status=0
base="$(mktemp -d)"  # pytest's own temp rotation could remove a concurrent run's folders
trap 'rm -rf "$base"' EXIT
for engine in vllm sglang; do
  ENGINEHOOKS_CONFORMANCE=full ENGINEHOOKS_CONFORMANCE_OUT="$out/$engine.json" \
    bash scripts/run.sh "$engine" python -m pytest -p no:cacheprovider tests/engines/conformance -q -rs \
    --basetemp "$base/$engine" || status=1
done
bash scripts/run.sh vllm python -m tests.engines.conformance.report "$out/vllm.json" "$out/sglang.json" \
  > docs/models.md || status=1
echo "[conformance] docs/models.md regenerated from $out/*.json" >&2
exit "$status"
