#!/usr/bin/env bash
# Builds (or reuses) the virtual environment that runs real megatron-core trainer ranks on
# CPU (2 gloo ranks, see docs/trainers.md), and prints its path. Like the engines' ones,
# it lives outside the repo (ENGINEHOOKS_CACHE, default ~/.cache/enginehooks), is reused
# between runs and is rebuilt from nothing whenever this script changes; the project is
# (re)installed editable into it on every call, which is quick.
#
# Versions: the CPU recipe verified in megatron-on-cpu.md (megatron-core 0.14.0 with
# mbridge 0.15.1, no Transformer Engine). torch is the CPU build the vLLM environment
# pins (2.13.0): the trainer ranks and the vLLM workers meet in one gloo group, so both
# sides run the same torch. mbridge imports einops at load time without declaring it.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${ENGINEHOOKS_CACHE:-$HOME/.cache/enginehooks}"
venv="${ENGINEHOOKS_MEGATRON_VENV:-$cache/venv-megatron}"
stamp_want="$(sha256sum < "${BASH_SOURCE[0]}" | cut -c1-16)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.enginehooks-stamp" 2>/dev/null)" != "$stamp_want" ]; then
  echo "[setup] building the Megatron environment in $venv (a few minutes, once)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  # The CPU torch wheel; pip finds it through the machine's find-links.
  "$venv/bin/pip" install -q "torch==2.13.0" >&2
  "$venv/bin/pip" install -q "torch==2.13.0" "megatron-core==0.14.0" "mbridge==0.15.1" \
    "transformers==5.24.0" "einops" "safetensors" >&2
  echo "$stamp_want" > "$venv/.enginehooks-stamp"
fi
if [ -f "$here/pyproject.toml" ]; then
  # Not [test]: the tests run in the vLLM environment and start these ranks as children.
  "$venv/bin/pip" install -q -e "$here" >&2
fi
echo "$venv"
