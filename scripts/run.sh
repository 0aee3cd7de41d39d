#!/usr/bin/env bash
# Run a command inside one of the project's engine environments, building it if needed:
#   scripts/run.sh vllm|sglang CMD ARGS...
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
which="$1"; shift
venv="$(bash "$here/scripts/setup-$which-env.sh")"
export PATH="$venv/bin:$PATH" HF_HUB_OFFLINE=1
cd "$here"
exec "$@"
